"""The public ops of the operator contract (docs/ops.md), one module per family.

[mla_prolog] -> [indexer_prolog] -> [lightning_indexer] -> [sparse_flash_attention]   (attention)
[moe_gate] -> [moe_dispatch] -> [grouped_matmul] -> [moe_combine]   = [fused_moe]     (MoE)
[dynamic_quant] -> [quant_matmul | w4a8_matmul], [hadamard_transform]                 (quantization)
[ep_dispatch] -> (each rank's experts) -> [ep_combine]                                (expert parallel, collective)

Each public function validates its arguments (glm5_hal.checks), then calls a `torch.library` custom op
(`torch.ops.glm5_hal.<name>`, with a fake implementation for torch.compile) whose body dispatches to the
backend that glm5_hal.selection picks. The expert-parallel pair is the exception: collectives that return an opaque
handle, selected through the same registry but not custom ops (glm5_hal/ops/expert_parallel.py says why).
"""

from glm5_hal.ops.expert_parallel import EPDispatch, EPHandle, ep_combine, ep_dispatch
from glm5_hal.ops.indexer import indexer_logits, indexer_prolog, lightning_indexer
from glm5_hal.ops.mla_prolog import mla_prolog
from glm5_hal.ops.moe import fused_moe, grouped_matmul, moe_combine, moe_dispatch, moe_gate
from glm5_hal.ops.quant import dynamic_quant, hadamard_transform, quant_matmul, w4a8_matmul
from glm5_hal.ops.sparse_attention import sparse_flash_attention

__all__ = [
    # attention
    "mla_prolog",
    "indexer_prolog",
    "indexer_logits",
    "lightning_indexer",
    "sparse_flash_attention",
    # MoE
    "moe_gate",
    "moe_dispatch",
    "grouped_matmul",
    "moe_combine",
    "fused_moe",
    # quantization
    "dynamic_quant",
    "quant_matmul",
    "w4a8_matmul",
    "hadamard_transform",
    # expert parallelism
    "ep_dispatch",
    "ep_combine",
    "EPDispatch",
    "EPHandle",
]
