"""ONNX graphs of the quantization ops (OPS.md section 5), in the standard opset.

[x] -> ReduceMax|x| -> scale (1 for a zero row) -> Round (half to even) -> Clip -> Cast int8        dynamic_quant
[x_q, w_q] -> MatMulInteger (exact int32) -> Cast -> scale by x_scale, w_scale (+ bias)             quant_matmul
[w_packed] -> nibbles x 16 as int8 (BitShift / BitwiseAnd / Cast) -> per-group MatMulInteger -> scale  w4a8_matmul
[x] -> view [..., R, C] -> H_C on the right, H_R on the left (two small MatMuls)              hadamard_transform

MatMulInteger takes the weight as its first operand and the transposed activation as the second (y^T = w x^T),
so the transpose copies the activation (a few rows at decode), not the weight. The int4 weight is unpacked
inside the graph because the weight is a graph input here; in a deployed graph it is an initializer and a
runtime folds the unpacking away once.
"""

from __future__ import annotations

import math

from glm5_hal.onnx_export.blocks import cast, unsqueeze
from glm5_hal.onnx_export.graph import GraphBuilder, TensorSig
from glm5_hal.onnx_export.opgraph import LEADING, Dims, OpGraph, Options, require, sig
from glm5_hal.ops.quant import hadamard_base_size

F32, I8, U8 = "float32", "int8", "uint8"
INT8_MAX = 127.0


def _out_dtype_name(options: Options) -> str:
    return str(options["out_dtype"]).removeprefix("torch.")


def _to_out_dtype(g: GraphBuilder, y: str, options: Options) -> str:
    dtype = _out_dtype_name(options)
    return g.op("Identity", y, out="y") if dtype == F32 else cast(g, y, dtype, out="y")


# --------------------------------------------------------------------------------------------- dynamic_quant
def _build_dynamic_quant(g: GraphBuilder, v, d: Dims, o: Options) -> dict[str, str]:
    x = v["x"]
    amax = g.op("ReduceMax", g.op("Abs", x), g.const([-1]), keepdims=1)  # [..., 1]
    scale = g.op(
        "Where", g.op("Greater", amax, g.const(0.0, F32)), g.op("Div", amax, g.const(INT8_MAX, F32)), g.const(1.0, F32)
    )
    # ONNX Round rounds half to even, as the contract asks.
    codes = g.op("Clip", g.op("Round", g.op("Div", x, scale)), g.const(-INT8_MAX, F32), g.const(INT8_MAX, F32))
    return {"q": cast(g, codes, I8, out="q"), "scale": g.op("Squeeze", scale, g.const([-1]), out="scale")}


DYNAMIC_QUANT = OpGraph(
    name="dynamic_quant",
    inputs=(sig("x", F32, LEADING, "K"),),
    outputs=(sig("q", I8, LEADING, "K"), sig("scale", F32, LEADING)),
    options_from_config=lambda cfg: {},
    dims_from_config=lambda cfg: {"K": cfg.hidden_size},
    build=_build_dynamic_quant,
)


# ---------------------------------------------------------------------------------------------- quant_matmul
def _build_quant_matmul(g: GraphBuilder, v, d: Dims, o: Options) -> dict[str, str]:
    acc_t = g.op("MatMulInteger", v["w_q"], g.op("Transpose", v["x_q"], perm=[1, 0]))  # [N, M] int32, exact
    y_t = g.op("Mul", g.op("Mul", cast(g, acc_t, F32), unsqueeze(g, v["w_scale"], 1)), v["x_scale"])
    y = g.op("Transpose", y_t, perm=[1, 0])  # [M, N]
    if "bias" in v:
        y = g.op("Add", y, v["bias"])
    return {"y": _to_out_dtype(g, y, o)}


QUANT_MATMUL = OpGraph(
    name="quant_matmul",
    inputs=(
        sig("x_q", I8, "M", "K"),
        sig("x_scale", F32, "M"),
        sig("w_q", I8, "N", "K"),
        sig("w_scale", F32, "N"),
        sig("bias", F32, "N"),
    ),
    outputs=(sig("y", "out_dtype", "M", "N"),),
    # The preset's q_a_proj (x [M, hidden] -> [M, q_lora]); GLM-5's linears have no bias.
    options_from_config=lambda cfg: {"out_dtype": F32},
    dims_from_config=lambda cfg: {"N": cfg.q_lora_rank, "K": cfg.hidden_size},
    build=_build_quant_matmul,
    optional=("bias",),
    preset_absent=("bias",),
)


# ----------------------------------------------------------------------------------------------- w4a8_matmul
def unpack_int4_times16(g: GraphBuilder, w_packed: str, k: int) -> str:
    """int8 [N, K] holding 16 * w for the int4 w in [-8, 7] packed in uint8 [N, K/2] (even k in the low nibble).

    Each nibble is moved to the high half of a byte (low << 4, high & 0xF0) and the byte cast to int8: ONNX Cast
    keeps the low bits and reinterprets them as two's complement, so nibble 0xF becomes 0xF0 = -16 = 16 * -1.
    This stays in 8 bits (no int32 copy of the weight); the factor 16 is exact and divided out after the GEMM.
    """
    low = g.op("BitShift", w_packed, g.const(4, U8), direction="LEFT")  # uint8 keeps the low 8 bits
    high = g.op("BitwiseAnd", w_packed, g.const(0xF0, U8))
    bytes_ = g.op("Reshape", g.op("Concat", unsqueeze(g, low, 2), unsqueeze(g, high, 2), axis=2), g.const([0, k]))
    return cast(g, bytes_, I8)


