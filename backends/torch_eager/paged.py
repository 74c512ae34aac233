"""Paged-cache access of the torch backend: row gathers and cache writes. Token sequences, positions, key slots and
the cache read in place as rows (slot_rows) are shared by every backend (glm5_hal.paged).

Sequence b owns query tokens cu_seqlens_q[b] : cu_seqlens_q[b+1] and key positions 0 .. seq_lens_k[b] - 1. Query
token t of sequence b sits at position seq_lens_k[b] - cu_seqlens_q[b+1] + t and sees the keys at positions <= it.
Key position p of sequence b lives in flat slot block_table[b, p // block_size] * block_size + p % block_size.

Everything here stays on the tensors' device and never reads a value back to the host, except `write_cache`
(see there).
"""

from __future__ import annotations

from torch import Tensor


def gather_rows(table: Tensor, index: Tensor) -> Tensor:
    """table [R, ...] rows picked by index [...] (int64, all in range): [*index.shape, ...]. index_select copies whole
    rows (7-9x faster on CPU than advanced indexing `table[index]`, which moves bf16 rows element by element), and
    reads a strided table in place."""
    return table.index_select(0, index.reshape(-1)).view(*index.shape, *table.shape[1:])


def write_cache(cache: Tensor, slot_mapping: Tensor, rows: Tensor) -> None:
    """Write rows[t] to flat slot slot_mapping[t] of cache [num_blocks, block_size, D] in place; slot -1 = skip.

    rows: [T, D], any floating dtype (cast to the cache's). Works for any cache strides.
    """
    keep = slot_mapping >= 0
    # The one host sync of the backend's cache writes: boolean selection needs the count of kept tokens, and
    # eager torch has no masked scatter that skips rows without it (redirecting skipped rows to a dummy slot
    # would race with a real write to that slot).
    slots = slot_mapping[keep]
    block_size = cache.shape[1]
    cache[slots // block_size, slots % block_size] = rows[keep].to(cache.dtype)
