"""The quantized cache formats (glm5_hal.kv_formats) in the standard opset: decoding gathered rows, encoding
written ones.

ONNX (opset 18) has no bit-cast, so bytes become numbers by arithmetic that is exact at every step:

[decode]  codes       uint8 -> Gather from a 256-entry fp32 table of the format's values (e4m3 / int8)
          fp32 scale  4 bytes -> bits = b0 + 256 b1 + 2^16 b2 + 2^24 b3 (int64) -> sign, exponent, mantissa ->
                      (1 + m / 2^23) * 2^(e - 127) in float64 (2^(e - 127) from a 256-entry table) -> fp32
          bf16 RoPE   2 bytes -> bits16 * 2^16 = its fp32 bits -> the same
          values      code value * its tile's scale (one fp32 multiply, as every backend)
[encode]  scale       per tile of 128: max|x| / qmax (1 for an all-zero tile), fp32; a tile holding NaN / +-inf:
                      scale NaN / +inf and codes 0 (ops_reference.kv_cache "NaN and inf")
          int8        Round (half to even) of x / scale, clipped to +-127, as its two's-complement byte
          e4m3        e = max(floor(log2|r|), -6) counted against a table of binade edges, m = Round(|r| / 2^(e-3)),
                      code = 8 (e + 6) + m, at most 126 (448), + 128 if r < 0
          fp32 / bf16 the value's bits from its exponent (Log, corrected against the power-of-two table) and its
                      mantissa, split into little-endian bytes; bf16 after a Cast (round to nearest even)
Only the rows a graph reads (its gathered keys) or writes are decoded / encoded, never the whole cache.
A -0.0 is stored as +0.0 here (no sign bit of zero without a bit-cast); it decodes to the same value.
"""

from __future__ import annotations

import numpy as np

from glm5_hal.kv_formats import FORMATS, TILE, KVCacheFormat
from glm5_hal.onnx_export.blocks import cast, slice_last
from glm5_hal.onnx_export.graph import GraphBuilder
from ops_reference.kv_cache import decode_e4m3, decode_int8

F32, F64, I64 = "float32", "float64", "int64"
_POW2 = np.ldexp(1.0, np.arange(256) - 127)  # 2^(e - 127) for an fp32 exponent field e (0 and 255 unused)
_POW2[0] = 2.0**-126  # exponent field 0: subnormals, whose mantissa has no implicit 1
_E4M3_EDGES = np.ldexp(1.0, np.arange(-5, 9)).astype(np.float32)  # 2^-5 .. 2^8: where e4m3 binades begin
_NAN_BITS, _INF_BITS = 0x7FC00000, 0x7F800000  # fp32 bits of +NaN and +inf


def format_of(options) -> KVCacheFormat | None:
    """The quantized format an op's export options name (None for a float cache)."""
    name = options.get("kv_cache_dtype", "auto")
    return None if name == "auto" else FORMATS[str(name)]


def _code_table(fmt: KVCacheFormat) -> np.ndarray:
    codes = np.arange(256, dtype=np.uint8)
    values = decode_e4m3(codes) if fmt.code == "e4m3" else decode_int8(codes)
    return np.asarray(values, np.float32)


def _floats_from_bits(g: GraphBuilder, bits: str) -> str:
    """fp32 values of fp32 bit patterns held as int64 (0 .. 2^32 - 1); exact (computed in float64). Exponent field
    255 is inf (2^128 overflows the cast to fp32) or, with a mantissa, NaN."""
    exponent = g.op("Mod", g.op("Div", bits, g.const(2**23)), g.const(256))
    mantissa_bits = g.op("Mod", bits, g.const(2**23))
    fraction = g.op("Div", cast(g, mantissa_bits, F64), g.const(float(2**23), F64))
    normal = g.op("Greater", exponent, g.const(0))
    significand = g.op("Where", normal, g.op("Add", fraction, g.const(1.0, F64)), fraction)
    magnitude = g.op("Mul", significand, g.op("Gather", g.const(_POW2, F64), exponent))
    negative = g.op("GreaterOrEqual", bits, g.const(2**31))
    value = cast(g, g.op("Where", negative, g.op("Neg", magnitude), magnitude), F32)
    nan = g.op("And", g.op("Equal", exponent, g.const(255)), g.op("Greater", mantissa_bits, g.const(0)))
    return g.op("Where", nan, g.const(float("nan"), F32), value)


