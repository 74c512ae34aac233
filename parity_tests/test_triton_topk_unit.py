"""The Triton top-k select (backends/triton/topk.py) against glm5_hal.topk, bit for bit.

Both promise the contract's order: the best k columns, equal scores by the lower column, NaN above every number;
so on any row they must return the same scores (the same bits) and the same columns in the same order. Rows here
hold what makes a select go wrong: long runs of equal scores across the k-th place, both zeros, NaN of either sign
and any payload, infinities, subnormals, whole rows of -inf; the passes over a row run in several chunks (the chunk
is cut to 64 keys), and k runs from 1 to the whole row.

Runs natively on a GPU, else under TRITON_INTERPRET=1 on the CPU.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.triton.runtime import use_interpreter_if_no_gpu

use_interpreter_if_no_gpu()  # before triton's first import (the conftest does it too; this file may run alone)
pytest.importorskip("triton", reason="triton is not installed: pip install glm5-hal[triton]")

from backends.triton import indexer as triton_indexer  # noqa: E402
from backends.triton import topk as triton_topk  # noqa: E402
from glm5_hal.parity.inputs import SeqSpec, paged_batch, randn  # noqa: E402
from glm5_hal.topk import topk_lower_position_ties  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# fp32 bit patterns a select must order right: both zeros, NaN with the sign bit and with payloads, infinities,
# the smallest subnormals and the largest finite values.
SPECIAL_BITS = [0x00000000, 0x80000000, 0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFFFFFFF, 0x7F800000, 0xFF800000,
                0x00000001, 0x80000001, 0x7F7FFFFF, 0xFF7FFFFF]  # fmt: skip


def _specials(count: int, gen: torch.Generator) -> torch.Tensor:
    bits = torch.tensor(SPECIAL_BITS, dtype=torch.int64)[torch.randint(0, len(SPECIAL_BITS), (count,), generator=gen)]
    return bits.to(torch.int32).view(torch.float32) if count else torch.empty(0)


def _rows(num_rows: int, width: int, kind: str, gen: torch.Generator) -> torch.Tensor:
    scores = torch.randn(num_rows, width, generator=gen)
    if kind == "ties":  # a few distinct values: equal scores across the k-th place in most rows
        scores = torch.round(scores * 2) / 2
    elif kind == "specials":  # a third of the row special values, at random places
        mask = torch.rand(num_rows, width, generator=gen) < 0.33
        scores[mask] = _specials(int(mask.sum()), gen)
    elif kind == "invisible":  # mostly -inf, as a short sequence's row past its position
        scores[torch.rand(num_rows, width, generator=gen) < 0.8] = float("-inf")
    return scores


def _expected(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    values, columns = topk_lower_position_ties(scores, k)
    return values, torch.where(values == float("-inf"), -1, columns).to(torch.int32)


def _select(scores: torch.Tensor, k: int, pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's answer, written into outputs `pad` columns wider than k (left as they were)."""
    values = torch.full((scores.shape[0], k + pad), 7.0, device=DEVICE)
    columns = torch.full((scores.shape[0], k + pad), 7, dtype=torch.int32, device=DEVICE)
    triton_topk.select_topk(scores.to(DEVICE), k, values, columns)
    assert (values[:, k:] == 7.0).all() and (columns[:, k:] == 7).all(), "wrote past column k"
    return values[:, :k].cpu(), columns[:, :k].cpu()


