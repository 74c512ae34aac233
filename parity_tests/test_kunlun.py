"""The `kunlun` backend without a Kunlunxin XPU: the parity suite on a strict fake of vllm-kunlun 0.11.1's kernels.

The fake (parity_tests/fakes/kunlun) defines every `_C` kernel the backend calls from the schema rebuilt out of the
vllm-kunlun wheel's wrapper source, refuses what the sources rule out and computes with ops_reference; see
docs/vendors.md for what this does and does not prove. Tests needing the wheel are skipped, with the reason, when it
cannot be fetched.

    pytest parity_tests/test_kunlun.py parity_tests/fuzz/test_fuzz_kunlun.py [--quick]
"""

from __future__ import annotations

import pytest
import torch

from fakes.kunlun import KERNELS, ops
from fakes.kunlun.common import FakeKunlunError
from fakes.kunlun.fixture import fake_kunlun_fixture, vllm_kunlun_wheel_fixture  # noqa: F401 (pytest fixtures)
from fakes.kunlun.wheel import wrappers
from glm5_hal.cli.info import collect, op_table, report_data
from glm5_hal.parity import CASES, run_case
from glm5_hal.registry import registry

BF16, BOTH = ("bfloat16",), ("float32", "bfloat16")
# The kernel each mapped op's parity cases must reach, and in which dtypes (with which cache format); other dtypes
# and formats run the portable path.
KERNEL = {
    "sparse_flash_attention": (BF16, "auto", None),  # decode or prefill kernel: by the case's batch (ROUTES)
    "indexer_logits": (BF16, "int8_index", "I8_"),
    "lightning_indexer": (BF16, "int8_index", "I8_"),
    "moe_gate": (("float32",), "auto", "moe_sigmoid_group_topk_norm"),
    "grouped_matmul": (BF16, "auto", "moe_fc"),
    "moe_combine": (BF16, "auto", "moe_post"),
    "fused_moe": (BF16, "auto", "moe_pre_sorted"),
    "dynamic_quant": (BF16, "auto", "quant2d"),
    "quant_matmul": (BF16, "auto", "cutlass_scaled_mm"),
}
# Cases whose route differs from their op's row above, and why.
ROUTES = {
    "sparse_flash_attention/mini_prefill": "sparse_prefill_fwd_opt",
    "sparse_flash_attention/ragged_with_invalid": "sparse_prefill_fwd_opt",
    "sparse_flash_attention/empty_rows": "sparse_prefill_fwd_opt",
    "sparse_flash_attention/decode": "fwd_kvcache_mla",  # one new token per sequence
    "sparse_flash_attention/glm5_dims_topk2048": "sparse_prefill_fwd_opt",
    "sparse_flash_attention/deepseek_v32_heads": "fwd_kvcache_mla",
    "lightning_indexer/glm5_dims_topk2048": "fast_topkv2",  # topk is fast_topkv2's fixed 2048
    "moe_gate/mini_groups_softmax": None,  # softmax scoring: the kernel is sigmoid only
    "moe_gate/no_bias_unnormalised": None,  # the kernel always renormalises
    "quant_matmul/unit_scales_exact": None,  # fp32 output: vLLM's cutlass_scaled_mm outputs bf16 / fp16
}


def _format(case) -> str:
    return next(
        (fmt for fmt in ("int8_index", "fp8_index", "int8_mla", "fp8_ds_mla") if case.name.endswith(fmt)), "auto"
    )


def expected_kernel(case, dtype_name: str) -> str | None:
    """A kernel (or kernel-name prefix) `case` must run in `dtype_name`, or None for the portable path."""
    dtypes, fmt, kernel = KERNEL[case.op]
    if dtype_name not in dtypes or _format(case) != fmt:
        return None
    base = case.id.removesuffix(f"_{fmt}") if fmt != "auto" else case.id
    return ROUTES.get(base, kernel)


def _parity_params():
    for case in CASES:
        if case.op not in KERNEL:
            continue
        for dtype in case.dtypes:
            if case.slow and expected_kernel(case, str(dtype).removeprefix("torch.")) is None:
                continue  # real dims on the portable path: the torch backend's own parity run covers them
            marks = [pytest.mark.slow] if case.slow else []
            yield pytest.param(case, dtype, id=f"{case.id}-{str(dtype).removeprefix('torch.')}", marks=marks)