def _int_bytes(g: GraphBuilder, data: str, count: int) -> str:
    """[..., n * count] uint8 -> [..., n] int64: each group of `count` little-endian bytes as one integer."""
    groups = g.op("Reshape", cast(g, data, I64), g.const([0, 0, -1, count]))
    weights = g.const([256**i for i in range(count)])
    return g.op("ReduceSum", g.op("Mul", groups, weights), g.const([-1]), keepdims=0)


def decode_rows(g: GraphBuilder, rows: str, fmt: KVCacheFormat) -> str:
    """rows [R1, R2, row_bytes] uint8 -> their values [R1, R2, width] fp32 (code * scale, then bf16 RoPE)."""
    codes = cast(g, slice_last(g, rows, 0, fmt.scales_offset), I64)
    values = g.op("Gather", g.const(_code_table(fmt), F32), codes)  # [R1, R2, Q]
    scales = _floats_from_bits(g, _int_bytes(g, slice_last(g, rows, fmt.scales_offset, fmt.rope_offset), 4))
    tiles = g.op("Reshape", values, g.const([0, 0, fmt.num_scales, TILE]))
    scaled = g.op("Mul", tiles, g.op("Unsqueeze", scales, g.const([-1])))
    quantized = g.op("Reshape", scaled, g.const([0, 0, fmt.quantized_dims]))
    if not fmt.rope_dims:
        return quantized
    rope_bits = g.op("Mul", _int_bytes(g, slice_last(g, rows, fmt.rope_offset, fmt.row_bytes), 2), g.const(2**16))
    return g.op("Concat", quantized, _floats_from_bits(g, rope_bits), axis=-1)


def _bits(g: GraphBuilder, x: str) -> str:
    """int64 fp32 bit patterns of fp32 values x, NaN (as +NaN) and +-inf included."""
    nan, inf = g.op("IsNaN", x), g.op("IsInf", x)
    finite_bits = _float_bits(g, g.op("Where", g.op("Or", nan, inf), g.const(0.0, F32), x))
    sign = g.op("Mul", cast(g, g.op("Less", x, g.const(0.0, F32)), I64), g.const(2**31))
    return g.op(
        "Where", nan, g.const(_NAN_BITS), g.op("Where", inf, g.op("Add", sign, g.const(_INF_BITS)), finite_bits)
    )


def _float_bits(g: GraphBuilder, x: str) -> str:
    """int64 fp32 bit patterns of fp32 values x (finite; -0.0 gives +0.0's bits)."""
    magnitude = cast(g, g.op("Abs", x), F64)
    tiny = g.const(2.0**-126, F64)
    safe = g.op("Max", magnitude, tiny)
    # floor(log2) in float64, then corrected by one either way against exact powers of two.
    guess = g.op("Floor", g.op("Div", g.op("Log", safe), g.const(float(np.log(2.0)), F64)))
    field = g.op("Clip", g.op("Add", cast(g, guess, I64), g.const(127)), g.const(1), g.const(254))
    pow2 = g.const(_POW2, F64)
    field = g.op("Sub", field, cast(g, g.op("Greater", g.op("Gather", pow2, field), safe), I64))
    field = g.op(
        "Add", field, cast(g, g.op("LessOrEqual", g.op("Gather", pow2, g.op("Add", field, g.const(1))), safe), I64)
    )
    mantissa = g.op("Sub", g.op("Div", safe, g.op("Gather", pow2, field)), g.const(1.0, F64))  # [0, 1), exact
    normal_bits = g.op(
        "Add", g.op("Mul", field, g.const(2**23)), cast(g, g.op("Mul", mantissa, g.const(2.0**23, F64)), I64)
    )
    subnormal_bits = cast(g, g.op("Mul", magnitude, g.const(2.0**149, F64)), I64)  # exponent field 0
    bits = g.op("Where", g.op("Less", magnitude, tiny), subnormal_bits, normal_bits)
    negative = g.op("Less", x, g.const(0.0, F32))
    return g.op("Add", bits, g.op("Mul", cast(g, negative, I64), g.const(2**31)))


