"""The `metax` backend without MetaX hardware: the parity suite on a strict fake of mcoplib and mcFlashMLA.

The fake (parity_tests/fakes/metax) defines each op the backend calls from the schema string MetaX publishes
(written into the project with its source and commit), refuses what the sources' checks refuse and computes with
ops_reference; docs/vendors.md says what this does and does not prove.

    pytest parity_tests/test_metax.py parity_tests/fuzz/test_fuzz_metax.py [--quick]
"""

from __future__ import annotations

import pytest
import torch

import glm5_hal
from fakes.metax import ops as fake_ops
from fakes.metax.common import FakeMetaxError
from fakes.metax.fixture import fake_metax_fixture  # noqa: F401 (pytest fixture)
from glm5_hal.cli.info import collect, op_table, report_data
from glm5_hal.parity import CASES, run_case
from glm5_hal.parity.inputs import SeqSpec, paged_batch
from glm5_hal.selection import use_backend

BF16, FP32, BOTH = ("bfloat16",), ("float32",), ("float32", "bfloat16")
MAPPED = ("sparse_flash_attention", "lightning_indexer", "moe_gate", "dynamic_quant", "quant_matmul")


def expected_kernels(case, dtype_name: str) -> set[str]:
    """The fake kernels `case` must reach in `dtype_name` (empty: the portable path), from the adapters' rules."""
    op = case.op
    if op == "dynamic_quant":
        return {"dynamic_scaled_int8_quant"}
    if op == "moe_gate":
        return set() if "softmax" in case.name else {"grouped_topk", "moe_fused_gate"}
    if op == "quant_matmul":
        return {"cutlass_scaled_mm"} if dtype_name == "bfloat16" else set()
    if op == "lightning_indexer":
        return {"fast_topk"} if "topk2048" in case.name else set()
    if op == "sparse_flash_attention":
        quantized = case.name.endswith(("fp8_ds_mla", "int8_mla"))
        return set() if quantized or dtype_name != "bfloat16" else {"sparse_prefill_fwd", "fwd_kvcache_mla"}
    return set()


def _params():
    for case in CASES:
        if case.op not in MAPPED:
            continue
        for dtype in case.dtypes:
            if case.slow and not expected_kernels(case, str(dtype).removeprefix("torch.")):
                continue  # real dims on the portable path: the torch / triton backends' own parity runs cover them
            marks = [pytest.mark.slow] if case.slow else []
            yield pytest.param(case, dtype, id=f"{case.id}-{str(dtype).removeprefix('torch.')}", marks=marks)


@pytest.mark.parametrize(("case", "dtype"), list(_params()))
def test_metax_parity_case(fake_metax, case, dtype, request, record_parity) -> None:
    if case.slow and request.config.getoption("--quick"):
        pytest.skip("real-dims case skipped by --quick")
    result = run_case(case, "metax", dtype, device="cpu")
    record_parity(result)
    assert result.passed, f"{result.status}: {result.detail} (worst rel err {result.rel_err:.3g})"
    want = expected_kernels(case, result.dtype)
    ran = {name for name, count in fake_metax.calls.items() if count and name != "get_mla_metadata"}
    if want:
        assert ran and ran <= want, f"expected one of {want} to run, ran {dict(fake_metax.calls)}"
    else:
        assert not ran, f"expected the portable path, but ran {dict(fake_metax.calls)}"


# ------------------------------------------------------------------- kernels at the shapes where they engage
def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _attention_inputs(num_heads: int, seqs, block_size: int = 16, topk: int = 24, invalid: float = 0.25):
    from glm5_hal.parity.inputs import random_topk_indices

    gen = _gen(1)
    batch = paged_batch(seqs, block_size, gen)
    q = torch.randn(batch.num_tokens, num_heads, 576, generator=gen).to(torch.bfloat16)
    cache = torch.randn(batch.num_blocks, block_size, 576, generator=gen).to(torch.bfloat16)
    indices = random_topk_indices(batch, topk, gen, invalid_fraction=invalid)
    indices[0] = -1  # a token without a valid index: out 0, lse -inf
    return q, cache, indices, batch


def _reference_attention(q, cache, indices, b, sm_scale: float = 0.06):
    """ops_reference's (out, natural lse) of _attention_inputs' batch, in float64."""
    import ops_reference as ref

    return ref.sparse_flash_attention(
        q.double().numpy(),
        cache.double().numpy(),
        indices.numpy(),
        b.block_table.numpy(),
        b.seq_lens_k.numpy(),
        b.cu_seqlens_q.numpy(),
        sm_scale,
    )


