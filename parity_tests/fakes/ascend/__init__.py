"""A strict fake of torch_npu 2.14.0 for testing the `ascend` backend without an NPU (test tree only, not shipped).

[wheel: download torch-npu 2.14.0, read its codegen yaml] -> define each op the backend calls from its REAL schema
with torch.library (namespace `npu`, so `torch.ops.npu.<op>` exists, and `torch_npu.<op>` is that op) -> CPU
kernels (basic, mla, attention, moe, quant) that reject what the documentation forbids and compute the documented
result with ops_reference. PyTorch itself rejects a misspelt keyword, a missing argument or a wrong type.

The module carries GLM5_HAL_STAND_IN_DEVICE = "cpu" (the convention every glm5-hal vendor fake follows), so the
backend's probe reports it available on the CPU stand-in, and says it is a fake.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

from fakes.ascend import attention, basic, mc2, mla, moe, quant
from fakes.ascend.common import STATE, FakeNpuError
from fakes.ascend.wheel import VERSION, schemas
from fakes.schema_fake import define_ops

KERNELS: dict[str, Callable] = {
    "npu_format_cast": basic.npu_format_cast,
    "npu_rms_norm": basic.npu_rms_norm,
    "npu_interleave_rope": basic.npu_interleave_rope,
    "npu_rotary_mul": basic.npu_rotary_mul,
    "npu_scatter_nd_update_": basic.npu_scatter_nd_update_,
    "npu_swiglu": basic.npu_swiglu,
    "npu_mla_prolog_v3": mla.npu_mla_prolog_v3,
    "npu_kv_rmsnorm_rope_cache": mla.npu_kv_rmsnorm_rope_cache,
    "npu_lightning_indexer": attention.npu_lightning_indexer,
    "npu_sparse_flash_attention": attention.npu_sparse_flash_attention,
    "npu_kv_quant_sparse_flash_attention": attention.npu_kv_quant_sparse_flash_attention,
    "npu_moe_gating_top_k": moe.npu_moe_gating_top_k,
    "npu_moe_init_routing_v2": moe.npu_moe_init_routing_v2,
    "npu_grouped_matmul": moe.npu_grouped_matmul,
    "npu_moe_token_unpermute": moe.npu_moe_token_unpermute,
    "npu_dynamic_quant": quant.npu_dynamic_quant,
    "npu_quant_matmul": quant.npu_quant_matmul,
    "npu_convert_weight_to_int4pack": quant.npu_convert_weight_to_int4pack,
    "npu_weight_quant_batchmatmul": quant.npu_weight_quant_batchmatmul,
    "npu_moe_distribute_dispatch_v2": mc2.npu_moe_distribute_dispatch_v2,
    "npu_moe_distribute_combine_v2": mc2.npu_moe_distribute_combine_v2,
}
NAMESPACE = "npu"
STAND_IN_DEVICE = "cpu"


class _NpuDevice(ModuleType):
    """torch_npu.npu: the device module. No NPU exists behind this fake; it answers as an Atlas A3 (soc_version
    250; tests set `soc_version` to play another SoC)."""

    soc_version = 250

    def get_soc_version(self) -> int:
        return self.soc_version

    @staticmethod
    def is_available() -> bool:
        return False

    @staticmethod
    def device_count() -> int:
        return 0


@functools.cache
def build(wheel: Path) -> ModuleType:
    """The fake torch_npu module (built once per process: torch.library definitions are global)."""
    library = define_ops(NAMESPACE, schemas(wheel, sorted(KERNELS)), KERNELS, STATE)
    module = ModuleType("torch_npu", __doc__)
    module.__version__ = f"{VERSION} (glm5-hal strict fake, schemas from {wheel.name})"
    module.GLM5_HAL_STAND_IN_DEVICE = STAND_IN_DEVICE
    module.npu = _NpuDevice("torch_npu.npu")
    module.calls = STATE.calls
    module.reset_calls = STATE.reset
    module.FakeNpuError = FakeNpuError
    module._library = library  # keeps the definitions alive
    for name in KERNELS:
        setattr(module, name, getattr(torch.ops.npu, name))
    return module
