"""Deterministic top-k (OPS.md section 7, "Top-k ties"): equal indexer scores rank by the LOWER key position.

- glm5_hal.topk: its composite key orders like (score, -position) for every float, -0.0 == +0.0 included, and
  picks the contract's set where torch.topk on the floats is free to pick any;
- its native CPU kernel (backends.torch_eager.native.topk): bit for bit the torch path's values and columns, in the same
  order, on random, tie-heavy, NaN / inf / signed-zero, all -inf, edge-sized and strided rows, for any thread count;
- lightning_indexer on every backend that runs here, float and quantized key caches, with deliberately tied
  scores: keys are small integers and every q . k dot an integer below 256 in magnitude (exact in every dtype, even
  as the bf16 result of a fast-path GEMM, so every backend's scores tie exactly, whatever its summation order and
  GEMM path), copied to several positions, plus keys whose every head's dot is negative (score 0, +0.0 or -0.0
  depending on the head weights' signs); the set must be the contract's and identical over repeated calls.

The ascend backend is excluded from the backend sweep: npu_lightning_indexer does not document its tie order, so
the strict fake cannot model it (docs/ascend.md); its portable path is the torch backend's, swept here.
"""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import glm5_hal
import ops_reference as ref
from backends.torch_eager.native import build, threads
from backends.torch_eager.native import topk as native_topk
from backends.torch_eager.topk import topk as eager_topk
from glm5_hal.kv_formats import FORMATS
from glm5_hal.parity.inputs import SeqSpec, paged_batch
from glm5_hal.parity.quantized_cache import encode_cache
from glm5_hal.registry import registry
from glm5_hal.topk import _composite_topk, _torch_topk, ordered_key, topk_lower_position_ties
from ops_reference.ranking import descending_nan_first

BACKENDS = ("reference", "torch", "triton")
REPEATS = 3


def contract_topk(scores: np.ndarray, k: int) -> np.ndarray:
    """The contract's top-k columns of a row: NaN first, then by score, then by lower column (the reference's
    stable order, ops_reference.ranking)."""
    return descending_nan_first(scores)[:k]


# ------------------------------------------------------------------------------------------------- glm5_hal.topk
def test_key_orders_like_the_floats_with_zeros_equal():
    values = torch.tensor([float("-inf"), -3.0, -1e-30, -0.0, 0.0, 1e-45, 2.5, float("inf")])
    keys = ordered_key(values[None, :].expand(2, -1).contiguous())
    # Strictly increasing except -0.0 / +0.0 (columns 3 and 4), where the LOWER column must rank higher.
    assert (keys[0, 1:3] > keys[0, :2]).all() and (keys[0, 5:] > keys[0, 4:-1]).all()
    assert keys[0, 3] > keys[0, 4] and keys[0, 4] > keys[0, 2]


def test_nan_of_either_sign_ranks_above_every_number():
    """x86's default NaN (from inf - inf, 0 * inf) has its sign bit set: it must rank first like +NaN, in both
    paths."""
    negative_nan = torch.tensor([-4194304], dtype=torch.int32).view(torch.float32)  # 0xFFC00000
    assert negative_nan.isnan().all() and negative_nan.view(torch.int32).item() < 0
    scores = torch.tensor([[1.0, 2.0, 0.0, float("inf"), float("nan"), -1.0]])
    scores[0, 2] = negative_nan
    keys = ordered_key(scores)
    assert keys[0, 2] > keys[0, 3] and keys[0, 4] > keys[0, 3] and keys[0, 2] > keys[0, 4]  # NaN ties: lower column
    for graph_mode in (False, True):
        with mock.patch("glm5_hal.topk.host_reads_allowed", return_value=not graph_mode):
            values, columns = topk_lower_position_ties(scores, 3)
        assert columns[0].tolist() == [2, 4, 3], graph_mode


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.sampled_from([-2.0, -1.0, -0.0, 0.0, 0.5, 1.0, 3.0, float("-inf"), float("nan"), -float("nan")]),
        min_size=1,
        max_size=40,
    ),
    st.integers(1, 40),
    st.booleans(),
)
def test_matches_a_stable_sort_on_heavily_tied_rows(row, k, graph_mode):
    """Both selection paths: the float select with boundary repair, and the composite-key select taken where no
    flag may be read back (graph capture, tracing)."""
    k = min(k, len(row))
    scores = torch.tensor([row])
    with mock.patch("glm5_hal.topk.host_reads_allowed", return_value=not graph_mode):
        values, columns = topk_lower_position_ties(scores, k)
    want = contract_topk(np.array(row), k)
    visible = np.array(row)[want] > -np.inf  # columns picked at -inf become -1 in the indexer: any will do
    visible |= np.isnan(np.array(row)[want])
    assert columns[0].numpy()[visible].tolist() == want[visible].tolist()  # the same set and order
    torch.testing.assert_close(values, scores[:, want], rtol=0, atol=0, equal_nan=True)


