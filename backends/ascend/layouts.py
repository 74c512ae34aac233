"""Layout conversions between the glm5-hal contract (docs/ops.md) and torch_npu's fused operators.

Pure functions of tensors: no torch_npu call, no host sync unless stated. Each is tested directly against
ops_reference in parity_tests/test_ascend_adapters.py.

    glm5-hal                                        torch_npu
    cu_seqlens_q [B+1] = (0, ..., T)            ->  actual_seq_lengths_query [B]: TND prefix sums, no leading 0
    cos, sin [T, R/2] fp32                      ->  [T, R] in the activation dtype, halves repeated (the
                                                    InterleaveRope kernels) or pairs repeated (npu_rotary_mul)
    RoPE output, pairs interleaved (x0, x1)     <-  InterleaveRope output [a_0..a_{R/2-1}, b_0..b_{R/2-1}]
    indices [T, topk], invalid anywhere         ->  valid-first rows, -1 tail (npu_sparse_flash_attention)
    request-local key position + block_table    ->  flat cache slot
    expert_offsets [E+1]                       <->  group_list [E]: cumulative counts, or counts
    src_index (row r came from assignment a)   <->  sorted_indices (assignment a sits in row r): the inverse
    softmax_max, softmax_sum [N2, T, H/N2]      ->  natural-log lse [T, H], -inf for a row with no valid key
    w_packed uint8 [N, K/2] (even k low nibble) ->  int4 values as int32 [N, K] (npu_convert_weight_to_int4pack)
    dynamic-quant scale 0 (all-zero row)        ->  glm5_hal.vendor_conventions.contract_quant_scale
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

from glm5_hal.paged import key_slots as shared_key_slots
from glm5_hal.paged import slot_rows
from glm5_hal.vendor_conventions import (  # noqa: F401 (the adapters' names for them)
    invert_permutation,
    lse_from_max_and_sum,
    valid_first,
)


# ------------------------------------------------------------------------------------------------ ragged batches
def tnd_prefix_sums(cu_seqlens_q: Tensor) -> Tensor:
    """[B+1] int32 cumulative token counts (0, ..., T) -> [B] int32, what TND layouts call actual_seq_lengths."""
    return cu_seqlens_q[1:].to(torch.int32).contiguous()


def uniform_prefix_sums(batches: int, length: int, device: torch.device) -> Tensor:
    """[batches] int32 prefix sums of `batches` sequences of `length` tokens each: length, 2*length, ..."""
    return torch.arange(1, batches + 1, dtype=torch.int32, device=device) * length


def key_slots(
    block_table: Tensor, seqs: Tensor, positions: Tensor, valid: Tensor, block_size: int, num_blocks: int
) -> Tensor:
    """Flat cache slots of request-local key positions [N, S] (glm5_hal.paged.key_slots), -1 where `valid` is False
    or the block table does not address the key (the layout the NPU kernels take for "no key")."""
    slots, addressable = shared_key_slots(block_table, seqs, positions, block_size, num_blocks)
    return torch.where(valid & addressable, slots, -1)


def blocks_outside_the_cache(block_table: Tensor, seq_lens_k: Tensor, block_size: int, num_blocks: int) -> Tensor:
    """[B] bool: whether a block sequence b uses (its first ceil(seq_lens_k[b] / block_size) table entries) is not a
    block of the cache. Validation refuses such a table where value checks run; with them off, the keys of such a
    block are not keys (docs/ops.md "Paged caches"), which a kernel that reads the table itself cannot know."""
    columns = torch.arange(block_table.shape[1], device=block_table.device)
    used = columns[None, :] * block_size < seq_lens_k.to(torch.int64)[:, None]  # [B, max_blocks]
    outside = (block_table < 0) | (block_table >= num_blocks)
    return (used & outside).any(dim=1)


# --------------------------------------------------------------------------------------------------------- RoPE
def rope_table_halves(table: Tensor, dtype: torch.dtype) -> Tensor:
    """[T, R/2] -> [T, R] = [t_0 .. t_{R/2-1}, t_0 .. t_{R/2-1}] in `dtype`.

    The cos/sin layout of torch_npu's InterleaveRope-style kernels (npu_interleave_rope, npu_kv_rmsnorm_rope_cache,
    npu_mla_prolog_v3) and of npu_rotary_mul's "half" mode.
    """
    return torch.cat([table, table], dim=-1).to(dtype)


def rope_table_pairs(table: Tensor, dtype: torch.dtype) -> Tensor:
    """[T, R/2] -> [T, R] = [t_0, t_0, t_1, t_1, ...] in `dtype`: npu_rotary_mul's "interleave" mode."""
    return torch.repeat_interleave(table, 2, dim=-1).to(dtype)


