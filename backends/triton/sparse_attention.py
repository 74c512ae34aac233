"""Sparse flash attention of the Triton backend (DSA over the absorbed MLA latent cache).

One program per (query token, tile of BLOCK_H heads). The program walks the token's topk selected key positions
in tiles of BLOCK_N:
  1. block-table lookup of each key position -> its cache row (invalid keys: -1, >= seq_lens_k, past topk are
     masked, never read),
  2. one gather of the BLOCK_N rows of D = d_v + rope dims, shared by every head of the tile: that reuse is
     the point of the layout (H heads x one KV head, MQA mode),
  3. scores = q[BLOCK_H, D] . kv[D, BLOCK_N] as two dots, one over the V dims (512) and one over the rest (64),
     because D = 576 is not a power of two and Triton blocks must be,
  4. online softmax in fp32 with a running max / sum per head (base 2 inside, natural-log lse out),
  5. acc[BLOCK_H, d_v] += p . V with V = the first d_v dims of the same gathered rows.
A head with no valid key ends with out 0 and lse -inf, as the contract says; NaN in a read score propagates.

Split over keys (flash-decoding): a decode step has few tokens, so one program per token and head tile leaves most
of a GPU idle (64 tokens x 1-4 head tiles on an H200's 132 SMs; the one H200 run measured decode at 3.6% of HBM
bandwidth). With num_splits > 1 a third grid axis cuts each token's topk keys into that many ranges; each program
keeps the online softmax's state of its range (fp32 acc, running max and sum, the count of valid keys) in a
workspace, and a second kernel merges the ranges with the same rescaling the loop applies between key tiles, then
finishes as the unsplit kernel does (_finish): the same edge rules (no valid key: out 0, lse -inf; every score -inf:
out 0; NaN reaches out and lse), the sums in another order. `_default_splits` picks the count; it has not been
timed on a GPU yet (perf/triton_gpu.py times the decode target at 1, 2, 4 and 8 ranges and at its choice).
A quantized latent cache (fp8_ds_mla, int8_mla) is decoded in step 2 as the rows are loaded (code x its tile's
scale, the RoPE dims from bf16), into q's dtype; nothing else changes (backends/triton/quantized_cache.py).
The paged-batch helpers (token -> sequence, key position -> cache row) are jit functions shared with the indexer.
Reference: ops_reference/attention.py
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from backends.triton.quant import cast_for_store
from backends.triton.quantized_cache import aligned_cache, code_of, layout_of, load_cache_values
from backends.triton.runtime import DOT_UPCAST, interpreting, unit_stride_arguments
from glm5_hal.kv_formats import AUTO

_LOG2E = tl.constexpr(1.4426950408889634)
_LN2 = tl.constexpr(0.6931471805599453)


# ------------------------------------------------------------------------------------------ paged batch helpers
@triton.jit
def _sequence_ends(cu_seqlens_q_ptr, num_seqs, BLOCK_B: tl.constexpr):
    """cu_seqlens_q[1:] [BLOCK_B]: where each sequence's new tokens end; past B, ends no token reaches."""
    b = tl.arange(0, BLOCK_B)
    return tl.load(cu_seqlens_q_ptr + 1 + b, mask=b < num_seqs, other=2147483647)


@triton.jit
def token_sequence(cu_seqlens_q_ptr, num_seqs, token, BLOCK_B: tl.constexpr):
    """The sequence of query `token`: the number of sequences whose new tokens all come before it.

    cu_seqlens_q [B+1] int32 prefix sums; BLOCK_B >= B. Sequences with no new tokens are skipped, as they own
    no token.
    """
    return tl.sum((_sequence_ends(cu_seqlens_q_ptr, num_seqs, BLOCK_B) <= token).to(tl.int32), axis=0)


@triton.jit
def token_sequences(cu_seqlens_q_ptr, num_seqs, tokens, BLOCK_B: tl.constexpr):
    """token_sequence of each of `tokens` [N] -> [N] int32."""
    ends = _sequence_ends(cu_seqlens_q_ptr, num_seqs, BLOCK_B)
    return tl.sum((ends[None, :] <= tokens[:, None]).to(tl.int32), axis=1)


