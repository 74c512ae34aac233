"""Vendor kernel chains with bf16 / fp16 intermediates serve only what those keep within the tolerance
(glm5_hal/vendor_precision.py): configs the chains took out of it run the portable path and hold, and the shapes
the rules allow still run the chains. The fused MoE chains (Ascend, Kunlunxin): fp16, and bf16 narrower than 16
outputs per token. Ascend's MLA prolog: qk_nope_head_dim below 16.

    pytest parity_tests/test_vendor_precision.py
"""

from __future__ import annotations

import pytest
import torch

from fakes.ascend.fixture import fake_torch_npu_fixture, torch_npu_schemas_fixture  # noqa: F401 (pytest fixtures)
from fakes.kunlun.fixture import fake_kunlun_fixture, vllm_kunlun_wheel_fixture  # noqa: F401 (pytest fixtures)
from glm5_hal.config import GLM5_MINI
from glm5_hal.parity.cases import fused_moe_inputs, mla_prolog_inputs
from glm5_hal.parity.inputs import SeqSpec
from glm5_hal.parity.runner import run_inputs
from glm5_hal.vendor_precision import (
    MIN_FUSED_MOE_WIDTH,
    MIN_MLA_PROLOG_NOPE,
    fused_moe_chain_unsupported,
    mla_prolog_chain_unsupported,
)

# backend -> (its fake's fixture, a kernel of its fused MoE chain)
CHAINS = {"kunlun": ("fake_kunlun", "moe_pre_sorted"), "ascend": ("fake_torch_npu", "npu_swiglu")}
# Configs the chains took out of the tolerance before the rule (the first found by the long fuzz profile's kind of
# draw, the others by a sweep of seeds): (dtype, width, seed, tokens, inter, experts, used experts, k).
CHAIN_MISSES = {
    "fp16": (torch.float16, 32, 294, 1, 7, 5, 4, 3),  # 1.0e-3 off on both chains (tolerance 1e-3)
    "bf16_width_1": (torch.bfloat16, 1, 39, 4, 4, 5, 3, 3),  # Kunlunxin's chain 5.7e-2 off (tolerance 1.6e-2)
}


def _inputs(dtype: torch.dtype, width: int, seed: int, tokens: int, inter: int, experts: int, used: int, k: int):
    return fused_moe_inputs(tokens, width, inter, k, experts, used)(torch.Generator().manual_seed(seed), dtype)


@pytest.mark.parametrize("backend", list(CHAINS))
@pytest.mark.parametrize("miss", list(CHAIN_MISSES))
def test_a_config_the_chain_missed_runs_portable_and_holds(request, backend: str, miss: str) -> None:
    fake = request.getfixturevalue(CHAINS[backend][0])
    dtype, width, *config = CHAIN_MISSES[miss]
    result = run_inputs("fused_moe", _inputs(dtype, width, *config), backend, dtype)
    assert result.passed, f"{result.status}: {result.detail}"
    assert not fake.calls, f"expected the portable path, but ran {dict(fake.calls)}"


@pytest.mark.parametrize("backend", list(CHAINS))
def test_bf16_from_the_minimum_width_runs_the_chain(request, backend: str) -> None:
    fixture, kernel = CHAINS[backend]
    fake = request.getfixturevalue(fixture)
    dtype = torch.bfloat16
    result = run_inputs("fused_moe", _inputs(dtype, MIN_FUSED_MOE_WIDTH, 7, 3, 8, 4, 3, 2), backend, dtype)
    assert result.passed, f"{result.status}: {result.detail}"
    assert fake.calls[kernel] > 0, f"expected {kernel} to run, ran {dict(fake.calls)}"


# Ascend MLA prolog configs its kernels' half-precision q took out of the tolerance (a sweep of seeds at hidden 8,
# q_lora 16, qk_nope 1): (dtype, seed) -> how far off they were.
PROLOG_MISSES = {"bf16": (torch.bfloat16, 138), "fp16": (torch.float16, 33)}  # 13% and 2.6e-3 off


def _prolog_inputs(dtype: torch.dtype, seed: int, nope: int):
    cfg = GLM5_MINI.with_overrides(
        name="narrow-nope",
        hidden_size=8,
        q_lora_rank=16,
        qk_nope_head_dim=nope,
        num_attention_heads=1 + seed % 3,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
    )
    return mla_prolog_inputs(cfg, [SeqSpec(1 + seed % 3, 4 + seed % 5)], 4)(torch.Generator().manual_seed(seed), dtype)


@pytest.mark.parametrize("miss", list(PROLOG_MISSES))
def test_an_mla_prolog_the_npu_kernels_missed_runs_portable_and_holds(fake_torch_npu, miss: str) -> None:
    dtype, seed = PROLOG_MISSES[miss]
    result = run_inputs("mla_prolog", _prolog_inputs(dtype, seed, 1), "ascend", dtype)
    assert result.passed, f"{result.status}: {result.detail}"
    assert not fake_torch_npu.calls, f"expected the portable path, but ran {dict(fake_torch_npu.calls)}"


def test_an_mla_prolog_from_the_minimum_nope_runs_the_npu_kernels(fake_torch_npu) -> None:
    result = run_inputs(
        "mla_prolog", _prolog_inputs(torch.bfloat16, 138, MIN_MLA_PROLOG_NOPE), "ascend", torch.bfloat16
    )
    assert result.passed, f"{result.status}: {result.detail}"
    assert fake_torch_npu.calls["npu_kv_rmsnorm_rope_cache"] > 0, dict(fake_torch_npu.calls)


def test_the_rules_name_their_reasons() -> None:
    assert "fp16" in fused_moe_chain_unsupported(torch.float16, 4096)
    assert "narrower than 16" in fused_moe_chain_unsupported(torch.bfloat16, MIN_FUSED_MOE_WIDTH - 1)
    assert fused_moe_chain_unsupported(torch.bfloat16, MIN_FUSED_MOE_WIDTH) is None
    assert fused_moe_chain_unsupported(torch.float32, 1) is None
    assert "qk_nope_head_dim below 16" in mla_prolog_chain_unsupported(torch.float16, MIN_MLA_PROLOG_NOPE - 1)
    assert mla_prolog_chain_unsupported(torch.bfloat16, MIN_MLA_PROLOG_NOPE) is None
    assert mla_prolog_chain_unsupported(torch.float32, 1) is None