def interleave_rope_pairs(x: Tensor) -> Tensor:
    """[..., R] pairs stored as halves [a_0 .. a_{R/2-1}, b_0 .. b_{R/2-1}] -> interleaved [a_0, b_0, a_1, b_1, ...].

    InterleaveRope kernels read pairs (x[2i], x[2i+1]) but write the rotated pair i to positions i and i + R/2
    (DeepSeek's reference code does the same); the contract keeps the interleaved layout.
    """
    return x.unflatten(-1, (2, x.shape[-1] // 2)).transpose(-1, -2).flatten(-2)


def halve_rope_pairs(x: Tensor) -> Tensor:
    """Inverse of `interleave_rope_pairs`: [a_0, b_0, a_1, b_1, ...] -> [a_0 .. a_{R/2-1}, b_0 .. b_{R/2-1}]."""
    return x.unflatten(-1, (x.shape[-1] // 2, 2)).transpose(-1, -2).flatten(-2)


# ------------------------------------------------------------------------------------------------ sparse indices
def selected_positions(
    indices: Tensor, seq_lens_k: Tensor, seqs: Tensor, block_table: Tensor, block_size: int, num_blocks: int
) -> tuple[Tensor, Tensor, Tensor]:
    """The valid selections of sparse attention in the NPU kernels' order: (positions [T, k] int64, valid first,
    -1 after; their validity [T, k]; each valid entry's rank in its row [T, k] int32, -1 after), from indices
    [T, k] (invalid: -1, >= seq_lens_k [B] of the token's sequence seqs [T], or a key the block table does not
    address in a cache of num_blocks blocks)."""
    idx = indices.to(torch.int64)
    _, addressable = shared_key_slots(block_table, seqs, idx, block_size, num_blocks)
    valid = (idx >= 0) & (idx < seq_lens_k.to(torch.int64)[seqs, None]) & addressable
    idx = valid_first(idx, valid)
    ordered_valid = idx >= 0
    rank = torch.arange(indices.shape[1], device=indices.device)
    return idx, ordered_valid, torch.where(ordered_valid, rank, -1).to(torch.int32)


def gathered_rows(
    cache: Tensor, block_table: Tensor, seqs: Tensor, idx: Tensor, valid: Tensor, tile: int
) -> Iterator[tuple[slice, Tensor]]:
    """(tokens, their selected cache rows [t, k, row]) for tiles of `tile` tokens: cache [blocks, bs, row] read in
    place (glm5_hal.paged.slot_rows: a view with spare slots per block is not copied), idx / valid [T, k] from
    selected_positions. Rows of invalid entries are some valid row's (never referenced by the kernels, which take
    the validity separately). Tiles bound the rows held at once."""
    view = slot_rows(cache)
    steps = {"block_step": view.block_step, "row_step": view.row_step}
    for start in range(0, idx.shape[0], tile):
        part = slice(start, start + tile)
        slots, addressable = shared_key_slots(
            block_table, seqs[part], idx[part], cache.shape[1], cache.shape[0], **steps
        )
        yield part, view.rows[torch.where(valid[part] & addressable, slots, 0)]


def natural_lse(softmax_max: Tensor, softmax_sum: Tensor) -> Tensor:
    """[N2, T, G] row max and sum of exp(score - max) -> [T, N2 * G] fp32 natural-log logsumexp (the edge rules of
    glm5_hal.vendor_conventions.lse_from_max_and_sum: -inf for a row with no valid key)."""
    lse = lse_from_max_and_sum(softmax_max, softmax_sum)
    return lse.permute(1, 0, 2).reshape(lse.shape[1], -1)


# -------------------------------------------------------------------------------------------------------- MoE
def group_list(expert_offsets: Tensor, *, cumulative: bool) -> Tensor:
    """[E+1] int64 row offsets -> [E] int64: offsets[1:] (group_list_type 0) or per-expert counts (type 1)."""
    offsets = expert_offsets.to(torch.int64)
    return offsets[1:].contiguous() if cumulative else (offsets[1:] - offsets[:-1])


def offsets_from_counts(counts: Tensor) -> Tensor:
    """[E] per-expert row counts -> [E+1] int64 row offsets starting at 0."""
    counts = counts.to(torch.int64)
    return torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0)])


# ------------------------------------------------------------------------------------------------ quantization
def int4_values(w_packed: Tensor) -> Tensor:
    """[N, K/2] uint8, two's complement nibbles packed along K with even k in the low nibble -> [N, K] int32."""
    packed = w_packed.to(torch.int32)
    low, high = packed & 0xF, packed >> 4
    nibbles = torch.stack([low, high], dim=-1).flatten(-2)  # [N, K]: k = 2j (low), 2j + 1 (high)
    return torch.where(nibbles >= 8, nibbles - 16, nibbles)