@triton.jit
def key_rows(
    block_table_ptr,
    stride_bt_b,
    seq,
    positions,
    max_blocks,
    num_blocks,
    stride_block,
    stride_slot,
    BLOCK_SIZE: tl.constexpr,
):
    """(Element offsets (int64) of the cache rows of request-local key `positions` of sequence `seq`, whether the
    table addresses each one). A row is block block_table[seq, p // BLOCK_SIZE] times the cache's block stride plus
    p % BLOCK_SIZE times its slot stride (so a cache whose blocks have spare slots, or any other strides, is read in
    place).

    A position is addressed when it lies in the table and its entry is a block of the cache (0 <= id < num_blocks);
    otherwise its offset is 0's and it is not a key (docs/ops.md "Paged caches": a bad id only gets here with value
    checks off). The block id of an entry a sequence does not use may be anything (padding), so the caller must
    also mask every invalid key's load (masked lanes are never read).
    """
    in_table = (positions >= 0) & (positions < max_blocks * BLOCK_SIZE)
    pos = tl.where(in_table, positions, 0)
    block = tl.load(block_table_ptr + seq.to(tl.int64) * stride_bt_b + pos // BLOCK_SIZE, mask=in_table, other=-1)
    addressed = in_table & (block >= 0) & (block < num_blocks)
    block = tl.where(addressed, block, 0)
    return block.to(tl.int64) * stride_block + (pos % BLOCK_SIZE).to(tl.int64) * stride_slot, addressed


# ------------------------------------------------------------------------------------------------------ kernel
@triton.jit
def _finish(acc, running_max, running_sum, num_valid):
    """(out [BLOCK_H, BLOCK_DV] fp32, lse [BLOCK_H] natural log) from the online softmax's state: acc = sum of
    2^(s - running_max) v over the keys, running_sum = sum of 2^(s - running_max), num_valid = keys seen."""
    # Decided by the count, not by running_sum > 0: a NaN score makes the sum NaN, and NaN must reach out and lse.
    has_keys = num_valid > 0
    # A sum of 0 (no key, or every score -inf: an empty softmax, docs/ops.md "Edge rules") gives out 0, whatever V
    # holds (acc may hold 0 * inf there); a NaN sum is not 0 and reaches out.
    empty = running_sum == 0.0
    out = tl.where(empty[:, None], 0.0, acc / tl.where(empty, 1.0, running_sum)[:, None])
    lse = tl.where(has_keys, (running_max + tl.math.log2(tl.where(has_keys, running_sum, 1.0))) * _LN2, float("-inf"))
    return out, lse


@triton.jit
def _sparse_attention_kernel(
    # Pointers
    q_ptr,  # [T, H, D]
    kv_ptr,  # [num_blocks, BLOCK_SIZE, D] (or a format's uint8 rows [.., .., row_bytes]), any block / slot strides
    indices_ptr,  # [T, topk] int32 request-local key positions
    block_table_ptr,  # [B, max_blocks] int32
    seq_lens_k_ptr,  # [B] int32
    cu_seqlens_q_ptr,  # [B+1] int32
    out_ptr,  # [T, H, d_v] q's dtype, written (unsplit)
    lse_ptr,  # [T, H] fp32, written (unsplit)
    part_acc_ptr,  # [T, S, H, BLOCK_DV] fp32, written (split): each key range's acc
    part_state_ptr,  # [T, S, H, 3] fp32, written (split): its running max (base 2), running sum, valid keys
    # Sizes and scalars
    num_heads,
    topk,
    num_splits,  # S: key ranges per token (grid axis 2)
    keys_per_split,  # keys of a range: a multiple of every BLOCK_N
    num_seqs,
    max_blocks,
    num_blocks,
    d_v,
    d_rest,  # D - d_v
    qk_scale,  # sm_scale * log2(e): the softmax runs in base 2
    # Strides (elements)
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kv_block,
    stride_kv_slot,
    stride_kv_d,
    stride_it,
    stride_ik,
    stride_bt_b,
    stride_ot,
    stride_oh,
    stride_od,
    stride_lt,
    stride_lh,
    # Meta-parameters
    BLOCK_SIZE: tl.constexpr,  # cache block size (keys per block)
    BLOCK_B: tl.constexpr,  # >= B
    BLOCK_H: tl.constexpr,  # heads per program (>= 16: tl.dot's minimum)
    BLOCK_N: tl.constexpr,  # keys per step
    BLOCK_DV: tl.constexpr,  # >= d_v, power of two
    BLOCK_DR: tl.constexpr,  # >= D - d_v, power of two
    DOT_UPCAST: tl.constexpr,  # the interpreter's bf16 dot is wrong: widen operands to fp32 there
    KV_CODE: tl.constexpr,  # CODE_FLOAT, or the code kind of a quantized cache (backends/triton/quantized_cache.py)
    QUANT_DIMS: tl.constexpr,  # a quantized row's layout: coded dims, byte offsets of its scales and RoPE values
    SCALES_OFFSET: tl.constexpr,
    ROPE_OFFSET: tl.constexpr,
    SPLIT: tl.constexpr,  # write the range's state for _merge_splits_kernel instead of out and lse
):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    k_begin = split * keys_per_split
    k_end = tl.minimum(topk, k_begin + keys_per_split)
    head_ok = heads < num_heads
    dv = tl.arange(0, BLOCK_DV)
    dr = tl.arange(0, BLOCK_DR)
    dv_ok = dv < d_v
    dr_ok = dr < d_rest

    seq = token_sequence(cu_seqlens_q_ptr, num_seqs, token, BLOCK_B)
    key_limit = tl.load(seq_lens_k_ptr + seq)

    q_rows = q_ptr + token * stride_qt + heads[:, None] * stride_qh
    q_v = tl.load(q_rows + dv[None, :] * stride_qd, mask=head_ok[:, None] & dv_ok[None, :], other=0.0)
    q_r = tl.load(q_rows + (d_v + dr[None, :]) * stride_qd, mask=head_ok[:, None] & dr_ok[None, :], other=0.0)
    if DOT_UPCAST:
        q_v = q_v.to(tl.float32)
        q_r = q_r.to(tl.float32)

    running_max = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    running_sum = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_DV), tl.float32)
    num_valid = tl.zeros((BLOCK_H,), tl.int32)  # valid keys seen (the same for every head)
    for k0 in range(k_begin, k_end, BLOCK_N):
        ks = k0 + tl.arange(0, BLOCK_N)
        pos = tl.load(indices_ptr + token * stride_it + ks * stride_ik, mask=ks < k_end, other=-1)
        rows, addressed = key_rows(
            block_table_ptr, stride_bt_b, seq, pos, max_blocks, num_blocks, stride_kv_block, stride_kv_slot, BLOCK_SIZE
        )
        key_ok = (pos >= 0) & (pos < key_limit) & addressed
        num_valid += tl.sum(key_ok.to(tl.int32), axis=0)
        kv_rows = kv_ptr + rows[:, None]
        # The layout arguments are spelled out: Triton's compiler cannot build a tuple holding a dtype ("'dtype'
        # object has no attribute 'type'": 3.6 on an H200, 3.9 in compile_check); the interpreter never noticed.
        kv_v = load_cache_values(
            kv_rows, dv[None, :], key_ok[:, None] & dv_ok[None, :], stride_kv_d,
            q_ptr.dtype.element_ty, KV_CODE, QUANT_DIMS, SCALES_OFFSET, ROPE_OFFSET,
        )  # fmt: skip
        kv_r = load_cache_values(
            kv_rows, d_v + dr[None, :], key_ok[:, None] & dr_ok[None, :], stride_kv_d,
            q_ptr.dtype.element_ty, KV_CODE, QUANT_DIMS, SCALES_OFFSET, ROPE_OFFSET,
        )  # fmt: skip
        if DOT_UPCAST:
            kv_v = kv_v.to(tl.float32)
            kv_r = kv_r.to(tl.float32)
        # "ieee": fp32 operands must not be rounded to tf32 (fp32 parity is 1e-5); bf16/fp16 dots are unaffected.
        scores = tl.dot(q_v, tl.trans(kv_v), input_precision="ieee")
        scores = tl.dot(q_r, tl.trans(kv_r), scores, input_precision="ieee")
        scores = tl.where(key_ok[None, :], scores * qk_scale, float("-inf"))  # [BLOCK_H, BLOCK_N], base-2 units

        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        # While a head has seen no valid key its max is -inf; shifting by 0 then keeps exp2 at exactly 0 (no nan).
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        p = tl.math.exp2(scores - shift[:, None])
        rescale = tl.math.exp2(running_max - shift)
        running_sum = running_sum * rescale + tl.sum(p, axis=1)
        # p goes into the tensor-core dot in V's dtype, as flash attention kernels do (fp32 when upcasting).
        acc = tl.dot(p.to(kv_v.dtype), kv_v, acc * rescale[:, None], input_precision="ieee")
        running_max = new_max

    if SPLIT:
        part = (token * num_splits + split) * num_heads + heads  # [BLOCK_H] rows of the workspace
        tl.store(part_acc_ptr + part[:, None] * BLOCK_DV + dv[None, :], acc, mask=head_ok[:, None])
        tl.store(part_state_ptr + part * 3, running_max, mask=head_ok)
        tl.store(part_state_ptr + part * 3 + 1, running_sum, mask=head_ok)
        tl.store(part_state_ptr + part * 3 + 2, num_valid.to(tl.float32), mask=head_ok)
    else:
        out, lse = _finish(acc, running_max, running_sum, num_valid)
        tl.store(
            out_ptr + token * stride_ot + heads[:, None] * stride_oh + dv[None, :] * stride_od,
            cast_for_store(out, out_ptr.dtype.element_ty),
            mask=head_ok[:, None] & dv_ok[None, :],
        )
        tl.store(lse_ptr + token * stride_lt + heads * stride_lh, lse, mask=head_ok)