def _build_w4a8_matmul(g: GraphBuilder, v, d: Dims, o: Options) -> dict[str, str]:
    k = 2 * d["K/2"]
    group = k if o["group_size"] is None else int(o["group_size"])
    require(group > 0 and k % group == 0, f"group_size: expected a divisor of K = {k}, got {o['group_size']}")
    groups = k // group
    w16 = unpack_int4_times16(g, v["w_packed"], k)
    # Per group: acc[g] = 16 * w[:, g] @ x[:, g]^T as [G, N, M] int32 (exact: |acc| <= 128 * 127 * K < 2^31),
    # scaled by the group's weight scale; 1/16 (exact in fp32) rides on the activation scale at the end.
    w_groups = g.op("Transpose", g.op("Reshape", w16, g.const([0, groups, group])), perm=[1, 0, 2])  # [G, N, g]
    x_groups = g.op("Transpose", g.op("Reshape", v["x_q"], g.const([0, groups, group])), perm=[1, 2, 0])  # [G, g, M]
    acc = cast(g, g.op("MatMulInteger", w_groups, x_groups), F32)  # [G, N, M]
    if o["group_size"] is None:
        w_scale = g.op("Reshape", v["w_scale"], g.const([1, -1, 1]))  # [1, N, 1]
    else:
        w_scale = unsqueeze(g, g.op("Transpose", v["w_scale"], perm=[1, 0]), 2)  # [G, N, 1]
    y_t = g.op("ReduceSum", g.op("Mul", acc, w_scale), g.const([0]), keepdims=0)  # [N, M]
    x_scale = g.op("Mul", unsqueeze(g, v["x_scale"], 1), g.const(1.0 / 16.0, F32))
    y = g.op("Mul", g.op("Transpose", y_t, perm=[1, 0]), x_scale)
    return {"y": _to_out_dtype(g, y, o)}


def _w4a8_inputs(inputs: tuple[TensorSig, ...], options: Options) -> tuple[TensorSig, ...]:
    """w_scale is [N] per channel, [N, K / group_size] per group."""
    if options.get("group_size") is None:
        return inputs
    return tuple(sig("w_scale", F32, "N", "G") if s.name == "w_scale" else s for s in inputs)


W4A8_MATMUL = OpGraph(
    name="w4a8_matmul",
    inputs=(
        sig("x_q", I8, "M", "K"),
        sig("x_scale", F32, "M"),
        sig("w_packed", U8, "N", "K/2"),
        sig("w_scale", F32, "N"),
    ),
    outputs=(sig("y", "out_dtype", "M", "N"),),
    # The preset's expert w13 GEMM (x [M, hidden] -> [M, 2 * moe_intermediate]) with groups of 128 along K.
    options_from_config=lambda cfg: {"out_dtype": F32, "group_size": 128},
    dims_from_config=lambda cfg: {
        "N": 2 * cfg.moe_intermediate_size,
        "K": cfg.hidden_size,
        "K/2": cfg.hidden_size // 2,
    },
    derived_dims=lambda d, o: {} if o.get("group_size") is None else {"G": 2 * d["K/2"] // int(o["group_size"])},
    build=_build_w4a8_matmul,
    adjust_inputs=_w4a8_inputs,
)


# ---------------------------------------------------------------------------------------- hadamard_transform
def hadamard_factors(n: int) -> tuple[int, int]:
    """(R, C) with n = R * C, C = 2^b <= about sqrt(n) and R = K * 2^a: H_n = kron(H_R, H_C) by Sylvester's rule
    (the base K stays on the slow index), so two [R, R] and [C, C] constants replace one [n, n]."""
    base = hadamard_base_size(n)
    require(base is not None, f"x: expected a last dim n = K * 2^m with a supported K, got n = {n}")
    power = n // base
    cols = 1
    while cols * cols * 4 <= n and cols * 2 <= power:
        cols *= 2
    return n // cols, cols


def _build_hadamard_transform(g: GraphBuilder, v, d: Dims, o: Options) -> dict[str, str]:
    from ops_reference.hadamard import hadamard_matrix  # the +-1 matrices are defined once, in the reference

    n = d["n"]
    rows, cols = hadamard_factors(n)
    scale = 1.0 / math.sqrt(n) if o["scale"] is None else float(o["scale"])
    x = v["x"]
    lead = g.op("Shape", x, end=-1)
    # y = scale * x @ kron(H_R, H_C)^T  ==  scale * H_R @ X @ H_C^T with X = x viewed [..., R, C].
    z = g.op("Reshape", x, g.op("Concat", lead, g.const([rows, cols]), axis=0))
    right = (hadamard_matrix(cols).T * scale).astype("float32")  # the scale rides on the smaller factor
    z = g.op("MatMul", z, g.const(right, F32))
    if rows > 1:
        z = g.op("MatMul", g.const(hadamard_matrix(rows).astype("float32"), F32), z)
    return {"y": g.op("Reshape", z, g.op("Shape", x), out="y")}


HADAMARD_TRANSFORM = OpGraph(
    name="hadamard_transform",
    inputs=(sig("x", F32, LEADING, "n"),),
    outputs=(sig("y", F32, LEADING, "n"),),
    options_from_config=lambda cfg: {"scale": None},
    # QuaRot rotates the residual stream: the preset's graph is over hidden_size (12 x 512 for GLM-5).
    dims_from_config=lambda cfg: {"n": cfg.hidden_size},
    build=_build_hadamard_transform,
)

GRAPHS = (DYNAMIC_QUANT, QUANT_MATMUL, W4A8_MATMUL, HADAMARD_TRANSFORM)