@pytest.mark.parametrize(
    ("heads", "seqs", "kernel"),
    [
        (64, [SeqSpec(5, 40), SeqSpec(3, 30)], "sparse_prefill_fwd"),  # GLM-5's 64 heads, a prefill
        (64, [SeqSpec(1, 40), SeqSpec(1, 33), SeqSpec(1, 9)], "fwd_kvcache_mla"),  # decode
        (8, [SeqSpec(4, 20), SeqSpec(2, 37)], "fwd_kvcache_mla"),  # heads no prefill kernel takes
    ],
    ids=["prefill-64-heads", "decode-64-heads", "prefill-8-heads-decode-kernel"],
)
def test_sparse_attention_kernels_match_the_reference(fake_metax, heads, seqs, kernel) -> None:
    q, cache, indices, b = _attention_inputs(heads, seqs)
    with use_backend("metax", strict=True):
        out, lse = glm5_hal.sparse_flash_attention(q, cache, indices, b.block_table, b.seq_lens_k, b.cu_seqlens_q, 0.06)
    assert fake_metax.calls[kernel] == 1, dict(fake_metax.calls)
    want_out, want_lse = _reference_attention(q, cache, indices, b)
    assert lse[0].tolist() == [float("-inf")] * heads and (out[0] == 0).all()
    torch.testing.assert_close(lse[1:].double(), torch.from_numpy(want_lse[1:]), rtol=0, atol=1e-5)
    torch.testing.assert_close(out.double(), torch.from_numpy(want_out), rtol=1.6e-2, atol=1.6e-2)


def test_lightning_indexer_takes_fast_topk_at_topk_2048(fake_metax) -> None:
    import ops_reference as ref

    gen = _gen(2)
    b = paged_batch([SeqSpec(2, 2100), SeqSpec(1, 300)], 64, gen)  # one row past 2048 keys, one below
    q = torch.randn(b.num_tokens, 2, 128, generator=gen)
    w = torch.randn(b.num_tokens, 2, generator=gen)
    cache = torch.randn(b.num_blocks, 64, 128, generator=gen)
    args = (q, w, cache, b.block_table, b.seq_lens_k, b.cu_seqlens_q)
    with use_backend("metax", strict=True):
        indices, scores = glm5_hal.lightning_indexer(*args, 2048, return_scores=True)
    assert fake_metax.calls["fast_topk"] == 1
    logits = ref.indexer_logits(*(a.double().numpy() if a.is_floating_point() else a.numpy() for a in args))
    with use_backend("metax", strict=True):  # indexer_logits: the portable delegate the adapter scores with
        portable_logits = glm5_hal.indexer_logits(*args)
    for t in range(b.num_tokens):
        got = indices[t][indices[t] >= 0].long()
        visible = int(b.positions[t]) + 1
        assert len(got) == min(visible, 2048) and len(set(got.tolist())) == len(got)
        assert (indices[t][len(got) :] == -1).all(), "valid picks first"
        kth = sorted(logits[t, :visible], reverse=True)[len(got) - 1]
        assert (logits[t, got.numpy()] >= kth - 1e-9).all(), "a pick outside the top set"
        # The picks' scores are the portable indexer_logits' own numbers (the adapter gathers them), bit for bit.
        assert torch.equal(scores[t, : len(got)], portable_logits[t, got])


def test_moe_gate_takes_moe_fused_gate_where_it_fits_and_grouped_topk_otherwise(fake_metax) -> None:
    import ops_reference as ref

    logits, bias = torch.randn(5, 256, generator=_gen(3)), torch.randn(256, generator=_gen(4)) * 0.1
    kwargs = dict(top_k=8, topk_group=4, routed_scaling_factor=2.5, scoring="sigmoid")
    with use_backend("metax", strict=True):
        for n_group, norm, kernel in [
            (8, True, "moe_fused_gate"),
            (1, True, "grouped_topk"),
            (8, False, "grouped_topk"),
        ]:
            fake_metax.reset()
            args = dict(kwargs, n_group=n_group, topk_group=min(4, n_group), norm_topk_prob=norm)
            weights, ids = glm5_hal.moe_gate(logits, bias, **args)
            assert dict(fake_metax.calls) == {kernel: 1}
            want_w, want_ids = ref.moe_gate(logits.double().numpy(), bias.double().numpy(), **args)
            assert ids.tolist() == want_ids.tolist()
            torch.testing.assert_close(weights.double(), torch.from_numpy(want_w), rtol=1e-5, atol=0)
        fake_metax.reset()
        low = logits - 40  # the fused kernel's sum without the contract's 1e-20: grouped_topk keeps it
        glm5_hal.moe_gate(low, bias, **dict(kwargs, n_group=8, norm_topk_prob=True))
        assert dict(fake_metax.calls) == {"grouped_topk": 1}