@triton.jit
def _merge_splits_kernel(
    part_acc_ptr,  # [T, S, H, BLOCK_DV] fp32
    part_state_ptr,  # [T, S, H, 3] fp32: running max (base 2), running sum, valid keys
    out_ptr,  # [T, H, d_v] written
    lse_ptr,  # [T, H] fp32, written
    num_heads,
    num_splits,
    d_v,
    stride_ot,
    stride_oh,
    stride_od,
    stride_lt,
    stride_lh,
    BLOCK_H: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """One program per (token, tile of BLOCK_H heads): the key ranges' states merged as the attention loop merges
    key tiles (each range rescaled by 2^(its max - the overall max)), then finished as the unsplit kernel finishes.
    A range with no valid key has max -inf and sum 0, and weighs 0; its acc (0, or NaN from 0 x inf) still reaches
    acc, as in the unsplit loop."""
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < num_heads
    dv = tl.arange(0, BLOCK_DV)
    first = token * num_splits * num_heads + heads  # [BLOCK_H] rows of range 0
    overall_max = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    for split in range(num_splits):
        row_max = tl.load(part_state_ptr + (first + split * num_heads) * 3, mask=head_ok, other=float("-inf"))
        overall_max = tl.maximum(overall_max, row_max)
    shift = tl.where(overall_max == float("-inf"), 0.0, overall_max)
    running_sum = tl.zeros((BLOCK_H,), tl.float32)
    num_valid = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_DV), tl.float32)
    for split in range(num_splits):
        row = first + split * num_heads
        row_max = tl.load(part_state_ptr + row * 3, mask=head_ok, other=float("-inf"))
        weight = tl.math.exp2(row_max - shift)
        running_sum += tl.load(part_state_ptr + row * 3 + 1, mask=head_ok, other=0.0) * weight
        num_valid += tl.load(part_state_ptr + row * 3 + 2, mask=head_ok, other=0.0)
        acc += (
            tl.load(part_acc_ptr + row[:, None] * BLOCK_DV + dv[None, :], mask=head_ok[:, None], other=0.0)
            * (weight[:, None])
        )
    out, lse = _finish(acc, overall_max, running_sum, num_valid)
    tl.store(
        out_ptr + token * stride_ot + heads[:, None] * stride_oh + dv[None, :] * stride_od,
        cast_for_store(out, out_ptr.dtype.element_ty),
        mask=head_ok[:, None] & (dv < d_v)[None, :],
    )
    tl.store(lse_ptr + token * stride_lt + heads * stride_lh, lse, mask=head_ok)


