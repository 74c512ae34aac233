"""A small paged KV-cache manager: per-layer latent and index-key caches, block allocation, step metadata.

One forward call ("step") feeds T new tokens of B sequences, token-major (OPS.md "Conventions"). `plan_step`
allocates the blocks the new tokens need, advances each sequence's length and returns everything the ops take:
positions, slot_mapping, block_table, seq_lens_k and cu_seqlens_q. Prefill, chunked prefill and decode are all
the same call with different token counts.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from glm5_hal.config import ModelConfig
from glm5_hal.kv_formats import AUTO, CACHE_DTYPE, INDEX, LATENT, cache_format


def _row(fmt, width: int, dtype: torch.dtype) -> tuple[int, torch.dtype]:
    """(row length, element dtype) of a cache: `width` values of `dtype`, or a format's row_bytes of uint8."""
    return (width, dtype) if fmt is None else (fmt.row_bytes, CACHE_DTYPE)


@dataclass(frozen=True)
class StepMetadata:
    """What one forward call over T new tokens of B sequences needs to read and write the cache.

    positions: [T] int64. Position of each new token in its sequence.
    slot_mapping: [T] int64. Cache slot (block * block_size + offset) each new token's rows are written to.
    block_table: [B, max_blocks] int32. Cache blocks of each sequence in order; unused entries are 0.
    seq_lens_k: [B] int32. Keys of each sequence after this step (its new tokens included).
    cu_seqlens_q: [B + 1] int32. Prefix sum of the new-token counts.
    """

    positions: Tensor
    slot_mapping: Tensor
    block_table: Tensor
    seq_lens_k: Tensor
    cu_seqlens_q: Tensor

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]


class PagedKVCache:
    """Per layer: the MLA latent cache [num_blocks, block_size, kv_lora + rope] and the indexer key cache
    [num_blocks, block_size, index_head_dim], in the model's dtype; plus the block lists of live sequences.

    Blocks are handed out from a free list; `shuffle_seed` shuffles that list so block tables are not the
    identity (tests use it to prove nothing depends on contiguous blocks).

    kv_cache_dtype / index_cache_dtype: "auto" (the model's dtype), or a quantized format of glm5_hal.kv_formats
    ("fp8_ds_mla" / "int8_mla" for the latent cache, "fp8_index" / "int8_index" for the index keys): the cache is
    then uint8 [num_blocks, block_size, row_bytes] and every op that writes or reads it is told so.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        *,
        shuffle_seed: int | None = None,
        kv_cache_dtype: str = AUTO,
        index_cache_dtype: str = AUTO,
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks, block_size: expected positive ints, got {num_blocks}, {block_size}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.device = torch.device(device)
        self.kv_cache_dtype, self.index_cache_dtype = kv_cache_dtype, index_cache_dtype
        shape = (num_blocks, block_size)
        kv_row = _row(cache_format(kv_cache_dtype, LATENT), cfg.latent_dim, dtype)
        index_row = _row(cache_format(index_cache_dtype, INDEX), cfg.index_head_dim, dtype)
        self.kv = [torch.zeros(*shape, kv_row[0], dtype=kv_row[1], device=device) for _ in range(cfg.num_hidden_layers)]
        self.index_k = [
            torch.zeros(*shape, index_row[0], dtype=index_row[1], device=device) for _ in range(cfg.num_hidden_layers)
        ]
        order = list(range(num_blocks))
        if shuffle_seed is not None:
            perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(shuffle_seed))
            order = perm.tolist()
        self._free = order[::-1]  # pop() hands out order[0] first
        self._blocks: dict[Hashable, list[int]] = {}
        self._lengths: dict[Hashable, int] = {}

    def bytes_per_token(self) -> int:
        """Cache bytes one token takes over all layers (latent row + index-key row, per layer)."""
        per_layer = self.kv[0][0, 0].nbytes + self.index_k[0][0, 0].nbytes
        return per_layer * len(self.kv)

    def seq_len(self, seq_id: Hashable) -> int:
        """Tokens of `seq_id` in the cache (0 for an unknown sequence)."""
        return self._lengths.get(seq_id, 0)

    def free(self, seq_id: Hashable) -> None:
        """Return a finished sequence's blocks to the free list."""
        self._free.extend(reversed(self._blocks.pop(seq_id, [])))
        self._lengths.pop(seq_id, None)

    def plan_step(self, seq_ids: Sequence[Hashable], num_new_tokens: Sequence[int]) -> StepMetadata:
        """Append num_new_tokens[b] tokens to sequence seq_ids[b] (new ids start empty); allocate their blocks."""
        if len(seq_ids) != len(num_new_tokens) or len(set(seq_ids)) != len(seq_ids):
            raise ValueError(
                f"seq_ids, num_new_tokens: expected distinct ids and one count per id, got {list(seq_ids)} and "
                f"{list(num_new_tokens)}"
            )
        if any(n < 0 for n in num_new_tokens):
            raise ValueError(f"num_new_tokens: expected counts >= 0, got {list(num_new_tokens)}")
        needed = {
            seq_id: -(-(self.seq_len(seq_id) + count) // self.block_size) - len(self._blocks.get(seq_id, []))
            for seq_id, count in zip(seq_ids, num_new_tokens, strict=True)
        }
        if sum(needed.values()) > len(self._free):  # checked before allocating, so a refused step changes nothing
            raise RuntimeError(
                f"PagedKVCache: out of blocks ({sum(needed.values())} needed, {len(self._free)} free of "
                f"{self.num_blocks}); make the cache larger or free finished sequences"
            )
        positions, slots, lengths = [], [], []
        for seq_id, count in zip(seq_ids, num_new_tokens, strict=True):
            start = self.seq_len(seq_id)
            blocks = self._blocks.setdefault(seq_id, [])
            blocks.extend(self._free.pop() for _ in range(needed[seq_id]))
            for pos in range(start, start + count):
                positions.append(pos)
                slots.append(blocks[pos // self.block_size] * self.block_size + pos % self.block_size)
            self._lengths[seq_id] = start + count
            lengths.append(start + count)
        max_blocks = max(1, max(len(self._blocks[s]) for s in seq_ids))
        table = torch.zeros(len(seq_ids), max_blocks, dtype=torch.int32)
        for b, seq_id in enumerate(seq_ids):
            table[b, : len(self._blocks[seq_id])] = torch.tensor(self._blocks[seq_id], dtype=torch.int32)
        cu = torch.zeros(len(seq_ids) + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(torch.tensor(list(num_new_tokens), dtype=torch.int32), 0)
        dev = self.device
        return StepMetadata(
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_table=table.to(dev),
            seq_lens_k=torch.tensor(lengths, dtype=torch.int32, device=dev),
            cu_seqlens_q=cu.to(dev),
        )