def test_long_rows_pick_the_lower_positions_of_a_tie():
    """128K keys where 4096 share the k-th best score: exactly the lowest-positioned ones fill the set."""
    gen = torch.Generator().manual_seed(5)
    scores = torch.randn(3, 131072, generator=gen).clamp_max(2.0)  # ~2.3% of every row ties at 2.0
    values, columns = topk_lower_position_ties(scores, 2048)
    for row, picked in zip(scores, columns):
        assert set(picked.tolist()) == set(contract_topk(row.numpy(), 2048).tolist())
    assert (values == 2.0).all()


# ------------------------------------------------------------------------------------- backends.torch_eager.native.topk
NATIVE_SETTINGS = settings(max_examples=80, deadline=None, derandomize=True)
# fp32 bit patterns beyond ordinary numbers: NaNs of both signs with different payloads (quiet and signalling),
# the infinities, both zeros, the smallest subnormals, the most negative finite value.
SPECIAL_BITS = [
    0x7FC00000,
    -0x400000,
    0x7F800001,
    -1,
    0x7FC12345,
    0x7F800000,
    -0x800000,
    0,
    -(1 << 31),
    1,
    -(1 << 31) + 1,
    -0x800001,  # -FLT_MAX, the most negative finite value: the key just above -inf's
]


def _special(*bits: int) -> torch.Tensor:
    return torch.tensor(bits, dtype=torch.int32).view(torch.float32)


@pytest.fixture
def native() -> None:
    ok, why = native_topk.availability()
    if not ok:
        pytest.skip(f"the native top-k does not run here: {why}")