def _launch_config(num_heads: int, dtype: torch.dtype) -> dict[str, int] | None:
    """Fixed tile sizes for the interpreter (whose cost is per program and per step, so: large key tiles, few
    programs); None on a GPU, where `_tuned_kernel` picks them."""
    if not interpreting():
        return None
    return {"BLOCK_H": max(16, min(64, triton.next_power_of_2(num_heads))), "BLOCK_N": 64, "num_warps": 4}


@functools.cache
def _tuned_kernel():
    """The kernel autotuned over head tiles (all 64 GLM-5 heads sharing a gathered tile, or 32 / 16 with more
    programs), key tiles and pipelining, per (heads, widths, dtype, topk). Configurations that exceed the
    device's shared memory or registers (the fp32 ones at 64 heads) fail to compile and are skipped by the
    autotuner, so every dtype has a working one. Not tuned on hardware yet: the one H200 run (docs/backends.md)
    timed these as they are."""
    configs = [
        triton.Config({"BLOCK_H": h, "BLOCK_N": n}, num_warps=w, num_stages=s)
        for h, n, w, s in [
            (64, 32, 8, 2),
            (64, 32, 8, 1),
            (64, 16, 8, 1),
            (32, 32, 8, 2),
            (32, 32, 4, 1),
            (16, 32, 4, 2),
            (16, 16, 4, 1),
        ]
    ]
    return triton.autotune(configs, key=["num_heads", "d_v", "d_rest", "topk", "num_splits"])(_sparse_attention_kernel)


