"""glm5_hal.paged.blocks_in_use: a serving engine's block table cut to the blocks its batch uses."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import glm5_hal
from glm5_hal.kv_formats import FORMATS, encode_rows
from glm5_hal.paged import blocks_in_use


@pytest.mark.parametrize(
    ("max_seq_len", "block_size", "columns"),
    [(0, 16, 1), (1, 16, 1), (16, 16, 1), (17, 16, 2), (100, 16, 7), (10_000, 16, 8), (5, 1, 5)],
)
def test_blocks_in_use_keeps_the_columns_the_longest_sequence_needs(max_seq_len, block_size, columns):
    table = torch.arange(24, dtype=torch.int32).view(3, 8)
    cut = blocks_in_use(table, max_seq_len, block_size)
    assert cut.shape == (3, columns)
    assert torch.equal(cut, table[:, :columns]) and cut.data_ptr() == table.data_ptr()  # a view, not a copy


@settings(max_examples=20, deadline=None, derandomize=True)
@given(
    lens=st.lists(st.integers(1, 300), min_size=1, max_size=3),
    block_size=st.sampled_from([16, 64]),
    spare_blocks=st.integers(0, 40),
    kv_cache_dtype=st.sampled_from(["auto", "fp8_index"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_the_indexer_over_the_blocks_in_use_picks_what_it_picks_over_the_whole_table(
    lens, block_size, spare_blocks, kv_cache_dtype, seed
):
    """The vLLM plugin cuts vLLM's block table (as wide as max_model_len) to the batch's longest sequence before the
    indexer scores and ranks every position the table addresses: the same top-k, one new token per sequence."""
    gen = torch.Generator().manual_seed(seed)
    batch = len(lens)
    used = -(-max(lens) // block_size)
    width = used + spare_blocks
    num_blocks = batch * width + 1
    rows = torch.randn(num_blocks * block_size, 128, generator=gen)
    if kv_cache_dtype == "auto":
        cache = rows.bfloat16().view(num_blocks, block_size, 128)
    else:
        cache = encode_rows(rows, FORMATS[kv_cache_dtype]).view(num_blocks, block_size, -1)
    table = torch.randperm(num_blocks, generator=gen)[: batch * width].view(batch, width).to(torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    cu_seqlens_q = torch.arange(batch + 1, dtype=torch.int32)
    q = torch.randn(batch, 4, 128, generator=gen).bfloat16()
    weights = torch.rand(batch, 4, generator=gen)
    args = (q, weights, cache)
    whole = glm5_hal.lightning_indexer(*args, table, seq_lens, cu_seqlens_q, 64, kv_cache_dtype=kv_cache_dtype)
    cut = blocks_in_use(table, max(lens), block_size)
    assert cut.shape[1] == used
    in_use = glm5_hal.lightning_indexer(*args, cut, seq_lens, cu_seqlens_q, 64, kv_cache_dtype=kv_cache_dtype)
    assert torch.equal(in_use, whole)
