"""Standard-opset building blocks several op graphs share: linears, norms, RoPE, the paged ragged batch, cache writes.

Each function appends nodes to a GraphBuilder and returns the name of the value it computed. Shapes in the
docstrings use OPS.md's names; `T` (tokens), `B` (sequences), `num_blocks`, `block_size`, `max_blocks` are
symbolic in every exported graph, so these blocks never read them as Python numbers: they take them from
`Shape` at run time. Model dims (head counts, widths) are Python ints baked into the graph.
"""

from __future__ import annotations

from dataclasses import dataclass

from glm5_hal.onnx_export.graph import GraphBuilder, elem_type

NEG_INF = float("-inf")


# ---------------------------------------------------------------------------------------------------- basics
def cast(g: GraphBuilder, x: str, dtype: str, out: str | None = None) -> str:
    return g.op("Cast", x, to=elem_type(dtype), out=out)


def dims(g: GraphBuilder, x: str, start: int, end: int | None = None) -> str:
    """int64 [end - start]: the run-time sizes of x's axes start:end."""
    return g.op("Shape", x, start=start, end=end)


def filled(g: GraphBuilder, shape: str, value: float | int, dtype: str) -> str:
    """A tensor of run-time shape `shape` (int64 1-D) filled with `value`."""
    fill = g.onnx.helper.make_tensor("value", elem_type(dtype), [1], [value])
    return g.op("ConstantOfShape", shape, value=fill)


def arange(g: GraphBuilder, stop: str) -> str:
    """int64 [n]: 0 .. n-1 for a run-time scalar (0-d int64) `stop`."""
    return g.op("Range", g.const(0), stop, g.const(1))


def scalar_dim(g: GraphBuilder, x: str, axis: int) -> str:
    """0-d int64: the run-time size of x's axis `axis`."""
    return g.op("Squeeze", dims(g, x, axis, axis + 1 if axis != -1 else None), g.const([0]))


def unsqueeze(g: GraphBuilder, x: str, *axes: int) -> str:
    return g.op("Unsqueeze", x, g.const(list(axes)))


def squeeze(g: GraphBuilder, x: str, *axes: int) -> str:
    return g.op("Squeeze", x, g.const(list(axes)))


def slice_last(g: GraphBuilder, x: str, start: int, end: int) -> str:
    """x[..., start:end]."""
    return g.op("Slice", x, g.const([start]), g.const([end]), g.const([-1]))


# ------------------------------------------------------------------------------------------ linears and norms
def linear(g: GraphBuilder, x: str, w: str, out: str | None = None) -> str:
    """x [R, in] @ w^T for an nn.Linear-layout weight w [out, in] (Gemm's transB reads w without a copy)."""
    return g.op("Gemm", x, w, transB=1, out=out)


def rms_norm(g: GraphBuilder, x: str, gamma: str, eps: float, out: str | None = None) -> str:
    """x / sqrt(mean(x^2, -1) + eps) * gamma over the last dim (RMSNormalization is opset 23, so spelled out)."""
    mean_square = g.op("ReduceMean", g.op("Mul", x, x), g.const([-1]), keepdims=1)
    rms = g.op("Sqrt", g.op("Add", mean_square, g.const(eps, "float32")))
    return g.op("Mul", g.op("Div", x, rms), gamma, out=out)


def layer_norm(g: GraphBuilder, x: str, weight: str, bias: str, eps: float) -> str:
    """LayerNorm over the last dim with a biased variance (ONNX LayerNormalization, opset 17)."""
    return g.op("LayerNormalization", x, weight, bias, axis=-1, epsilon=float(eps))


def silu(g: GraphBuilder, x: str) -> str:
    return g.op("Mul", x, g.op("Sigmoid", x))


# ----------------------------------------------------------------------------------------------------- RoPE
def rope(
    g: GraphBuilder, x: str, cos: str, sin: str, *, rank: int, rope_dim: int, interleaved: bool, out: str | None = None
) -> str:
    """Rotate the pairs of x [T, ..., rope_dim] (rank `rank`) by cos, sin [T, rope_dim/2].

    Interleaved pairs are (x[2i], x[2i+1]); half-split pairs (x[i], x[i + rope_dim/2]). (a, b) -> (a cos - b sin,
    a sin + b cos). cos and sin broadcast over the middle dims (heads).
    """
    half = rope_dim // 2
    middle = tuple(range(1, rank - 1))
    cos_b = unsqueeze(g, cos, *middle) if middle else cos
    sin_b = unsqueeze(g, sin, *middle) if middle else sin
    if interleaved:
        # [..., rope] -> [..., rope/2, 2]; Reshape's 0 copies the input's (symbolic) leading sizes.
        pairs = g.op("Reshape", x, g.const([0] * (rank - 1) + [half, 2]))
        a = g.op("Gather", pairs, g.const(0), axis=-1)
        b = g.op("Gather", pairs, g.const(1), axis=-1)
    else:
        a, b = g.op("Split", x, g.const([half, half]), axis=-1, n_out=2)
    rot_a = g.op("Sub", g.op("Mul", a, cos_b), g.op("Mul", b, sin_b))
    rot_b = g.op("Add", g.op("Mul", a, sin_b), g.op("Mul", b, cos_b))
    if interleaved:
        stacked = g.op("Concat", unsqueeze(g, rot_a, -1), unsqueeze(g, rot_b, -1), axis=-1)
        return g.op("Reshape", stacked, g.const([0] * (rank - 1) + [rope_dim]), out=out)
    return g.op("Concat", rot_a, rot_b, axis=-1, out=out)


