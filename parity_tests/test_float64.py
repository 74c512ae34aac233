"""The float64 verification mode: float ops take fp64 activations on a float64-capable backend (reference).

What must hold (docs/ops.md "float64 verification mode"):
- on the reference backend, fp64 inputs give fp64 outputs equal, bit for bit, to ops_reference called directly on
  the same arrays (it is the same float64 computation, so nothing may round in between);
- every tensor that is fp32 by contract (RoPE tables, indexer weights and scores, router logits, routing weights,
  lse) is fp64 in this mode, and stays fp32 in the normal mode; the fake implementations agree;
- a backend without float64 support refuses fp64 inputs with a TypeError naming the op, the backend and who does
  support it, before running anything;
- mixing fp64 activations with fp32-by-contract tensors (or the reverse) is a dtype error naming the argument.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import glm5_hal
from glm5_hal.checks import accumulation_dtype
from glm5_hal.parity.cases import Case, cases_for
from glm5_hal.parity.runner import case_generator, custom_op_arguments
from glm5_hal.parity.specs import SPECS
from glm5_hal.registry import ANY_DEVICE, OP_NAMES, Availability, Backend, registry
from glm5_hal.selection import ENV_BACKEND, ENV_OP_BACKENDS, Float64UnsupportedError, use_backend

SEED = 20260
# The ops of the float64 mode: every op but the quantized ones, which stay bf16/fp16/fp32.
QUANTIZED_OPS = ("dynamic_quant", "quant_matmul", "w4a8_matmul")
FLOAT_OPS = tuple(op for op in OP_NAMES if op not in QUANTIZED_OPS)
# Outputs that are fp32 by contract in the normal mode: accumulation_dtype of the activations.
ACCUMULATION_OUTPUTS = {
    "indexer_prolog": ("weights",),
    "indexer_logits": ("logits",),
    "lightning_indexer": ("scores",),
    "sparse_flash_attention": ("lse",),
    "moe_gate": ("topk_weights",),
}
FP64_CASES = [case for op in FLOAT_OPS for case in cases_for(op, quick=True)]


@pytest.fixture(autouse=True)
def _no_env_selection(monkeypatch):
    # The tests choose backends themselves; a GLM5_HAL_BACKEND set for the parity run must not interfere.
    monkeypatch.delenv(ENV_BACKEND, raising=False)
    monkeypatch.delenv(ENV_OP_BACKENDS, raising=False)


def build(case: Case, dtype: torch.dtype) -> dict:
    """The case's inputs with activations in `dtype`; in fp64 every float tensor (fp32 ones included) is fp64."""
    inputs = case.build(case_generator(case, dtype, SEED), dtype)
    if dtype != torch.float64:
        return inputs
    return {
        k: v.to(torch.float64) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
        for k, v in inputs.items()
    }


def run_on(backend: str, case: Case, inputs: dict) -> dict[str, torch.Tensor]:
    """The op's named outputs (and mutated caches) on `backend`, from a copy of `inputs`."""
    copies = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    with use_backend(backend, ops=[case.op], strict=True):
        return SPECS[case.op].run(copies)


@pytest.mark.parametrize("case", FP64_CASES, ids=[c.id for c in FP64_CASES])
def test_reference_backend_fp64_is_ops_reference_bit_for_bit(case: Case) -> None:
    inputs = build(case, torch.float64)
    outputs = run_on("reference", case, inputs)
    want = SPECS[case.op].reference(inputs)
    for name, got in outputs.items():
        if got.is_floating_point():
            assert got.dtype == torch.float64, f"{case.id}: {name} is {got.dtype}, expected float64"
        # Exact, -inf included: a rounding anywhere on the way (an fp32 cast) shows up as a difference.
        np.testing.assert_array_equal(got.numpy(), want[name], err_msg=f"{case.id}: {name}")


@pytest.mark.parametrize("op", sorted(ACCUMULATION_OUTPUTS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64], ids=str)
def test_fp32_by_contract_outputs_follow_accumulation_dtype(op: str, dtype: torch.dtype) -> None:
    case = cases_for(op, quick=True)[0]
    # moe_gate has no activation: its builder draws fp32 router logits whatever `dtype` is (fp64 after `build`).
    outputs = run_on("reference", case, build(case, dtype))
    for name in ACCUMULATION_OUTPUTS[op]:
        assert outputs[name].dtype == accumulation_dtype(dtype), f"{op}: {name} is {outputs[name].dtype}"


@pytest.mark.parametrize("op", FLOAT_OPS)
def test_fake_implementations_agree_in_fp64(op: str) -> None:
    # test_faketensor compares the fake's output dtypes and shapes with the real (reference) outputs.
    case = cases_for(op, quick=True)[0]
    with use_backend("reference", ops=[op], strict=True):
        torch.library.opcheck(
            getattr(torch.ops.glm5_hal, op).default,
            custom_op_arguments(op, build(case, torch.float64)),
            test_utils=("test_schema", "test_faketensor"),
        )


