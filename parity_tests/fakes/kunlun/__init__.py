"""A strict fake of vllm-kunlun 0.11.1's kernels for testing the `kunlun` backend without a Kunlunxin XPU (test
tree only, not shipped).

[wheel: download vllm-kunlun 0.11.1, parse vllm_utils_wrapper.py, rebuild each wrapper's schema with its output
arguments marked written] -> each op defined with torch.library in a namespace of its own
(fakes/schema_fake.define_ops), so PyTorch refuses a call the real schema refuses -> CPU kernels (attention,
indexer, moe, quant) that refuse what the sources rule out and compute the documented result with ops_reference ->
modules `vllm_kunlun` (carrying GLM5_HAL_OP_NAMESPACES, the redirect backends/kunlun/runtime.py honours) and
`vllm_kunlun.vllm_utils_wrapper`. The closed kunlun_ops is never imported.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

from fakes.kunlun import attention, indexer, moe, quant
from fakes.kunlun.common import CALLS
from fakes.kunlun.wheel import NAMESPACE, VERSION, schemas
from fakes.schema_fake import define_ops

FAKE_NAMESPACE = "glm5_fake_kunlun_C"  # stands in for `_C`, which a real vLLM (or MetaX's fake) may own
MODULES = ("vllm_kunlun", "vllm_kunlun.vllm_utils_wrapper")

# Each kernel the backend calls, and the arguments it writes (the wrappers' mutates_args=() omits them).
KERNELS: dict[str, tuple[Callable, tuple[str, ...]]] = {
    "sparse_prefill_fwd_opt": (attention.sparse_prefill_fwd_opt, ("out", "max_logits", "lse")),
    "fwd_kvcache_mla": (attention.fwd_kvcache_mla, ("out", "max_logits", "p_sums")),
    "I8_mqa_logits": (indexer.I8_mqa_logits, ("logits",)),
    "I8_paged_mqa_logits": (indexer.I8_paged_mqa_logits, ("out",)),
    "fast_topkv2": (indexer.fast_topkv2, ()),
    "moe_sigmoid_group_topk_norm": (moe.moe_sigmoid_group_topk_norm, ("topk_index", "norm_score", "block_static")),
    "gen_block_statistic": (moe.gen_block_statistic, ("block_statistic",)),
    "moe_pre_sorted": (moe.moe_pre_sorted, ("moe_expand", "moe_index", "expert_m", "sorted_tokens_num_lod")),
    "moe_fc": (moe.moe_fc, ("y",)),
    "moe_post": (moe.moe_post, ("y",)),
    "quant2d": (quant.quant2d, ("x_q", "max")),
    "cutlass_scaled_mm": (quant.cutlass_scaled_mm, ()),
}
OUTPUTS = {name: written for name, (_, written) in KERNELS.items()}


def ops() -> object:
    """torch.ops of the fake's namespace (where the backend finds vllm-kunlun's `_C` ops)."""
    return getattr(torch.ops, FAKE_NAMESPACE)


@functools.cache
def build(wheel: Path) -> dict[str, ModuleType]:
    """{module name: fake module} (built once per process: torch.library definitions are global)."""
    library = define_ops(FAKE_NAMESPACE, schemas(wheel, OUTPUTS), {n: k for n, (k, _) in KERNELS.items()}, CALLS)
    package = ModuleType("vllm_kunlun", f"glm5-hal strict fake of vllm-kunlun {VERSION} (schemas from {wheel.name})")
    package.__path__ = []  # a package, so that `import vllm_kunlun.vllm_utils_wrapper` finds the submodule
    package.__version__ = f"{VERSION} (glm5-hal strict fake)"
    package.GLM5_HAL_OP_NAMESPACES = {NAMESPACE: FAKE_NAMESPACE}
    package._library = library  # keeps the definitions alive
    wrapper = ModuleType("vllm_kunlun.vllm_utils_wrapper", f"fake: its ops are torch.ops.{FAKE_NAMESPACE}")
    package.vllm_utils_wrapper = wrapper
    return {"vllm_kunlun": package, "vllm_kunlun.vllm_utils_wrapper": wrapper}
