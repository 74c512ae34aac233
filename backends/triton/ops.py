"""The triton backend's op table: op name -> Triton implementation (public op arguments, already validated).

Imported only by the descriptor's load_ops, after the interpreter decision (backends/triton/runtime.py). An op
missing here runs the `torch` backend with a one-time warning (or fails in strict mode).
"""

from __future__ import annotations

from collections.abc import Callable

from backends.triton.hadamard import hadamard_transform
from backends.triton.indexer import indexer_logits, lightning_indexer
from backends.triton.moe import fused_moe, grouped_matmul, moe_combine, moe_dispatch, moe_gate
from backends.triton.prolog import indexer_prolog, mla_prolog
from backends.triton.quant import dynamic_quant, quant_matmul, w4a8_matmul
from backends.triton.sparse_attention import sparse_flash_attention

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
}