# ----------------------------------------------------------------------------------------- paged ragged batch
@dataclass(frozen=True)
class TokenLayout:
    """Per query token t (int64 [T] each): its sequence `seq`, the end `seq_end` = cu_seqlens_q[seq + 1] of that
    sequence's tokens, and t itself (`token`)."""

    seq: str
    seq_end: str
    token: str


def token_sequences(g: GraphBuilder, tokens_of: str, cu_seqlens_q: str) -> TokenLayout:
    """Which sequence each query token belongs to (OPS.md "Conventions"). tokens_of: any value with T on axis 0.

    Token t belongs to the first sequence b with cu_seqlens_q[b+1] > t, so seq = #{b : cu_seqlens_q[b+1] <= t}
    (a compare [T, B] and a sum: no loop, and sequences without new tokens need no special case).
    """
    token = arange(g, scalar_dim(g, tokens_of, 0))  # [T]
    ends = g.op("Slice", cast(g, cu_seqlens_q, "int64"), g.const([1]), g.const([2**62]), g.const([0]))  # [B]
    ended = g.op("LessOrEqual", unsqueeze(g, ends, 0), unsqueeze(g, token, 1))  # [T, B]
    seq = g.op("ReduceSum", cast(g, ended, "int64"), g.const([1]), keepdims=0)  # [T]
    return TokenLayout(seq, g.op("Gather", ends, seq), token)


def token_positions(g: GraphBuilder, layout: TokenLayout, seq_lens_k: str) -> str:
    """int64 [T]: token t of a sequence with q_len new tokens sits at seq_lens_k - q_len + i
    = seq_lens_k[seq] - cu_seqlens_q[seq + 1] + t."""
    k_len = g.op("Gather", cast(g, seq_lens_k, "int64"), layout.seq)
    return g.op("Add", g.op("Sub", k_len, layout.seq_end), layout.token)


def sequence_slots(g: GraphBuilder, block_table: str, cache: str) -> str:
    """int64 [B, S] with S = max_blocks * block_size: the flat cache slot of every key position of every sequence.

    Blocks a sequence does not use (block_table padding, e.g. -1) give meaningless slots; they are clamped to 0
    so every gather stays in range, and callers mask those positions out.
    """
    block_size = dims(g, cache, 1, 2)  # [1]
    first_slot = g.op("Mul", unsqueeze(g, cast(g, block_table, "int64"), 2), block_size)  # [B, max_blocks, 1]
    slots = g.op("Add", first_slot, arange(g, squeeze(g, block_size, 0)))  # [B, max_blocks, block_size]
    return g.op("Max", g.op("Reshape", slots, g.const([0, -1])), g.const(0))


def flat_cache(g: GraphBuilder, cache: str, width: int) -> str:
    """[num_blocks * block_size, width]: the cache as one row per slot."""
    return g.op("Reshape", cache, g.const([-1, width]))


def write_cache(g: GraphBuilder, cache: str, slot_mapping: str, rows: str, *, out: str) -> str:
    """The cache [num_blocks, block_size, width] with rows [T, width] written at slot_mapping [T]; -1 is skipped.

    ONNX values are immutable, so this returns the updated cache. ScatterND has no "skip", and duplicate indices
    are not allowed, so Compress first keeps only the tokens with a slot (a data-dependent count); one ScatterND
    then writes them at (slot // block_size, slot % block_size) of the 3-d cache, so that ScatterND's own copy
    is the only copy of the cache (a Reshape of a caller's buffer would be another).
    """
    slots = cast(g, slot_mapping, "int64")
    keep = g.op("GreaterOrEqual", slots, g.const(0))  # [T]
    kept = g.op("Compress", slots, keep, axis=0)  # [T']
    block_size = dims(g, cache, 1, 2)  # [1]
    where = g.op(
        "Concat", unsqueeze(g, g.op("Div", kept, block_size), 1), unsqueeze(g, g.op("Mod", kept, block_size), 1), axis=1
    )
    return g.op("ScatterND", cache, where, g.op("Compress", rows, keep, axis=0), out=out)  # where: [T', 2]
