"""The paged ragged batch of OPS.md "Conventions": token positions, key slots, cache writes.

Sequence b owns query tokens cu_seqlens_q[b] : cu_seqlens_q[b+1] and keys 0 .. seq_lens_k[b]-1. Query token i of
sequence b (q_len new tokens) sits at position seq_lens_k[b] - q_len + i and sees the keys at positions <= it.
Key position p of sequence b lives in slot block_table[b, p // block_size] * block_size + p % block_size.
"""

from __future__ import annotations

import numpy as np

from ops_reference.kv_cache import AUTO, cache_format, encode_rows


def token_sequences(cu_seqlens_q: np.ndarray) -> np.ndarray:
    """[T] the sequence each query token belongs to."""
    q_lens = np.diff(np.asarray(cu_seqlens_q, np.int64))
    return np.repeat(np.arange(len(q_lens)), q_lens)


def token_positions(seq_lens_k: np.ndarray, cu_seqlens_q: np.ndarray) -> np.ndarray:
    """[T] the position of each query token in its sequence."""
    cu = np.asarray(cu_seqlens_q, np.int64)
    seq = token_sequences(cu)
    offset_in_seq = np.arange(cu[-1]) - cu[seq]
    q_lens = np.diff(cu)
    return np.asarray(seq_lens_k, np.int64)[seq] - q_lens[seq] + offset_in_seq


def addressable(block_table: np.ndarray, num_blocks: int, block_size: int, b: int, positions: np.ndarray) -> np.ndarray:
    """[len(positions)] bool: whether the block table of sequence `b` addresses each key position, i.e. the position
    lies in the table and its entry is a block of the cache (0 <= id < num_blocks). A key it does not address is not
    a key (docs/ops.md "Paged caches": only reachable with value checks off, which would refuse such a table)."""
    table = np.asarray(block_table, np.int64)[b]
    positions = np.asarray(positions, np.int64)
    inside = (positions >= 0) & (positions < table.shape[0] * block_size)
    blocks = table[np.where(inside, positions, 0) // block_size] if table.shape[0] else np.zeros_like(positions)
    return inside & (blocks >= 0) & (blocks < num_blocks)


def gather_keys(cache: np.ndarray, block_table: np.ndarray, b: int, positions: np.ndarray) -> np.ndarray:
    """The cache rows [len(positions), D] of key `positions` (request-local) of sequence `b` (all addressable)."""
    block_size = cache.shape[1]
    positions = np.asarray(positions, np.int64)
    blocks = np.asarray(block_table, np.int64)[b, positions // block_size]
    return np.asarray(cache, np.float64)[blocks, positions % block_size]


def write_cache(
    cache: np.ndarray, slot_mapping: np.ndarray, rows: np.ndarray, kv_cache_dtype: str = AUTO
) -> np.ndarray:
    """A copy of `cache` with rows[t] written to flat slot slot_mapping[t]; slot -1 is not written. A quantized
    cache (kv_cache_dtype one of ops_reference.kv_cache.FORMATS, uint8 rows) gets the rows encoded."""
    fmt = cache_format(kv_cache_dtype)
    # C order: `flat` below must be a view of it (a column-major cache's writes are kept).
    new = np.array(cache, np.float64 if fmt is None else np.uint8, copy=True, order="C")
    flat = new.reshape(-1, new.shape[-1])
    slots = np.asarray(slot_mapping, np.int64)
    keep = slots >= 0
    kept = np.asarray(rows, np.float64)[keep]
    flat[slots[keep]] = kept if fmt is None else encode_rows(kept, fmt)
    return new