@pytest.mark.parametrize(("case", "dtype"), list(_parity_params()))
def test_kunlun_parity(fake_kunlun, case, dtype: torch.dtype, request, record_parity) -> None:
    if case.slow and request.config.getoption("--quick"):
        pytest.skip("real-dims case skipped by --quick")
    result = run_case(case, "kunlun", dtype)
    record_parity(result)
    assert result.passed, f"{result.status}: {result.detail} (worst rel err {result.rel_err:.3g})"
    kernel = expected_kernel(case, result.dtype)
    if kernel is None:
        assert not fake_kunlun.calls, f"expected the portable path, but ran {dict(fake_kunlun.calls)}"
    else:
        ran = [name for name in fake_kunlun.calls if name.startswith(kernel)]
        assert ran, f"expected {kernel} to run, ran {dict(fake_kunlun.calls)}"


# ------------------------------------------------------------------------------------------- info and mapping
def test_info_shows_each_op_on_its_kernel_or_why_not(fake_kunlun) -> None:
    avail = registry().availability("kunlun")
    assert avail.available and "stand-in" in avail.reason
    table = op_table("kunlun")
    assert {op for op, how in table.items() if how == "native"} == set(KERNEL)
    assert all(how.startswith("via ") for op, how in table.items() if op not in KERNEL)
    kernels = report_data(collect(), "kunlun")["kernels"]
    assert kernels["sparse_flash_attention"]["kernel"].startswith("fwd_kvcache_mla")
    assert kernels["lightning_indexer"]["kernel"].endswith("fast_topkv2 at topk 2048 (deterministic top-k otherwise)")
    assert "tie order is not documented" in kernels["lightning_indexer"]["why"]
    assert kernels["moe_dispatch"] == {"kernel": "", "why": kernels["moe_dispatch"]["why"]}
    assert "order of rows within an expert" in kernels["moe_dispatch"]["why"]
    assert any("fast_topkv2" in note and "lower-position" in note for note in registry().get("kunlun").notes)


