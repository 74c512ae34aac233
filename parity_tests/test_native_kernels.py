"""backends.torch_eager.native: the CPU kernels built on first use with the machine's C compiler.

- Each kernel against a float64 computation of its own contract, on random shapes (hypothesis) that cross its
  tile, block and vector edges, with NaN / inf, unused (-1) slots, odd widths and strided operands, for every build
  that runs here: the AVX-512 BF16 one and the AVX2 one where the CPU has them, and the portable one (the same loops
  around scalar arithmetic) on any CPU with a compiler, so the blocking is checked on every machine.
- A result does not depend on how the work is split over threads (bit for bit).
- The builder: GLM5_HAL_NATIVE=0, a CPU without the flags, a failing compiler and a missing one are reasons, never
  crashes; the build cache is keyed by the source.
- Bad arguments name the argument, what was expected and what came.
"""

from __future__ import annotations

import multiprocessing

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import glm5_hal
from backends.torch_eager.native import bf16_gemm, build, indexer_scores, quantized_index_scores
from backends.torch_eager.native import indexer_prolog as native_prolog
from backends.torch_eager.native import sparse_attention as native_attention
from backends.torch_eager.native.row_prefetch import ROW_PREFETCHES
from glm5_hal.kv_formats import FORMATS, decode_rows, encode_rows
from glm5_hal.paged import token_positions, token_sequences

ISAS = ("avx512_bf16", "avx2", "portable")
SETTINGS = settings(max_examples=30, deadline=None, derandomize=True)
FP32_SUM = 2.0**-24  # the unit roundoff of fp32 sums: a sum of n terms is within n * FP32_SUM * sum |terms|


def _runs(module, isa: str, *kernel: str) -> None:
    ok, why = module.availability(isa, *kernel)
    if not ok:
        pytest.skip(f"{isa} build does not run here: {why}")


def _builds(module) -> list:
    """The builds of an op with a vector kernel and an AMX one (sparse attention, indexer scores) as (C kernel, build):
    the vector kernel's builds, and the AMX kernel's AMX build, its amx_emulated one (the AMX build's AVX-512 code
    around the tile instructions emulated in scalar C: checked on any AVX-512 CPU) and its portable one (all of it in
    scalar C: checked on any CPU)."""
    amx_builds = ("amx", "amx_emulated", "portable")
    return [
        *[pytest.param(module.KERNEL, isa, id=isa) for isa in ISAS],
        *[pytest.param(module.AMX_KERNEL, isa, id=f"amx_kernel-{isa}") for isa in amx_builds],
    ]


