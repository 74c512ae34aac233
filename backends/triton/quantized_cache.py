"""Quantized caches in the Triton backend (glm5_hal.kv_formats): codes are decoded in registers as they are loaded,
never into a dequantized copy of the cache; rows are quantized in registers before they are stored.

[reading]  load_cache_values: cache elements -> values, from a float row or from a format's uint8 row:
               code byte -> e4m3 / int8 value (from its bits: no fp8 hardware needed) x its tile's fp32 scale;
               RoPE dims -> their bf16 value
           load_index_codes + index_key_scale: an index key's 128 codes (exact in bf16/fp16, so the indexer's dot
               stays a tensor-core dot) and the one scale its scores are multiplied by afterwards
[writing]  quantize_into_cache: fp32 rows [T, width] -> per tile of 128: max|x|, scale, codes -> the paged
               cache's uint8 rows at slot_mapping (-1 = skip); RoPE dims stored as bf16; a tile holding NaN
               or inf: scale NaN / inf and codes 0

Formats reach the kernels as constexpr (CODE_FLOAT / CODE_E4M3 / CODE_INT8 and byte offsets), so a float cache
compiles to exactly the kernels it had before. Reference: ops_reference/kv_cache.py
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from backends.triton.quant import cast_for_store, round_half_even
from backends.triton.runtime import interpreting
from glm5_hal.kv_formats import AUTO, FORMATS, TILE, KVCacheFormat

CODE_FLOAT = tl.constexpr(0)  # a float cache: elements are values
CODE_E4M3 = tl.constexpr(1)
CODE_INT8 = tl.constexpr(2)
_CODES = {"e4m3": 1, "int8": 2}
_SUBNORMAL_STEP = tl.constexpr(0.001953125)  # 2^-9: the e4m3 subnormal spacing
_E4M3_MAX_CODE = tl.constexpr(126)  # S.1111.110 = 448; 127 would be NaN


def code_of(kv_cache_dtype: str) -> int:
    """The constexpr code kind of a kv_cache_dtype (CODE_FLOAT for "auto")."""
    return 0 if kv_cache_dtype == AUTO else _CODES[FORMATS[kv_cache_dtype].code]


def layout_of(kv_cache_dtype: str) -> dict[str, int]:
    """The constexpr byte layout the reading kernels take (zeros for a float cache)."""
    if kv_cache_dtype == AUTO:
        return {"QUANT_DIMS": 0, "SCALES_OFFSET": 0, "ROPE_OFFSET": 0}
    fmt = FORMATS[kv_cache_dtype]
    return {"QUANT_DIMS": fmt.quantized_dims, "SCALES_OFFSET": fmt.scales_offset, "ROPE_OFFSET": fmt.rope_offset}


# --------------------------------------------------------------------------------------------------- decoding
@triton.jit
def decode_codes(codes, CODE: tl.constexpr):
    """uint8 codes -> fp32 values. e4m3 from its bit layout (sign, 4 exponent bits of bias 7, 3 mantissa bits;
    exponent 0 subnormal; S.1111.111 NaN), built as fp32 bits; int8 as the two's-complement byte."""
    if CODE == CODE_E4M3:
        c = codes.to(tl.int32)
        negative = (c & 0x80) != 0
        exponent = (c >> 3) & 0xF
        mantissa = c & 0x7
        normal = (((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)  # 2^(e-7) * 1.m
        magnitude = tl.where(exponent == 0, mantissa.to(tl.float32) * _SUBNORMAL_STEP, normal)
        value = tl.where(negative, -magnitude, magnitude)
        return tl.where((c & 0x7F) == 0x7F, float("nan"), value)
    else:
        return codes.to(tl.int8, bitcast=True).to(tl.float32)


@triton.jit
def load_cache_values(
    rows,  # [R, 1] pointers to the start of each cache row (element 0)
    elems,  # [1, E] or [R, E] element indices within the row (0 .. width-1)
    mask,  # [R, E]
    stride_elem,  # element stride of a float cache (bytes are contiguous in a quantized row)
    dtype: tl.constexpr,  # what a quantized row's values are converted to (the float path keeps the cache's)
    CODE: tl.constexpr,
    QUANT_DIMS: tl.constexpr,
    SCALES_OFFSET: tl.constexpr,
    ROPE_OFFSET: tl.constexpr,
):
    """Values of cache elements: a float row's as they are stored, or a quantized row's code * scale (elements
    < QUANT_DIMS) and bf16 RoPE values (the rest), as `dtype`. Masked elements are 0."""
    if CODE == CODE_FLOAT:
        return tl.load(rows + elems * stride_elem, mask=mask, other=0.0)
    else:
        quantized = elems < QUANT_DIMS
        code_at = tl.where(quantized, elems, 0)  # addresses stay inside the row for every lane
        rope_at = tl.where(quantized, 0, elems - QUANT_DIMS)
        codes = tl.load(rows + code_at, mask=mask & quantized, other=0)
        scale_ptrs = (rows + SCALES_OFFSET).to(tl.pointer_type(tl.float32)) + code_at // 128
        scales = tl.load(scale_ptrs, mask=mask & quantized, other=1.0)
        rope_ptrs = (rows + ROPE_OFFSET).to(tl.pointer_type(tl.bfloat16)) + rope_at
        rope = tl.load(rope_ptrs, mask=mask & ~quantized, other=0.0)
        values = tl.where(quantized, decode_codes(codes, CODE) * scales, rope.to(tl.float32))
        return tl.where(mask, values, 0.0).to(dtype)


@triton.jit
def load_index_codes(rows, dims, mask, stride_elem, dtype: tl.constexpr, CODE: tl.constexpr):
    """An index key's elements [R, D]: a float cache's values, or a quantized key's CODES as `dtype` (exact in
    bf16 / fp16 / fp32: e4m3 values and int8 need at most 8 significant bits); the scale comes separately."""
    if CODE == CODE_FLOAT:
        return tl.load(rows + dims * stride_elem, mask=mask, other=0.0)
    else:
        return decode_codes(tl.load(rows + dims, mask=mask, other=0), CODE).to(dtype)


@triton.jit
def index_key_scale(scores, row_ptrs, mask, CODE: tl.constexpr, SCALES_OFFSET: tl.constexpr):
    """scores [S] of keys whose codes were dotted, times each key's scale (a float cache: unchanged). The scale is
    positive, so sum_j w_j ReLU(q_j . s k) = s * sum_j w_j ReLU(q_j . k)."""
    if CODE == CODE_FLOAT:
        return scores
    else:
        return scores * tl.load((row_ptrs + SCALES_OFFSET).to(tl.pointer_type(tl.float32)), mask=mask, other=1.0)


# --------------------------------------------------------------------------------------------------- encoding
@triton.jit
def encode_e4m3(y):
    """fp32 -> float8_e4m3fn code (uint8), round to nearest even, saturating at +-448; NaN -> 0x7F.

    With e = max(floor(log2|y|), -6) and m = rne(|y| / 2^(e-3)) (an integer 0..16), the code's low 7 bits are
    8 * (e + 6) + m: that is (e + 7) << 3 | (m - 8) for a normal value, m itself for a subnormal one (e = -6,
    m < 8), and m = 16 or m = 8 from below carry into the next exponent by themselves."""
    bits = y.to(tl.int32, bitcast=True)
    magnitude = tl.abs(y)
    exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    step = ((exponent + 124) << 23).to(tl.float32, bitcast=True)  # 2^(exponent - 3)
    m = tl.minimum(round_half_even(magnitude / step), 16.0)  # exact division by a power of two; inf -> 16
    code = tl.minimum(8 * (exponent + 6) + m.to(tl.int32), _E4M3_MAX_CODE)
    code = tl.where(bits < 0, code | 0x80, code)
    return tl.where(y != y, 0x7F, code).to(tl.uint8)


@triton.jit
def _quantize_rows_kernel(
    # Pointers
    rows_ptr,  # [T, width] fp32 rows to store
    slot_ptr,  # [T] int64 flat cache slots, -1 = skip
    cache_ptr,  # [num_blocks, block_size, row_bytes] uint8, rows of contiguous bytes, any block / slot strides
    # Sizes
    num_rows,
    block_size,  # slots per cache block
    # Strides
    stride_row,  # elements
    stride_block,  # bytes
    stride_slot,  # bytes
    # Meta-parameters
    CODE: tl.constexpr,
    QMAX: tl.constexpr,  # 448.0 (e4m3) or 127.0 (int8)
    NUM_SCALES: tl.constexpr,
    SCALES_OFFSET: tl.constexpr,
    ROPE_DIMS: tl.constexpr,
    ROPE_OFFSET: tl.constexpr,
    TILE_SIZE: tl.constexpr,
    BLOCK_R: tl.constexpr,  # rows per program
    BLOCK_ROPE: tl.constexpr,  # >= ROPE_DIMS, power of two
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    slots = tl.load(slot_ptr + rows, mask=rows < num_rows, other=-1)
    ok = slots >= 0  # padding tokens (and rows past the end) store nothing
    src = rows_ptr + rows[:, None] * stride_row
    slots = tl.where(ok, slots, 0)
    row_dst = cache_ptr + (slots // block_size) * stride_block + (slots % block_size) * stride_slot  # [BLOCK_R]
    dst = row_dst[:, None]
    cols = tl.arange(0, TILE_SIZE)
    for t in tl.static_range(NUM_SCALES):
        x = tl.load(src + t * TILE_SIZE + cols[None, :], mask=ok[:, None], other=0.0)  # [BLOCK_R, TILE]
        amax = tl.max(tl.abs(x), axis=1)
        scale = tl.where(amax == 0.0, 1.0, amax / QMAX)
        # NaN found by x != x: a max reduction may drop it (fmax on GPUs). A NaN tile's scale is NaN, an inf
        # tile's +inf (from amax); either stores codes 0 (ops_reference.kv_cache).
        has_nan = tl.max((x != x).to(tl.int32), axis=1) > 0
        scale = tl.where(has_nan, float("nan"), scale)
        finite = (scale == scale) & (scale != float("inf"))
        ratio = x / scale[:, None]  # a true division, as the reference's x / scale
        if CODE == CODE_E4M3:
            codes = encode_e4m3(ratio)
        else:
            codes = tl.minimum(tl.maximum(round_half_even(ratio), -QMAX), QMAX).to(tl.int8)
            codes = codes.to(tl.uint8, bitcast=True)
        codes = tl.where(finite[:, None], codes, 0).to(tl.uint8)
        tl.store(dst + t * TILE_SIZE + cols[None, :], codes, mask=ok[:, None])
        tl.store((row_dst + SCALES_OFFSET).to(tl.pointer_type(tl.float32)) + t, scale, mask=ok)
    if ROPE_DIMS > 0:
        dims = tl.arange(0, BLOCK_ROPE)
        mask = ok[:, None] & (dims < ROPE_DIMS)[None, :]
        x = tl.load(src + NUM_SCALES * TILE_SIZE + dims[None, :], mask=mask, other=0.0)
        rope_ptrs = (dst + ROPE_OFFSET).to(tl.pointer_type(tl.bfloat16)) + dims[None, :]
        tl.store(rope_ptrs, cast_for_store(x, tl.bfloat16), mask=mask)


def quantize_into_cache(rows: Tensor, cache: Tensor, slot_mapping: Tensor, fmt: KVCacheFormat) -> None:
    """Store rows [T, width] fp32 as `fmt` rows of the uint8 cache [num_blocks, block_size, row_bytes] (any
    view: written in place, through an aligned copy only where `needs_copy`) at flat slots slot_mapping [T] int64
    (-1 = skip)."""
    num_rows = rows.shape[0]
    if num_rows == 0:
        return
    if needs_copy(cache, fmt.name):
        dense = aligned_cache(cache, fmt.name)
        quantize_into_cache(rows, dense, slot_mapping, fmt)
        cache.copy_(dense)
        return
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    block_r = 16 if interpreting() else 4  # interpreted programs cost Python time each: fewer, larger ones
    _quantize_rows_kernel[(triton.cdiv(num_rows, block_r),)](
        rows,
        slot_mapping.contiguous(),
        cache,
        num_rows=num_rows,
        block_size=cache.shape[1],
        stride_row=rows.stride(0),
        stride_block=cache.stride(0),
        stride_slot=cache.stride(1),
        CODE=_CODES[fmt.code],
        QMAX=fmt.qmax,
        NUM_SCALES=fmt.num_scales,
        SCALES_OFFSET=fmt.scales_offset,
        ROPE_DIMS=fmt.rope_dims,
        ROPE_OFFSET=fmt.rope_offset,
        TILE_SIZE=TILE,
        BLOCK_R=block_r,
        BLOCK_ROPE=max(1, triton.next_power_of_2(fmt.rope_dims)),
        num_warps=4,
    )


def scratch_rows(cache: Tensor, slot_mapping: Tensor, kv_cache_dtype: str, num_tokens: int, width: int, device):
    """Where a prolog writes its cache rows: (the cache itself, slot_mapping) for a float cache, or (an fp32
    scratch [T, width], None) that `finish_write` then quantizes into the cache."""
    if kv_cache_dtype == AUTO:
        return cache, slot_mapping
    return torch.empty((num_tokens, width), dtype=torch.float32, device=device), None


def finish_write(scratch: Tensor, cache: Tensor, slot_mapping: Tensor, kv_cache_dtype: str) -> None:
    """Quantize a prolog's scratch rows into a quantized cache (nothing for a float cache, written directly)."""
    if kv_cache_dtype != AUTO:
        quantize_into_cache(scratch, cache, slot_mapping, FORMATS[kv_cache_dtype])


def aligned_cache(cache: Tensor, kv_cache_dtype: str) -> Tensor:
    """`cache`, or a fresh copy with contiguous strides where `needs_copy` says its rows cannot be used in place. A
    clone, not .contiguous(): torch counts a view as contiguous whatever the strides of its size-1 dims, so a cache of
    one block of one slot with padded rows stayed misaligned through .contiguous() (which returns such a view
    itself), and the writer, copying until aligned, recursed without end (found by the long fuzz profile)."""
    return cache.clone(memory_format=torch.contiguous_format) if needs_copy(cache, kv_cache_dtype) else cache


def needs_copy(cache: Tensor, kv_cache_dtype: str) -> bool:
    """Whether a quantized cache's rows cannot be read or written in place: the kernels address rows by block and
    slot stride (so a cache whose blocks have spare slots is fine), but read a row's bytes contiguously and its
    fp32 scales / bf16 RoPE values through aligned pointers (a plain torch allocation always can be)."""
    if kv_cache_dtype == AUTO:
        return False
    strides_aligned = cache.stride(0) % 4 == 0 and cache.stride(1) % 4 == 0
    return cache.stride(2) != 1 or not strides_aligned or cache.data_ptr() % 4 != 0