def test_without_vllm_kunlun_every_op_is_portable_and_info_says_why(monkeypatch) -> None:
    for var in ("GLM5_HAL_BACKEND", "GLM5_HAL_OP_BACKENDS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("GLM5_HAL_VENDOR", "kunlun")
    monkeypatch.setenv("GLM5_HAL_STAND_IN_DEVICE", "cpu")
    monkeypatch.setitem(__import__("sys").modules, "vllm_kunlun", None)  # an import that fails
    registry().refresh()
    try:
        assert all(how.startswith("via ") for how in op_table("kunlun").values())
        kernels = report_data(collect(), "kunlun")["kernels"]
        assert kernels["quant_matmul"]["kernel"] == "" and "pip install vllm-kunlun" in kernels["quant_matmul"]["why"]
    finally:
        monkeypatch.undo()
        registry().refresh()


# ----------------------------------------------------------------------------------- the fake is strict
def test_schemas_are_the_wrappers_with_their_outputs_marked_written(vllm_kunlun_wheel) -> None:
    found = wrappers(vllm_kunlun_wheel)
    for name, (_, written) in KERNELS.items():
        signature, mutates = found[name]
        assert mutates == "()", f"{name}: the wrapper now declares mutates_args={mutates}: re-check the fake"
        assert set(written) <= set(signature.parameters), name


def test_pytorch_refuses_what_the_real_schema_refuses(fake_kunlun) -> None:
    """Wrong keyword, missing argument, wrong type: refused by PyTorch's schema check before any fake kernel runs,
    so an adapter making such a call fails its test exactly as it would fail on the XPU."""
    kernels = ops()
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    q, row_max = torch.empty(4, 8, dtype=torch.int8), torch.empty(4, 1)
    bad_calls = [
        lambda: kernels.quant2d(x, q, row_max, force_sdn=True),  # misspelt keyword
        lambda: kernels.quant2d(x, q),  # missing argument
        lambda: kernels.fast_topkv2(torch.randn(2, 4), torch.tensor([4, 4], dtype=torch.int32), 2048.0),  # float k
        lambda: kernels.cutlass_scaled_mm(q, q.t(), row_max, row_max, "bf16"),  # a string for a ScalarType
    ]
    for call in bad_calls:
        with pytest.raises((TypeError, RuntimeError)) as err:
            call()
        assert not isinstance(err.value, FakeKunlunError), err.value
    assert not fake_kunlun.calls, f"a kernel ran although the schema should have refused: {dict(fake_kunlun.calls)}"
    kernels.quant2d(x, q, row_max, True)
    assert fake_kunlun.calls["quant2d"] == 1 and torch.allclose(row_max[:, 0], x.float().abs().amax(1))


def test_the_fake_refuses_what_the_sources_rule_out(fake_kunlun) -> None:
    kernels = ops()
    with pytest.raises(FakeKunlunError, match="topk = 2048"):
        kernels.fast_topkv2(torch.randn(2, 4), torch.tensor([4, 4], dtype=torch.int32), 16)
    q = torch.randn(1, 3, 2, 576, dtype=torch.bfloat16)
    out = torch.empty(1, 3, 2, 512, dtype=torch.bfloat16)
    stats = torch.empty(1, 3, 2)
    with pytest.raises(FakeKunlunError, match="seq_len_q <= 2"):
        kernels.fwd_kvcache_mla(
            q,
            torch.randn(8, 576, dtype=torch.bfloat16),
            torch.zeros(1, 3, 4, dtype=torch.int32),
            torch.tensor([8], dtype=torch.int32),
            out,
            stats,
            stats.clone(),
            0.1,
            8,
        )
    ids = torch.tensor([[0, 1], [1, 2]], dtype=torch.int32)
    rows = torch.empty(4, 8, dtype=torch.bfloat16)
    with pytest.raises(FakeKunlunError, match="gen_block_statistic"):
        kernels.moe_pre_sorted(
            torch.randn(2, 8, dtype=torch.bfloat16),
            ids,
            torch.zeros(12, 3, dtype=torch.int32),
            rows,
            torch.empty(4, dtype=torch.int32),
            torch.empty(3, dtype=torch.int32),
            torch.empty(4, dtype=torch.int32),
        )


# ------------------------------------------------------------------- the fake catches a wrong adapter
def _case(case_id: str):
    return next(c for c in CASES if c.id == case_id)


MUTATIONS = [
    # (what the broken adapter does, attribute replaced, replacement, case that catches it, in which output)
    (
        "prefill lse taken as base 2",
        "backends.kunlun.attention.PREFILL_LSE_BASE2",
        True,
        "sparse_flash_attention/mini_prefill",
        "lse",
    ),
    (
        "request-local positions passed as flat rows",
        "backends.kunlun.attention.flat_rows",
        lambda indices, *_: indices.to(torch.int32),
        "sparse_flash_attention/decode",
        "out",
    ),
    (
        "src_index given where moe_post takes its inverse",
        "backends.kunlun.moe.invert_permutation",
        lambda perm: perm,
        "moe_combine/mini",
        "out",
    ),
    ("quant2d's max taken as the scale", "backends.kunlun.quant.INT8_MAX", 1.0, "dynamic_quant/tokens", "scale"),
    (
        "query scale not folded into the indexer weights",
        "backends.kunlun.indexer.INT8_MAX",
        1.0,
        "indexer_logits/mini_prefill_int8_index",
        "logits",
    ),
]


@pytest.mark.parametrize(("bug", "target", "replacement", "case_id", "where"), MUTATIONS, ids=[m[0] for m in MUTATIONS])
def test_parity_on_the_fake_catches_a_broken_adapter(
    fake_kunlun, monkeypatch, bug, target, replacement, case_id, where
) -> None:
    monkeypatch.setattr(target, replacement)
    result = run_case(_case(case_id), "kunlun", torch.bfloat16)
    assert not result.passed, f"a backend with '{bug}' passed {case_id}"
    assert where in result.detail, f"'{bug}' was caught for another reason: {result.detail}"
