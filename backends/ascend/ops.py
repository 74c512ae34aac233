"""The op table of the `ascend` backend: op name -> adapter (each module's docstring maps it to torch_npu)."""

from collections.abc import Callable

from backends.ascend.expert_parallel import ep_combine, ep_dispatch
from backends.ascend.indexer import indexer_prolog, lightning_indexer
from backends.ascend.mla_prolog import mla_prolog
from backends.ascend.moe import fused_moe, grouped_matmul, moe_combine, moe_dispatch, moe_gate
from backends.ascend.quant import dynamic_quant, quant_matmul, w4a8_matmul
from backends.ascend.sparse_attention import sparse_flash_attention

OPS: dict[str, Callable] = {
    "mla_prolog": mla_prolog,
    "indexer_prolog": indexer_prolog,
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
    "ep_dispatch": ep_dispatch,
    "ep_combine": ep_combine,
}