def _assert_same_bits(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> None:
    assert torch.equal(got[1], want[1]), f"columns differ at {(got[1] != want[1]).nonzero()[:5].tolist()}"
    assert torch.equal(got[0].view(torch.int32), want[0].view(torch.int32)), "score bits differ"


@pytest.fixture
def short_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Passes over a row in chunks of 64 keys, so that rows of a few hundred keys take several."""
    monkeypatch.setattr(triton_topk, "_BLOCK", 64)


@settings(max_examples=20, deadline=None, derandomize=True)
@given(
    num_rows=st.integers(1, 3),
    width=st.integers(1, 300),
    k_fraction=st.floats(0.0, 1.0),
    kind=st.sampled_from(["random", "ties", "specials", "invisible"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_select_equals_glm5_hal_topk_bit_for_bit(num_rows, width, k_fraction, kind, seed):
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(triton_topk, "_BLOCK", 64)
        scores = _rows(num_rows, width, kind, torch.Generator().manual_seed(seed))
        k = max(1, round(k_fraction * width))
        _assert_same_bits(_select(scores, k, pad=3), _expected(scores, k))


@pytest.mark.parametrize("k", [1, 64, 65, 200])
def test_select_with_a_tie_across_the_kth_place(short_chunks, k):
    """Every score equal but a few larger ones: the k-th place is inside a run of 200+ equal scores, so the lower
    columns of the run must be taken, across chunks, in column order."""
    scores = torch.zeros(2, 260)
    scores[0, [250, 3, 129]] = 1.0
    scores[1, 10] = float("nan")
    _assert_same_bits(_select(scores, k), _expected(scores, k))


def test_select_at_glm5_topk(short_chunks):
    """k = 2048 of 3000 keys (the sort at its real size), with ties and specials."""
    gen = torch.Generator().manual_seed(5)
    scores = torch.cat([_rows(1, 3000, kind, gen) for kind in ("ties", "specials")])
    _assert_same_bits(_select(scores, 2048), _expected(scores, 2048))


def test_select_refuses_what_it_cannot_do():
    scores = torch.zeros(2, 10, device=DEVICE)
    values, columns = torch.empty(2, 20, device=DEVICE), torch.empty(2, 20, dtype=torch.int32, device=DEVICE)
    for k in (0, 11):
        with pytest.raises(ValueError, match=rf"k: expected 1 <= k <= min\(row width 10, 4096\), got {k}"):
            triton_topk.select_topk(scores, k, values, columns)
    with pytest.raises(ValueError, match="scores: expected fp32 rows of unit stride"):
        triton_topk.select_topk(scores.t().contiguous().t(), 3, values, columns)


def test_lightning_indexer_selects_agree_bit_for_bit():
    """lightning_indexer with the kernel's select and with glm5_hal.topk's: the same indices and score bits, on a
    batch whose rows run out of visible keys before topk; a select that cannot take the topk is an error."""
    gen = torch.Generator().manual_seed(3)
    batch = paged_batch([SeqSpec(3, 45), SeqSpec(0, 20), SeqSpec(2, 150)], 16, gen)
    args = (
        randn((batch.num_tokens, 4, 32), gen),
        randn((batch.num_tokens, 4), gen, std=0.3),
        randn((batch.num_blocks, 16, 32), gen),
        batch.block_table,
        batch.seq_lens_k,
        batch.cu_seqlens_q,
    )
    args = [a.to(DEVICE) for a in args]
    for topk in (8, 100, 200):  # 200: past the cache width (160 columns), the rest -1
        got = triton_indexer.lightning_indexer(*args, topk, topk_select="kernel")
        want = triton_indexer.lightning_indexer(*args, topk, topk_select="torch")
        assert torch.equal(got[0], want[0]) and torch.equal(got[1].view(torch.int32), want[1].view(torch.int32))
    with pytest.raises(ValueError, match="topk_select: expected 'torch', or 'kernel' for at most 4096 .*'radix'"):
        triton_indexer.lightning_indexer(*args, 8, topk_select="radix")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(triton_indexer, "MAX_K", 100)  # as if the cache were wider than the kernel's MAX_K
        with pytest.raises(ValueError, match="for at most 100 ranked keys; got 'kernel' for 150"):
            triton_indexer.lightning_indexer(*args, 150, topk_select="kernel")


@pytest.mark.parametrize("interpreted", [False, True])
def test_default_select(monkeypatch, interpreted):
    """The kernel on a GPU up to MAX_K ranked keys, glm5_hal.topk past it; glm5_hal.topk under the interpreter."""
    monkeypatch.setattr(triton_indexer, "interpreting", lambda: interpreted)
    on_gpu = "torch" if interpreted else "kernel"
    assert triton_indexer._default_select(2048) == on_gpu
    assert triton_indexer._default_select(triton_topk.MAX_K) == on_gpu
    assert triton_indexer._default_select(triton_topk.MAX_K + 1) == "torch"