def _same(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> bool:
    """The same values bit for bit (NaN payloads and the sign of zero included) and the same columns, in order."""
    (got_values, got_columns), (want_values, want_columns) = got, want
    return (
        got_values.shape == want_values.shape
        and got_values.dtype == want_values.dtype == torch.float32
        and torch.equal(got_values.view(torch.int32), want_values.view(torch.int32))
        and got_columns.dtype == want_columns.dtype == torch.int64
        and torch.equal(got_columns, want_columns)
    )


def _assert_native_is_the_torch_path(scores: torch.Tensor, k: int) -> None:
    """The native kernel against both torch selections: the composite one (the contract, columns everywhere) and
    the float select with its boundary repair (the path it replaces), whose columns are free where a tie at -inf
    crosses the boundary (there every value is -inf, and callers mark those columns -1)."""
    got = native_topk.topk(scores, k)
    assert _same(got, _composite_topk(scores, k))
    want_values, want_columns = _torch_topk(scores, k)
    visible = want_values != float("-inf")
    assert _same((got[0], got[1][visible]), (want_values, want_columns[visible]))
    rows = torch.arange(scores.shape[0])[:, None].expand(-1, k)
    assert _same((scores[rows, got[1]], got[1]), got)  # the row's own bits at the columns
    # The indexer's form: the same values, the columns as int32 with -1 where the value is -inf (and only there)
    values, positions = native_topk.positions(scores, k)
    assert torch.equal(values.view(torch.int32), got[0].view(torch.int32)) and positions.dtype == torch.int32
    assert torch.equal(positions, torch.where(got[0] == float("-inf"), -1, got[1]).to(torch.int32))


def test_native_topk_is_the_torch_path_on_random_rows(native):
    gen = torch.Generator().manual_seed(1)
    for rows, width, k in [(4, 16384, 2048), (3, 1000, 100), (5, 70, 64), (2, 4097, 4096), (1, 300, 63)]:
        _assert_native_is_the_torch_path(torch.randn(rows, width, generator=gen), k)
        causal = torch.randn(rows, width, generator=gen)
        causal[:, width // 2 :] = float("-inf")  # half the keys not visible: -inf ties across the boundary
        _assert_native_is_the_torch_path(causal, k)


def test_native_topk_takes_the_lower_columns_of_ties_across_the_boundary(native):
    gen = torch.Generator().manual_seed(2)
    for pool_size in (1, 2, 5, 40):
        scores = torch.randint(-pool_size, pool_size + 1, (4, 5000), generator=gen).float() / 4
        _assert_native_is_the_torch_path(scores, 2048)
        _assert_native_is_the_torch_path(scores, 1)
    scores = torch.randn(3, 131072, generator=gen).clamp_max(2.0)  # 2048 of ~3000 tied at 2.0
    _assert_native_is_the_torch_path(scores, 2048)
    values, columns = native_topk.topk(scores, 2048)
    assert (values == 2.0).all() and torch.equal(columns, columns.sort(dim=-1).values)  # lowest first


def test_native_topk_orders_nan_inf_and_signed_zeros_like_the_torch_path(native):
    gen = torch.Generator().manual_seed(3)
    pool = torch.cat([_special(*SPECIAL_BITS), torch.tensor([-2.0, -1.0, 0.5, 3.0])])
    scores = pool[torch.randint(0, len(pool), (5, 257), generator=gen)]
    for k in (1, 7, 40, 128, 200, 257):
        _assert_native_is_the_torch_path(scores, k)
    values, columns = native_topk.topk(scores, 257)
    # NaN first (whatever its sign and payload: the payloads come back as they were), -0.0 tied with +0.0 by column.
    nan = values.isnan()
    assert (nan[:, :-1] >= nan[:, 1:]).all()
    zero_columns = columns[values == 0.0]
    assert (values[values == 0.0].view(torch.int32) == -(1 << 31)).any(), "the pool must hold -0.0"
    assert zero_columns.numel() > 1


def test_native_topk_of_all_minus_inf_rows_takes_the_first_columns(native):
    scores = torch.full((3, 500), float("-inf"))
    scores[1, 7] = 1.0
    values, columns = native_topk.topk(scores, 20)
    _assert_native_is_the_torch_path(scores, 20)
    assert columns[0].tolist() == list(range(20))
    assert columns[1].tolist() == [7, *range(7), *range(8, 20)]
    assert (values[[0, 2]] == float("-inf")).all()


def test_native_topk_edge_sizes(native):
    gen = torch.Generator().manual_seed(4)
    for rows, width, k in [(3, 1, 1), (2, 9, 9), (2, 9, 1), (1, 2048, 2048), (0, 10, 4)]:
        _assert_native_is_the_torch_path(torch.randn(rows, width, generator=gen), k)
    for shape, k in [((0, 10), 4), ((3, 10), 0), ((0, 0), 0)]:
        values, columns = eager_topk(torch.randn(shape), k)
        assert values.shape == columns.shape == (shape[0], k)
        assert values.dtype == torch.float32 and columns.dtype == torch.int64


def test_native_topk_reads_strided_rows(native):
    gen = torch.Generator().manual_seed(5)
    base = torch.randint(-3, 4, (600, 8), generator=gen).float()
    for view in (base.T, base.T[::3], base.T[:, ::5], base[:300:2].T[1:]):
        assert not view.is_contiguous()
        for k in (1, 50, view.shape[1]):
            got = eager_topk(view, k)
            assert _same(got, native_topk.topk(view.contiguous(), k))
            _assert_native_is_the_torch_path(view, k)


@NATIVE_SETTINGS
@given(
    st.integers(0, 5),
    st.integers(1, 300),
    st.integers(1, 300),
    st.lists(st.sampled_from(SPECIAL_BITS + [0x3F800000, -0x40800000, 0x40400000, 0x3F000000]), max_size=6),
    st.floats(0.0, 1.0),
    st.booleans(),
    st.integers(0, 2**31 - 1),
)
def test_native_topk_property(rows, width, k, pool_bits, random_share, transposed, seed):
    """Rows from a small pool of values (ties everywhere, NaN / inf / signed zeros among them), a share of random
    fp32 numbers mixed in, contiguous or read through a transposed view."""
    if not native_topk.availability()[0]:
        pytest.skip("the native top-k does not run here")
    k = min(k, width)
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randn(rows, width, generator=gen)
    if pool_bits:
        pool = _special(*pool_bits)
        from_pool = torch.rand(rows, width, generator=gen) >= random_share
        scores[from_pool] = pool[torch.randint(0, len(pool), (int(from_pool.sum()),), generator=gen)]
    if transposed:
        scores = scores.T.contiguous().T
    _assert_native_is_the_torch_path(scores, k)


def test_native_topk_does_not_depend_on_the_thread_count(native):
    gen = torch.Generator().manual_seed(6)
    scores = torch.randint(-50, 50, (9, 16384), generator=gen).float()
    scores[::2, 9000:] = float("-inf")
    work = native_topk.WORK_PER_SCORE * scores.numel()
    assert threads.thread_count(work, 2) == 2, "the test must split the rows over threads"
    before = torch.get_num_threads()
    try:
        results = []
        for count in (1, 2):
            torch.set_num_threads(count)
            results.append(topk_lower_position_ties(scores, 2048))
    finally:
        torch.set_num_threads(before)
    assert _same(results[0], results[1])
    assert _same(native_topk.topk(scores, 2048, threads=2), results[0])
    assert _same(results[0], _composite_topk(scores, 2048))


def test_the_torch_backend_runs_cpu_fp32_rows_on_the_native_kernel_unless_switched_off(native, monkeypatch):
    gen = torch.Generator().manual_seed(7)
    scores = torch.randint(-3, 4, (4, 3000), generator=gen).float()
    with mock.patch.object(native_topk, "topk", wraps=native_topk.topk) as spy:
        got = eager_topk(scores, 2048)
    assert spy.call_count == 1
    monkeypatch.setenv(build.ENV_NATIVE, "0")
    assert not native_topk.availability()[0]
    with mock.patch.object(native_topk, "topk", wraps=native_topk.topk) as spy:
        assert _same(eager_topk(scores, 2048), got)
    assert spy.call_count == 0


def test_scores_that_need_a_gradient_keep_the_differentiable_torch_path(native):
    scores = torch.randn(2, 100, requires_grad=True)
    values, columns = eager_topk(scores, 10)
    values.sum().backward()
    assert scores.grad.sum() == 20 and (scores.grad.gather(-1, columns) == 1).all()
    with torch.no_grad():
        assert _same(eager_topk(scores, 10), (values.detach(), columns))


def test_native_topk_op_has_a_fake():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        values, columns = torch.ops.glm5_hal.native_topk(torch.empty(3, 100), 7)
    assert values.shape == columns.shape == (3, 7)
    assert values.dtype == torch.float32 and columns.dtype == torch.int64


def test_native_topk_rejects_bad_arguments():
    with pytest.raises(TypeError, match=r"scores: expected \[N, S\] fp32 on the CPU, got \(2, 3\) torch.bfloat16"):
        native_topk.topk(torch.zeros(2, 3, dtype=torch.bfloat16), 1)
    with pytest.raises(TypeError, match=r"scores: expected \[N, S\] fp32 on the CPU, got \(3,\)"):
        native_topk.topk(torch.zeros(3), 1)
    with pytest.raises(ValueError, match=r"k: expected 0 .. 3 \(the row width\), got 4"):
        native_topk.topk(torch.zeros(2, 3), 4)
    with pytest.raises(ValueError, match=r"k: expected 0 .. 3 \(the row width\), got -1"):
        native_topk.topk(torch.zeros(2, 3), -1)


# ------------------------------------------------------------------------------------------- lightning_indexer
def _tied_inputs(kv_cache_dtype: str, dtype: torch.dtype, seed: int) -> dict:
    """A ragged batch whose keys are integer vectors from a pool of 5, so many scores tie exactly; pool key 0 has
    a negative dot with every query head (score exactly zero), and every head weight is a power of two."""
    gen = torch.Generator().manual_seed(seed)
    heads, dim, block = 4, 128, 16
    batch = paged_batch([SeqSpec(3, 90), SeqSpec(1, 41), SeqSpec(2, 64)], block, gen)
    q = torch.randint(1, 3, (batch.num_tokens, heads, dim), generator=gen).float()  # positive entries...
    q[..., 0] = 0.0  # ...except against the keys' peak column, which only sets their scale: the dots stay small
    # Every key's largest magnitude is the format's qmax, so its scale is exactly 1 and the stored codes are the
    # integers themselves (small integers are e4m3 values too).
    peak = FORMATS[kv_cache_dtype].qmax if kv_cache_dtype != "auto" else 127.0
    pool = torch.randint(-2, 3, (5, dim), generator=gen).float()
    pool[:, 0] = peak
    pool[0] = -1.0  # q . pool[0] < 0 for every head: ReLU 0 everywhere, a score of +-0
    pool[0, 0] = -peak
    keys = pool[torch.randint(0, 5, (batch.num_blocks * block,), generator=gen)]
    # Integers below 256 are exact in bf16: every backend's q . k products are then exact, whichever GEMM path.
    assert (torch.einsum("thd,sd->ths", q, keys).abs() < 256).all()
    signs = torch.where(torch.rand(batch.num_tokens, heads, generator=gen) < 0.5, -1.0, 1.0)
    weights = signs * torch.exp2(torch.randint(-3, 1, (batch.num_tokens, heads), generator=gen).float())
    cache = keys.view(batch.num_blocks, block, dim)
    if kv_cache_dtype == "auto":
        cache = cache.to(dtype)
    else:
        cache = encode_cache(cache, FORMATS[kv_cache_dtype], zero_tiles=False)
        assert np.array_equal(
            ref.decode_rows(cache.numpy(), FORMATS[kv_cache_dtype]), keys.view(cache.shape[:2] + (dim,)).numpy()
        )
    return {
        "q_idx": q.to(dtype),
        "weights": weights,
        "index_k_cache": cache,
        "block_table": batch.block_table,
        "seq_lens_k": batch.seq_lens_k,
        "cu_seqlens_q": batch.cu_seqlens_q,
        "kv_cache_dtype": kv_cache_dtype,
    }


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8_index", "fp8_index"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_tied_scores_select_the_lower_positions_every_call(backend, kv_cache_dtype, dtype):
    avail = registry().availability(backend)
    if not avail.available:
        pytest.skip(f"backend {backend} unavailable: {avail.reason}")
    inputs = _tied_inputs(kv_cache_dtype, dtype, seed=11)
    topk = 24
    args = {
        k: (v.numpy() if isinstance(v, torch.Tensor) and not v.is_floating_point() else v) for k, v in inputs.items()
    }
    floats = {k: v.double().numpy() for k, v in inputs.items() if isinstance(v, torch.Tensor) and v.is_floating_point()}
    logits = ref.indexer_logits(**{**args, **floats})
    runs = []
    with glm5_hal.use_backend(backend, strict=True):
        for _ in range(REPEATS):
            runs.append(glm5_hal.lightning_indexer(**inputs, topk=topk))
    for indices in runs[1:]:
        assert torch.equal(indices, runs[0]), "a repeated call picked other keys"
    ties_at_the_boundary = 0
    for t, row in enumerate(runs[0].numpy()):
        visible = np.isfinite(logits[t])
        want = contract_topk(np.where(visible, logits[t], -np.inf), min(topk, int(visible.sum())))
        assert sorted(row[row >= 0].tolist()) == sorted(want.tolist()), f"token {t}: not the contract's set"
        kth = logits[t][want[-1]]
        ties_at_the_boundary += int((logits[t][visible] == kth).sum()) > int((logits[t][want] == kth).sum())
    assert ties_at_the_boundary >= 3, "the inputs must put ties across the top-k boundary"


def test_the_parity_judge_wants_the_lowest_nan_positions():
    """compare_topk: with more NaN-scored keys than topk, the lowest-positioned ones (NaN ties NaN)."""
    from glm5_hal.parity.compare import compare_topk

    logits = np.array([[1.0, np.nan, 2.0, np.nan, np.nan, -np.inf]])
    assert compare_topk("indices", torch.tensor([[3, 1]]), logits, 2, torch.float32).passed
    assert not compare_topk("indices", torch.tensor([[1, 4]]), logits, 2, torch.float32).passed
    assert compare_topk("indices", torch.tensor([[4, 1, 3, 2]]), logits, 4, torch.float32).passed
    assert not compare_topk("indices", torch.tensor([[1, 3, 2, 0]]), logits, 4, torch.float32).passed
