"""The op table of the `kunlun` backend and its per-op routes for `glm5-hal info` (each adapter module's docstring
maps its ops onto vllm-kunlun's kernels)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from backends.kunlun import runtime
from backends.kunlun.attention import sparse_flash_attention
from backends.kunlun.indexer import indexer_logits, lightning_indexer
from backends.kunlun.moe import fused_moe, grouped_matmul, moe_combine, moe_gate
from backends.kunlun.quant import dynamic_quant, quant_matmul

OPS: dict[str, Callable] = {
    "sparse_flash_attention": sparse_flash_attention,
    "indexer_logits": indexer_logits,
    "lightning_indexer": lightning_indexer,
    "moe_gate": moe_gate,
    "grouped_matmul": grouped_matmul,
    "moe_combine": moe_combine,
    "fused_moe": fused_moe,
    "dynamic_quant": dynamic_quant,
    "quant_matmul": quant_matmul,
}

# Per op: the kernels that run where the inputs fit, and what runs the portable path.
KERNELS: dict[str, tuple[str, str]] = {
    "sparse_flash_attention": (
        "fwd_kvcache_mla (every sequence 1 or 2 new tokens) / sparse_prefill_fwd_opt (otherwise)",
        "portable for fp16/fp32, quantized caches, non-contiguous caches",
    ),
    "indexer_logits": (
        "quant2d on the query + I8_paged_mqa_logits (decode) / I8_mqa_logits (prefill)",
        "int8_index caches with bf16 queries only; the query is quantized to int8 (bf16-level error)",
    ),
    "lightning_indexer": (
        "as indexer_logits, then fast_topkv2 at topk 2048 (deterministic top-k otherwise)",
        "int8_index caches with bf16 queries only; fast_topkv2's tie order is not documented",
    ),
    "moe_gate": ("moe_sigmoid_group_topk_norm", "portable for softmax scoring, norm_topk_prob=False, NaN logits"),
    "grouped_matmul": ("moe_fc", "bf16/fp16 only"),
    "moe_combine": ("moe_post", "bf16/fp16 only"),
    "fused_moe": (
        "gen_block_statistic + moe_pre_sorted + moe_fc x2 + moe_post",
        "bf16 from 16 outputs per token only (its bf16 / fp16 intermediates: glm5_hal.vendor_precision)",
    ),
    "dynamic_quant": ("quant2d", "bf16/fp16 only"),
    "quant_matmul": ("cutlass_scaled_mm", "bf16/fp16 outputs only"),
}
# Ops with no Kunlun kernel that expresses the contract, and why.
PORTABLE: dict[str, str] = {
    "mla_prolog": "no fused MLA prolog kernel in vllm-kunlun 0.11.1 (its pieces are generic norm / rope / GEMM ops)",
    "indexer_prolog": "no fused indexer prolog kernel",
    "moe_dispatch": "moe_pre_sorted does not document the order of rows within an expert (the contract fixes it)",
    "w4a8_matmul": "moe_fc_v3's int4 packing (XOR 0x88, scales x 7) is documented for MoE weights only",
    "hadamard_transform": "no Hadamard kernel",
    "ep_dispatch": "no expert-parallel dispatch / combine kernel",
    "ep_combine": "no expert-parallel dispatch / combine kernel",
}


def vendor_ops(portable_ops: Mapping[str, Callable]) -> Mapping[str, Callable]:
    """The adapters of the mapped ops once vllm-kunlun's wrappers import (each adapter falls back by itself for
    inputs its kernels do not take); none without them, so that `glm5-hal info` shows every op on the portable path
    and the report says why."""
    runtime.load(portable_ops)
    return {} if runtime.unavailable() else OPS


def routes() -> dict[str, dict[str, str]]:
    """Per op: {"kernel": what runs where inputs fit ("" if nothing), "why": its limits, or why nothing}."""
    missing = runtime.unavailable()
    table = {}
    for op, (kernels, limits) in KERNELS.items():
        table[op] = {"kernel": "", "why": missing} if missing else {"kernel": kernels, "why": limits}
    table.update({op: {"kernel": "", "why": why} for op, why in PORTABLE.items()})
    return table
