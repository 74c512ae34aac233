"""The `ascend` backend: Huawei Ascend NPUs through torch_npu's fused operators (the ones vllm-ascend runs for
GLM-5 and DeepSeek-V3.2), with layouts and conventions converted at the edge.

[detect: lazy torch_npu import, NPU visibility] -> [ops: mla_prolog, indexer, sparse_attention, moe, quant,
                                                    expert_parallel adapters]
    adapters use [layouts: pure conversions] and [runtime: torch_npu, portable fallback, weights prepared once]

Importing this package imports neither torch_npu nor any adapter: the registry calls `probe` when asked, then
`load_ops`. docs/ascend.md maps every op to its kernel and says what is validated without hardware.
"""

from collections.abc import Callable, Mapping

from backends.ascend.detect import probe
from glm5_hal.kv_formats import FORMATS
from glm5_hal.registry import Backend

# Ops no torch_npu kernel expresses; the registry runs them through the `torch` backend on the npu device.
DELEGATES: dict[str, str] = {
    "indexer_logits": "torch",  # no kernel returns the full [T, S] score matrix (it is a parity/debug op)
    "hadamard_transform": "torch",  # torch_npu 2.14 has no Hadamard kernel
}

NOTES = (
    "fused kernels take bf16/fp16: fp32 activations (and fp32 outputs of quant_matmul / w4a8_matmul) run the "
    "portable torch path on the npu",
    "mla_prolog uses npu_mla_prolog_v3 at DeepSeek-V3.2 dims (its documented shape range), the unfused "
    "npu_kv_rmsnorm_rope_cache path otherwise (GLM-5: q_lora 2048, qk_nope 192); below qk_nope 16 the portable path "
    "(both keep q in bf16 / fp16, too coarse for a short absorption sum)",
    "shapes outside a kernel's documented range (block size not a multiple of 16, > 64 indexer heads, ...) run the "
    "portable torch path; see docs/ascend.md",
    "ep_dispatch / ep_combine use the MC2 kernels npu_moe_distribute_dispatch_v2 / combine_v2 on Atlas A3 within "
    "their documented limits (bf16/fp16, 2..384 ranks, H 1024..7168, 1..512 tokens per rank), the portable "
    "all_to_all_single exchange otherwise (A2 included)",
    "fused_moe in fp16, or in bf16 with fewer than 16 outputs per token, runs the portable path: the fused kernels' "
    "bf16 / fp16 intermediates are not accurate enough there",
    "a batch with a NaN router logit runs moe_gate's portable path while value checks are on (the kernel does not "
    "document how it ranks NaN)",
    "validated here only against a strict fake of torch_npu 2.14.0's schemas and docs, not on an NPU",
    "quantized caches: int8_mla reads run npu_kv_quant_sparse_flash_attention on the selected rows; writes encode in "
    "torch after the NPU prolog kernels; fp8 formats and quantized index keys read on the portable path",
    "lightning_indexer: npu_lightning_indexer does not document which of exactly tied keys it keeps; the contract's "
    "lower-position rule is guaranteed on the portable path only",
)


def _load_ops() -> Mapping[str, Callable]:
    from backends.ascend.ops import OPS

    return OPS


BACKEND = Backend(
    name="ascend",
    summary="Huawei Ascend through torch_npu's fused ops (the ones vllm-ascend runs for GLM-5 / DeepSeek-V3.2)",
    probe=probe,
    load_ops=_load_ops,
    # Ahead of the portable `torch` backend (0) wherever an NPU is visible.
    auto_priority=30,
    delegates=DELEGATES,
    notes=NOTES,
    kv_cache_dtypes=tuple(FORMATS),
)
