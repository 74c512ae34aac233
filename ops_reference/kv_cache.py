"""Quantized cache formats (OPS.md section 7): the byte layout of one cache row, and its encode / decode.

A quantized cache is a uint8 array [num_blocks, block_size, row_bytes]; each row stores one token's values:

    format        cache         row layout (bytes, little-endian)                                       row_bytes
    fp8_ds_mla    latent (576)  [0, 512) e4m3 codes | [512, 528) 4 fp32 scales | [528, 656) 64 bf16 RoPE    656
    int8_mla      latent (576)  [0, 512) int8 codes | [512, 528) 4 fp32 scales | [528, 656) 64 bf16 RoPE    656
    fp8_index     index (128)   [0, 128) e4m3 codes | [128, 132) 1 fp32 scale                                132
    int8_index    index (128)   [0, 128) int8 codes | [128, 132) 1 fp32 scale                                132

Each tile of TILE = 128 quantized values has scale = max|tile| / QMAX (448 for e4m3, 127 for int8; an all-zero
tile gets scale 1), stored as fp32; its codes are round_half_even(x / scale) in the format's number set (e4m3:
the nearest float8_e4m3fn value, saturating at +-448; int8: clamped to [-127, 127]). The value a reader sees is
code * scale (the fp32 scale). RoPE dims are stored as bf16 (round to nearest even) and read as they are.

NaN and inf (docs/ops.md "NaN"): a tile holding NaN gets scale NaN, one holding +-inf (and no NaN) scale +inf;
either stores codes 0, so every value of that tile reads NaN (0 * NaN, 0 * inf), as dynamic_quant's rows do.
A RoPE value keeps its bf16 rounding: NaN reads NaN, +-inf and values past bf16's range read +-inf. The bytes of
a NaN (scale or RoPE) are not fixed, only that it is a NaN.

Everything here is NumPy: the e4m3 and bf16 roundings are written out from their bit layouts, so the reference
does not depend on torch's casts (the tests check the two agree).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

TILE = 128  # quantized values per fp32 scale
E4M3_MAX = 448.0  # largest finite float8_e4m3fn: S.1111.110 = 1.75 * 2^8
INT8_MAX = 127.0
AUTO = "auto"  # kv_cache_dtype of a float cache: rows in the activations' dtype, as without quantization


@dataclass(frozen=True)
class KVCacheFormat:
    """One quantized cache format: which cache it is for and where each part of a row lives.

    name: the kv_cache_dtype string. cache: "latent" (the MLA KV cache, rows [c_kv | k_pe]) or "index" (the
    indexer key cache). code: "e4m3" or "int8", the 1-byte codes of the first `quantized_dims` values.
    rope_dims: trailing values stored as bf16 (the RoPE part of a latent row; 0 for index keys).
    """

    name: str
    cache: str
    code: str
    quantized_dims: int
    rope_dims: int

    @property
    def width(self) -> int:
        """Values per row (576 latent, 128 index)."""
        return self.quantized_dims + self.rope_dims

    @property
    def num_scales(self) -> int:
        return self.quantized_dims // TILE

    @property
    def qmax(self) -> float:
        return E4M3_MAX if self.code == "e4m3" else INT8_MAX

    @property
    def scales_offset(self) -> int:
        """Byte offset of the fp32 scales (right after the codes)."""
        return self.quantized_dims

    @property
    def rope_offset(self) -> int:
        """Byte offset of the bf16 RoPE values (right after the scales)."""
        return self.scales_offset + 4 * self.num_scales

    @property
    def row_bytes(self) -> int:
        return self.rope_offset + 2 * self.rope_dims


FORMATS: dict[str, KVCacheFormat] = {
    f.name: f
    for f in (
        KVCacheFormat("fp8_ds_mla", "latent", "e4m3", 512, 64),
        KVCacheFormat("int8_mla", "latent", "int8", 512, 64),
        KVCacheFormat("fp8_index", "index", "e4m3", 128, 0),
        KVCacheFormat("int8_index", "index", "int8", 128, 0),
    )
}


def cache_format(kv_cache_dtype: str) -> KVCacheFormat | None:
    """The format named `kv_cache_dtype`; None for "auto" (a float cache)."""
    if kv_cache_dtype == AUTO:
        return None
    if kv_cache_dtype not in FORMATS:
        raise ValueError(f"kv_cache_dtype: expected 'auto' or one of {sorted(FORMATS)}, got {kv_cache_dtype!r}")
    return FORMATS[kv_cache_dtype]


# ------------------------------------------------------------------------------------------------- number sets
def _round_to_float(x: np.ndarray, mantissa_bits: int, min_exponent: int, max_finite: float) -> np.ndarray:
    """x (float64) rounded to the nearest value of a binary float format with `mantissa_bits` stored mantissa
    bits and smallest normal exponent `min_exponent` (subnormals below it), ties to even; magnitudes beyond
    `max_finite` saturate to it. NaN stays NaN."""
    x = np.asarray(x, np.float64)
    magnitude = np.abs(x)
    _, exponent = np.frexp(magnitude)  # magnitude = m * 2^exponent with m in [0.5, 1): binade 2^(exponent - 1)
    binade = np.maximum(exponent - 1, min_exponent)  # subnormals share the smallest normal binade's step
    step = np.ldexp(1.0, binade - mantissa_bits)
    rounded = np.rint(magnitude / step) * step  # a division by a power of two is exact; rint ties to even
    return np.copysign(np.minimum(rounded, max_finite), x)


def round_e4m3(x: np.ndarray) -> np.ndarray:
    """The nearest float8_e4m3fn value (3 mantissa bits, normal exponents from -6, max 448), ties to even,
    saturating at +-448 (e4m3fn has no infinity)."""
    return _round_to_float(x, 3, -6, E4M3_MAX)


def encode_e4m3(x: np.ndarray) -> np.ndarray:
    """float8_e4m3fn codes (uint8: 1 sign, 4 exponent (bias 7), 3 mantissa bits) of round_e4m3(x); NaN -> 0x7F."""
    value = round_e4m3(x)
    bits = np.asarray(np.abs(value), np.float32).view(np.uint32).astype(np.int64)  # every e4m3 value is an fp32
    exponent = (bits >> 23) - 127
    normal = ((exponent + 7) << 3) | ((bits >> 20) & 0x7)  # 3 mantissa bits from the top of fp32's 23
    subnormal = np.rint(np.abs(value) * 2.0**9).astype(np.int64)  # m * 2^-9, m in 0..7
    code = np.where(exponent >= -6, normal, subnormal) | np.where(np.signbit(value), 0x80, 0)
    return np.where(np.isnan(value), 0x7F, code).astype(np.uint8)


def decode_e4m3(codes: np.ndarray) -> np.ndarray:
    """float32 values of float8_e4m3fn codes (uint8), from the bit layout: 1 sign, 4 exponent (bias 7), 3 mantissa
    bits; exponent 0 is subnormal (m / 8 * 2^-6); S.1111.111 is NaN."""
    bits = np.asarray(codes).astype(np.int64)
    sign = np.where(bits & 0x80, -1.0, 1.0)
    exponent = (bits >> 3) & 0xF
    mantissa = bits & 0x7
    normal = (1.0 + mantissa / 8.0) * np.exp2(exponent - 7.0)
    subnormal = (mantissa / 8.0) * 2.0**-6
    value = sign * np.where(exponent == 0, subnormal, normal)
    value = np.where((exponent == 0xF) & (mantissa == 0x7), np.nan, value)
    return value.astype(np.float32)  # every e4m3fn value is exact in float32


def encode_int8(x: np.ndarray) -> np.ndarray:
    """int8 codes clamp(round_half_even(x), -127, 127) as their two's-complement bytes (uint8); NaN -> 0."""
    codes = np.clip(np.rint(np.nan_to_num(np.asarray(x, np.float64), nan=0.0)), -INT8_MAX, INT8_MAX)
    return codes.astype(np.int8).view(np.uint8)


