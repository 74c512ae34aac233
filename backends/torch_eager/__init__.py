"""The `torch` backend: every glm5-hal op in portable PyTorch eager, on any torch device.

[paged: token positions, key slots, cache writes] + [primitives: fp32 linear, norms, RoPE]
  + [gemm: the GEMM path of a call]
  + [quantized_cache: rows encoded on write, decoded into the GEMM operand dtype as they are gathered]
  -> mla_prolog | indexer (prolog, logits, top-k) | sparse_attention | moe | quant | hadamard
  -> expert_parallel (ep_dispatch / ep_combine over torch.distributed.all_to_all_single)

Arguments arrive validated by the public ops in glm5_hal; each implementation takes and returns exactly what its
public op does. Everything but the GEMMs is computed in fp32 and outputs are cast back. The GEMMs take the path
backends.torch_eager.capabilities chose for the device: fp32 operands (the conservative path, and always for fp32
inputs), or bf16 / fp16 operands with fp32 accumulation and an exact int8 GEMM where the device has faster units for
them (GLM5_HAL_FAST_PATHS=0 forces the conservative path). Large working sets (the indexer's scores, sparse attention's
gathered rows) are tiled so that memory stays bounded at real GLM-5 dims.
"""

from collections.abc import Callable

from backends.torch_eager.expert_parallel import ep_combine, ep_dispatch
from backends.torch_eager.hadamard import hadamard_transform
from backends.torch_eager.indexer import indexer_logits, indexer_prolog, lightning_indexer
from backends.torch_eager.mla_prolog import mla_prolog
from backends.torch_eager.moe import fused_moe, grouped_matmul, moe_combine, moe_dispatch, moe_gate
from backends.torch_eager.quant import dynamic_quant, quant_matmul, w4a8_matmul
from backends.torch_eager.route_workloads import time_routes
from backends.torch_eager.sparse_attention import sparse_flash_attention

OPS: dict[str, Callable] = {
    "mla_prolog": mla_prolog,
    "indexer_prolog": indexer_prolog,
    "indexer_logits": indexer_logits,
    "lightning_indexer": lightning_indexer,
    "sparse_flash_attention": sparse_flash_attention,
    "moe_gate": moe_gate,
    "moe_dispatch": moe_dispatch,
    "grouped_matmul": grouped_matmul,
    "moe_combine": moe_combine,
    "fused_moe": fused_moe,
    "dynamic_quant": dynamic_quant,
    "quant_matmul": quant_matmul,
    "w4a8_matmul": w4a8_matmul,
    "hadamard_transform": hadamard_transform,
    "ep_dispatch": ep_dispatch,
    "ep_combine": ep_combine,
}

__all__ = ["OPS", "time_routes"]  # importing route_workloads installs the probe's route timer