# A key range of a split is a multiple of this many keys (of every BLOCK_N the kernel may run with), and at least
# MIN_SPLIT_KEYS long: shorter ranges would spend more on the workspace (d_v fp32 per head and range, written and
# read again) than they save.
SPLIT_KEYS_MULTIPLE = 64
MIN_SPLIT_KEYS = 256
MAX_SPLITS = 8


def key_ranges(topk: int, num_splits: int) -> tuple[int, int]:
    """(keys per range, ranges) for `num_splits` wanted over topk keys: ranges of a multiple of SPLIT_KEYS_MULTIPLE
    keys, as few as cover topk (so none is empty: fewer than asked where topk is short)."""
    keys_per_split = triton.cdiv(triton.cdiv(max(topk, 1), num_splits), SPLIT_KEYS_MULTIPLE) * SPLIT_KEYS_MULTIPLE
    return keys_per_split, triton.cdiv(max(topk, 1), keys_per_split)


@functools.cache
def _multiprocessors(device_index: int) -> int:
    """The SM count of a CUDA device (asked once: every decode step's call needs it)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _default_splits(num_tokens: int, num_heads: int, topk: int, device: torch.device) -> int:
    """Key ranges per token: 1 unless the unsplit grid (at the widest head tile, 64) has fewer programs than the
    GPU has SMs; then enough ranges to give every SM one (at most MAX_SPLITS, each at least MIN_SPLIT_KEYS keys).
    1 under the interpreter (its cost is per program). A first guess from the grid's shape, not yet timed on a GPU."""
    if interpreting() or device.type != "cuda":
        return 1
    programs = num_tokens * triton.cdiv(num_heads, 64)
    sms = _multiprocessors(device.index if device.index is not None else torch.cuda.current_device())
    if programs >= sms:
        return 1
    return max(1, min(triton.cdiv(sms, programs), MAX_SPLITS, topk // MIN_SPLIT_KEYS))


@unit_stride_arguments()
def sparse_flash_attention(
    q: Tensor,
    kv_cache: Tensor,
    indices: Tensor,
    block_table: Tensor,
    seq_lens_k: Tensor,
    cu_seqlens_q: Tensor,
    sm_scale: float,
    d_v: int = 512,
    kv_cache_dtype: str = AUTO,
    *,
    num_splits: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Attention of each token over its selected keys (validated by glm5_hal.sparse_flash_attention).

    q: [T, H, D] bf16/fp16/fp32. kv_cache: [num_blocks, block_size, D], q's dtype, or the uint8 rows of a
    quantized kv_cache_dtype (decoded as they are loaded); K = the whole row, V = its first d_v dims.
    indices: [T, topk] int32 request-local key positions (-1, >= seq_lens_k[b] and keys the table does not address
    ignored).
    block_table: [B, max_blocks] int32; seq_lens_k: [B] int32; cu_seqlens_q: [B+1] int32.

    Returns (out [T, H, d_v] q's dtype, lse [T, H] fp32 natural log); a token with no valid key gives out 0 and
    lse -inf.

    num_splits: key ranges per token wanted (the module docstring; None: _default_splits); key_ranges says how
    many run.
    """
    num_tokens, num_heads, width = q.shape
    topk = indices.shape[1]
    out = torch.empty((num_tokens, num_heads, d_v), dtype=q.dtype, device=q.device)
    lse = torch.empty((num_tokens, num_heads), dtype=torch.float32, device=q.device)
    if num_tokens == 0 or num_heads == 0:
        return out, lse
    if num_splits is None:
        num_splits = _default_splits(num_tokens, num_heads, topk, q.device)
    if num_splits < 1:
        raise ValueError(f"num_splits: expected >= 1, got {num_splits}")
    keys_per_split, num_splits = key_ranges(topk, num_splits)
    block_dv = triton.next_power_of_2(max(d_v, 16))
    split = num_splits > 1
    # The ranges' states (module docstring); unsplit, the kernel never touches them (lse stands in for both).
    part_acc = part_state = lse
    if split:
        part_acc = torch.empty((num_tokens, num_splits, num_heads, block_dv), dtype=torch.float32, device=q.device)
        part_state = torch.empty((num_tokens, num_splits, num_heads, 3), dtype=torch.float32, device=q.device)
    kv_cache = aligned_cache(kv_cache, kv_cache_dtype)  # a quantized row's scales / RoPE values need aligned addresses
    config = _launch_config(num_heads, q.dtype)
    kernel = _sparse_attention_kernel if config is not None else _tuned_kernel()
    config = config or {}

    def grid(meta: dict) -> tuple[int, int, int]:
        return (num_tokens, triton.cdiv(num_heads, meta["BLOCK_H"]), num_splits)

    kernel[grid](
        q,
        kv_cache,
        indices,
        block_table,
        seq_lens_k,
        cu_seqlens_q,
        out,
        lse,
        part_acc,
        part_state,
        num_heads=num_heads,
        topk=topk,
        num_splits=num_splits,
        keys_per_split=keys_per_split,
        num_seqs=seq_lens_k.shape[0],
        max_blocks=block_table.shape[1],
        num_blocks=kv_cache.shape[0],
        d_v=d_v,
        d_rest=width - d_v,
        qk_scale=float(sm_scale) * math.log2(math.e),
        stride_qt=q.stride(0),
        stride_qh=q.stride(1),
        stride_qd=q.stride(2),
        stride_kv_block=kv_cache.stride(0),
        stride_kv_slot=kv_cache.stride(1),
        stride_kv_d=kv_cache.stride(2),
        stride_it=indices.stride(0),
        stride_ik=indices.stride(1),
        stride_bt_b=block_table.stride(0),
        stride_ot=out.stride(0),
        stride_oh=out.stride(1),
        stride_od=out.stride(2),
        stride_lt=lse.stride(0),
        stride_lh=lse.stride(1),
        BLOCK_SIZE=kv_cache.shape[1],
        BLOCK_B=max(2, triton.next_power_of_2(seq_lens_k.shape[0])),
        BLOCK_DV=block_dv,
        BLOCK_DR=triton.next_power_of_2(max(width - d_v, 16)),
        DOT_UPCAST=DOT_UPCAST,
        KV_CODE=code_of(kv_cache_dtype),
        **layout_of(kv_cache_dtype),
        SPLIT=split,
        **config,
    )
    if split:
        merge_heads = min(16, triton.next_power_of_2(num_heads))
        _merge_splits_kernel[(num_tokens, triton.cdiv(num_heads, merge_heads))](
            part_acc,
            part_state,
            out,
            lse,
            num_heads,
            num_splits,
            d_v,
            out.stride(0),
            out.stride(1),
            out.stride(2),
            lse.stride(0),
            lse.stride(1),
            BLOCK_H=merge_heads,
            BLOCK_DV=block_dv,
        )
    return out, lse