def decode_int8(codes: np.ndarray) -> np.ndarray:
    return np.asarray(codes, np.uint8).view(np.int8).astype(np.float64)


def encode_bf16(x: np.ndarray) -> np.ndarray:
    """bf16 bit patterns (uint16) of x rounded to nearest even (8 significant bits, fp32's exponent range); past
    the largest bf16 value it rounds to +-inf, as IEEE rounding (and torch's cast) does; NaN stays NaN."""
    value = _round_to_float(x, 7, -126, np.inf)
    with np.errstate(over="ignore"):  # 2^128 (rounded up from past bf16's range) becomes inf in fp32
        bits = np.asarray(value, np.float32).view(np.uint32)
    return (bits >> 16).astype(np.uint16)


def decode_bf16(bits: np.ndarray) -> np.ndarray:
    return (np.asarray(bits, np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)


# --------------------------------------------------------------------------------------------------------- rows
def encode_rows(rows: np.ndarray, fmt: KVCacheFormat) -> np.ndarray:
    """rows [N, width] (float) -> their quantized cache rows, uint8 [N, row_bytes]."""
    rows = np.asarray(rows, np.float64)
    n = rows.shape[0]
    tiles = rows[:, : fmt.quantized_dims].reshape(n, fmt.num_scales, TILE)  # [N, tiles, TILE]
    amax = np.abs(tiles).max(axis=-1, initial=0.0)  # [N, tiles]; NaN propagates, inf gives inf
    scale = np.where(amax == 0, 1.0, amax / fmt.qmax).astype(np.float32)  # the stored scale ...
    with np.errstate(invalid="ignore"):  # inf / inf in a non-finite tile, whose codes are 0 below anyway
        ratio = tiles / scale[..., None].astype(np.float64)  # ... is the one the codes are relative to
        codes = encode_e4m3(ratio) if fmt.code == "e4m3" else encode_int8(ratio)
    codes = np.where(np.isfinite(scale)[..., None], codes, 0).astype(np.uint8)  # a NaN / inf tile: codes 0
    out = np.empty((n, fmt.row_bytes), np.uint8)  # (every reshape below names its sizes: N may be 0)
    out[:, : fmt.scales_offset] = codes.reshape(n, fmt.quantized_dims)
    out[:, fmt.scales_offset : fmt.rope_offset] = scale.astype("<f4").view(np.uint8).reshape(n, 4 * fmt.num_scales)
    rope = encode_bf16(rows[:, fmt.quantized_dims :]).astype("<u2")
    out[:, fmt.rope_offset :] = rope.view(np.uint8).reshape(n, 2 * fmt.rope_dims)
    return out


def decode_rows(data: np.ndarray, fmt: KVCacheFormat) -> np.ndarray:
    """Quantized cache rows uint8 [..., row_bytes] -> their values, float64 [..., width]: code * scale for the
    quantized dims, the bf16 values for the RoPE dims."""
    data = np.ascontiguousarray(data, np.uint8)
    lead = data.shape[:-1]
    codes = data[..., : fmt.scales_offset]
    values = decode_e4m3(codes).astype(np.float64) if fmt.code == "e4m3" else decode_int8(codes)
    scales = np.ascontiguousarray(data[..., fmt.scales_offset : fmt.rope_offset]).view("<f4").astype(np.float64)
    with np.errstate(invalid="ignore"):  # code 0 x scale inf (a tile written with inf) reads NaN, by the rule
        tiles = values.reshape(*lead, fmt.num_scales, TILE) * scales[..., None]
    quantized = tiles.reshape(*lead, fmt.quantized_dims)
    rope = decode_bf16(np.ascontiguousarray(data[..., fmt.rope_offset :]).view("<u2"))
    return np.concatenate([quantized, rope], axis=-1)


def dequantize_cache(cache: np.ndarray, kv_cache_dtype: str = AUTO) -> np.ndarray:
    """The cache's values in float64 [num_blocks, block_size, width]: a float cache as it is, a quantized one
    decoded row by row. Readers apply the float op to this, so parity is judged on the stored bytes."""
    fmt = cache_format(kv_cache_dtype)
    return np.asarray(cache, np.float64) if fmt is None else decode_rows(cache, fmt)
