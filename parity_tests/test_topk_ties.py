"""Deterministic top-k (OPS.md section 7, "Top-k ties"): equal indexer scores rank by the LOWER key position.

- glm5_hal.topk: its composite key orders like (score, -position) for every float, -0.0 == +0.0 included, and
  picks the contract's set where torch.topk on the floats is free to pick any;
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
from glm5_hal.kv_formats import FORMATS
from glm5_hal.parity.inputs import SeqSpec, paged_batch
from glm5_hal.parity.quantized_cache import encode_cache
from glm5_hal.registry import registry
from glm5_hal.topk import ordered_key, topk_lower_position_ties
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
