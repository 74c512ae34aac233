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


def key_slots(block_table: Tensor, seqs: Tensor, positions: Tensor, block_size: int) -> Tensor:
    """Flat cache slots of request-local key positions.

    block_table: [B, max_blocks] int32. seqs: [N] int64, a sequence per row. positions: [S] (shared by all rows)
    or [N, S] (one set per row), any integer dtype. Returns [N, S] int64.

    Positions the block table cannot address (negative, past the table, or in an unallocated -1 block) map to
    some valid slot so that the gather stays in bounds; callers mask those keys out.
    """
    max_position = block_table.shape[1] * block_size - 1
    positions = positions.to(torch.int64).clamp(0, max_position)
    blocks = block_table.to(torch.int64)[seqs[:, None], positions // block_size]  # [N, S]
    return blocks.clamp_min(0) * block_size + positions % block_size
