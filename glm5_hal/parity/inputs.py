"""Random, valid inputs for every op: the ragged paged batches and weights that parity tests and benchmarks use.

Everything is drawn from a seeded `torch.Generator` on the CPU (fresh values each run, never zeros) and then
cast and moved; the same seed gives the same inputs on every device.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from glm5_hal.config import ModelConfig


@dataclass(frozen=True)
class SeqSpec:
    """One sequence of a ragged batch: `q_len` new tokens at the end of a context of `k_len` keys."""

    q_len: int
    k_len: int

    def __post_init__(self) -> None:
        if not 0 <= self.q_len <= self.k_len:
            raise ValueError(f"SeqSpec: expected 0 <= q_len <= k_len, got q_len={self.q_len}, k_len={self.k_len}")


@dataclass
class PagedBatch:
    """A ragged token-major batch over a paged cache (OPS.md "Conventions").

    block_table: [B, max_blocks] int32; seq_lens_k: [B] int32; cu_seqlens_q: [B+1] int32; slot_mapping: [T]
    int64 (the cache slots of the new tokens, -1 for padding tokens); positions: [T] int64 (each new token's
    position in its sequence); num_blocks, block_size: the cache geometry.
    """

    block_table: torch.Tensor
    seq_lens_k: torch.Tensor
    cu_seqlens_q: torch.Tensor
    slot_mapping: torch.Tensor
    positions: torch.Tensor
    num_blocks: int
    block_size: int

    @property
    def num_tokens(self) -> int:
        return int(self.cu_seqlens_q[-1])

    def to(self, device: torch.device | str) -> PagedBatch:
        return PagedBatch(
            self.block_table.to(device),
            self.seq_lens_k.to(device),
            self.cu_seqlens_q.to(device),
            self.slot_mapping.to(device),
            self.positions.to(device),
            self.num_blocks,
            self.block_size,
        )


def paged_batch(
    seqs: Sequence[SeqSpec],
    block_size: int,
    gen: torch.Generator,
    *,
    shuffle_blocks: bool = True,
    spare_blocks: int = 1,
    pad_slots: Sequence[int] = (),
    garbage_padding: bool = False,
    extra_columns: int = 0,
) -> PagedBatch:
    """Lay `seqs` out in a paged cache.

    shuffle_blocks: assign cache blocks in a random order (what a real allocator produces) instead of 0, 1, 2...
    spare_blocks: extra unused blocks in the cache (so an off-by-one block id reads garbage, not nothing).
    pad_slots: flat token indices whose slot_mapping is -1 (padding tokens that must not be written).
    garbage_padding: fill the block-table entries a sequence does not use with random int32 values (any value is
        allowed there) instead of -1. extra_columns: block-table columns beyond the longest sequence's blocks.
    """
    blocks_per_seq = [math.ceil(s.k_len / block_size) for s in seqs]
    max_blocks = max(max(blocks_per_seq, default=1), 1) + extra_columns
    num_blocks = sum(blocks_per_seq) + spare_blocks
    order = torch.randperm(num_blocks, generator=gen) if shuffle_blocks else torch.arange(num_blocks)
    if garbage_padding:  # unused entries: anything
        block_table = torch.randint(-(2**31), 2**31, (len(seqs), max_blocks), generator=gen, dtype=torch.int64)
        block_table = block_table.to(torch.int32)
    else:  # unused entries: -1 padding
        block_table = torch.full((len(seqs), max_blocks), -1, dtype=torch.int32)
    next_block = 0
    for b, n in enumerate(blocks_per_seq):
        block_table[b, :n] = order[next_block : next_block + n].to(torch.int32)
        next_block += n
    seq_lens_k = torch.tensor([s.k_len for s in seqs], dtype=torch.int32)
    q_lens = torch.tensor([s.q_len for s in seqs], dtype=torch.int64)
    cu_seqlens_q = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    cu_seqlens_q[1:] = torch.cumsum(q_lens, 0).to(torch.int32)
    positions = torch.cat(
        [torch.arange(s.k_len - s.q_len, s.k_len, dtype=torch.int64) for s in seqs]
        or [torch.zeros(0, dtype=torch.int64)]
    )
    seq_of_token = torch.repeat_interleave(torch.arange(len(seqs)), q_lens)
    blocks = block_table.to(torch.int64)[seq_of_token, positions // block_size]
    slot_mapping = blocks * block_size + positions % block_size
    for t in pad_slots:
        slot_mapping[t] = -1
    return PagedBatch(block_table, seq_lens_k, cu_seqlens_q, slot_mapping, positions, num_blocks, block_size)


def randn(shape: Sequence[int], gen: torch.Generator, *, std: float = 1.0, dtype: torch.dtype = torch.float32):
    """Gaussian values (fp32 draw, then cast: the same seed gives the same values in every dtype)."""
    return (torch.randn(tuple(shape), generator=gen) * std).to(dtype)


def linear_weight(out_features: int, in_features: int, gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """An nn.Linear-layout weight [out, in] scaled so activations keep unit variance."""
    return randn((out_features, in_features), gen, std=in_features**-0.5, dtype=dtype)


def norm_gain(width: int, gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """A norm gain near 1 (never exactly 1, so a backend that ignores it fails)."""
    return (1.0 + 0.1 * torch.randn(width, generator=gen)).to(dtype)


def rope_tables(positions: torch.Tensor, rope_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, rope_dim / 2] fp32 with angle_i(pos) = pos * theta^(-2i / rope_dim) (OPS.md)."""
    inv_freq = theta ** (-torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim)  # [R/2]
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]  # [T, R/2]
    return torch.cos(angles).to(torch.float32), torch.sin(angles).to(torch.float32)


