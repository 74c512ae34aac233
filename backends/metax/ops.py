"""The metax backend's op table: which op runs which MetaX kernel, from which library, and why the others do not.

Each mapped op's adapter (attention, topk, moe, quant) runs its kernel where the inputs fit the kernel's
documented range and the portable path otherwise; an op whose library does not import runs the portable path.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from backends.metax import attention, moe, quant, topk
from backends.metax.runtime import available, load_libraries


@dataclass(frozen=True)
class KernelRoute:
    adapter: Callable
    library: str
    kernels: str  # what runs, for `glm5-hal info`


MAPPED: dict[str, KernelRoute] = {
    "sparse_flash_attention": KernelRoute(
        attention.sparse_flash_attention,
        attention.LIBRARY,
        "mcFlashMLA flash_mla_sparse_fwd (prefill: bf16, H % 64 == 0) / flash_mla_with_kvcache with indices "
        "(decode: bf16/fp16, power-of-two blocks); float caches only",
    ),
    "lightning_indexer": KernelRoute(
        topk.lightning_indexer, topk.LIBRARY, "sgl_kernel.fast_topk (topk 2048) over the portable indexer scores"
    ),
    "moe_gate": KernelRoute(
        moe.moe_gate, moe.GROUPED, "_moe_C.grouped_topk, or sgl_kernel.moe_fused_gate where it fits (sigmoid)"
    ),
    "dynamic_quant": KernelRoute(quant.dynamic_quant, quant.LIBRARY, "_C.dynamic_scaled_int8_quant"),
    "quant_matmul": KernelRoute(quant.quant_matmul, quant.LIBRARY, "_C.cutlass_scaled_mm (bf16/fp16 out, K, N % 16)"),
}

# Why the other ops have no MetaX kernel here (shown by `glm5-hal info`).
UNMAPPED: dict[str, str] = {
    "indexer_logits": "no public MetaX indexer-score kernel (its DeepGEMM port was not found)",
    "w4a8_matmul": "cutlass_w4a8_mm (vLLM-metax) takes fp8 activations, not the contract's int8 codes",
    "mla_prolog": "fused_mla_RMS_rotary_emb's semantics are not documented enough to express the contract",
    "indexer_prolog": "indexer_k_quant_and_cache writes fp8 only; no documented prolog kernel",
    "moe_dispatch": "moe_permute's row order is not documented as the contract's stable (token, slot) order",
    "grouped_matmul": "cutlass_moe_mm_w8a8 is a quantized GEMM; no float grouped GEMM is published",
    "moe_combine": "moe_unpermute's weighting is not documented",
    "fused_moe": "runs the portable path (its pieces above)",
    "hadamard_transform": "hadacore_transform's size range and scaling are not documented",
    "ep_dispatch": "no MetaX expert-parallel exchange kernel",
    "ep_combine": "no MetaX expert-parallel exchange kernel",
}


def vendor_ops(portable_ops: Mapping[str, Callable]) -> dict[str, Callable]:
    """{op: adapter} for the mapped ops whose library imports here; records the portable ops for the adapters."""
    load_libraries(portable_ops)
    return {op: m.adapter for op, m in MAPPED.items() if available(m.library)[0]}


def routes() -> dict[str, dict[str, str]]:
    """Per op: {"kernel": what runs where inputs fit ("" if nothing), "why": why not}; valid after vendor_ops()."""
    table: dict[str, dict[str, str]] = {}
    for op, m in MAPPED.items():
        ok, why = available(m.library)
        table[op] = {"kernel": m.kernels if ok else "", "why": "" if ok else why}
    for op, why in UNMAPPED.items():
        table[op] = {"kernel": "", "why": why}
    return table