def test_quant_kernels_at_aligned_shapes_and_nan_rows(fake_metax) -> None:
    x = torch.randn(4, 64, generator=_gen(5)).to(torch.bfloat16)
    x[1] = 0
    x[2, 3] = float("nan")
    with use_backend("metax", strict=True):
        q, scale = glm5_hal.dynamic_quant(x)
        assert fake_metax.calls["dynamic_scaled_int8_quant"] == 1
        assert (q[1] == 0).all() and scale[1] == 1 and (q[2] == 0).all() and torch.isnan(scale[2])
        w_q = torch.randint(-127, 128, (32, 64), generator=_gen(6), dtype=torch.int8)
        y = glm5_hal.quant_matmul(q, scale, w_q, torch.rand(32, generator=_gen(7)) + 0.1, out_dtype=torch.bfloat16)
        assert fake_metax.calls["cutlass_scaled_mm"] == 1 and torch.isnan(y[2]).all() and (y[1] == 0).all()


@pytest.mark.parametrize(("m", "n", "k"), [(3, 0, 16), (0, 16, 16)])
def test_quant_matmul_with_an_empty_operand_runs_portable(fake_metax, m: int, n: int, k: int) -> None:
    """N = 0 passed the kernel's alignment rule (0 is a multiple of 16) and reached cutlass_scaled_mm, which refuses a
    0-wide operand (the strict fake: "16 byte alignment"; found by a sweep of the fuzz suite's configs)."""
    x_q = torch.randint(-127, 128, (m, k), generator=_gen(8), dtype=torch.int8)
    w_q = torch.randint(-127, 128, (n, k), generator=_gen(9), dtype=torch.int8)
    x_scale, w_scale, bias = torch.rand(m) + 0.1, torch.rand(n) + 0.1, torch.randn(n, generator=_gen(10))
    with use_backend("metax", strict=True):
        y = glm5_hal.quant_matmul(x_q, x_scale, w_q, w_scale, bias, out_dtype=torch.bfloat16)
    want = ((x_q.double() @ w_q.double().T) * x_scale.double()[:, None] * w_scale.double() + bias.double()).bfloat16()
    assert y.shape == (m, n) and torch.equal(y, want) and not fake_metax.calls, dict(fake_metax.calls)


# ----------------------------------------------------------------------------------- the fake is strict
def test_pytorch_enforces_the_real_schemas(fake_metax) -> None:
    """A call the real schema refuses (misspelt keyword, missing argument, wrong type) fails before any kernel."""
    c, moe, sgl = fake_ops("_C"), fake_ops("_moe_C"), fake_ops("sgl_kernel")
    x = torch.randn(3, 16)
    q, scale = torch.empty(3, 16, dtype=torch.int8), torch.empty(3, 1)
    bad_calls = [
        lambda: c.dynamic_scaled_int8_quant(q, x, scale),  # azp is required (Tensor!?, no default)
        lambda: c.dynamic_scaled_int8_quant(result=q, input=x, scales=scale, azp=None),  # misspelt
        lambda: moe.grouped_topk(x, 1, 1, 2.5, True, 2.5, torch.zeros(16), 1),  # topk is an int
        lambda: sgl.fast_topk(x, torch.empty(3, 2048, dtype=torch.int32), torch.ones(3, dtype=torch.int32)),
    ]
    for call in bad_calls:
        with pytest.raises((TypeError, RuntimeError)) as err:
            call()
        assert not isinstance(err.value, FakeMetaxError), err.value
    assert not fake_metax.calls, "a kernel ran although the schema should have refused the call"
    c.dynamic_scaled_int8_quant(q, x, scale, None)
    assert fake_metax.calls["dynamic_scaled_int8_quant"] == 1


