"""Every op as a PyTorch custom op: opcheck, and torch.compile(fullgraph=True, dynamic=True) over changing sizes.

opcheck (schema, fake tensors, AOT dispatch with dynamic shapes) runs on random valid configs in random layouts,
so the fake implementations must agree with the real outputs whatever the input strides (docs/ops.md: outputs
are new contiguous tensors). The compiled call must trace without a graph break (validation builds its messages
lazily and keeps sizes symbolic), and give the eager result bit for bit, on configs of different sizes. The cache
ops do both with their cache in every quantized format too (uint8 caches, kv_cache_dtype a string argument).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings

import glm5_hal
from fuzz.strategies import FUZZ_COUNTS, VALID_CASES, FuzzCase, examples, quantized_cache_cases
from glm5_hal.kv_formats import OP_CACHE
from glm5_hal.parity.inputs import with_layout
from glm5_hal.parity.runner import custom_op_arguments
from glm5_hal.registry import OP_NAMES

OPCHECK_CONFIGS_PER_OP = 4
COMPILED_CONFIGS_PER_OP = 4
QUANTIZED_CONFIGS_PER_OP = 3  # per cache op, each test
# (op, strategy, what the session summary calls it): every op on float configs, the cache ops on quantized ones
# without NaN / inf tiles (opcheck compares eager and traced outputs with assert_close, where NaN != NaN).
CONFIGS = [(op, VALID_CASES[op], op) for op in OP_NAMES] + [
    (op, quantized_cache_cases(op, nonfinite_tiles=False), f"{op} quantized") for op in OP_CACHE
]
CONFIG_IDS = [label.replace(" ", "-") for _, _, label in CONFIGS]


def _laid_out(case: FuzzCase) -> dict:
    return {
        k: (_opcheck_input(v, case.layouts.get(k, "contiguous")) if isinstance(v, torch.Tensor) else v)
        for k, v in case.inputs.items()
    }


def _opcheck_input(t: torch.Tensor, layout: str) -> torch.Tensor:
    """t in `layout`, except an empty t: opcheck copies its inputs with torch's clone_input, which sizes the copy as
    sum((n - 1) * stride) + 32, negative for an empty tensor with two empty dims even when contiguous ((0, 0, 32):
    -33 + 32 = -1; the long fuzz profile drew it for hadamard_transform) or with large strides: a crash in the test
    harness, not in the op. Empty tensors hold no values, so they get unit strides (Σ(n - 1) >= -ndim), and their
    layout only matters to the parity and canary tests."""
    if t.numel() == 0:
        return torch.empty_strided(t.shape, (1,) * t.dim(), dtype=t.dtype, device=t.device)
    return with_layout(t, layout)


def test_opcheck_takes_inputs_with_two_empty_dims() -> None:
    """The long profile's failing example: hadamard_transform of a (0, 0, 32) tensor, through the same helper."""
    inputs = _laid_out(FuzzCase("hadamard_transform", {"x": torch.zeros(0, 0, 32), "scale": None}, torch.float32, {}))
    torch.library.opcheck(
        torch.ops.glm5_hal.hadamard_transform.default,
        custom_op_arguments("hadamard_transform", inputs),
        test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"),
    )


def _count(label: str) -> int:
    return QUANTIZED_CONFIGS_PER_OP if label.endswith("quantized") else OPCHECK_CONFIGS_PER_OP


@pytest.mark.parametrize(("op", "configs", "label"), CONFIGS, ids=CONFIG_IDS)
def test_opcheck_on_random_configs_and_layouts(op: str, configs, label: str) -> None:
    @settings(max_examples=examples(_count(label)), suppress_health_check=[HealthCheck.too_slow])
    @given(case=configs)
    def holds(case: FuzzCase) -> None:
        torch.library.opcheck(
            getattr(torch.ops.glm5_hal, op).default,
            custom_op_arguments(op, _laid_out(case)),
            test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"),
        )
        FUZZ_COUNTS[("opcheck", label, "default")] += 1

    holds()


def _outputs(result: object) -> tuple[torch.Tensor, ...]:
    return result if isinstance(result, tuple) else (result,)


@pytest.mark.parametrize(("op", "configs", "label"), CONFIGS, ids=CONFIG_IDS)
def test_compiled_fullgraph_dynamic_matches_eager(op: str, configs, label: str) -> None:
    torch._dynamo.reset()
    fn = getattr(glm5_hal, op)
    compiled = torch.compile(lambda kw: fn(**kw), fullgraph=True, dynamic=True, backend="aot_eager")
    count = examples(_count(label))
    # Examples differ in dtype, in sizes of 0 or 1 (which dynamic shapes specialize on), in optional arguments and
    # in the kv_cache_dtype string, and each such difference may compile anew; with fullgraph=True, dynamo's
    # default of 8 recompiles is a hard failure that says nothing about the op (the long profile's 40 examples
    # reached it). Allow one per example, and as many again for hypothesis' replays.
    recompiles = torch._dynamo.config.patch(recompile_limit=2 * count + 8)

    @recompiles
    @settings(max_examples=count, suppress_health_check=[HealthCheck.too_slow])
    @given(case=configs)
    def holds(case: FuzzCase) -> None:
        eager_inputs = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in case.inputs.items()}
        compiled_inputs = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in case.inputs.items()}
        want, got = _outputs(fn(**eager_inputs)), _outputs(compiled(compiled_inputs))
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True)
        for name, value in eager_inputs.items():  # written caches: the same writes
            if isinstance(value, torch.Tensor):
                torch.testing.assert_close(compiled_inputs[name], value, rtol=0, atol=0, equal_nan=True)
        FUZZ_COUNTS[("torch.compile", label, "default")] += 1

    holds()