def mla_weights(cfg: ModelConfig, gen: torch.Generator, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The attention weights one layer's `mla_prolog` and `indexer_prolog` read, keyed by op argument name."""
    heads, nope, rope = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    return {
        "w_dq": linear_weight(cfg.q_lora_rank, cfg.hidden_size, gen, dtype),
        "gamma_cq": norm_gain(cfg.q_lora_rank, gen, dtype),
        "w_uq_qr": linear_weight(heads * (nope + rope), cfg.q_lora_rank, gen, dtype),
        "w_uk": randn((heads, nope, cfg.kv_lora_rank), gen, std=nope**-0.5, dtype=dtype),
        "w_dkv_kr": linear_weight(cfg.kv_lora_rank + rope, cfg.hidden_size, gen, dtype),
        "gamma_ckv": norm_gain(cfg.kv_lora_rank, gen, dtype),
        "w_iq": linear_weight(cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank, gen, dtype),
        "w_ik": linear_weight(cfg.index_head_dim, cfg.hidden_size, gen, dtype),
        "k_norm_weight": norm_gain(cfg.index_head_dim, gen, dtype),
        "k_norm_bias": randn((cfg.index_head_dim,), gen, std=0.1, dtype=dtype),
        "w_iw": linear_weight(cfg.index_n_heads, cfg.hidden_size, gen, dtype),
    }


def random_topk_indices(batch: PagedBatch, topk: int, gen: torch.Generator, *, invalid_fraction: float = 0.0):
    """[T, topk] int32: per token, distinct visible key positions (fewer than topk -> -1 tail).

    invalid_fraction: share of each row's valid slots replaced by invalid entries (-1, or a position at or past
    seq_lens_k, which the contract also treats as invalid) at random places in the row.
    """
    rows = []
    for b in range(batch.block_table.shape[0]):
        start, end = int(batch.cu_seqlens_q[b]), int(batch.cu_seqlens_q[b + 1])
        k_len = int(batch.seq_lens_k[b])
        for t in range(start, end):
            visible = int(batch.positions[t]) + 1
            chosen = torch.randperm(visible, generator=gen)[:topk].to(torch.int32)
            row = torch.full((topk,), -1, dtype=torch.int32)
            row[: chosen.numel()] = chosen
            if invalid_fraction > 0 and chosen.numel():
                n_bad = max(1, int(invalid_fraction * chosen.numel()))
                bad = torch.randperm(chosen.numel(), generator=gen)[:n_bad]
                past_end = torch.randint(k_len, k_len + 64, (n_bad,), generator=gen, dtype=torch.int32)
                row[bad] = torch.where(torch.rand(n_bad, generator=gen) < 0.5, -1, past_end)
            rows.append(row)
    return torch.stack(rows) if rows else torch.zeros(0, topk, dtype=torch.int32)


# Memory layouts a tensor argument may come in (validation accepts any strides): the same values, other strides.
#   contiguous    as built
#   strided       every other element of a buffer along the last dim (the gaps hold poison)
#   padded        the leading block of a buffer one larger in every dim, at an offset (row / block padding, e.g.
#                 a cache whose blocks have spare slots, a weight sliced out of a wider one)
#   column_major  the last two dims swapped in memory (a transposed view); 1-D tensors get `strided`
LAYOUTS = ("contiguous", "strided", "padded", "column_major")


def poison_value(dtype: torch.dtype) -> float | int:
    """What fills the gaps of a non-contiguous buffer: NaN for floats (any read of a gap shows in the result),
    0 for integers (a valid index or code, so a kernel that ignores strides computes a wrong answer rather than
    reading outside its buffers)."""
    return float("nan") if dtype.is_floating_point else 0


def with_layout(t: torch.Tensor, layout: str) -> torch.Tensor:
    """`t`'s values in `layout` (see LAYOUTS): a view into a fresh buffer whose other elements are poison."""
    if layout == "contiguous" or t.dim() == 0:
        return t.clone()
    if layout == "column_major" and t.dim() >= 2:
        return t.mT.contiguous().mT
    if layout in ("strided", "column_major"):
        buffer = torch.full((*t.shape[:-1], 2 * t.shape[-1]), poison_value(t.dtype), dtype=t.dtype, device=t.device)
        view = buffer[..., ::2]
    elif layout == "padded":
        buffer = torch.full(tuple(n + 2 for n in t.shape), poison_value(t.dtype), dtype=t.dtype, device=t.device)
        view = buffer[tuple(slice(1, n + 1) for n in t.shape)]
    else:
        raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
    view.copy_(t)
    return view