def _byte_split(g: GraphBuilder, values: str, count: int) -> str:
    """int64 [N, n] (each < 256^count) -> uint8 [N, n * count], little-endian."""
    powers = g.const([256**i for i in range(count)])
    digits = g.op("Mod", g.op("Div", g.op("Unsqueeze", values, g.const([-1])), powers), g.const(256))
    return cast(g, g.op("Reshape", digits, g.const([0, -1])), "uint8")


def _encode_e4m3(g: GraphBuilder, ratio: str) -> str:
    """int64 float8_e4m3fn codes of fp32 values (round to nearest even, saturating at +-448)."""
    magnitude = g.op("Abs", ratio)
    above = g.op("GreaterOrEqual", g.op("Unsqueeze", magnitude, g.const([-1])), g.const(_E4M3_EDGES, F32))
    binade = g.op("ReduceSum", cast(g, above, I64), g.const([-1]), keepdims=0)  # e + 6, 0 .. 14
    step = g.op("Gather", g.const(np.ldexp(1.0, np.arange(15) - 9).astype(np.float32), F32), binade)  # 2^(e - 3)
    m = cast(g, g.op("Round", g.op("Div", magnitude, step)), I64)  # exact division; Round ties to even
    code = g.op("Min", g.op("Add", g.op("Mul", binade, g.const(8)), m), g.const(126))
    return g.op("Add", code, g.op("Mul", cast(g, g.op("Less", ratio, g.const(0.0, F32)), I64), g.const(128)))


def encode_rows(g: GraphBuilder, rows: str, fmt: KVCacheFormat) -> str:
    """rows [N, width] fp32 -> their cache rows [N, row_bytes] uint8 (per tile: scale, codes; bf16 RoPE)."""
    tiles = g.op("Reshape", slice_last(g, rows, 0, fmt.quantized_dims), g.const([0, fmt.num_scales, TILE]))
    # A tile holding NaN gets scale NaN, one holding +-inf scale +inf, and either codes 0 (ops_reference.kv_cache);
    # found by IsNaN / IsInf, since how ReduceMax treats NaN is left to the runtime.
    has_nan = g.op("ReduceMax", cast(g, g.op("IsNaN", tiles), I64), g.const([-1]), keepdims=0)
    has_inf = g.op("ReduceMax", cast(g, g.op("IsInf", tiles), I64), g.const([-1]), keepdims=0)
    finite = g.op("Equal", g.op("Add", has_nan, has_inf), g.const(0))  # [N, tiles]
    magnitudes = g.op("Where", g.op("Unsqueeze", finite, g.const([-1])), g.op("Abs", tiles), g.const(0.0, F32))
    amax = g.op("ReduceMax", magnitudes, g.const([-1]), keepdims=0)  # [N, tiles]
    scale = g.op(
        "Where", g.op("Equal", amax, g.const(0.0, F32)), g.const(1.0, F32), g.op("Div", amax, g.const(fmt.qmax, F32))
    )
    ratio = g.op("Div", tiles, g.op("Unsqueeze", scale, g.const([-1])))  # [N, tiles, TILE]
    if fmt.code == "e4m3":
        codes = _encode_e4m3(g, ratio)
    else:
        codes = cast(g, g.op("Clip", g.op("Round", ratio), g.const(-127.0, F32), g.const(127.0, F32)), I64)
        codes = g.op("Mod", g.op("Add", codes, g.const(256)), g.const(256))  # two's complement byte
    codes = g.op("Where", g.op("Unsqueeze", finite, g.const([-1])), codes, g.const(0))
    special = g.op("Where", g.op("Greater", has_nan, g.const(0)), g.const(float("nan"), F32), g.const(np.inf, F32))
    scale = g.op("Where", finite, scale, special)
    parts = [
        cast(g, g.op("Reshape", codes, g.const([0, fmt.quantized_dims])), "uint8"),
        _byte_split(g, _bits(g, scale), 4),
    ]
    if fmt.rope_dims:
        rope = cast(g, cast(g, slice_last(g, rows, fmt.quantized_dims, fmt.width), "bfloat16"), F32)
        parts.append(_byte_split(g, g.op("Div", _bits(g, rope), g.const(2**16)), 2))
    return g.op("Concat", *parts, axis=-1)
