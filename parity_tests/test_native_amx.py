"""backends.torch_eager.native.amx_gemm: the GEMMs on AMX tiles, for every build that runs here: the AMX one where
the CPU has amx_bf16 / amx_int8 and Linux grants the tile state (skipped elsewhere, with the reason), and the
portable one (the same blocking around scalar tile operations, amx_tiles.h) on any CPU with a compiler, so the
blocking, staging and padding are checked on every machine. (amx_attention.c, amx_index_scores.c and
amx_quantized_index_scores.c, sparse attention and the indexer's scores on tiles, are checked with the vector
kernels' tests in test_native_kernels.py and on their routes in test_fast_paths.py; their builds and ops here.)

- bf16: within the fp32 summation bound of the float64 product on hypothesis shapes that cross the tile (16), block
  (32) and K-step (32) edges, strided, transposed, batch-stride-0 and empty operands, NaN / inf; and bit for bit the
  order of the tile instruction's fp32 adds (two 16-product chains per K step, their sum added to the tile), so a
  blocking that skipped, repeated or misplaced a K step or a column would fail. DAZ / FTZ as the instruction does.
- int8: the exact integer sums (equal to int64 products), -128 / 127 extremes at K = 16384 included, for the weight as
  stored, strided and in panels.
- A result does not depend on the thread count; the custom ops are what the defaults call, and their fakes give the
  shapes under FakeTensorMode; the AMX build compiles here and, where the CPU lacks AMX, is a reason, never a crash.
"""

from __future__ import annotations

import errno

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_native_kernels import _assert_within_fp32_sums, _same_bits
from torch._subclasses.fake_tensor import FakeTensorMode

from backends.torch_eager.native import amx_gemm, amx_tiles, build, indexer_scores, sparse_attention
from backends.torch_eager.native import quantized_index_scores as quantized
from glm5_hal.cpu_flags import this_cpu
from glm5_hal.kv_formats import FORMATS, encode_rows

ISAS = (amx_gemm.FAST, amx_gemm.PORTABLE)
SETTINGS = settings(max_examples=25, deadline=None, derandomize=True)
K_STEP = 32  # bf16 per K step of the tile product (one A-tile row of 16 pairs)
PAIRS = 16  # pairs per K step


def _runs(isa: str) -> None:
    ok, why = amx_gemm.availability(isa)
    if not ok:
        pytest.skip(f"{isa} build does not run here: {why}")


def _bf16(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).bfloat16()


