"""The paged ragged batch of OPS.md "Conventions" as device tensors, shared by the backends: which sequence each
query token belongs to, its position, and the flat cache slot of a key position.

Sequence b owns query tokens cu_seqlens_q[b] : cu_seqlens_q[b+1] and key positions 0 .. seq_lens_k[b] - 1. Query
token t of sequence b sits at position seq_lens_k[b] - cu_seqlens_q[b+1] + t and sees the keys at positions <= it.
Key position p of sequence b lives in flat slot block_table[b, p // block_size] * block_size + p % block_size.
Nothing here reads a value back to the host.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


def token_sequences(cu_seqlens_q: Tensor, num_tokens: int) -> Tensor:
    """[T] int64: the sequence each query token belongs to (cu_seqlens_q: [B+1] int32 prefix sums ending at T)."""
    tokens = torch.arange(num_tokens, device=cu_seqlens_q.device)
    # searchsorted rather than repeat_interleave(q_lens): its output size is known, so the host never waits.
    # right=True skips sequences with no new tokens (equal consecutive prefix sums).
    return torch.searchsorted(cu_seqlens_q[1:].to(torch.int64), tokens, right=True)


def token_positions(seq_lens_k: Tensor, cu_seqlens_q: Tensor, seqs: Tensor) -> Tensor:
    """[T] int64: each query token's position in its sequence. seqs: [T] from `token_sequences`."""
    tokens = torch.arange(seqs.shape[0], device=seqs.device)
    return seq_lens_k.to(torch.int64)[seqs] - cu_seqlens_q.to(torch.int64)[seqs + 1] + tokens


def blocks_in_use(block_table: Tensor, max_seq_len: int, block_size: int) -> Tensor:
    """block_table [B, max_blocks] cut to the columns sequences of at most max_seq_len keys use: a view of its first
    ceil(max_seq_len / block_size) columns (at least 1, at most max_blocks). A serving engine's table is as wide as
    the longest sequence it allows; an op that scans every key position its table can address (the indexer's scores
    and their top-k) then scans only the batch's. max_seq_len: the batch's longest sequence, or an upper bound."""
    used = max(1, -(-max_seq_len // block_size)) if block_size > 0 else block_table.shape[1]
    return block_table[:, : min(used, block_table.shape[1])]


def key_slots(
    block_table: Tensor,
    seqs: Tensor,
    positions: Tensor,
    block_size: int,
    num_blocks: int,
    *,
    block_step: int | None = None,
    row_step: int = 1,
) -> tuple[Tensor, Tensor]:
    """Flat cache slots of request-local key positions, and whether the block table addresses each one.

    block_table: [B, max_blocks] int32. seqs: [N] int64, a sequence per row. positions: [S] (shared by all rows)
    or [N, S] (one set per row), any integer dtype. num_blocks: the cache's blocks. Returns (slots [N, S] int64,
    addressable [N, S] bool). A slot is block * block_step + offset * row_step: the flat slot (block_size, 1) by
    default, or the row of a strided view of the cache that reads it in place (slot_rows).

    A position is addressable when it lies in the table (0 <= p < max_blocks * block_size) and its table entry is a
    block of the cache (0 <= id < num_blocks). With value checks on, the blocks a sequence uses always are; with
    them off (or under torch.compile) a bad id must not reach memory: docs/ops.md ("Paged caches") makes such a key
    not a key, on every backend. The slot of a position that is not addressable is 0, so that a gather stays in
    bounds whatever the table holds; callers mask those keys out.
    """
    positions = positions.to(torch.int64)
    max_position = block_table.shape[1] * block_size - 1
    if max_position < 0:  # a table with no column addresses nothing
        shape = torch.broadcast_shapes((seqs.shape[0], 1), positions.shape)
        zeros = torch.zeros(shape, dtype=torch.int64, device=positions.device)
        return zeros, zeros.bool()
    clamped = positions.clamp(0, max_position)
    blocks = block_table.to(torch.int64)[seqs[:, None], clamped // block_size]  # [N, S]
    addressable = (positions == clamped) & (blocks >= 0) & (blocks < num_blocks)
    block_step = block_size if block_step is None else block_step
    slots = blocks * block_step + (clamped % block_size) * row_step
    return torch.where(addressable, slots, 0), addressable


@dataclass(frozen=True)
class SlotRows:
    """A paged cache [num_blocks, block_size, D] read in place as the rows of one 2-D view: slot (block b, offset o)
    is row b * block_step + o * row_step of `rows` [R, D]. For a contiguous cache that is flatten(0, 1) (block_step =
    block_size, row_step = 1); for a view whose blocks have spare slots, or lie any number of elements apart, `rows`
    is a strided view over the same storage (rows at the gcd of the block and slot strides, so some rows overlap
    or fall between slots: only the ones slots name are read)."""

    rows: Tensor
    block_step: int
    row_step: int


def slot_rows(cache: Tensor) -> SlotRows:
    """The rows of cache [num_blocks, block_size, D] as a view (SlotRows), never a copy: flatten(0, 1) of a view
    whose blocks are not one run of rows copied the whole cache on every call."""
    num_blocks, block_size, width = cache.shape
    block_stride, slot_stride, dim_stride = cache.stride()
    if num_blocks * block_size == 0:
        return SlotRows(cache.new_empty(0, width), block_size, 1)
    unit = math.gcd(block_stride, slot_stride) or 1  # both 0: every slot is the same row
    block_step, row_step = block_stride // unit, slot_stride // unit
    count = (num_blocks - 1) * block_step + (block_size - 1) * row_step + 1
    # Its last element is the cache's last element: the view stays inside the cache's own span of its storage.
    return SlotRows(cache.as_strided((count, width), (unit, dim_stride)), block_step, row_step)
