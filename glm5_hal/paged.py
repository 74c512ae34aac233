"""The paged ragged batch of OPS.md "Conventions" as device tensors, shared by the backends: which sequence each
query token belongs to, its position, and the flat cache slot of a key position.

Sequence b owns query tokens cu_seqlens_q[b] : cu_seqlens_q[b+1] and key positions 0 .. seq_lens_k[b] - 1. Query
token t of sequence b sits at position seq_lens_k[b] - cu_seqlens_q[b+1] + t and sees the keys at positions <= it.
Key position p of sequence b lives in flat slot block_table[b, p // block_size] * block_size + p % block_size.
Nothing here reads a value back to the host.
"""

from __future__ import annotations

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


def key_slots(
    block_table: Tensor, seqs: Tensor, positions: Tensor, block_size: int, num_blocks: int
) -> tuple[Tensor, Tensor]:
    """Flat cache slots of request-local key positions, and whether the block table addresses each one.

    block_table: [B, max_blocks] int32. seqs: [N] int64, a sequence per row. positions: [S] (shared by all rows)
    or [N, S] (one set per row), any integer dtype. num_blocks: the cache's blocks. Returns (slots [N, S] int64,
    addressable [N, S] bool).

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
    return torch.where(addressable, blocks * block_size + clamped % block_size, 0), addressable