def _bf16(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).bfloat16()


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality of fp32 tensors (torch.equal says NaN != NaN)."""
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def _assert_within_fp32_sums(got: torch.Tensor, want: torch.Tensor, magnitude: torch.Tensor, terms: int) -> None:
    """got (fp32) equals the float64 `want` up to fp32 summation of `terms` terms whose |sum| is `magnitude`;
    NaN and infinities exactly where want has them."""
    got = got.double()
    assert torch.equal(got.isnan(), want.isnan())
    finite = want.isfinite()
    assert torch.equal(got[~finite & ~want.isnan()], want[~finite & ~want.isnan()])
    bound = (terms + 2) * FP32_SUM * magnitude[finite] + 1e-30
    error = (got[finite] - want[finite]).abs()
    assert (error <= bound).all(), f"worst error {float((error / bound).max()):.3g}x the fp32 summation bound"


# ------------------------------------------------------------------------------------------------ bf16_gemm


@pytest.mark.parametrize("isa", ISAS)
@SETTINGS
@given(
    batch=st.integers(1, 3),
    rows=st.integers(0, 11),
    cols=st.integers(0, 13),
    depth=st.sampled_from([0, 1, 31, 32, 33, 100, 1024, 1025, 2100]),
    strided=st.booleans(),
    special=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_bf16_gemm_is_the_fp32_gemm_of_the_bf16_operands(isa, batch, rows, cols, depth, strided, special, seed):
    _runs(bf16_gemm, isa)
    gen = torch.Generator().manual_seed(seed)
    a, b = _bf16(gen, batch, rows, depth), _bf16(gen, batch, cols, depth + 3 * strided)
    b = b[..., :depth]  # strided: rows of b 3 apart wider than K
    if special and rows and depth:
        a[0, 0, 0] = float("nan")
        a[-1, -1, -1] = float("inf")
    want = torch.bmm(a.double(), b.double().mT)
    got = bf16_gemm.bmm_nt(a, b, isa=isa, threads=1)
    assert got.dtype == torch.float32 and got.shape == (batch, rows, cols)
    _assert_within_fp32_sums(got, want, torch.bmm(a.double().abs(), b.double().abs().mT), depth)


@pytest.mark.parametrize("isa", ISAS)
def test_bf16_gemm_gives_a_row_the_same_bits_whether_a_stays_in_l2_or_is_blocked(isa):
    """bf16_gemm.c reads a small A (decode: up to A_RESIDENT = 256 KiB) with each group of B rows whole and a larger
    one in blocks of rows of A per pass over B; both sum each output's K blocks in the same order, so a row's result
    is the same to the bit whatever else is in the batch (a decode token alone, or within a prefill)."""
    _runs(bf16_gemm, isa)
    gen = torch.Generator().manual_seed(11)
    depth = 2100  # three K blocks, the last partial
    a, b = _bf16(gen, 1, 70, depth), _bf16(gen, 1, 37, depth)  # 70 x 2100 x 2 bytes: past A_RESIDENT
    blocked = bf16_gemm.bmm_nt(a, b, isa=isa, threads=1)
    _assert_within_fp32_sums(
        blocked, torch.bmm(a.double(), b.double().mT), torch.bmm(a.double().abs(), b.double().abs().mT), depth
    )
    for rows in (slice(0, 1), slice(5, 9), slice(60, 70), slice(0, 62)):  # 62 x 2100 x 2 bytes: within it
        assert _same_bits(bf16_gemm.bmm_nt(a[:, rows], b, isa=isa, threads=1), blocked[:, rows])


@pytest.mark.parametrize("isa", ISAS)
def test_bf16_gemm_takes_transposed_and_expanded_operands_and_any_thread_count(isa):
    _runs(bf16_gemm, isa)
    gen = torch.Generator().manual_seed(5)
    a = _bf16(gen, 40, 3, 2).permute(1, 2, 0)  # [3, 2, 40], K not contiguous: copied into the kernel's layout
    b = _bf16(gen, 1, 70, 40).expand(3, 70, 40)  # batch stride 0
    one = bf16_gemm.bmm_nt(a, b, isa=isa, threads=1)
    assert torch.allclose(one.double(), torch.bmm(a.double(), b.double().mT), rtol=1e-5, atol=1e-5)
    for threads in (2, 3, 7):
        assert _same_bits(bf16_gemm.bmm_nt(a, b, isa=isa, threads=threads), one)
        assert _same_bits(bf16_gemm.bmm_nt(a[:1], b[:1], isa=isa, threads=threads), one[:1])  # split by columns


def test_bf16_gemm_rejects_bad_operands():
    a = torch.zeros(2, 3, 8, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"b: expected bfloat16, got torch.float32"):
        bf16_gemm.bmm_nt(a, torch.zeros(2, 4, 8))
    with pytest.raises(ValueError, match=r"b: expected \[2, N, 8\] to match a \(2, 3, 8\), got \(2, 4, 7\)"):
        bf16_gemm.bmm_nt(a, torch.zeros(2, 4, 7, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"a: expected \[B, rows, K\], got shape \(3, 8\)"):
        bf16_gemm.bmm_nt(a[0], a[0])


# ------------------------------------------------------------------------------------------------ indexer scores


def _indexer_want(q, weights, cache, tables, limits, width) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 scores and sum_h |w_h| sum_d |q k| over the heads with a finite dot (the magnitude the fp32 sums are
    judged by; a head whose dot is -inf adds exactly 0 after the ReLU)."""
    block_size = cache.shape[1]
    positions = torch.arange(width)
    keys = cache[tables[:, positions // block_size].long(), positions % block_size].double()  # [T, width, D]
    dots = torch.einsum("thd,tsd->tsh", q.double(), keys)
    scores = (weights.double()[:, None, :] * dots.clamp_min(0).where(~dots.isnan(), dots)).sum(-1)
    per_head = torch.einsum("th,thd,tsd->tsh", weights.double().abs(), q.double().abs(), keys.abs())
    magnitude = per_head.where(dots.isfinite(), 0.0).sum(-1)
    visible = positions[None, :] < limits[:, None]
    return scores.where(visible, float("-inf")), magnitude.where(visible, 0.0)


@pytest.mark.parametrize("kernel, isa", _builds(indexer_scores))
@SETTINGS
@given(
    tokens=st.integers(1, 3),
    heads=st.integers(1, 40),
    dims=st.sampled_from([1, 2, 7, 64, 128, 129]),
    block_size=st.sampled_from([1, 4, 16, 64]),  # 64: whole groups of 32 keys in a block
    width=st.integers(0, 300),
    special=st.booleans(),
    spare=st.sampled_from([0, 3]),
    seed=st.integers(0, 2**31 - 1),
)
def test_indexer_scores_are_the_fp32_scores_over_the_keys_in_place(
    kernel, isa, tokens, heads, dims, block_size, width, special, spare, seed
):
    """Against float64, NaN and inf included; the cache's rows `spare` elements longer than D (a view: rows read in
    place one row stride apart, not D); the split over threads changes no bit."""
    _runs(indexer_scores, isa, kernel)
    gen = torch.Generator().manual_seed(seed)
    blocks = -(-max(width, 1) // block_size)
    cache = _bf16(gen, blocks + 2, block_size, dims + spare)[..., :dims]
    q, weights = _bf16(gen, tokens, heads, dims), torch.randn(tokens, heads, generator=gen)
    tables = torch.randint(0, blocks + 2, (tokens, blocks), generator=gen, dtype=torch.int32)
    limits = torch.randint(0, width + 2, (tokens,), generator=gen)
    if special:
        cache.view(-1, dims)[torch.randint(0, cache.shape[0] * block_size, (3,), generator=gen)] = float("nan")
        q[0, -1, 0] = float("inf")
    want, magnitude = _indexer_want(q, weights, cache, tables, limits, width)
    got = indexer_scores.scores(q, weights, cache, tables, limits, width, isa=isa, kernel=kernel, threads=1)
    _assert_within_fp32_sums(got, want, magnitude, heads * dims)
    again = indexer_scores.scores(q, weights, cache, tables, limits, width, isa=isa, kernel=kernel, threads=3)
    assert _same_bits(again, got)


@pytest.mark.parametrize("kernel, isa", _builds(indexer_scores))
def test_indexer_heads_past_h_add_nothing_even_where_a_key_holds_inf(kernel, isa):
    """3 heads: the vector lanes past them hold q = 0, whose product with an inf in a key is NaN; they must be masked
    out, not weighted by 0. Key 0's -inf makes every real head's dot -inf (ReLU: 0); key 1's +inf makes it +inf."""
    _runs(indexer_scores, isa, kernel)
    cache = torch.ones(1, 2, 8, dtype=torch.bfloat16)
    cache[0, 0, 0], cache[0, 1, 0] = float("-inf"), float("inf")
    q = torch.ones(1, 3, 8, dtype=torch.bfloat16)
    table, limit = torch.zeros(1, 1, dtype=torch.int32), torch.tensor([2])
    got = indexer_scores.scores(q, torch.ones(1, 3), cache, table, limit, 2, isa=isa, kernel=kernel, threads=1)
    assert got.tolist() == [[0.0, float("inf")]]


def test_indexer_scores_reject_bad_arguments():
    q, w = torch.zeros(2, 4, 8, dtype=torch.bfloat16), torch.zeros(2, 4)
    cache = torch.zeros(3, 4, 8, dtype=torch.bfloat16)
    tables, limits = torch.zeros(2, 2, dtype=torch.int32), torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"tables: expected \[2, >= 9 / 4\], got \(2, 2\)"):
        indexer_scores.scores(q, w, cache, tables, limits, 9)
    with pytest.raises(TypeError, match=r"cache: expected \[blocks, block_size, 8\] bf16"):
        indexer_scores.scores(q, w, cache.float(), tables, limits, 8)
    strided = torch.zeros(3, 4, 16, dtype=torch.bfloat16)[..., ::2]
    with pytest.raises(ValueError, match=r"cache: expected rows contiguous in D, got strides \(64, 16, 2\)"):
        indexer_scores.scores(q, w, strided, tables, limits, 8)
    with pytest.raises(ValueError, match=r"weights: expected \(2, 4\), got \(2, 3\)"):
        indexer_scores.scores(q, w[:, :3], cache, tables, limits, 8)


# ------------------------------------------------------------------------------------------ quantized index scores


def _quantized_index_cache(gen: torch.Generator, kv_cache_dtype: str, blocks: int, block_size: int, raw: bool):
    """uint8 [blocks, block_size, 132] rows of `kv_cache_dtype`: random keys as kv_formats encodes them, or (raw)
    random codes (every code, NaN e4m3 codes included) with random scales, a few of them NaN or inf. (Not random
    scale bytes: fp32 products of scales near 1e38 overflow where the float64 reference does not.)"""
    fmt = FORMATS[kv_cache_dtype]
    if raw:
        rows = torch.randint(0, 256, (blocks * block_size, fmt.row_bytes), generator=gen, dtype=torch.uint8)
        scales = torch.randn(blocks * block_size, 1, generator=gen).abs()
        scales[torch.randint(0, scales.shape[0], (2,), generator=gen)] = torch.tensor([[float("nan")], [float("inf")]])
        rows[:, fmt.scales_offset :] = scales.view(torch.uint8)
        return rows.view(blocks, block_size, fmt.row_bytes)
    keys = torch.randn(blocks * block_size, fmt.quantized_dims, generator=gen) * 4
    return encode_rows(keys, fmt).view(blocks, block_size, fmt.row_bytes)


@pytest.mark.parametrize("kernel, isa", _builds(quantized_index_scores))
@SETTINGS
@given(
    kv_cache_dtype=st.sampled_from(sorted(quantized_index_scores.CODES)),
    q_dtype=st.sampled_from([torch.bfloat16, torch.float32, "mixed"]),
    tokens=st.integers(1, 4),
    heads=st.integers(1, 40),
    block_size=st.sampled_from([1, 3, 16, 64]),
    width=st.integers(0, 600),
    one_sequence=st.booleans(),
    raw=st.booleans(),
    prefetch=st.sampled_from(tuple(ROW_PREFETCHES)),
    seed=st.integers(0, 2**31 - 1),
)
# A bf16 token after an fp32 one of its sequence reused the fp32 keys (the fp32 route), alone it took the bf16 route:
# its bits depended on the split over threads (found at 10x this test's examples).
@example(kv_cache_dtype="fp8_index", q_dtype="mixed", tokens=4, heads=35, block_size=1, width=118, one_sequence=True,
         raw=False, prefetch="nta", seed=0)  # fmt: skip
def test_quantized_index_scores_are_the_fp32_scores_over_the_decoded_rows(
    kernel, isa, kv_cache_dtype, q_dtype, tokens, heads, block_size, width, one_sequence, raw, prefetch, seed
):
    """Widths past the kernel's 256-key chunk, tokens sharing one block table (the decoded chunk is reused) or each
    their own (decoded again), rows of random bytes (NaN codes, any scale) or as the writer encodes them; bf16
    queries (the bf16 route over e4m3 codes), fp32 ones, or "mixed": fp32 queries of which every other token holds
    bf16 values, so tokens sharing a decoded chunk alternate between the two routes, each taking its own. The split
    over threads and the hint the next chunk's rows are prefetched with change no bit."""
    _runs(quantized_index_scores, isa, kernel)
    gen = torch.Generator().manual_seed(seed)
    blocks = -(-max(width, 1) // block_size)
    cache = _quantized_index_cache(gen, kv_cache_dtype, blocks + 2, block_size, raw)
    q = torch.randn(tokens, heads, 128, generator=gen)
    if q_dtype == "mixed":
        q[::2] = q[::2].bfloat16().float()
    else:
        q = q.to(q_dtype)
    weights = torch.randn(tokens, heads, generator=gen)
    tables = torch.randint(0, blocks + 2, (tokens, blocks), generator=gen, dtype=torch.int32)
    if one_sequence:
        tables[1:] = tables[0]
    limits = torch.randint(0, width + 2, (tokens,), generator=gen)
    keys = decode_rows(cache, FORMATS[kv_cache_dtype])  # fp32, exactly what the kernel multiplies
    want, magnitude = _indexer_want(q, weights, keys, tables, limits, width)
    got = quantized_index_scores.scores(
        q, weights, cache, tables, limits, width, kv_cache_dtype, isa=isa, kernel=kernel, threads=1
    )
    _assert_within_fp32_sums(got, want, magnitude, heads * 128)
    three = quantized_index_scores.scores(
        q, weights, cache, tables, limits, width, kv_cache_dtype, isa=isa, kernel=kernel, threads=3, prefetch=prefetch
    )
    assert _same_bits(three, got)


@pytest.mark.parametrize("kernel, isa", _builds(quantized_index_scores))
@pytest.mark.parametrize("kv_cache_dtype", sorted(quantized_index_scores.CODES))
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
def test_every_code_decodes_to_kv_formats_value_bit_for_bit(kernel, isa, kv_cache_dtype, q_dtype):
    """Token d's query is the unit vector e_d (one head), so its score over a row is relu(key[d]) exactly, and with
    -e_d relu(-key[d]): every one of the 256 codes, at a scale of 1, a plain one and one that makes products
    subnormal, against kv_formats.decode_rows. NaN codes sit in rows of their own (0 x NaN would spread them). With
    bf16 queries e4m3 codes take the bf16 route (value times scale after the dot: here the same rounding)."""
    _runs(quantized_index_scores, isa, kernel)
    fmt = FORMATS[kv_cache_dtype]
    finite = [c for c in range(256) if kv_cache_dtype != "fp8_index" or c & 0x7F != 0x7F]
    codes = torch.tensor(finite + [0] * (-len(finite) % 128), dtype=torch.uint8).view(-1, 128)
    if kv_cache_dtype == "fp8_index":  # NaN codes 0x7F and 0xFF, one row each
        codes = torch.cat([codes, torch.zeros(2, 128, dtype=torch.uint8)])
        codes[-2, 5], codes[-1, 77] = 0x7F, 0xFF
    rows = []
    for scale in (1.0, 0.3712, 2.0**-140):
        scales = torch.full((codes.shape[0], 1), scale).view(torch.uint8)
        rows.append(torch.cat([codes, scales], dim=1))
    cache = torch.stack(rows).flatten(0, 1)[:, None, :]  # one row per block
    width = cache.shape[0]
    want = decode_rows(cache, fmt)[:, 0]  # [rows, 128]
    table = torch.arange(width, dtype=torch.int32).expand(128, width)
    limits = torch.full((128,), width)
    for sign in (1.0, -1.0):
        q = (sign * torch.eye(128, dtype=q_dtype))[:, None, :]  # token d: q = sign e_d
        expected = (sign * want).T.clamp_min(0.0)  # [token d, row]
        nan_rows = want.isnan().any(dim=1)
        for got in _together_and_alone(q, torch.ones(128, 1), cache, table, limits, width, kv_cache_dtype, isa, kernel):
            assert got[:, nan_rows].isnan().all()
            assert torch.equal(got[:, ~nan_rows], expected[:, ~nan_rows])  # equal values (a zero's sign aside)


def _together_and_alone(q, weights, cache, tables, limits, width, kv_cache_dtype, isa, kernel):
    """The scores of every token of one call (which decodes each chunk into the workspace once for the tokens that
    share it), then each token's in a call of its own (a decode step's route: the codes decoded in the tiles; the AMX
    kernel, which has no such path, decodes the chunk for the lone token too)."""
    together = quantized_index_scores.scores(
        q, weights, cache, tables, limits, width, kv_cache_dtype, isa=isa, kernel=kernel, threads=1
    )
    alone = torch.cat(
        [
            quantized_index_scores.scores(
                q[t : t + 1],
                weights[t : t + 1],
                cache,
                tables[t : t + 1],
                limits[t : t + 1],
                width,
                kv_cache_dtype,
                isa=isa,
                kernel=kernel,
                threads=1,
            )
            for t in range(q.shape[0])
        ]
    )
    return together, alone


@pytest.mark.parametrize("kernel, isa", _builds(quantized_index_scores))
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
def test_e4m3_codes_decode_bit_for_bit_at_scales_near_the_fp32_range_ends(kernel, isa, q_dtype):
    """The fp32 route multiplies an e4m3 code's fp16-widened value by 256 x scale in one step where 256 x scale is
    finite, and by 256 then by the scale where it is not (quantized_index_scores.c, row_scale). Scales on both sides
    of FLT_MAX / 256 (with codes small enough that no key overflows) and scales that make keys subnormal or flush them
    to zero: every token's score is kv_formats.decode_rows' value, in the workspace and in a lone token's tiles."""
    _runs(quantized_index_scores, isa, kernel)
    fmt = FORMATS["fp8_index"]
    small = [c for c in range(256) if c & 0x7F <= 0x6F]  # |value| <= 120: x 2^121 stays below FLT_MAX
    codes = torch.tensor(small + [0] * (-len(small) % 128), dtype=torch.uint8).view(-1, 128)
    edge = torch.tensor(torch.finfo(torch.float32).max / 256)  # exact: a power of two below FLT_MAX
    scales = [edge.item(), torch.nextafter(edge, torch.tensor(float("inf"))).item(), 2.0**121, 2.0**-140, 2.0**-149]
    rows = [torch.cat([codes, torch.full((codes.shape[0], 1), s).view(torch.uint8)], dim=1) for s in scales]
    cache = torch.cat(rows)[:, None, :]  # one row per block
    width = cache.shape[0]
    want = decode_rows(cache, fmt)[:, 0]
    assert want.isfinite().all() and (want.abs() > 1e36).any() and ((want != 0) & (want.abs() < 1e-38)).any()
    table = torch.arange(width, dtype=torch.int32).expand(128, width)
    limits = torch.full((128,), width)
    for sign in (1.0, -1.0):
        q = (sign * torch.eye(128, dtype=q_dtype))[:, None, :]
        for got in _together_and_alone(q, torch.ones(128, 1), cache, table, limits, width, "fp8_index", isa, kernel):
            assert torch.equal(got, (sign * want).T.clamp_min(0.0))


@pytest.mark.parametrize("kernel, isa", _builds(quantized_index_scores))
def test_every_e4m3_code_decodes_the_same_with_subnormals_flushed(kernel, isa):
    """The decode never holds a subnormal fp32 (the e4m3 subnormal codes go through integer operations or through
    fp16, whose widening MXCSR's DAZ does not touch), so a process that flushes subnormals (FTZ / DAZ, as oneDNN and
    many inference stacks set) decodes every code to the same value. Scale 1: no result is subnormal either."""
    _runs(quantized_index_scores, isa, kernel)
    finite = [c for c in range(256) if c & 0x7F != 0x7F]
    codes = torch.tensor(finite + [0] * (-len(finite) % 128), dtype=torch.uint8).view(-1, 128)
    cache = torch.cat([codes, torch.ones(codes.shape[0], 1).view(torch.uint8)], dim=1)[:, None, :]
    width = cache.shape[0]
    want = decode_rows(cache, FORMATS["fp8_index"])[:, 0]
    table = torch.arange(width, dtype=torch.int32).expand(128, width)
    q, ones, limits = torch.eye(128)[:, None, :], torch.ones(128, 1), torch.full((128,), width)
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush subnormals (no FTZ / DAZ)")
    try:
        assert (torch.tensor(1e-30) * 1e-10).item() == 0.0  # subnormals are flushed now
        got = quantized_index_scores.scores(
            q, ones, cache, table, limits, width, "fp8_index", isa=isa, kernel=kernel, threads=1
        )
    finally:
        torch.set_flush_denormal(False)
    assert torch.equal(got, want.T.clamp_min(0.0))


BF16_ROUTE_ISAS = ("avx512_bf16", "portable")  # the builds of quantized_index_scores.c with the bf16 route


@pytest.mark.parametrize("kernel, isa", _builds(quantized_index_scores))
def test_bf16_queries_over_e4m3_codes_take_the_bf16_route_where_the_build_has_it(kernel, isa):
    """q = e_0 + e_1 over a row with codes of value 2^-9 and 3 x 2^-8 at dims 0 and 1, scale 0.3712: the bf16 route
    scales the exact sum once, (v0 + v1) x s, the fp32 route sums the scaled keys, v0 s + v1 s, and the two differ in
    the last bit here. So the score says which route ran: the bf16 one in the builds that have it (a guard or a
    decode that sent every token to the fp32 route fails this), the fp32 one in the others."""
    _runs(quantized_index_scores, isa, kernel)
    codes = torch.zeros(1, 128, dtype=torch.uint8)
    codes[0, 0], codes[0, 1] = 0x01, 0x06
    scale = torch.tensor([[0.3712]])
    cache = torch.cat([codes, scale.view(torch.uint8)], dim=1)[:, None, :]
    v0, v1 = decode_rows(torch.cat([codes, torch.ones(1, 1).view(torch.uint8)], 1)[:, None, :], FORMATS["fp8_index"])[
        0, 0, :2
    ]
    assert (v0.item(), v1.item()) == (2.0**-9, 3 * 2.0**-8)
    bf16_route, fp32_route = (v0 + v1) * scale[0, 0], v0 * scale[0, 0] + v1 * scale[0, 0]  # fp32 arithmetic
    assert bf16_route != fp32_route
    q = torch.zeros(1, 1, 128, dtype=torch.bfloat16)
    q[0, 0, :2] = 1.0
    table, limits = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int64)
    got = quantized_index_scores.scores(
        q, torch.ones(1, 1), cache, table, limits, 1, "fp8_index", isa=isa, kernel=kernel, threads=1
    )
    has_route = isa in BF16_ROUTE_ISAS or kernel == quantized_index_scores.AMX_KERNEL  # every AMX build has it
    assert got.item() == (bf16_route if has_route else fp32_route).item()


@pytest.mark.parametrize("kernel, isa", _builds(quantized_index_scores))
def test_bf16_queries_the_bf16_route_cannot_take_exactly_get_the_fp32_scores(kernel, isa):
    """The bf16 route (quantized_index_scores.c's top) scales after the dot and runs VDPBF16PS, which flushes
    subnormals. Token 0's bf16 query is +-2^-120 (and its negation, a second head): its products with the e4m3
    subnormal codes (m 2^-9) are subnormal, so that route would give 0 where the scores are m 2^-29 sums (scale
    2^100). Token 1's bf16 query e_0 - e_1 meets rows whose keys overflow (448 x 1e38: inf - inf, NaN) or hold
    0 x inf (scale inf), where scaling after the dot would give 0 and inf. Each must equal the scores over the
    decoded rows: the fp32 route."""
    _runs(quantized_index_scores, isa, kernel)
    gen = torch.Generator().manual_seed(7)
    fmt = FORMATS["fp8_index"]
    codes = torch.randint(1, 8, (4, 128), generator=gen, dtype=torch.uint8)  # subnormal magnitudes
    codes |= torch.randint(0, 2, (4, 128), generator=gen, dtype=torch.uint8) << 7  # random signs
    codes[2:] = 0
    codes[2, :2] = 0x7E  # 448, 448
    codes[3, 0] = 0x38  # 1.0, then 0
    scales = torch.tensor([[2.0**100], [2.0**100], [1e38], [float("inf")]])
    cache = torch.cat([codes, scales.view(torch.uint8)], dim=1)[:, None, :]  # one row per block
    q = torch.zeros(2, 2, 128)
    q[0, 0] = (torch.randint(0, 2, (128,), generator=gen) * 2 - 1) * 2.0**-120
    q[0, 1] = -q[0, 0]  # the two heads' relu sum to |dot|
    q[1, 0, 0], q[1, 0, 1] = 1.0, -1.0
    q = q.bfloat16()
    weights, width = torch.ones(2, 2), 4
    tables = torch.arange(width, dtype=torch.int32).expand(2, width)
    limits = torch.full((2,), width)
    want, magnitude = _indexer_want(q, weights, decode_rows(cache, fmt), tables, limits, width)
    assert want[0, :2].abs().min() > 0 and want[1, 2:].isnan().all()  # what the bf16 route would have missed
    # A call each, token 0 over rows 0-1 only: a chunk with a scale the route cannot take is decoded for the fp32
    # route, and a token that decodes it so takes every token sharing it past the route.
    for t, keys in ((0, 2), (1, width)):
        got = quantized_index_scores.scores(
            q[t : t + 1],
            weights[t : t + 1],
            cache,
            tables[t : t + 1, :keys],
            limits[t : t + 1],
            keys,
            "fp8_index",
            isa=isa,
            kernel=kernel,
            threads=1,
        )
        _assert_within_fp32_sums(got, want[t : t + 1, :keys], magnitude[t : t + 1, :keys], 2 * 128)


@pytest.mark.parametrize("kernel, isa", _builds(quantized_index_scores))
@pytest.mark.parametrize("heads", [1, 4, 5])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("kv_cache_dtype", sorted(quantized_index_scores.CODES))
def test_a_lone_tokens_scores_are_the_bits_it_gets_beside_a_token_of_its_sequence(
    kernel, isa, heads, block_size, kv_cache_dtype
):
    """A token alone with its keys (a decode step) and at most 4 heads has its tiles decode the codes on the way;
    beside a token of its own sequence (prefill) it reads the chunk that token decoded into the workspace. Both
    orders of the same products: each row the same bits either way (NaN where the other has NaN: the compiler may
    swap the operands of a sum in one copy of the tile, and x86 then keeps the other NaN's sign), over 3 chunks of
    random codes (NaN codes and scales included) with bf16 queries (the bf16 route over e4m3 codes), fp32 ones (the
    fp32 route) and a limit inside a chunk, for both quantized formats."""
    _runs(quantized_index_scores, isa, kernel)
    gen = torch.Generator().manual_seed(heads * 31 + block_size)
    width = 600
    blocks = -(-width // block_size)
    cache = _quantized_index_cache(gen, kv_cache_dtype, blocks + 2, block_size, raw=True)
    table = torch.randperm(blocks + 2, generator=gen)[:blocks].to(torch.int32).expand(2, blocks)
    limits = torch.tensor([width, 421])
    weights = torch.randn(2, heads, generator=gen)
    for q_dtype in (torch.bfloat16, torch.float32):
        q = torch.randn(2, heads, 128, generator=gen).to(q_dtype)
        together, alone = _together_and_alone(q, weights, cache, table, limits, width, kv_cache_dtype, isa, kernel)
        for t in range(2):
            nan = together[t].isnan()
            assert torch.equal(alone[t].isnan(), nan), (q_dtype, t)
            assert _same_bits(alone[t][~nan], together[t][~nan]), (q_dtype, t)


def test_quantized_index_scores_reject_bad_arguments():
    q, w = torch.zeros(2, 4, 128, dtype=torch.bfloat16), torch.zeros(2, 4)
    cache = torch.zeros(3, 4, 132, dtype=torch.uint8)
    tables, limits = torch.zeros(2, 2, dtype=torch.int32), torch.zeros(2, dtype=torch.int64)
    scores = quantized_index_scores.scores
    with pytest.raises(ValueError, match=r"kv_cache_dtype: expected one of \('fp8_index', 'int8_index'\)"):
        scores(q, w, cache, tables, limits, 8, "fp8_ds_mla")
    with pytest.raises(TypeError, match=r"q: expected \[T, H, 128\] bf16, fp16 or fp32, got \(2, 4, 64\)"):
        scores(q[..., :64], w, cache, tables, limits, 8, "fp8_index")
    with pytest.raises(TypeError, match=r"cache: expected \[blocks, block_size, 132\] uint8 fp8_index rows"):
        scores(q, w, cache[..., :128], tables, limits, 8, "fp8_index")
    with pytest.raises(ValueError, match=r"tables: expected \[2, >= 9 / 4\], got \(2, 2\)"):
        scores(q, w, cache, tables, limits, 9, "int8_index")
    with pytest.raises(ValueError, match=r"weights: expected \(2, 4\), got \(2, 3\)"):
        scores(q, w[:, :3], cache, tables, limits, 8, "fp8_index")
    strided = torch.zeros(3, 4, 264, dtype=torch.uint8)[..., ::2]
    with pytest.raises(ValueError, match=r"cache: expected rows contiguous in D, got strides \(1056, 264, 2\)"):
        scores(q, w, strided, tables, limits, 8, "fp8_index")
    with pytest.raises(ValueError, match=r"quantized index scores: prefetch: expected one of .*, got 'L2'"):
        scores(q, w, cache, tables, limits, 8, "fp8_index", prefetch="L2")


@pytest.mark.parametrize("kernel, isa", _builds(quantized_index_scores))
@SETTINGS
@given(
    kv_cache_dtype=st.sampled_from(sorted(quantized_index_scores.CODES)),
    q_lens=st.lists(st.integers(0, 4), min_size=1, max_size=3),
    extra_keys=st.lists(st.integers(0, 300), min_size=3, max_size=3),
    heads=st.integers(1, 9),
    block_size=st.sampled_from([1, 3, 16, 64]),
    spare_columns=st.integers(0, 2),
    outside=st.booleans(),
    first_token=st.integers(0, 2),
    seed=st.integers(0, 2**31 - 1),
)
def test_paged_quantized_index_scores_find_each_tokens_keys_as_the_torch_side_did(
    kernel, isa, kv_cache_dtype, q_lens, extra_keys, heads, block_size, spare_columns, outside, first_token, seed
):
    """The paged entry against the per-token one fed as the torch backend fed it (glm5_hal.paged's sequences and
    positions, table rows clamped into the cache, keys of entries outside the cache -inf after), bit for bit:
    ragged batches with sequences without new tokens, spare table columns, entries outside the cache (negative and
    past the end), a tile of the batch from first_token on, one thread and three."""
    _runs(quantized_index_scores, isa, kernel)
    gen = torch.Generator().manual_seed(seed)
    q_len = torch.tensor(q_lens)
    k_len = q_len + torch.tensor(extra_keys[: len(q_lens)])
    columns = int(-(-k_len.max() // block_size)) + spare_columns
    blocks = max(columns, 1) + 1
    table = torch.randint(0, blocks, (len(q_lens), max(columns, 1)), generator=gen, dtype=torch.int32)
    if outside:
        entries = torch.randint(0, table.numel(), (3,), generator=gen)
        table.view(-1)[entries] = torch.tensor([-1, blocks, -7], dtype=torch.int32)
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), q_len.cumsum(0)]).to(torch.int32)
    tokens, width, seq_lens = int(cu[-1]), table.shape[1] * block_size, k_len.to(torch.int32)
    cache = _quantized_index_cache(gen, kv_cache_dtype, blocks, block_size, False)
    q = torch.randn(tokens, heads, 128, generator=gen).bfloat16()
    weights = torch.randn(tokens, heads, generator=gen)
    seqs = token_sequences(cu, tokens)
    positions = token_positions(seq_lens, cu, seqs)
    raw = table[seqs]
    want = quantized_index_scores.scores(
        q,
        weights,
        cache,
        raw.clamp(0, blocks - 1),
        positions + 1,
        width,
        kv_cache_dtype,
        isa=isa,
        kernel=kernel,
        threads=1,
    )
    key_blocks = torch.arange(width) // block_size
    visible = torch.arange(width)[None, :] <= positions[:, None]
    want[((raw < 0) | (raw >= blocks))[:, key_blocks] & visible] = float("-inf")
    first = min(first_token, tokens)
    for threads, prefetch in ((1, "nta"), (3, "l2"), (2, "l1")):
        got = quantized_index_scores.paged_scores(
            q[first:], weights[first:], cache, table, seq_lens, cu, width, kv_cache_dtype,
            first_token=first, isa=isa, kernel=kernel, threads=threads, prefetch=prefetch,
        )  # fmt: skip
        assert _same_bits(got, want[first:]), (threads, prefetch)


@pytest.mark.parametrize("kernel, isa", _builds(quantized_index_scores))
def test_paged_quantized_index_scores_of_tokens_without_a_sequence_see_no_key(kernel, isa):
    """Value checks off, a batch of no sequence can come with tokens (cu_seqlens_q [0] while T = 2): every score is
    -inf and nothing of the (empty) per-sequence tensors is read (the ASan run checks the reading)."""
    _runs(quantized_index_scores, isa, kernel)
    q, w = torch.randn(2, 4, 128).bfloat16(), torch.randn(2, 4)
    cache = encode_rows(torch.randn(12, 128), FORMATS["fp8_index"]).view(3, 4, 132)
    table, lens, cu = torch.zeros(0, 2, dtype=torch.int32), torch.zeros(0, dtype=torch.int32), torch.zeros(1)
    got = quantized_index_scores.paged_scores(
        q, w, cache, table, lens, cu.int(), 8, "fp8_index", isa=isa, kernel=kernel, threads=2
    )
    assert torch.equal(got, torch.full((2, 8), float("-inf")))


def test_paged_quantized_index_scores_op_passes_opcheck():
    """The custom op the backend calls (what spies, FakeTensor and torch.compile see): schema (out mutated),
    fake and real results alike."""
    _runs(quantized_index_scores, "avx2")
    q, w = torch.randn(2, 4, 128).bfloat16(), torch.randn(2, 4)
    cache = encode_rows(torch.randn(12, 128), FORMATS["fp8_index"]).view(3, 4, 132)
    table, lens = torch.tensor([[0, 2]], dtype=torch.int32), torch.tensor([5], dtype=torch.int32)
    args = (q, w, cache, table, lens, torch.tensor([0, 2], dtype=torch.int32), torch.empty(2, 8), "fp8_index", 0)
    torch.library.opcheck(torch.ops.glm5_hal.native_quantized_index_scores_paged.default, (*args, "avx2"))
    kernel = quantized_index_scores.KERNEL
    torch.library.opcheck(torch.ops.glm5_hal.native_quantized_index_scores_paged.default, (*args, "avx2", kernel, "l1"))


def test_paged_quantized_index_scores_reject_bad_arguments():
    q, w = torch.zeros(2, 4, 128, dtype=torch.bfloat16), torch.zeros(2, 4)
    cache = torch.zeros(3, 4, 132, dtype=torch.uint8)
    table, lens, cu = torch.zeros(1, 2, dtype=torch.int32), torch.tensor([2], dtype=torch.int32), torch.tensor([0, 2])
    cu = cu.to(torch.int32)
    paged = quantized_index_scores.paged_scores
    with pytest.raises(ValueError, match=r"kv_cache_dtype: expected one of \('fp8_index', 'int8_index'\)"):
        paged(q, w, cache, table, lens, cu, 8, "fp8_ds_mla")
    with pytest.raises(ValueError, match=r"block_table: expected \[B, >= 9 / 4\] int32, got \(1, 2\) torch.int32"):
        paged(q, w, cache, table, lens, cu, 9, "fp8_index")
    with pytest.raises(ValueError, match=r"block_table: expected \[B, >= 8 / 4\] int32, got \(1, 2\) torch.int64"):
        paged(q, w, cache, table.long(), lens, cu, 8, "fp8_index")
    with pytest.raises(ValueError, match=r"seq_lens_k: expected \[1\] int32, got \(2,\) torch.int32"):
        paged(q, w, cache, table, lens.repeat(2), cu, 8, "fp8_index")
    with pytest.raises(ValueError, match=r"cu_seqlens_q: expected \[2\] int32, got \(2,\) torch.int64"):
        paged(q, w, cache, table, lens, cu.long(), 8, "fp8_index")
    with pytest.raises(ValueError, match=r"first_token: expected >= 0, got -1"):
        paged(q, w, cache, table, lens, cu, 8, "fp8_index", first_token=-1)
    with pytest.raises(ValueError, match=r"weights: expected \(2, 4\), got \(2, 3\)"):
        paged(q, w[:, :3], cache, table, lens, cu, 8, "fp8_index")
    with pytest.raises(ValueError, match=r"out: expected \[2, 8\] fp32 with contiguous rows"):
        paged(q, w, cache, table, lens, cu, 8, "fp8_index", out=torch.empty(2, 7))
    with pytest.raises(ValueError, match=r"quantized index scores: prefetch: expected one of \('l2', 'l1', 'nta'\)"):
        paged(q, w, cache, table, lens, cu, 8, "fp8_index", prefetch="t0")


# ------------------------------------------------------------------------------------------------ indexer prolog


def _prolog_want(x, q_norm, w_iq, w_ik, norm_w, norm_b, w_iw, cos, sin, interleaved, eps):
    """float64 q [T, H, D], k [T, D], weights [T, H] of the contract, and the magnitudes their fp32 sums run over."""
    heads, dims = w_iw.shape[0], w_ik.shape[0]
    x64, qn64 = x.double(), q_norm.double()
    q = (qn64 @ w_iq.double().T).view(-1, heads, dims)
    q_mag = (qn64.abs() @ w_iq.double().abs().T).view(-1, heads, dims)
    k_pre = x64 @ w_ik.double().T
    k_mag = x64.abs() @ w_ik.double().abs().T
    mean = k_pre.mean(-1, keepdim=True)
    rstd = 1.0 / torch.sqrt(((k_pre - mean) ** 2).mean(-1, keepdim=True) + eps)
    k = (k_pre - mean) * rstd * norm_w.double() + norm_b.double()
    half = cos.shape[1]

    def rope(v):
        v = v.clone()
        c, s = cos.double(), sin.double()
        if v.dim() == 3:
            c, s = c[:, None], s[:, None]
        idx_a = torch.arange(half) * 2 if interleaved else torch.arange(half)
        idx_b = idx_a + 1 if interleaved else idx_a + half
        a, b = v[..., idx_a].clone(), v[..., idx_b].clone()
        v[..., idx_a], v[..., idx_b] = a * c - b * s, a * s + b * c
        return v

    weights = (x64 @ w_iw.double().T) * heads**-0.5 * dims**-0.5
    w_mag = (x64.abs() @ w_iw.double().abs().T) * heads**-0.5 * dims**-0.5
    return rope(q), q_mag, rope(k), rstd * k_mag * norm_w.double().abs(), weights, w_mag


@pytest.mark.parametrize("isa", ISAS)
@SETTINGS
@given(
    kv_cache_dtype=st.sampled_from(sorted(native_prolog.CODES)),
    tokens=st.integers(0, native_prolog.MAX_TOKENS),
    heads=st.integers(1, 6),
    dims=st.sampled_from([8, 20, 64, 128]),
    hidden=st.integers(1, 300),
    q_lora=st.integers(1, 200),
    interleaved=st.booleans(),
    special=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_indexer_prolog_is_the_fp32_prolog_of_the_bf16_inputs(
    isa, kv_cache_dtype, tokens, heads, dims, hidden, q_lora, interleaved, special, seed
):
    """Widths that cross the 16-input steps and the 4-token passes, every cache the kernel writes, unused (-1) slots
    and rows it must leave alone, NaN / inf in a token's x (that token's key row and weights, not the others'), against
    float64: q and weights within fp32 sums (q then rounded to bf16), the key within its LayerNorm-scaled fp32 sums and
    its cache's rounding; splitting the projections over threads changes no bit."""
    _runs(native_prolog, isa)
    if kv_cache_dtype != "auto":
        dims = 128  # the index formats' rows hold 128 codes
    gen = torch.Generator().manual_seed(seed)
    x, q_norm = _bf16(gen, tokens, hidden), _bf16(gen, tokens, q_lora)
    w_iq, w_ik, w_iw = _bf16(gen, heads * dims, q_lora), _bf16(gen, dims, hidden), _bf16(gen, heads, hidden)
    norm_w, norm_b = _bf16(gen, dims), _bf16(gen, dims)
    half = int(torch.randint(0, dims // 2 + 1, (1,), generator=gen))
    angles = torch.rand(tokens, half, generator=gen) * 6.3
    cos, sin = angles.cos(), angles.sin()
    if special and tokens:
        x[0, 0] = float("nan") if tokens % 2 else float("inf")
    fmt = None if kv_cache_dtype == "auto" else FORMATS[kv_cache_dtype]
    block_size, blocks = 4, tokens // 2 + 2
    if fmt is None:
        cache = _bf16(gen, blocks, block_size, dims)
    else:
        cache = torch.randint(0, 256, (blocks, block_size, fmt.row_bytes), generator=gen, dtype=torch.uint8)
    slots = torch.randperm(blocks * block_size, generator=gen)[:tokens]
    slots[::3] = -1
    before = cache.clone()
    q_idx, weights = native_prolog.prolog(
        x, q_norm, w_iq, w_ik, norm_w, norm_b, w_iw, cos, sin, cache, slots,
        interleaved=interleaved, eps=1e-6, kv_cache_dtype=kv_cache_dtype, isa=isa, threads=1,
    )  # fmt: skip
    q, q_mag, k, k_mag, w, w_mag = _prolog_want(
        x, q_norm, w_iq, w_ik, norm_w, norm_b, w_iw, cos, sin, interleaved, 1e-6
    )
    rope_mag = 2.0 if half else 1.0  # a rotated value sums two rounded products of its pair
    bf16_half_ulp = 2.0**-8
    bound = bf16_half_ulp * q.abs() + 2 * (q_lora + 4) * FP32_SUM * rope_mag * q_mag.amax(-1, keepdim=True) + 1e-30
    assert ((q_idx.double() - q).abs() <= bound).all()
    _assert_within_fp32_sums(weights, w, w_mag, hidden + 1)
    flat = cache.flatten(0, 1)
    written = slots >= 0
    rows = flat[slots[written]]
    untouched = torch.ones(flat.shape[0], dtype=torch.bool)
    untouched[slots[written]] = False
    assert torch.equal(flat[untouched], before.flatten(0, 1)[untouched])
    stored = rows.double() if fmt is None else decode_rows(rows, fmt).double()
    k, k_mag = k[written], k_mag[written]
    finite_rows = k.isfinite().all(-1)
    assert stored[~finite_rows].isnan().any(-1).all()  # NaN / inf in x: the row is NaN (read back through its scale)
    k, k_mag, stored = k[finite_rows], k_mag[finite_rows], stored[finite_rows]
    fp32_error = 4 * (hidden + dims + 4) * FP32_SUM * rope_mag * k_mag.amax(-1, keepdim=True) + 2.0**-20 * k.abs()
    if fmt is None:
        rounding = bf16_half_ulp * k.abs()
    else:  # half a code step at the row's scale: 2^-4 of a normal e4m3 value, 2^-10 x scale below them; int8 half
        scale = rows[finite_rows, fmt.scales_offset :].contiguous().view(torch.float32).double()
        rounding = (2.0**-4 * k.abs() + 2.0**-10 * scale) if fmt.code == "e4m3" else 0.5 * scale
    assert ((stored - k).abs() <= rounding + fp32_error * (1 + 1 / 127)).all()
    again = before.clone()
    three = native_prolog.prolog(
        x, q_norm, w_iq, w_ik, norm_w, norm_b, w_iw, cos, sin, again, slots,
        interleaved=interleaved, eps=1e-6, kv_cache_dtype=kv_cache_dtype, isa=isa, threads=3,
    )  # fmt: skip
    assert torch.equal(three[0].view(torch.int16), q_idx.view(torch.int16)) and _same_bits(three[1], weights)
    assert torch.equal(again.view(torch.uint8), cache.view(torch.uint8))


def _encoder_rows(gen: torch.Generator) -> torch.Tensor:
    """Rows that cross every rounding edge of both index formats: random rows over 80 binades; rows of scale 1 (max
    448 or 127) holding e4m3 midpoints, normal and subnormal, and int8 halves; zero and -0.0 rows; NaN and inf rows;
    rows whose largest value is a subnormal, so that max / qmax underflows to 0 and every ratio is 0 / 0 or x / 0."""
    rows = torch.randn(400, 128, generator=gen) * torch.logspace(-40, 38, 400)[:, None].float()
    codes = torch.arange(1, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # positive e4m3 values
    midpoints = (codes[:-1] + codes[1:]) / 2
    e4m3 = torch.cat([midpoints, -midpoints, codes[:6]])[:128].clone()
    e4m3[0] = 448.0  # scale exactly 1
    int8 = torch.arange(-63.5, 64.5, 1.0)[:128].clone()
    int8[0] = 127.0
    tiny = torch.tensor(1e-45) * torch.randint(-3, 4, (128,), generator=gen)
    tiny[0] = 1e-45
    special = torch.zeros(5, 128)
    special[1] = -0.0
    special[2, 7], special[3, 9], special[4, 0] = float("nan"), float("inf"), -float("inf")
    return torch.cat([rows, e4m3[None], int8[None], tiny[None], special])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kv_cache_dtype", ["fp8_index", "int8_index"])
def test_indexer_prolog_encodes_rows_as_kv_formats_bit_for_bit(isa, kv_cache_dtype):
    """The prolog's encoder against kv_formats.encode_rows on every rounding edge (_encoder_rows), NaN bits included."""
    _runs(native_prolog, isa)
    rows = _encoder_rows(torch.Generator().manual_seed(3))
    got = native_prolog.encode(rows, kv_cache_dtype, isa=isa)
    assert torch.equal(got, encode_rows(rows, FORMATS[kv_cache_dtype]))


def test_the_torch_backend_runs_decode_prologs_on_the_fused_kernel(monkeypatch: pytest.MonkeyPatch):
    """With the native route forced, the torch backend's indexer_prolog of every parity case (both RoPE layouts,
    padding slots, every cache format, a written zero tile) of at most MAX_TOKENS tokens runs native/indexer_prolog.c,
    and the parity judge passes its outputs and written cache against the reference; larger calls keep the GEMM path."""
    from glm5_hal.parity.cases import cases_for
    from glm5_hal.parity.runner import case_generator, run_inputs

    native = "1" if native_prolog.availability()[0] else build.PORTABLE_ONLY
    monkeypatch.setenv("GLM5_HAL_FAST_PATHS", "1")
    monkeypatch.setenv(build.ENV_NATIVE, native)
    calls = []
    real = native_prolog.prolog
    monkeypatch.setattr(native_prolog, "prolog", lambda x, *a, **kw: calls.append(x.shape[0]) or real(x, *a, **kw))
    fused = set()
    for case in cases_for("indexer_prolog", quick=True):
        inputs = case.build(case_generator(case, torch.bfloat16, seed=7), torch.bfloat16)
        calls.clear()
        result = run_inputs("indexer_prolog", inputs, "torch", torch.bfloat16, name=case.name)
        assert result.passed, result.detail
        tokens = inputs["x"].shape[0]
        assert calls == ([tokens] if tokens <= native_prolog.MAX_TOKENS else []), (case.name, calls)
        if calls:
            fused.add(inputs.get("kv_cache_dtype", "auto"))
    assert fused == set(native_prolog.CODES), f"decode-sized cases only for {fused}: the test checks too little"


def test_indexer_prolog_bounds_its_slots_with_value_checks_off(monkeypatch):
    """The backend calls the native prolog with validated=True, behind the op's checks; the op's slot range check is a
    value check that GLM5_HAL_CHECK_VALUES=0 turns off, so the native path must still refuse a slot past the cache
    before its kernel writes there."""
    from glm5_hal.parity.cases import cases_for
    from glm5_hal.parity.runner import case_generator

    native = "1" if native_prolog.availability()[0] else build.PORTABLE_ONLY
    monkeypatch.setenv("GLM5_HAL_FAST_PATHS", "1")
    monkeypatch.setenv(build.ENV_NATIVE, native)
    monkeypatch.setenv("GLM5_HAL_CHECK_VALUES", "0")
    calls = []
    real = native_prolog.prolog
    monkeypatch.setattr(native_prolog, "prolog", lambda *a, **kw: calls.append(kw["validated"]) or real(*a, **kw))
    cases = cases_for("indexer_prolog", quick=True)
    built = (c.build(case_generator(c, torch.bfloat16, seed=3), torch.bfloat16) for c in cases)
    inputs = next(i for i in built if 1 <= i["x"].shape[0] <= native_prolog.MAX_TOKENS)  # a decode-sized call
    cache = inputs["index_k_cache"]
    before = cache.clone()
    inputs["slot_mapping"] = inputs["slot_mapping"].clone()
    inputs["slot_mapping"][0] = cache.shape[0] * cache.shape[1]  # one past the last slot
    with pytest.raises(ValueError, match=r"slot_mapping: expected -1 or a slot of the \d+-slot cache"):
        glm5_hal.indexer_prolog(**inputs)
    assert calls == [True], "the call did not reach the native prolog validated: the test checks nothing"
    assert torch.equal(cache, before), "the refused call wrote into the cache"


def test_indexer_prolog_rejects_what_it_does_not_take():
    bf = torch.bfloat16
    x, q_norm = torch.zeros(2, 16, dtype=bf), torch.zeros(2, 8, dtype=bf)
    w_iq, w_ik, w_iw = torch.zeros(2 * 128, 8, dtype=bf), torch.zeros(128, 16, dtype=bf), torch.zeros(2, 16, dtype=bf)
    norm, cos = torch.zeros(128), torch.zeros(2, 32)
    cache, slots = torch.zeros(3, 4, 132, dtype=torch.uint8), torch.zeros(2, dtype=torch.int64)

    def prolog(**changed):
        args = dict(x=x, q_norm=q_norm, w_iq=w_iq, w_ik=w_ik, norm_weight=norm, norm_bias=norm, w_iw=w_iw, cos=cos)
        args |= dict(sin=cos, cache=cache, slot_mapping=slots) | changed
        kv = args.pop("kv_cache_dtype", "fp8_index")
        return native_prolog.prolog(**args, interleaved=True, eps=1e-6, kv_cache_dtype=kv, isa="portable")

    with pytest.raises(TypeError, match=r"expected at most 16 tokens, bf16 .* got 2 tokens, x torch.float32"):
        prolog(x=x.float())
    with pytest.raises(TypeError, match=r"got 17 tokens"):
        prolog(x=torch.zeros(17, 16, dtype=bf))
    with pytest.raises(TypeError, match=r"cache torch.float32 \(auto\)"):
        prolog(cache=torch.zeros(3, 4, 128), kv_cache_dtype="auto")
    with pytest.raises(ValueError, match=r"w_iq: expected \(256, 8\), got \(128, 8\)"):
        prolog(w_iq=w_iq[:128])
    with pytest.raises(ValueError, match=r"cos, sin: expected \[2, at most 64\], got \(2, 65\)"):
        prolog(cos=torch.zeros(2, 65), sin=torch.zeros(2, 65))
    with pytest.raises(ValueError, match=r"slot_mapping: expected -1 or a slot of the 12-slot cache, got \[3, 12\]"):
        prolog(slot_mapping=torch.tensor([3, 12]))
    with pytest.raises(ValueError, match=r"slot_mapping: expected -1 or a slot .* got \[-2, 0\]"):
        prolog(slot_mapping=torch.tensor([-2, 0]))
    with pytest.raises(ValueError, match=r"kv_cache_dtype: expected one of \('fp8_index', 'int8_index'\)"):
        native_prolog.encode(torch.zeros(1, 128), "auto")


# ------------------------------------------------------------------------------------------------ sparse attention


def _attention_reference(q, rows, slots, scale, d_v):
    """float64 (out, lse, bound on out's error, bound on lse's error) of the kernel's contract: the bounds are those
    of fp32 sums over the dims (scores) and keys (softmax, values), ~1 ulp exps, and P's hi + lo parts (~2^-16)."""
    valid = slots >= 0  # [T, topk]
    selected = rows[slots.clamp_min(0)].double().where(valid[..., None], 0.0)  # [T, topk, D]
    scores = torch.einsum("thd,tnd->thn", q.double(), selected) * scale
    scores = scores.where(valid[:, None, :], float("-inf"))
    magnitude = torch.einsum("thd,tnd->thn", q.double().abs(), selected.abs()) * scale
    score_error = ((q.shape[2] + 2) * FP32_SUM * magnitude).where(valid[:, None, :], 0.0)
    score_error = torch.nn.functional.pad(score_error, (0, 1)).amax(-1, keepdim=True)  # 0 for topk = 0
    lse = torch.logsumexp(scores, dim=-1)  # [T, H], -inf without keys
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row without keys: 0
    out = probs @ selected[..., :d_v]
    keys = slots.shape[1] + 16
    lse_bound = score_error[..., 0] + keys * FP32_SUM + 2.0**-22 * lse.abs()
    out_bound = (2 * score_error + keys * FP32_SUM + 2.0**-15) * (probs @ selected[..., :d_v].abs()) + 1e-30
    return out, lse, out_bound, lse_bound


@pytest.mark.parametrize("kernel, isa", _builds(native_attention))
@SETTINGS
@given(
    tokens=st.integers(1, 3),
    heads=st.integers(1, 70),
    dims=st.sampled_from([1, 8, 33, 576]),
    topk=st.integers(0, 70),
    d_v=st.sampled_from([0, 1, 17, 32, 48]),
    invalid=st.floats(0.0, 1.0),
    scale=st.sampled_from([0.125, 0.01]),
    prefetch=st.sampled_from(tuple(native_attention.ROW_PREFETCHES)),
    seed=st.integers(0, 2**31 - 1),
)
def test_sparse_attention_is_the_softmax_over_only_the_selected_rows(
    kernel, isa, tokens, heads, dims, topk, d_v, invalid, scale, prefetch, seed
):
    """out and lse against float64, with unused slots (-1) and NaN in every row no valid key selects: it must reach
    no result. The bf16 out is the fp32 out rounded once; the split over threads and the rows' prefetch hint change
    no bit."""
    _runs(native_attention, isa, kernel)
    d_v = min(d_v, dims)
    gen = torch.Generator().manual_seed(seed)
    rows = _bf16(gen, 2 * topk + 4, dims)
    slots = torch.randint(1, rows.shape[0], (tokens, topk), generator=gen)
    slots[torch.rand(tokens, topk, generator=gen) < invalid] = -1
    unused = torch.ones(rows.shape[0], dtype=torch.bool)
    unused[slots[slots >= 0]] = False
    rows[unused] = float("nan")
    q = _bf16(gen, tokens, heads, dims)
    want, want_lse, bound, lse_bound = _attention_reference(q, rows, slots, scale, d_v)

    got, lse = native_attention.attention(
        q, rows, slots, scale, d_v, out_dtype=torch.float32, isa=isa, kernel=kernel, threads=1, prefetch=prefetch
    )
    assert got.shape == (tokens, heads, d_v) and lse.shape == (tokens, heads)
    assert ((got.double() - want).abs() <= bound).all(), "out off by more than the fp32 path's bound"
    no_keys = want_lse == float("-inf")
    assert torch.equal(lse == float("-inf"), no_keys)
    assert ((lse.double() - want_lse).abs()[~no_keys] <= lse_bound[~no_keys]).all()
    again, lse_again = native_attention.attention(
        q, rows, slots, scale, d_v, out_dtype=torch.float32, isa=isa, kernel=kernel, threads=2
    )
    assert _same_bits(again, got) and _same_bits(lse_again, lse)
    rounded, lse_rounded = native_attention.attention(q, rows, slots, scale, d_v, isa=isa, kernel=kernel, threads=1)
    assert rounded.dtype == torch.bfloat16 and _same_bits(lse_rounded, lse)
    assert torch.equal(rounded.view(torch.int16), got.bfloat16().view(torch.int16))
    # q as a view (heads and tokens at strides of their own, an offset): the kernel packs it from where it lies
    view = _bf16(gen, tokens, 2 * heads, dims + 3)[:, 1::2, 2 : 2 + dims]
    view.copy_(q)
    got_view, lse_view = native_attention.attention(
        view, rows, slots, scale, d_v, out_dtype=torch.float32, isa=isa, kernel=kernel, threads=1
    )
    assert _same_bits(got_view, got) and _same_bits(lse_view, lse)


@pytest.mark.parametrize("kernel, isa", _builds(native_attention))
@pytest.mark.parametrize("heads", [1, 3, 4])
def test_sparse_attention_over_many_blocks_of_keys_whose_peak_keeps_rising(kernel, isa, heads):
    """At most 4 heads the AVX2 build takes a token's rows in one pass, blocks of 32 keys with the softmax shifted by
    the running peak (the block's exps, total and partial output rescaled where a block raises it). Keys ordered by
    head 0's score, so every block raises its peak, and in random order: out and lse within the fp32 path's bounds.
    Then a +inf score in a late block, after blocks were taken: that head's out and lse are NaN (the file's top), and
    the other heads keep their values."""
    _runs(native_attention, isa, kernel)
    gen = torch.Generator().manual_seed(heads)
    topk, dims, d_v, scale = 300, 64, 48, 0.125
    rows = _bf16(gen, topk + 4, dims)
    q = _bf16(gen, 1, heads, dims)
    ascending = (rows.double() @ q[0, 0].double()).argsort()[None]  # head 0's scores, lowest first
    for slots in (ascending[:, -topk:], torch.randperm(rows.shape[0], generator=gen)[None, :topk]):
        want, want_lse, bound, lse_bound = _attention_reference(q, rows, slots, scale, d_v)
        got, lse = native_attention.attention(
            q, rows, slots, scale, d_v, out_dtype=torch.float32, isa=isa, kernel=kernel, threads=1
        )
        assert ((got.double() - want).abs() <= bound).all(), "out off by more than the fp32 path's bound"
        assert ((lse.double() - want_lse).abs() <= lse_bound).all()
        for prefetch in ("l1", "nta"):  # the rows asked for another way: the same bits
            again, lse_again = native_attention.attention(
                q,
                rows,
                slots,
                scale,
                d_v,
                out_dtype=torch.float32,
                isa=isa,
                kernel=kernel,
                threads=1,
                prefetch=prefetch,
            )
            assert _same_bits(again, got) and _same_bits(lse_again, lse), prefetch
    slots = ascending[:, -topk:]
    late = slots[0, 250]
    rows[late, 0] = float("inf")
    q[0, :, 0] = torch.tensor([1.0, -1.0, 1.0, -1.0][:heads], dtype=torch.bfloat16)  # +inf for even heads
    want, want_lse, bound, lse_bound = _attention_reference(q, rows, slots, scale, d_v)
    got, lse = native_attention.attention(
        q, rows, slots, scale, d_v, out_dtype=torch.float32, isa=isa, kernel=kernel, threads=1
    )
    for h in range(heads):
        if h % 2 == 0:
            assert got[0, h].isnan().all() and lse[0, h].isnan()
        else:  # a -inf score: probability 0, whose product with the row's inf is NaN in that dim only
            assert got[0, h, 0].isnan() and ((got[0, h, 1:].double() - want[0, h, 1:]).abs() <= bound[0, h, 1:]).all()
            assert (lse[0, h].double() - want_lse[0, h]).abs() <= lse_bound[0, h]


@pytest.mark.parametrize(
    "module, kernel, isa",
    [
        pytest.param(module, *param.values, id=f"{name}-{param.id}")
        for name, module in (("attention", native_attention), ("quantized_indexer", quantized_index_scores))
        for param in _builds(module)
        if param.values[1] != "portable"  # the portable build asks for nothing (row_prefetch.h)
    ],
)
def test_native_builds_carry_every_row_prefetch_hint(module, kernel, isa):
    """The row prefetch the probe chooses (sparse attention's, the quantized indexer's) must exist in the machine
    code: gcc 12 once merged the three hints' loops of _mm_prefetch into one whose hint was not a constant and emitted
    no prefetch at all, which no result shows. (The quantized indexer's AMX kernel prefetches on its fp32 route.)"""
    import shutil
    import subprocess

    _runs(module, isa, kernel)
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("no objdump here to read the build's machine code")
    library = build._build(kernel, build.ISAS[isa])
    code = subprocess.run([objdump, "-d", str(library)], capture_output=True, text=True, check=True).stdout
    for instruction in ("prefetcht2", "prefetcht0", "prefetchnta"):
        assert instruction in code, (library.name, instruction)


@pytest.mark.parametrize("kernel, isa", _builds(native_attention))
def test_sparse_attention_nan_and_inf_scores_follow_the_reference(kernel, isa):
    """A NaN score makes its head NaN (torch's amax propagates it); so does a +inf score, out and lse (the softmax's
    shift by the peak gives inf - inf, as in the reference; the kernel shifted by 0 and gave lse +inf until
    2026-11-30); a -inf score is a probability of 0 (whose product with the row's inf is NaN, as in any matmul);
    other heads and dims are untouched."""
    _runs(native_attention, isa, kernel)
    rows = torch.ones(4, 32, dtype=torch.bfloat16)
    rows[2, 0] = float("inf")
    q = torch.zeros(1, 3, 32, dtype=torch.bfloat16)
    q[0, :, 0] = torch.tensor([1.0, 1.0, -1.0])  # row 2's score: +inf for heads 0 and 1, -inf for head 2
    q[0, 0, 1] = float("nan")
    out, lse = native_attention.attention(
        q, rows, torch.tensor([[0, 1, 2]]), 1.0, 32, out_dtype=torch.float32, isa=isa, kernel=kernel
    )
    assert out[0, 0].isnan().all() and lse[0, 0].isnan()
    assert out[0, 1].isnan().all() and lse[0, 1].isnan()
    assert torch.equal(out[0, 2, 1:], torch.ones(31)) and out[0, 2, 0].isnan()  # 1/2 of rows 0 and 1, 0 x inf
    assert torch.allclose(lse[0, 2], torch.tensor(2.0).log() - 1.0)


@pytest.mark.parametrize("kernel, isa", _builds(native_attention))
@SETTINGS
@given(
    q_lens=st.lists(st.integers(0, 3), min_size=1, max_size=4),
    extra_keys=st.lists(st.integers(0, 40), min_size=4, max_size=4),
    block_size=st.sampled_from([1, 3, 16]),
    spare_slots=st.sampled_from([0, 2]),
    heads=st.sampled_from([1, 4, 9]),
    topk=st.integers(0, 40),
    hostile=st.floats(0.0, 0.5),
    seed=st.integers(0, 2**31 - 1),
)
def test_paged_sparse_attention_reads_the_keys_the_slots_would(
    kernel, isa, q_lens, extra_keys, block_size, spare_slots, heads, topk, hostile, seed
):
    """The paged entry (the op's route) finds each token's sequence and each key's row itself: bit for bit the slot
    entry's results over the slots glm5_hal.paged.key_slots computes, on ragged batches (sequences without new
    tokens included) whose tables hold padding and ids outside the cache, whose indices hold -1 and positions past
    seq_lens_k or the table, over a cache whose blocks have spare slots, with non-contiguous indices; NaN in every
    row that is no key's. The split over threads changes no bit."""
    from glm5_hal.paged import key_slots, slot_rows, token_sequences

    _runs(native_attention, isa, kernel)
    gen = torch.Generator().manual_seed(seed)
    batch = len(q_lens)
    seq_lens = [q + e for q, e in zip(q_lens, extra_keys)]
    max_blocks = max(1, -(-max(seq_lens) // block_size))
    num_blocks = batch * max_blocks + 1
    # Blocks with `spare_slots` unused slots after their rows: the cache is a view, read in place.
    storage = torch.full((num_blocks, block_size + spare_slots, 40), float("nan"), dtype=torch.bfloat16)
    cache = storage[:, :block_size]
    table = torch.randperm(num_blocks, generator=gen)[: batch * max_blocks].view(batch, max_blocks).int()
    table[torch.rand(batch, max_blocks, generator=gen) < hostile] = -7  # padding / an id outside the cache
    table[torch.rand(batch, max_blocks, generator=gen) < hostile] = num_blocks + 5
    cu = torch.tensor([0, *q_lens]).cumsum(0).int()
    lens = torch.tensor(seq_lens).int()
    tokens = int(cu[-1])
    wide = torch.randint(-2, max_blocks * block_size + 3, (tokens, 2 * topk), generator=gen).int()
    indices = wide[:, ::2]  # non-contiguous rows
    seqs = token_sequences(cu, tokens)
    view = slot_rows(cache)
    slots, addressable = key_slots(
        table, seqs, indices, block_size, num_blocks, block_step=view.block_step, row_step=view.row_step
    )
    valid = (indices >= 0) & (indices < lens.long()[seqs][:, None]) & addressable
    slots = torch.where(valid, slots, -1)
    keyed = slots[slots >= 0]
    view.rows[keyed] = _bf16(gen, keyed.shape[0], 40)  # every other row stays NaN: it must reach no result
    q = _bf16(gen, tokens, heads, 40)

    want, want_lse = native_attention.attention(
        q, view.rows, slots, 0.1, 32, out_dtype=torch.float32, isa=isa, kernel=kernel, threads=1
    )
    for threads, prefetch in ((1, "l2"), (3, "l2"), (1, "l1"), (2, "nta")):
        got, lse = native_attention.paged_attention(
            q,
            cache,
            indices,
            table,
            lens,
            cu,
            0.1,
            32,
            out_dtype=torch.float32,
            isa=isa,
            kernel=kernel,
            threads=threads,
            prefetch=prefetch,
        )
        assert _same_bits(got, want) and _same_bits(lse, want_lse), (threads, prefetch)
    rounded, _ = native_attention.paged_attention(q, cache, indices, table, lens, cu, 0.1, 32, isa=isa, kernel=kernel)
    assert torch.equal(rounded.view(torch.int16), want.bfloat16().view(torch.int16))


def test_paged_sparse_attention_kernel_rejects_bad_arguments():
    q, cache = torch.zeros(2, 4, 8, dtype=torch.bfloat16), torch.zeros(3, 2, 8, dtype=torch.bfloat16)
    indices, table = torch.zeros(2, 3, dtype=torch.int32), torch.zeros(1, 3, dtype=torch.int32)
    lens, cu = torch.tensor([2], dtype=torch.int32), torch.tensor([0, 2], dtype=torch.int32)
    good = (q, cache, indices, table, lens, cu, 1.0, 8)
    native_attention.paged_attention(*good, isa="portable")
    with pytest.raises(TypeError, match=r"indices: expected \[2, topk\] int32, got \(2, 3\) torch.int64"):
        native_attention.paged_attention(q, cache, indices.long(), *good[3:])
    with pytest.raises(TypeError, match=r"cache: expected \[num_blocks, block_size, D\] bf16 with contiguous rows"):
        native_attention.paged_attention(q, cache.transpose(1, 2).contiguous().transpose(1, 2), *good[2:])
    with pytest.raises(ValueError, match=r"cache: expected 8 wide \(q's D\), got 4"):
        native_attention.paged_attention(q, cache[..., :4], *good[2:7], 4)
    with pytest.raises(TypeError, match=r"block_table: expected \[B, max_blocks\] int32"):
        native_attention.paged_attention(q, cache, indices, table.long(), *good[4:])
    with pytest.raises(TypeError, match=r"cu_seqlens_q: expected \[2\] int32, got \(3,\) torch.int32"):
        native_attention.paged_attention(*good[:5], torch.tensor([0, 1, 2], dtype=torch.int32), *good[6:])
    with pytest.raises(TypeError, match=r"seq_lens_k: expected \[1\] int32, got \(1,\) torch.int64"):
        native_attention.paged_attention(*good[:4], lens.long(), *good[5:])
    with pytest.raises(ValueError, match=r"d_v: expected 0 .. 8, got 9"):
        native_attention.paged_attention(*good[:7], 9)
    with pytest.raises(ValueError, match=r"prefetch: expected one of \('l2', 'l1', 'nta'\), got 'l3'"):
        native_attention.paged_attention(*good, isa="portable", prefetch="l3")


def test_sparse_attention_kernel_rejects_bad_arguments():
    q, rows = torch.zeros(2, 4, 8, dtype=torch.bfloat16), torch.zeros(5, 8, dtype=torch.bfloat16)
    slots = torch.zeros(2, 3, dtype=torch.int64)
    with pytest.raises(TypeError, match=r"slots: expected \[2, topk\] int64, got \(2, 3\) torch.int32"):
        native_attention.attention(q, rows, slots.int(), 1.0, 8)
    with pytest.raises(ValueError, match=r"d_v: expected 0 .. 8, got 9"):
        native_attention.attention(q, rows, slots, 1.0, 9)
    with pytest.raises(ValueError, match=r"prefetch: expected one of \('l2', 'l1', 'nta'\), got 'T0'"):
        native_attention.attention(q, rows, slots, 1.0, 8, prefetch="T0")
    with pytest.raises(TypeError, match=r"rows: expected \[num_slots, D\] bf16 with contiguous rows"):
        native_attention.attention(q, rows.T.contiguous().T, slots, 1.0, 8)
    with pytest.raises(ValueError, match=r"rows: expected 8 wide \(q's D\), got 4"):
        native_attention.attention(q, rows[:, :4], slots, 1.0, 4)
    with pytest.raises(TypeError, match=r"q: expected \[T, H, D\] bf16, got \(2, 4, 8\) torch.float32"):
        native_attention.attention(q.float(), rows, slots, 1.0, 8)
    with pytest.raises(TypeError, match=r"out_dtype: expected one of"):
        native_attention.attention(q, rows, slots, 1.0, 8, out_dtype=torch.float16)


# ------------------------------------------------------------------------------------------------ the builder


@pytest.fixture
def fresh_builds(monkeypatch: pytest.MonkeyPatch, tmp_path):
    """Builds into an empty cache, with load()'s memory cleared before and after."""
    monkeypatch.setenv(build.ENV_CACHE_DIR, str(tmp_path))
    build.forget()
    yield tmp_path
    build.forget()


def test_glm5_hal_native_0_is_a_reason_not_a_build(fresh_builds, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(build.ENV_NATIVE, "0")
    assert bf16_gemm.availability("portable") == (False, "GLM5_HAL_NATIVE=0")
    assert not list(fresh_builds.iterdir())


def test_a_cpu_without_the_flags_is_a_reason(fresh_builds, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(build, "this_cpu", lambda: ("AVX2 EPYC", frozenset({"avx2", "fma"})))
    ok, why = indexer_scores.availability("avx512_bf16")
    assert not ok and "needs CPU flags avx512f, avx512bw, avx512vl, avx512_bf16" in why


def test_a_failing_or_missing_compiler_is_a_reason_asked_once(fresh_builds, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("CC", "false")  # a compiler that exits 1
    calls = []
    real_popen = build.subprocess.Popen
    monkeypatch.setattr(build.subprocess, "Popen", lambda *a, **k: calls.append(a) or real_popen(*a, **k))
    for _ in range(2):
        ok, why = bf16_gemm.availability("portable")
        assert not ok and why.startswith("false failed to build bf16_gemm_portable (exit 1)")
    assert len(calls) == 1  # the failure is remembered for the process
    build.forget()
    monkeypatch.setattr(build.shutil, "which", lambda name: None)
    assert bf16_gemm.availability("portable") == (False, "no C compiler (set CC, or install gcc / clang)")


def test_builds_are_cached_by_source(fresh_builds):
    ok, why = bf16_gemm.availability("portable")
    if not ok:
        pytest.skip(f"no portable build here: {why}")
    (library,) = fresh_builds.glob("bf16_gemm_portable-*.so")
    build.forget()
    assert bf16_gemm.availability("portable")[0]
    assert list(fresh_builds.glob("bf16_gemm_portable-*.so")) == [library]  # reused, not rebuilt
    with pytest.raises(ValueError, match=r"native kernel: expected one of .* got 'nope', 'portable'"):
        build.load("nope", "portable")


def test_a_build_of_a_source_that_includes_another_is_keyed_by_both(fresh_builds, monkeypatch: pytest.MonkeyPatch):
    """amx_quantized_index_scores.c is quantized_index_scores.c with a switch: an edit to the included source must
    build the including one anew (its library's name hashes both), not load the library of the old code."""
    sources = fresh_builds / "sources"
    sources.mkdir()
    (sources / "inner.c").write_text("int glm5_answer(void) { return 1; }\n")
    (sources / "outer.c").write_text('#include "inner.c"\n')
    monkeypatch.setattr(build, "SOURCE_DIR", sources)
    portable = build.ISAS["portable"]
    try:
        first = build._build("outer", portable)
    except build.NativeUnavailable as exc:
        pytest.skip(f"no compiler here: {exc}")
    assert build._build("outer", portable) == first  # the same sources: the same library
    (sources / "inner.c").write_text("int glm5_answer(void) { return 2; }\n")
    second = build._build("outer", portable)
    assert second != first and second.exists()


def _product_in_child(queue) -> None:
    a = torch.ones(1, 128, 256, dtype=torch.bfloat16)
    queue.put(float(bf16_gemm.bmm_nt(a, a, isa="portable", threads=2).sum()))


def test_a_forked_child_gets_its_own_thread_pool():
    """The parent's pool object survives a fork but its threads do not: a child that splits a call over threads
    must make its own pool, not wait forever on the parent's."""
    _runs(bf16_gemm, "portable")
    a = torch.ones(1, 128, 256, dtype=torch.bfloat16)
    bf16_gemm.bmm_nt(a, a, isa="portable", threads=2)  # the parent's pool exists now
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_product_in_child, args=(queue,))
    child.start()
    child.join(timeout=60)
    if child.is_alive():
        child.kill()
        pytest.fail("the forked child's threaded product did not finish in 60 s")
    assert child.exitcode == 0 and queue.get(timeout=5) == 128 * 128 * 256
