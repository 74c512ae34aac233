"""Unit tests of the Triton attention-side kernels, for what the parity cases do not reach.

The parity cases fit in one tile of each kernel; these force the multi-tile and ragged paths:
- sparse attention with several head tiles and key tiles per token, both ragged (H and topk not multiples of
  the tile), at the 512 + 64 split of the real latent width and at widths where neither part is a power of two;
  invalid indices (-1, past seq_lens_k), an all-invalid row, a sequence with no new tokens, strided q and
  block table;
- indexer logits over several key tiles, HI and DI not powers of two, the causal edge inside a tile;
- lightning_indexer over several token tiles of its logit buffer, scores and -1 tail;
- the fused norm / RoPE / cache-write kernel at odd widths (mla_prolog with non-power-of-two dims).

Runs natively on a GPU, else under TRITON_INTERPRET=1 on the CPU (shapes chosen to take seconds there).
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.triton.runtime import use_interpreter_if_no_gpu

use_interpreter_if_no_gpu()  # before triton's first import (the conftest does it too; this file may run alone)
pytest.importorskip("triton", reason="triton is not installed: pip install glm5-hal[triton]")

import ops_reference as ref  # noqa: E402
from backends.triton import indexer as triton_indexer  # noqa: E402
from backends.triton import prolog as triton_prolog  # noqa: E402
from backends.triton import sparse_attention as triton_attention  # noqa: E402
from glm5_hal.kv_formats import FORMATS, encode_rows  # noqa: E402
from glm5_hal.parity.compare import compare_float, compare_topk, to_numpy  # noqa: E402
from glm5_hal.parity.inputs import SeqSpec, paged_batch, randn, random_topk_indices, rope_tables  # noqa: E402
from glm5_hal.parity.runner import session_seed  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.bfloat16]
# A chunked prefill, a sequence with no new tokens this step (owns no query token), a decode and a prefill.
SEQS = [SeqSpec(3, 45), SeqSpec(0, 20), SeqSpec(1, 150), SeqSpec(4, 4)]


@pytest.fixture
def gen(request: pytest.FixtureRequest) -> torch.Generator:
    """Fresh inputs every run, reproducible with GLM5_HAL_PARITY_SEED (printed with a failing test's output)."""
    seed = (session_seed() * 1_000_003 + zlib.crc32(request.node.name.encode())) % 2**63
    print(f"{request.node.name}: GLM5_HAL_PARITY_SEED={session_seed()} (generator seed {seed})")
    return torch.Generator().manual_seed(seed)


def _dev(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(DEVICE) for t in tensors]


def _assert_close(name: str, out: torch.Tensor, want: np.ndarray, dtype: torch.dtype) -> None:
    verdict = compare_float(name, out.cpu(), want, dtype)
    assert verdict.passed, f"{name}: {verdict.detail}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("width", "d_v"), [(576, 512), (80, 40)], ids=["576=512+64", "80=40+40"])
def test_sparse_attention_many_head_and_key_tiles(monkeypatch, gen, dtype, width, d_v):
    # 16 heads x 16 keys per program: 20 heads -> 2 head tiles (the second 4 of 16), topk 40 -> 3 key tiles.
    monkeypatch.setattr(
        triton_attention, "_launch_config", lambda num_heads, dtype: {"BLOCK_H": 16, "BLOCK_N": 16, "num_warps": 4}
    )
    num_heads, topk = 20, 40
    batch = paged_batch(SEQS, 16, gen)
    indices = random_topk_indices(batch, topk, gen, invalid_fraction=0.25)
    indices[1] = -1  # a token with no valid key: out 0, lse -inf
    # Strided operands: q rows padded past the latent width, a column-major block table.
    q = randn((indices.shape[0], num_heads, width + 32), gen, dtype=dtype)[..., :width]
    kv_cache = randn((batch.num_blocks, 16, width), gen, dtype=dtype)
    block_table = batch.block_table.t().contiguous().t()
    args = (q, kv_cache, indices, block_table, batch.seq_lens_k, batch.cu_seqlens_q)
    out, lse = triton_attention.sparse_flash_attention(*_dev(*args), sm_scale=0.11, d_v=d_v)
    want_out, want_lse = ref.sparse_flash_attention(*map(to_numpy, args), 0.11, d_v)
    _assert_close("out", out, want_out, dtype)
    _assert_close("lse", lse, want_lse, torch.float32 if dtype == torch.float32 else dtype)
    assert torch.isneginf(lse[1]).all() and (out[1] == 0).all()


@pytest.fixture
def split_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every sparse attention call split over keys (backends/triton/sparse_attention.py: flash-decoding) into up to 4
    ranges of a multiple of 16 keys, in key tiles of 16 and head tiles of 16, so small cases split too."""
    monkeypatch.setattr(
        triton_attention, "_launch_config", lambda num_heads, dtype: {"BLOCK_H": 16, "BLOCK_N": 16, "num_warps": 4}
    )
    monkeypatch.setattr(triton_attention, "SPLIT_KEYS_MULTIPLE", 16)
    monkeypatch.setattr(triton_attention, "_default_splits", lambda *args: 4)


class _Launches:
    """Stands in for a kernel: counts its launches (kernel[grid](...)) and runs them."""

    def __init__(self, kernel) -> None:
        self.kernel, self.count = kernel, 0

    def __getitem__(self, grid):
        self.count += 1
        return self.kernel[grid]


def _same_specials(got: torch.Tensor, want: torch.Tensor) -> bool:
    """NaN and infinities in the same places with the same signs (the finite values are judged elsewhere)."""
    got, want = got.float().cpu(), want.float().cpu()
    return torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf() * got.sign(), want.isinf() * want.sign())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sparse_attention_split_over_keys_merges_to_the_reference(split_keys, gen, dtype):
    """topk 70 in ranges of 32, 32 and 6 keys: the merged ranges equal the reference and the unsplit kernel's
    specials, with a token without keys, one whose keys all lie in its first range (the others empty), one whose
    keys all lie in its last, a NaN score in one range of one token, and 20 heads (two head tiles)."""
    num_heads, topk, width, d_v = 20, 70, 576, 512
    batch = paged_batch(SEQS, 16, gen)
    indices = random_topk_indices(batch, topk, gen, invalid_fraction=0.25)
    indices[1] = -1  # no valid key: out 0, lse -inf
    indices[2, 32:] = -1  # only the first range has keys
    indices[3, :64] = -1  # only the last range (6 keys) may have any
    q = randn((indices.shape[0], num_heads, width), gen, dtype=dtype)
    kv_cache = randn((batch.num_blocks, 16, width), gen, dtype=dtype)
    valid = indices[0][(indices[0] >= 0) & (indices[0] < batch.seq_lens_k[0])]  # token 0 is sequence 0's
    row = batch.block_table[0, valid[-1] // 16], valid[-1] % 16  # token 0's last valid key
    kv_cache[row[0], row[1], 7] = float("nan")  # a NaN score for every head of every token selecting that key
    args = (q, kv_cache, indices, batch.block_table, batch.seq_lens_k, batch.cu_seqlens_q)
    merges = _Launches(triton_attention._merge_splits_kernel)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(triton_attention, "_merge_splits_kernel", merges)
        out, lse = triton_attention.sparse_flash_attention(*_dev(*args), sm_scale=0.11, d_v=d_v)
    assert merges.count == 1
    whole_out, whole_lse = triton_attention.sparse_flash_attention(*_dev(*args), sm_scale=0.11, d_v=d_v, num_splits=1)
    assert lse[0].isnan().all() and _same_specials(out, whole_out) and _same_specials(lse, whole_lse)
    want_out, want_lse = ref.sparse_flash_attention(*map(to_numpy, args), 0.11, d_v)
    _assert_close("out", out, want_out, dtype)
    _assert_close("lse", lse, want_lse, torch.float32 if dtype == torch.float32 else dtype)
    assert torch.isneginf(lse[1]).all() and (out[1] == 0).all()


@settings(max_examples=15, deadline=None, derandomize=True)
@given(
    q_lens=st.lists(st.integers(0, 3), min_size=1, max_size=3),
    extra_keys=st.lists(st.integers(0, 90), min_size=3, max_size=3),
    num_heads=st.integers(1, 20),
    topk=st.integers(1, 100),
    num_splits=st.integers(1, 9),
    invalid_fraction=st.sampled_from([0.0, 0.3, 0.9]),
    seed=st.integers(0, 2**31 - 1),
)
def test_sparse_attention_split_over_keys_on_random_shapes(
    q_lens, extra_keys, num_heads, topk, num_splits, invalid_fraction, seed
):
    """Random batches (sequences without new tokens, rows with few or no valid keys), head counts and topk, split
    into 1 to 9 wanted ranges of 16-key multiples (key_ranges: fewer where topk is short): fp32 out and lse against
    the reference, and the split's specials where the unsplit kernel has them."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(
            triton_attention, "_launch_config", lambda h, dtype: {"BLOCK_H": 16, "BLOCK_N": 16, "num_warps": 4}
        )
        patch.setattr(triton_attention, "SPLIT_KEYS_MULTIPLE", 16)
        gen = torch.Generator().manual_seed(seed)
        seqs = [SeqSpec(q, q + extra) for q, extra in zip(q_lens, extra_keys)]
        batch = paged_batch(seqs, 16, gen, shuffle_blocks=True)
        indices = random_topk_indices(batch, topk, gen, invalid_fraction=invalid_fraction)
        q = randn((indices.shape[0], num_heads, 80), gen)
        kv_cache = randn((batch.num_blocks, 16, 80), gen)
        args = (q, kv_cache, indices, batch.block_table, batch.seq_lens_k, batch.cu_seqlens_q)
        out, lse = triton_attention.sparse_flash_attention(*_dev(*args), sm_scale=0.2, d_v=48, num_splits=num_splits)
        whole = triton_attention.sparse_flash_attention(*_dev(*args), sm_scale=0.2, d_v=48, num_splits=1)
    assert _same_specials(out, whole[0]) and _same_specials(lse, whole[1])
    want_out, want_lse = ref.sparse_flash_attention(*map(to_numpy, args), 0.2, 48)
    _assert_close("out", out, want_out, torch.float32)
    _assert_close("lse", lse, want_lse, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sparse_attention_split_keeps_the_empty_softmax_rule(split_keys, dtype):
    """Token 0 head 0 scores -inf against every key (q holds -inf where every row holds 1), over 40 keys in three
    ranges: out 0 and lse -inf, as for a row without keys, though a V row of its last range holds inf (0 x inf
    would be NaN in a plain product; V is part of K, and q's -1 in that dim keeps the row's scores -inf); token 0's
    other head (whose value product meets 0 x inf: NaN, as in the reference) and token 1 as the reference."""
    gen = torch.Generator().manual_seed(31)
    cache = torch.randn(4, 16, 576, generator=gen) * 0.1
    cache[..., 0] = 1.0
    cache[2, 5, 9] = float("inf")  # in V of key position 37 (block table [3, 0, 2, 1]: block 2, slot 5)
    q = torch.randn(2, 2, 576, generator=gen)
    q[0, 0, 0] = float("-inf")
    q[0, :, 9] = -1.0
    others = torch.tensor([p for p in range(48) if p != 37])
    indices = torch.stack([others[torch.randperm(47, generator=gen)[:40]] for _ in range(2)]).to(torch.int32)
    indices[0, 39] = 37
    args = (
        q.to(dtype),
        cache.to(dtype),
        indices,
        torch.tensor([[3, 0, 2, 1]], dtype=torch.int32),
        torch.tensor([48], dtype=torch.int32),
        torch.tensor([0, 2], dtype=torch.int32),
    )
    out, lse = triton_attention.sparse_flash_attention(*_dev(*args), sm_scale=0.05, d_v=512)
    assert (out[0, 0] == 0).all() and float(lse[0, 0]) == float("-inf")
    assert torch.isfinite(out[1]).all() and torch.isfinite(lse[1]).all() and torch.isfinite(lse[0, 1])
    whole_out, whole_lse = triton_attention.sparse_flash_attention(*_dev(*args), sm_scale=0.05, d_v=512, num_splits=1)
    assert _same_specials(out, whole_out) and _same_specials(lse, whole_lse)
    want_out, want_lse = ref.sparse_flash_attention(*map(to_numpy, args), 0.05, 512)
    _assert_close("out", out, want_out, dtype)
    _assert_close("lse", lse, want_lse, torch.float32 if dtype == torch.float32 else dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_every_sparse_attention_parity_case_passes_split_over_keys(monkeypatch, dtype):
    """The op's parity cases on the Triton backend with every call split into up to 4 key ranges: at topk 2048
    (GLM-5's and DeepSeek's head counts, every cache format) 4 ranges of 512 keys; the cases of at most 64 keys run
    as one range (the interpreter's key tiles are 64 keys: split_keys' tests cover small ranges at a fifth of the
    time these cases would take in 16-key tiles)."""
    from glm5_hal.parity import CASES, run_case

    monkeypatch.setattr(triton_attention, "_default_splits", lambda *args: 4)
    merges = _Launches(triton_attention._merge_splits_kernel)
    monkeypatch.setattr(triton_attention, "_merge_splits_kernel", merges)

    cases = [case for case in CASES if case.op == "sparse_flash_attention" and dtype in case.dtypes]
    assert len(cases) >= 10
    for case in cases:
        result = run_case(case, "triton", dtype)
        assert result.passed, f"{case.name}: {result.status}: {result.detail}"
    long = [case for case in cases if "topk2048" in case.name or "heads" in case.name]
    assert len(long) >= 6 and merges.count >= len(long)  # every topk-2048 case ran split


def test_default_splits_fill_the_sms_only_where_the_grid_leaves_them_idle(monkeypatch):
    """_default_splits on a GPU of 132 SMs (an H200), without one: 1 range where the unsplit grid at 64-head tiles
    has programs for every SM (prefill) and under the interpreter; else enough ranges for every SM, at most 8, each of
    at least 256 keys."""
    monkeypatch.setattr(triton_attention, "interpreting", lambda: False)
    monkeypatch.setattr(triton_attention, "_multiprocessors", lambda index: 132)
    gpu = torch.device("cuda", 0)
    cases = {(64, 64, 2048): 3, (4096, 64, 2048): 1, (132, 4, 2048): 1, (3, 64, 2048): 8, (1, 128, 2048): 8}
    cases |= {(4, 4, 32): 1, (4, 4, 600): 2, (20, 128, 2048): 4}
    assert {shape: triton_attention._default_splits(*shape, gpu) for shape in cases} == cases
    assert triton_attention._default_splits(1, 64, 2048, torch.device("cpu")) == 1
    monkeypatch.setattr(triton_attention, "interpreting", lambda: True)
    assert triton_attention._default_splits(1, 64, 2048, gpu) == 1
    assert triton_attention.key_ranges(2048, 3) == (704, 3) and triton_attention.key_ranges(70, 4) == (64, 2)


def test_sparse_attention_rejects_no_split():
    q = torch.zeros(1, 16, 576, device=DEVICE)
    args = (q, torch.zeros(1, 16, 576, device=DEVICE), torch.zeros(1, 4, dtype=torch.int32, device=DEVICE))
    batch = (torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), torch.tensor([0, 1]).int())
    with pytest.raises(ValueError, match="num_splits: expected >= 1, got 0"):
        triton_attention.sparse_flash_attention(*args, *_dev(*batch), sm_scale=1.0, num_splits=0)


def _indexer_args(gen: torch.Generator, dtype: torch.dtype, num_heads: int = 6, head_dim: int = 48):
    batch = paged_batch(SEQS, 16, gen)  # 150 keys -> 160 columns: two key tiles of 128, the second ragged
    num_tokens = int(batch.cu_seqlens_q[-1])
    return (
        randn((num_tokens, num_heads, head_dim), gen, dtype=dtype),
        randn((num_tokens, num_heads), gen, std=0.3),
        randn((batch.num_blocks, 16, head_dim), gen, dtype=dtype),
        batch.block_table,
        batch.seq_lens_k,
        batch.cu_seqlens_q,
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_indexer_logits_many_key_tiles(gen, dtype):
    args = _indexer_args(gen, dtype)
    logits = triton_indexer.indexer_logits(*_dev(*args))
    _assert_close("logits", logits, ref.indexer_logits(*map(to_numpy, args)), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens_per_program", [1, 2, 8])
def test_indexer_logits_tokens_per_program(gen, dtype, tokens_per_program):
    """The logits kernel with 1, 2 and 8 query tokens a program over SEQS (8 tokens of 4 sequences, one without new
    tokens): 8 a program puts every sequence in one tile (one pass per sequence), 2 splits the chunked prefill's
    3 tokens over two tiles. A NaN in one token's query reaches its row and no other token's."""
    args = list(_indexer_args(gen, dtype))
    args[0][5, 1, 7] = float("nan")  # token 5: the last sequence's second new token, beside its other three
    logits = triton_indexer.indexer_logits(*_dev(*args), tokens_per_program=tokens_per_program)
    want = ref.indexer_logits(*map(to_numpy, args))
    assert np.isnan(want[5]).any() and not np.isnan(np.delete(want, 5, axis=0)).any()
    _assert_close("logits", logits, want, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens_per_program", [1, 2])
def test_indexer_padding_heads_add_nothing_against_an_infinite_key(dtype, tokens_per_program):
    """A key holding +inf in a dim where every real head's query is negative: every real dot is -inf, the ReLU
    makes each 0, and the reference scores the key 0. The kernel's padding heads (6 heads in a tile of 8 or 16, their
    q and weight 0) dot that key to 0 x inf = NaN; they must add nothing (they made the score NaN until 2026-11-30).
    A key with -inf there scores 0 the same way from the other side, and one holding NaN is NaN."""
    gen = torch.Generator().manual_seed(11)
    q = randn((4, 6, 32), gen)
    q[..., 0] = -(torch.rand(4, 6, generator=gen) + 0.1)
    q[..., 1] = torch.rand(4, 6, generator=gen) + 0.1
    cache = randn((2, 16, 32), gen)
    cache[0, 3, 0] = float("inf")
    cache[0, 5, 1] = float("-inf")
    cache[1, 2, 7] = float("nan")  # key 18
    args = (q.to(dtype), randn((4, 6), gen), cache.to(dtype), torch.tensor([[0, 1]], dtype=torch.int32),
            torch.tensor([24], dtype=torch.int32), torch.tensor([0, 4], dtype=torch.int32))  # fmt: skip
    logits = triton_indexer.indexer_logits(*_dev(*args), tokens_per_program=tokens_per_program).cpu()
    want = ref.indexer_logits(*map(to_numpy, args))
    assert (want[:, [3, 5]] == 0).all() and np.isnan(want[:, 18]).all()
    _assert_close("logits", logits, want, torch.float32)


def test_tokens_per_program_guess_and_its_checks():
    """The guess: 1 at decode-like batches, else tokens for _DOT_ROWS rows of the dot, within the cap and the
    operands' shared-memory budget; bad values are errors naming the argument."""
    guess = triton_indexer.tokens_per_program
    assert guess(64, 64, 32, 128, 2) == 1  # a decode step
    assert guess(4096, 1, 32, 128, 2) == 4  # GLM-5's 32 index heads in bf16: 128 rows
    assert guess(4096, 1, 64, 128, 2) == 2  # DeepSeek-V3.2's 64
    assert guess(4096, 1, 3, 40, 4) == triton_indexer.MAX_TOKENS_PER_PROGRAM
    assert guess(4096, 1, 32, 128, 4) == 2  # fp32 operands at 4 tokens: 128 KB, over the budget; at 2: 96 KB
    args = _dev(*_indexer_args(torch.Generator().manual_seed(0), torch.float32))
    for bad in (0, 3, 16):
        with pytest.raises(ValueError, match=f"tokens_per_program: expected a power of two in 1..8, got {bad}"):
            triton_indexer.indexer_logits(*args, tokens_per_program=bad)


@settings(max_examples=15, deadline=None, derandomize=True)
@given(
    q_lens=st.lists(st.integers(0, 9), min_size=1, max_size=4),
    extra_keys=st.lists(st.integers(0, 150), min_size=4, max_size=4),
    num_heads=st.integers(1, 20),
    tokens_per_program=st.sampled_from([1, 2, 4, 8]),
    kv_cache_dtype=st.sampled_from(["auto", "fp8_index", "int8_index"]),
    garbage_padding=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_indexer_tokens_per_program_on_random_batches(
    q_lens, extra_keys, num_heads, tokens_per_program, kv_cache_dtype, garbage_padding, seed
):
    """Random batches (sequences without new tokens, tiles of tokens that span sequences, block-table padding of
    -1 or any value), head counts, float, fp8_index and int8_index caches, 1 to 8 tokens a program: fp32 logits
    against the reference, and lightning_indexer's picks on the same logits."""
    gen = torch.Generator().manual_seed(seed)
    seqs = [SeqSpec(q, q + extra) for q, extra in zip(q_lens, extra_keys)]
    batch = paged_batch(seqs, 16, gen, garbage_padding=garbage_padding)
    head_dim = 40 if kv_cache_dtype == "auto" else 128
    keys = randn((batch.num_blocks * 16, head_dim), gen)
    cache = keys.view(batch.num_blocks, 16, head_dim)
    if kv_cache_dtype != "auto":
        cache = encode_rows(keys, FORMATS[kv_cache_dtype]).view(batch.num_blocks, 16, -1)
    q = randn((batch.num_tokens, num_heads, head_dim), gen)
    weights = randn((batch.num_tokens, num_heads), gen, std=0.3)
    args = (q, weights, cache, batch.block_table, batch.seq_lens_k, batch.cu_seqlens_q)
    logits = triton_indexer.indexer_logits(
        *_dev(*args), kv_cache_dtype=kv_cache_dtype, tokens_per_program=tokens_per_program
    )
    want = ref.indexer_logits(*map(to_numpy, args), kv_cache_dtype=kv_cache_dtype)
    _assert_close("logits", logits, want, torch.float32)
    topk = 24
    indices, _ = triton_indexer.lightning_indexer(
        *_dev(*args), topk, kv_cache_dtype=kv_cache_dtype, tokens_per_program=tokens_per_program
    )
    verdict = compare_topk("indices", indices.cpu(), want, topk, torch.float32)
    assert verdict.passed, verdict.detail


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_lightning_indexer_many_token_tiles(monkeypatch, gen, dtype):
    args = _indexer_args(gen, dtype, num_heads=20, head_dim=32)
    width = args[3].shape[1] * args[2].shape[1]
    monkeypatch.setattr(triton_indexer, "_LOGIT_TILE_BYTES", 3 * 4 * width)  # 3 tokens per logit tile: 3 tiles
    topk = 64  # more than the 45 and 4 keys of two sequences: their rows end in -1
    indices, scores = triton_indexer.lightning_indexer(*_dev(*args), topk)
    want_logits = ref.indexer_logits(*map(to_numpy, args))
    verdict = compare_topk("indices", indices.cpu(), want_logits, topk, torch.float32)
    assert verdict.passed, verdict.detail
    # The scores are the logits of the picked keys, -inf exactly where the index is -1.
    picked = np.take_along_axis(want_logits, np.clip(to_numpy(indices), 0, None), axis=1)
    _assert_close("scores", scores, np.where(to_numpy(indices) >= 0, picked, -np.inf), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mla_prolog_odd_widths(gen, dtype):
    # kv_lora 40 + rope 12 (a 52-wide cache row), q_lora 24, 3 heads of nope 10: every width is masked.
    hidden, q_lora, heads, nope, kv_lora, rope = 72, 24, 3, 10, 40, 12
    batch = paged_batch([SeqSpec(3, 9), SeqSpec(2, 2)], 4, gen, pad_slots=(1,))
    cos, sin = rope_tables(batch.positions, rope, 10000.0)
    args = (
        randn((5, hidden), gen, dtype=dtype),
        randn((q_lora, hidden), gen, std=hidden**-0.5, dtype=dtype),
        (1 + 0.1 * randn((q_lora,), gen)).to(dtype),
        randn((heads * (nope + rope), q_lora), gen, std=q_lora**-0.5, dtype=dtype),
        randn((heads, nope, kv_lora), gen, std=nope**-0.5, dtype=dtype),
        randn((kv_lora + rope, hidden), gen, std=hidden**-0.5, dtype=dtype),
        (1 + 0.1 * randn((kv_lora,), gen)).to(dtype),
        cos,
        sin,
        randn((batch.num_blocks, 4, kv_lora + rope), gen, dtype=dtype),
        batch.slot_mapping,
    )
    dev_args = _dev(*args)
    q_lat, q_pe, q_norm = triton_prolog.mla_prolog(*dev_args, 1e-6)
    want = ref.mla_prolog(*map(to_numpy, args), 1e-6)
    for name, got, expected in zip(("q_lat", "q_pe", "q_norm", "kv_cache"), (q_lat, q_pe, q_norm, dev_args[9]), want):
        _assert_close(name, got, expected, dtype)


@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "half_split"])
def test_norm_rope_layer_norm_on_strided_rows(gen, interleaved):
    # LayerNorm over 36 dims, RoPE on dims 4..24 (inside the norm range, not at its start), rows 72 apart.
    x = randn((7, 72), gen).to(DEVICE)[:, :36]
    weight, bias = (1 + 0.1 * randn((36,), gen)).to(DEVICE), (0.1 * randn((36,), gen)).to(DEVICE)
    cos, sin = _dev(*rope_tables(torch.arange(7) * 3, 20, 10000.0))
    out = torch.empty((7, 36), device=DEVICE)
    triton_prolog.norm_rope(
        x, out, norm=2, weight=weight, bias=bias, norm_dim=36, eps=1e-6, cos=cos, sin=sin, rope_start=4,
        interleaved=interleaved,
    )  # fmt: skip
    want = ref.layer_norm(to_numpy(x), to_numpy(weight), to_numpy(bias), 1e-6)
    want[:, 4:24] = ref.rope(want[:, 4:24], to_numpy(cos), to_numpy(sin), interleaved=interleaved)
    _assert_close("rows", out, want, torch.float32)


@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "int8_mla"])
def test_quantized_cache_of_one_padded_slot_is_written_and_read(fmt):
    """A cache of one block of one slot whose rows are padded (strides row_bytes + 1) is 'contiguous' to torch (size-1
    dims' strides do not count), so .contiguous() returned it unchanged: the writer, copying until the rows were
    aligned, recursed without end (the long fuzz profile). The rows now go through a fresh aligned copy both ways."""
    from backends.triton.quantized_cache import aligned_cache, quantize_into_cache  # noqa: PLC0415
    from glm5_hal.kv_formats import FORMATS  # noqa: PLC0415

    row_bytes = FORMATS[fmt].row_bytes
    storage = torch.full((row_bytes + 1,), 7, dtype=torch.uint8, device=DEVICE)
    cache = storage.as_strided((1, 1, row_bytes), (row_bytes + 1, row_bytes + 1, 1))
    assert cache.is_contiguous() and cache.contiguous() is cache
    rows = torch.randn(1, 576, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    slot = torch.tensor([0], device=DEVICE)
    quantize_into_cache(rows, cache, slot, FORMATS[fmt])
    assert storage[-1] == 7  # the padding byte untouched
    plain = torch.zeros(1, 1, row_bytes, dtype=torch.uint8, device=DEVICE)  # the same row in an ordinary cache
    quantize_into_cache(rows, plain, slot, FORMATS[fmt])
    assert torch.equal(cache, plain)
    dense = aligned_cache(cache, fmt)  # what the readers take
    assert dense is not cache and torch.equal(dense, plain) and dense.stride() == plain.stride()