def _tile_order(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [B, M, K] bf16 @ b [B, N, K]^T in TDPBF16PS's order, in fp32 (normal inputs and results only): per K step of
    32, the even and odd elements of the 16 pairs each summed from 0 in one fp32 chain, their sum added to the
    result. Each product of two bf16 is exact in fp32; torch's separate mul and add round as the instruction does."""
    batch, rows, depth = a.shape
    steps = -(-depth // K_STEP)
    a32 = torch.nn.functional.pad(a.float(), (0, steps * K_STEP - depth))  # zero past K, as the kernel's staging
    b32 = torch.nn.functional.pad(b.float(), (0, steps * K_STEP - depth))
    out = torch.zeros(batch, rows, b.shape[1])
    for s in range(steps):
        chains = []
        for half in (0, 1):
            chain = torch.zeros_like(out)
            for p in range(PAIRS):
                k = K_STEP * s + 2 * p + half
                chain = chain + a32[:, :, k, None] * b32[:, None, :, k]  # [B, M, N]
            chains.append(chain)
        out = out + (chains[0] + chains[1])
    return out


# ------------------------------------------------------------------------------------------------ bf16 x bf16 -> fp32


@pytest.mark.parametrize("isa", ISAS)
@SETTINGS
@given(
    batch=st.integers(1, 2),
    rows=st.sampled_from([0, 1, 2, 15, 16, 17, 31, 32, 33, 40]),
    cols=st.sampled_from([0, 1, 13, 16, 17, 32, 33, 70]),
    depth=st.sampled_from([0, 1, 2, 31, 32, 33, 63, 64, 100, 257]),
    strided=st.booleans(),
    special=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_bf16_gemm_is_the_fp32_gemm_of_the_bf16_operands(isa, batch, rows, cols, depth, strided, special, seed):
    _runs(isa)
    gen = torch.Generator().manual_seed(seed)
    a, b = _bf16(gen, batch, rows, depth + 5 * strided), _bf16(gen, batch, cols, depth + 3 * strided)
    a, b = a[..., :depth], b[..., :depth]  # strided: rows 5 and 3 apart wider than K
    if special and rows and depth:
        a[0, 0, 0] = float("nan")
        a[-1, -1, -1] = float("inf")
    want = torch.bmm(a.double(), b.double().mT)
    got = amx_gemm.bmm_nt(a, b, isa=isa, threads=1)
    assert got.dtype == torch.float32 and got.shape == (batch, rows, cols)
    _assert_within_fp32_sums(got, want, torch.bmm(a.double().abs(), b.double().abs().mT), depth)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(("rows", "cols", "depth"), [(1, 1, 1), (17, 33, 65), (40, 70, 100), (33, 16, 96)])
def test_bf16_gemm_adds_in_the_tile_instructions_order(isa, rows, cols, depth):
    """Bit for bit the instruction's order of fp32 adds: a block that dropped, repeated or shifted a K step, a pair
    or a column, or padded with something other than zeros, would change bits here."""
    _runs(isa)
    gen = torch.Generator().manual_seed(rows * 1000 + depth)
    a, b = _bf16(gen, 2, rows, depth), _bf16(gen, 2, cols, depth)
    assert _same_bits(amx_gemm.bmm_nt(a, b, isa=isa, threads=1), _tile_order(a, b))


@pytest.mark.parametrize("isa", ISAS)
def test_bf16_subnormal_inputs_read_as_zero_and_subnormal_results_flush(isa):
    """The tile instruction's DAZ / FTZ: a bf16 subnormal (2^-130) times 2^100 would add 2^-30; it adds 0. A product
    of normals that lands below fp32's normal range (2^-70 x 2^-70 = 2^-140) is flushed to 0, not kept as a
    subnormal."""
    _runs(isa)
    a = torch.zeros(1, 2, 4, dtype=torch.bfloat16)
    b = torch.zeros(1, 1, 4, dtype=torch.bfloat16)
    a[0, 0, 0], b[0, 0, 0] = 2.0**-130, 2.0**100  # a bf16 subnormal (bf16's smallest normal is 2^-126)
    a[0, 0, 1], b[0, 0, 1] = 1.0, 3.0  # a normal product beside it, kept
    a[0, 1, 2], b[0, 0, 2] = 2.0**-70, 2.0**-70
    assert a[0, 0, 0].item() == 2.0**-130 and a[0, 1, 2].item() == 2.0**-70  # exact in bf16
    got = amx_gemm.bmm_nt(a, b, isa=isa, threads=1)
    assert got[0, :, 0].tolist() == [3.0, 0.0]  # without DAZ: 3 + 2^-30; without FTZ: 2^-140


@pytest.mark.parametrize("isa", ISAS)
def test_bf16_gemm_takes_transposed_and_expanded_operands_and_any_thread_count(isa):
    _runs(isa)
    gen = torch.Generator().manual_seed(5)
    a = _bf16(gen, 40, 3, 35).permute(1, 2, 0)  # [3, 35, 40], K not contiguous: copied into the kernel's layout
    b = _bf16(gen, 1, 70, 40).expand(3, 70, 40)  # batch stride 0
    one = amx_gemm.bmm_nt(a, b, isa=isa, threads=1)
    assert _same_bits(one, _tile_order(a, b))
    for threads in (2, 3, 7):
        assert _same_bits(amx_gemm.bmm_nt(a, b, isa=isa, threads=threads), one)  # split by batch
        assert _same_bits(amx_gemm.bmm_nt(a[:1], b[:1], isa=isa, threads=threads), one[:1])  # by blocks of columns


# ------------------------------------------------------------------------------------------------ int8 x int8 -> int32


def _codes(gen: torch.Generator, rows: int, cols: int, extreme: bool) -> torch.Tensor:
    if extreme:  # -128 / 127 only: the largest products
        return torch.tensor([-128, 127], dtype=torch.int8)[torch.randint(0, 2, (rows, cols), generator=gen)]
    return torch.randint(-128, 128, (rows, cols), generator=gen, dtype=torch.int8)


def _exact(x_q: torch.Tensor, w_q: torch.Tensor) -> torch.Tensor:
    return x_q.long() @ w_q.long().T  # int64: no overflow at these sizes


@pytest.mark.parametrize("isa", ISAS)
@SETTINGS
@given(
    rows=st.sampled_from([0, 1, 5, 16, 17, 32, 33, 40]),
    cols=st.sampled_from([0, 1, 15, 16, 17, 32, 33, 70]),
    depth=st.sampled_from([0, 1, 3, 63, 64, 65, 200]),
    layout=st.sampled_from(["stored", "strided", "panels"]),
    extreme=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_s8_sums_are_exact(isa, rows, cols, depth, layout, extreme, seed):
    _runs(isa)
    gen = torch.Generator().manual_seed(seed)
    x_q, w_q = _codes(gen, rows, depth + 7, extreme)[:, :depth], _codes(gen, cols, depth + 5, extreme)[:, :depth]
    w = {"stored": w_q.contiguous(), "strided": w_q, "panels": amx_gemm.panel_s8_weight(w_q)}[layout]
    got = amx_gemm.s8_mm(x_q, w, cols, isa=isa, threads=1)
    assert got.dtype == torch.int32 and torch.equal(got.long(), _exact(x_q, w_q))


@pytest.mark.parametrize("isa", ISAS)
def test_s8_sums_are_exact_at_k_16384_with_extreme_codes(isa):
    """K = 16384 of -128 / 127: sums up to 2^28 in magnitude (past fp32's exact integers), each one exact."""
    _runs(isa)
    gen = torch.Generator().manual_seed(11)
    depth = 16384
    x_q, w_q = _codes(gen, 33, depth, True), _codes(gen, 34, depth, True)
    x_q[0], w_q[0], w_q[1] = -128, -128, 127  # the extremes: 2^28 and -2^21 * 127
    weight = amx_gemm.prepare_s8(w_q, isa=isa)
    got = amx_gemm.run_s8(x_q, weight, threads=1)
    want = _exact(x_q, w_q)
    assert want[0, 0] == 2**28 and want[0, 1] == -(2**21) * 127
    assert torch.equal(got.long(), want)
    assert torch.equal(amx_gemm.run_s8(x_q, weight, threads=3), got)  # the split by blocks of columns


# ------------------------------------------------------------------------------------------------ ops, builds, errors


def test_the_custom_ops_are_what_the_defaults_call_and_their_fakes_give_the_shapes(monkeypatch: pytest.MonkeyPatch):
    """GLM5_HAL_NATIVE=portable runs the portable build in place of the AMX one, so the custom ops (the AMX build's
    entry points) run here; opcheck checks their schemas and fakes against them."""
    _runs(amx_gemm.PORTABLE)
    monkeypatch.setenv(build.ENV_NATIVE, "portable")
    gen = torch.Generator().manual_seed(3)
    a, b = _bf16(gen, 2, 17, 40), _bf16(gen, 2, 33, 40)
    assert _same_bits(amx_gemm.bmm_nt(a, b), amx_gemm.bmm_nt(a, b, isa=amx_gemm.PORTABLE, threads=1))
    x_q, w_q = _codes(gen, 5, 70, False), _codes(gen, 33, 70, False)
    assert torch.equal(amx_gemm.s8_mm(x_q, w_q).long(), _exact(x_q, w_q))
    torch.library.opcheck(torch.ops.glm5_hal.amx_bf16_bmm_nt, (a, b))
    torch.library.opcheck(torch.ops.glm5_hal.amx_s8_mm, (x_q, w_q, 33))
    with FakeTensorMode() as mode:
        fa, fb = mode.from_tensor(a), mode.from_tensor(b)
        out = torch.ops.glm5_hal.amx_bf16_bmm_nt(fa, fb)
        assert out.shape == (2, 17, 33) and out.dtype == torch.float32
        acc = torch.ops.glm5_hal.amx_s8_mm(mode.from_tensor(x_q), mode.from_tensor(w_q), 33)
        assert acc.shape == (5, 33) and acc.dtype == torch.int32
    # The ops of the vector kernels carry the AMX ones as an argument (their defaults pick it for the AMX build).
    q, cache = _bf16(gen, 3, 5, 64), _bf16(gen, 4, 16, 64)
    table, lens, cu = torch.tensor([[2, 0, 3, 1]], dtype=torch.int32), torch.tensor([50], dtype=torch.int32), None
    cu = torch.tensor([0, 3], dtype=torch.int32)
    indices = torch.randint(-1, 50, (3, 20), generator=gen, dtype=torch.int32)
    args = (q, cache, indices, table, lens, cu, 0.1, 32, sparse_attention.AMX, sparse_attention.AMX_KERNEL)
    torch.library.opcheck(torch.ops.glm5_hal.native_paged_sparse_attention, args)
    weights, limits, out = torch.rand(3, 5, generator=gen), torch.tensor([48, 49, 50]), torch.empty(3, 64)
    args = (q, weights, cache, table.expand(3, -1), limits, out, indexer_scores.AMX, indexer_scores.AMX_KERNEL)
    torch.library.opcheck(torch.ops.glm5_hal.native_indexer_scores, args)
    fp8 = encode_rows(torch.randn(64, 128, generator=gen), FORMATS["fp8_index"]).view(4, 16, 132)
    q, out = _bf16(gen, 3, 5, 128), torch.empty(3, 64)
    args = (q, weights, fp8, table, lens, cu, out, "fp8_index", 0, quantized.AMX, quantized.AMX_KERNEL)
    torch.library.opcheck(torch.ops.glm5_hal.native_quantized_index_scores_paged, args)


@pytest.fixture
def fresh_builds(monkeypatch: pytest.MonkeyPatch, tmp_path):
    """Builds into an empty cache, with load()'s memory cleared before and after."""
    monkeypatch.setenv(build.ENV_CACHE_DIR, str(tmp_path))
    build.forget()
    yield tmp_path
    build.forget()


def test_the_amx_build_compiles_here_and_without_amx_it_is_a_reason(fresh_builds, monkeypatch: pytest.MonkeyPatch):
    """The AMX source compiles with this compiler on any x86 CPU (a library is only built, never run, where the CPU
    lacks AMX). Where the CPU lacks it, availability says why; with the flags faked, the library loads and Linux's
    refusal of the tile state is the reason, before any tile instruction could run."""
    try:
        for kernel in (amx_gemm.KERNEL, *[m.AMX_KERNEL for m in (sparse_attention, indexer_scores, quantized)]):
            build._build(kernel, build.ISAS[amx_gemm.FAST])
    except build.NativeUnavailable as exc:
        pytest.skip(f"no AMX build here: {exc}")
    _model, flags = this_cpu()
    if flags is not None and "amx_tile" in flags:
        pytest.skip("this CPU has AMX: the refusals below cannot happen here")
    modules = (sparse_attention, indexer_scores, quantized)
    builds = (amx_gemm.availability, *[lambda m=m: m.availability(m.AMX) for m in modules])
    for availability in builds:
        ok, why = availability()
        assert not ok and "needs CPU flags amx_tile" in why
    build.forget()
    monkeypatch.setattr(build, "this_cpu", lambda: ("faked", frozenset(build.ISAS[amx_gemm.FAST].cpu_flags)))
    for availability in builds:
        ok, why = availability()
        assert not ok and "Linux refused the AMX tile state" in why
    with pytest.raises(build.NativeUnavailable, match="Linux refused the AMX tile state"):
        amx_tiles.function(amx_gemm.KERNEL, amx_gemm.FAST, "glm5_amx_s8_gemm_nt", [])
    assert "sigaltstack" in amx_tiles.refusal(amx_gemm.KERNEL, amx_gemm.FAST, errno.ENOSPC)  # a too small stack


def test_bad_arguments_name_what_was_expected():
    a = torch.zeros(2, 3, 8, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"b: expected torch.bfloat16, got torch.float32"):
        amx_gemm.bmm_nt(a, torch.zeros(2, 4, 8))
    with pytest.raises(ValueError, match=r"b: expected \[2, N, 8\] to match a \(2, 3, 8\), got \(2, 4, 7\)"):
        amx_gemm.bmm_nt(a, torch.zeros(2, 4, 7, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"a: expected 3 dimensions, got shape \(3, 8\)"):
        amx_gemm.bmm_nt(a[0], a[0])
    x_q = torch.zeros(3, 70, dtype=torch.int8)
    with pytest.raises(ValueError, match=r"w_q: expected \(5, 70\), got \(5, 71\)"):
        amx_gemm.s8_mm(x_q, torch.zeros(5, 71, dtype=torch.int8))
    with pytest.raises(ValueError, match=r"w_q: expected \(1, 2, 2, 16, 16, 4\), got \(1, 1, 2, 16, 16, 4\)"):
        amx_gemm.s8_mm(x_q, torch.zeros(1, 1, 2, 16, 16, 4, dtype=torch.int8), 5)
    with pytest.raises(TypeError, match=r"x_q: expected torch.int8, got torch.uint8"):
        amx_gemm.s8_mm(x_q.view(torch.uint8), torch.zeros(5, 70, dtype=torch.int8))