@pytest.fixture
def recording_backend():
    """A backend without float64 support that implements every op by recording the call (it must never run)."""
    calls: list[str] = []

    def make(op: str):
        def impl(*args, **kwargs):
            calls.append(op)
            raise AssertionError(f"{op} ran on a backend without float64 support")

        return impl

    backend = Backend(
        name="no_fp64",
        summary="test backend without float64 support",
        probe=lambda: Availability(True, "always", (ANY_DEVICE,)),
        load_ops=lambda: {op: make(op) for op in FLOAT_OPS},
    )
    registry().register(backend)
    yield calls
    registry().unregister("no_fp64")


@pytest.mark.parametrize("op", FLOAT_OPS)
def test_backend_without_float64_refuses_before_running(op: str, recording_backend: list[str]) -> None:
    case = cases_for(op, quick=True)[0]
    with use_backend("no_fp64"), pytest.raises(Float64UnsupportedError) as info:
        SPECS[op].run(build(case, torch.float64))
    assert isinstance(info.value, TypeError)
    message = str(info.value)
    assert message.startswith(f"{op}: float64 inputs are a verification mode supported by the 'reference' backend")
    assert "the backend selected for cpu is 'no_fp64'" in message
    assert f"{ENV_BACKEND}=reference" in message
    assert recording_backend == []


def test_auto_on_cpu_picks_torch_which_refuses_fp64() -> None:
    # The torch backend computes in fp32: running fp64 there would silently lose what the mode is for.
    case = cases_for("hadamard_transform", quick=True)[0]
    with pytest.raises(TypeError, match=r"hadamard_transform: float64 inputs .* is 'torch' \(auto picked 'torch'"):
        glm5_hal.hadamard_transform(**build(case, torch.float64))


def test_fp32_inputs_still_run_on_a_backend_without_float64() -> None:
    case = cases_for("hadamard_transform", quick=True)[0]
    inputs = build(case, torch.float32)
    with use_backend("torch"):
        assert glm5_hal.hadamard_transform(**inputs).dtype == torch.float32


def _to(dtype: torch.dtype):
    return lambda t: t.to(dtype)


# (case id, argument, what to do to it, the error's fragments): fp64 activations with one fp32 tensor, and the
# reverse. Every case runs in fp64 unless it is the reverse (built in fp32, one tensor widened).
MIXED = [
    ("mla_prolog/mini_prefill", torch.float64, "cos", _to(torch.float32), "cos: expected dtype float64"),
    ("mla_prolog/mini_prefill", torch.float64, "sin", _to(torch.float32), "sin: expected dtype float64"),
    ("mla_prolog/mini_prefill", torch.float64, "w_dq", _to(torch.float32), "w_dq: expected dtype float64"),
    ("mla_prolog/mini_prefill", torch.float32, "cos", _to(torch.float64), "cos: expected dtype float32"),
    ("indexer_prolog/mini_interleaved", torch.float64, "cos", _to(torch.float32), "cos: expected dtype float64"),
    ("indexer_logits/mini_prefill", torch.float64, "weights", _to(torch.float32), "weights: expected dtype float64"),
    ("indexer_logits/mini_prefill", torch.float32, "weights", _to(torch.float64), "weights: expected dtype float32"),
    ("moe_gate/glm5_sigmoid", torch.float64, "bias", _to(torch.float32), "bias: expected dtype float64"),
    ("moe_combine/mini", torch.float64, "topk_weights", _to(torch.float32), "topk_weights: expected dtype float64"),
    ("moe_combine/mini", torch.float32, "topk_weights", _to(torch.float64), "topk_weights: expected dtype float32"),
    ("fused_moe/mini", torch.float64, "topk_weights", _to(torch.float32), "topk_weights: expected dtype float64"),
    ("fused_moe/mini", torch.float64, "w13", _to(torch.float32), "w13: expected dtype float64"),
    ("sparse_flash_attention/mini_prefill", torch.float64, "kv_cache", _to(torch.float32), "kv_cache: expected"),
]


@pytest.mark.parametrize(
    ("case_id", "dtype", "arg", "change", "fragment"), MIXED, ids=[f"{c}-{a}-{d}" for c, d, a, *_ in MIXED]
)
def test_mixing_fp64_and_fp32_is_a_named_dtype_error(case_id, dtype, arg, change, fragment) -> None:
    case = next(c for c in cases_for() if c.id == case_id)
    inputs = build(case, dtype)
    inputs[arg] = change(inputs[arg])
    with use_backend("reference"), pytest.raises(TypeError, match=fragment) as info:
        SPECS[case.op].run(inputs)
    assert not isinstance(info.value, Float64UnsupportedError)  # validation caught it, not dispatch


@pytest.mark.parametrize("op", QUANTIZED_OPS)
def test_quantized_ops_stay_out_of_the_float64_mode(op: str) -> None:
    case = cases_for(op, quick=True)[0]
    inputs = case.build(case_generator(case, torch.float32, SEED), torch.float32)
    if op == "dynamic_quant":
        inputs["x"], fragment = inputs["x"].to(torch.float64), "x: expected dtype .* got float64"
    else:
        inputs["out_dtype"], fragment = torch.float64, "out_dtype: expected"
    with use_backend("reference"), pytest.raises(TypeError, match=fragment):
        SPECS[op].run(inputs)