def test_the_fake_refuses_what_the_sources_check(fake_metax) -> None:
    flash, c = fake_ops("flash_mla_cuda"), fake_ops("_C")
    q = torch.randn(2, 32, 576, dtype=torch.bfloat16)
    kv = torch.randn(40, 1, 576, dtype=torch.bfloat16)
    idx = torch.zeros(2, 1, 8, dtype=torch.int32)
    with pytest.raises(FakeMetaxError, match="h_q % 64"):
        flash.sparse_prefill_fwd(q, kv, idx, 0.1, 512, torch.zeros(2, 1, dtype=torch.bool))
    a, b = torch.zeros(4, 24, dtype=torch.int8), torch.zeros(16, 24, dtype=torch.int8).t()
    with pytest.raises(FakeMetaxError, match="16 byte alignment"):
        c.cutlass_scaled_mm(torch.empty(4, 16, dtype=torch.bfloat16), a, b, torch.ones(4), torch.ones(16), None)
    with pytest.raises(FakeMetaxError, match="MAX_VPT"):
        fake_ops("sgl_kernel").moe_fused_gate(torch.randn(2, 256), torch.zeros(256), 1, 1, 8, 0, 2.5, True)


def _case(case_id: str):
    return next(c for c in CASES if c.id == case_id)


MUTATIONS = [
    # (what the broken adapter does, attribute replaced, replacement, case that catches it, in which output)
    ("base-2 lse passed on", "backends.metax.attention.lse_from_base2", lambda lse: lse, "lse"),
    ("no zero-row rule", "backends.metax.quant.contract_quant_scale", lambda q, s: (q, s), "q"),
]


@pytest.mark.parametrize(("bug", "target", "replacement", "where"), MUTATIONS, ids=[m[0] for m in MUTATIONS])
def test_the_fake_catches_a_broken_adapter(fake_metax, monkeypatch, bug, target, replacement, where) -> None:
    monkeypatch.setattr(target, replacement)
    if where == "lse":
        q, cache, indices, b = _attention_inputs(64, [SeqSpec(5, 40), SeqSpec(3, 30)])
        with use_backend("metax", strict=True):
            _, lse = glm5_hal.sparse_flash_attention(
                q, cache, indices, b.block_table, b.seq_lens_k, b.cu_seqlens_q, 0.06
            )
        _, want = _reference_attention(q, cache, indices, b)
        assert not torch.allclose(lse[1:].double(), torch.from_numpy(want[1:]), rtol=1e-3), f"'{bug}' passed"
        return
    result = run_case(_case("dynamic_quant/zero_row_3d"), "metax", torch.bfloat16, device="cpu")
    assert not result.passed and where in result.detail, f"'{bug}': {result.detail}"


# --------------------------------------------------------------------------------------- glm5-hal info
def test_info_shows_the_kernel_of_each_op_or_why_not(fake_metax) -> None:
    table = op_table("metax")
    assert {op for op, how in table.items() if how == "native"} == set(MAPPED)
    assert table["indexer_logits"] in ("via torch", "via triton") and table["w4a8_matmul"] in (
        "via torch",
        "via triton",
    )
    kernels = report_data(collect(), "metax")["kernels"]
    assert "flash_mla_sparse_fwd" in kernels["sparse_flash_attention"]["kernel"]
    assert "fast_topk" in kernels["lightning_indexer"]["kernel"]
    assert kernels["w4a8_matmul"]["kernel"] == "" and "fp8" in kernels["w4a8_matmul"]["why"]
    assert kernels["indexer_logits"]["kernel"] == "" and "no public" in kernels["indexer_logits"]["why"]


def test_without_the_vendor_libraries_every_op_is_portable_and_info_says_why(monkeypatch) -> None:
    import sys

    from glm5_hal.registry import registry

    for name in ("mcoplib", "mcoplib._C", "mcoplib._moe_C", "mcoplib.sgl_kernel", "flash_mla"):
        monkeypatch.setitem(sys.modules, name, None)  # an import that fails
    monkeypatch.setenv("GLM5_HAL_VENDOR", "metax")
    monkeypatch.setenv("GLM5_HAL_STAND_IN_DEVICE", "cpu")
    registry().refresh()
    try:
        assert "native" not in op_table("metax").values()
        kernels = report_data(collect(), "metax")["kernels"]
        assert kernels["quant_matmul"]["kernel"] == "" and "mcoplib._C" in kernels["quant_matmul"]["why"]
    finally:
        monkeypatch.undo()
        registry().refresh()
