"""ONNX graphs of the MoE ops (OPS.md section 4), in the standard opset.

[router_logits] -> Sigmoid/Softmax (+bias) -> [group TopK mask] -> TopK -> GatherElements -> normalise  moe_gate
[topk_ids] -> int64 sort keys -> TopK (ascending) -> Gather rows; offsets = #{ids < e}              moe_dispatch
[x_sorted, offsets] -> Loop over the experts that own rows: Slice rows, Gemm with w[e], Concat   grouped_matmul
[y_sorted, src_index] -> ScatterND back to assignment order -> MatMul with the routing weights      moe_combine
dispatch -> one Loop doing both expert GEMMs and SiLU-and-mul -> combine                                fused_moe

A grouped GEMM has a data-dependent row split; the standard opset has no grouped MatMul, and gathering one
weight matrix per row would copy N x K per row. So the expert GEMMs run in a Loop whose trip count is the number
of experts that own rows (zero-token experts cost nothing, as in a real kernel). Toolchains without Loop support
can export `grouped_matmul` as a glm5_hal custom node instead (custom.py); fused_moe then keeps its dispatch and
combine in the standard opset around two such nodes.
"""

from __future__ import annotations

from collections.abc import Callable

from glm5_hal.onnx_export.blocks import (
    NEG_INF,
    arange,
    cast,
    dims,
    filled,
    linear,
    scalar_dim,
    silu,
    slice_last,
    unsqueeze,
)
from glm5_hal.onnx_export.custom import custom_node
from glm5_hal.onnx_export.graph import GraphBuilder, TensorSig
from glm5_hal.onnx_export.opgraph import Dims, OpGraph, Options, require, sig

F32, I32, I64 = "float32", "int32", "int64"


# -------------------------------------------------------------------------------------------------- moe_gate
def _build_moe_gate(g: GraphBuilder, v, d: Dims, o: Options) -> dict[str, str]:
    num_experts, top_k = d["E"], int(o["top_k"])
    n_group, topk_group = int(o["n_group"]), int(o["topk_group"])
    if o["scoring"] == "sigmoid":
        scores = g.op("Sigmoid", v["router_logits"])
    elif o["scoring"] == "softmax":
        scores = g.op("Softmax", v["router_logits"], axis=-1)
    else:
        raise ValueError(f"scoring: expected 'sigmoid' or 'softmax', got {o['scoring']!r}")
    # The bias only picks experts; the weights are gathered from the unbiased scores.
    biased = g.op("Add", scores, v["bias"]) if "bias" in v else scores
    if n_group > 1:
        require(num_experts % n_group == 0, f"n_group: expected a divisor of E = {num_experts}, got {n_group}")
        group_size = num_experts // n_group
        grouped = g.op("Reshape", biased, g.const([0, n_group, group_size]))  # [T, G, E/G]
        best_two, _ = g.op("TopK", grouped, g.const([min(2, group_size)]), axis=-1, n_out=2)
        group_scores = g.op("ReduceSum", best_two, g.const([-1]), keepdims=0)  # [T, G]
        _, kept_groups = g.op("TopK", group_scores, g.const([topk_group]), axis=-1, n_out=2)  # [T, topk_group]
        hits = g.op("Equal", unsqueeze(g, kept_groups, 2), g.const(list(range(n_group))))  # [T, topk_group, G]
        keep = g.op("Greater", g.op("ReduceSum", cast(g, hits, I64), g.const([1]), keepdims=0), g.const(0))  # [T, G]
        keep = g.op("Expand", unsqueeze(g, keep, 2), g.const([1, 1, group_size]))  # [T, G, E/G]
        biased = g.op("Where", g.op("Reshape", keep, g.const([0, num_experts])), biased, g.const(NEG_INF, F32))
    # TopK breaks ties by the lower index, as the reference's stable argsort does.
    _, ids = g.op("TopK", biased, g.const([top_k]), axis=-1, largest=1, sorted=1, n_out=2)  # [T, k] int64
    weights = g.op("GatherElements", scores, ids, axis=1)
    if o["norm_topk_prob"]:
        total = g.op("Add", g.op("ReduceSum", weights, g.const([-1]), keepdims=1), g.const(1e-20, F32))
        weights = g.op("Div", weights, total)
    weights = g.op("Mul", weights, g.const(float(o["routed_scaling_factor"]), F32), out="topk_weights")
    return {"topk_weights": weights, "topk_ids": cast(g, ids, I32, out="topk_ids")}


MOE_GATE = OpGraph(
    name="moe_gate",
    inputs=(sig("router_logits", F32, "T", "E"), sig("bias", F32, "E")),
    outputs=(sig("topk_weights", F32, "T", "top_k"), sig("topk_ids", I32, "T", "top_k")),
    options_from_config=lambda cfg: {
        "top_k": cfg.num_experts_per_tok,
        "n_group": cfg.n_group,
        "topk_group": cfg.topk_group,
        "routed_scaling_factor": cfg.routed_scaling_factor,
        "norm_topk_prob": cfg.norm_topk_prob,
        "scoring": cfg.scoring_func,
    },
    dims_from_config=lambda cfg: {"E": cfg.n_routed_experts},
    derived_dims=lambda d, o: {"top_k": int(o["top_k"])},
    build=_build_moe_gate,
    optional=("bias",),
)


# ---------------------------------------------------------------------------------------------- moe_dispatch
def dispatch(g: GraphBuilder, x: str, topk_ids: str, num_experts: int) -> tuple[str, str, str]:
    """(x_sorted [T*k, D], expert_offsets int64 [E+1], src_index int64 [T*k]) of OPS.md's moe_dispatch."""
    flat = g.op("Reshape", cast(g, topk_ids, I64), g.const([-1]))  # [T*k]: assignment a = t*k + j -> expert
    count = scalar_dim(g, flat, 0)
    # Unique keys expert * (T*k) + a make the ascending sort stable without relying on TopK's tie rule.
    keys = g.op("Add", g.op("Mul", flat, count), arange(g, count))
    _, src_index = g.op(
        "TopK", keys, unsqueeze(g, count, 0), axis=0, largest=0, sorted=1, n_out=2, out=[g.fresh("keys"), "src_index"]
    )
    x_sorted = g.op("Gather", x, g.op("Div", src_index, scalar_dim(g, topk_ids, 1)), out="x_sorted")
    # offsets[e] = number of assignments to experts < e (a compare and a sum: no bincount in ONNX).
    below = g.op("Less", unsqueeze(g, flat, 1), g.const(list(range(num_experts + 1))))  # [T*k, E+1]
    offsets = g.op("ReduceSum", cast(g, below, I64), g.const([0]), keepdims=0, out="expert_offsets")
    return x_sorted, offsets, src_index


MOE_DISPATCH = OpGraph(
    name="moe_dispatch",
    inputs=(sig("x", F32, "T", "D"), sig("topk_ids", I32, "T", "k")),
    outputs=(sig("x_sorted", F32, "T*k", "D"), sig("expert_offsets", I64, "E+1"), sig("src_index", I64, "T*k")),
    options_from_config=lambda cfg: {"num_experts": cfg.n_routed_experts},
    dims_from_config=lambda cfg: {"D": cfg.hidden_size, "k": cfg.num_experts_per_tok},
    derived_dims=lambda d, o: {"E+1": int(o["num_experts"]) + 1},
    build=lambda g, v, d, o: dict(
        zip(("x_sorted", "expert_offsets", "src_index"), dispatch(g, v["x"], v["topk_ids"], int(o["num_experts"])))
    ),
)


# -------------------------------------------------------------------------------------------- grouped_matmul
ExpertFn = Callable[[GraphBuilder, str, str], str]  # (body builder, rows [m, K], expert id 0-d) -> [m, width]


def expert_loop(g: GraphBuilder, x_sorted: str, offsets: str, width: int, expert_fn: ExpertFn) -> str:
    """[M, width]: expert_fn applied to each expert's rows x_sorted[offsets[e]:offsets[e+1]], in row order.

    A Loop over the experts that own at least one row (NonZero of the counts), concatenating each expert's result;
    experts come in ascending order and own consecutive rows, so the concatenation is in row order.
    """
    counts = g.op(
        "Sub",
        g.op("Slice", offsets, g.const([1]), g.const([2**62]), g.const([0])),
        g.op("Slice", offsets, g.const([0]), g.const([-1]), g.const([0])),
    )  # [E]
    active = g.op("Reshape", g.op("NonZero", g.op("Greater", counts, g.const(0))), g.const([-1]))  # [n_active]
    body = g.subgraph("expert_body")
    step = body.add_input(TensorSig(body.fresh("step"), I64, ()))
    cond = body.add_input(TensorSig(body.fresh("cond"), "bool", ()))
    done = body.add_input(TensorSig(body.fresh("rows_done"), F32, ("rows_done", width)))
    expert = body.op("Gather", active, step)  # 0-d
    start = body.op("Gather", offsets, expert)
    end = body.op("Gather", offsets, body.op("Add", expert, body.const(1)))
    rows = body.op("Slice", x_sorted, unsqueeze(body, start, 0), unsqueeze(body, end, 0), body.const([0]))
    result = body.op("Concat", done, expert_fn(body, rows, expert), axis=0)
    body.add_output(body.op("Identity", cond), TensorSig(body.fresh("cond_out"), "bool", ()))
    body.add_output(result, TensorSig(result, F32, ("rows_next", width)))
    nothing = filled(g, g.const([0, width]), 0.0, F32)
    return g.op("Loop", scalar_dim(g, active, 0), "", nothing, body=body.graph())


def grouped_gemm(g: GraphBuilder, x_sorted: str, w: str, offsets: str, n: int) -> str:
    """[M, n]: row r of x_sorted times w[e]^T for the expert e owning row r (a glm5_hal node if so exported)."""
    if "grouped_matmul" in g.custom_ops:
        return custom_node(g, "grouped_matmul", [x_sorted, w, offsets], n_out=1, options={})
    return expert_loop(g, x_sorted, offsets, n, lambda body, rows, e: linear(body, rows, body.op("Gather", w, e)))


def _build_grouped_matmul(g: GraphBuilder, v, d: Dims, o: Options) -> dict[str, str]:
    require(d["E+1"] == d["E"] + 1, f"expert_offsets: expected {d['E'] + 1} entries, got {d['E+1']}")
    return {"y": grouped_gemm(g, v["x_sorted"], v["w"], v["expert_offsets"], d["N"])}


GROUPED_MATMUL = OpGraph(
    name="grouped_matmul",
    inputs=(sig("x_sorted", F32, "M", "K"), sig("w", F32, "E", "N", "K"), sig("expert_offsets", I64, "E+1")),
    outputs=(sig("y", F32, "M", "N"),),
    options_from_config=lambda cfg: {},
    # The preset's first expert GEMM: x [M, hidden] @ w13[e]^T -> [M, 2 * moe_intermediate].
    dims_from_config=lambda cfg: {
        "E": cfg.n_routed_experts,
        "E+1": cfg.n_routed_experts + 1,
        "N": 2 * cfg.moe_intermediate_size,
        "K": cfg.hidden_size,
    },
    build=_build_grouped_matmul,
)


# ----------------------------------------------------------------------------------------------- moe_combine
def combine(g: GraphBuilder, y_sorted: str, src_index: str, topk_weights: str, width: int) -> str:
    """out [T, width] = sum_j topk_weights[t, j] * (the row of y_sorted that came from assignment t*k + j)."""
    rows = g.op("Concat", dims(g, src_index, 0, 1), g.const([width]), axis=0)
    by_assignment = g.op("ScatterND", filled(g, rows, 0.0, F32), unsqueeze(g, src_index, 1), y_sorted)  # [T*k, D]
    by_token = g.op("Reshape", by_assignment, g.op("Concat", dims(g, topk_weights, 0), g.const([width]), axis=0))
    return g.op("Squeeze", g.op("MatMul", unsqueeze(g, topk_weights, 1), by_token), g.const([1]), out="out")


MOE_COMBINE = OpGraph(
    name="moe_combine",
    inputs=(sig("y_sorted", F32, "T*k", "D"), sig("src_index", I64, "T*k"), sig("topk_weights", F32, "T", "k")),
    outputs=(sig("out", F32, "T", "D"),),
    options_from_config=lambda cfg: {},
    dims_from_config=lambda cfg: {"D": cfg.hidden_size, "k": cfg.num_experts_per_tok},
    build=lambda g, v, d, o: {"out": combine(g, v["y_sorted"], v["src_index"], v["topk_weights"], d["D"])},
)


# ------------------------------------------------------------------------------------------------- fused_moe
def _build_fused_moe(g: GraphBuilder, v, d: Dims, o: Options) -> dict[str, str]:
    width, inter = d["D"], d["I"]
    require(d["2I"] == 2 * inter, f"w13: expected {2 * inter} rows per expert (gate, then up), got {d['2I']}")
    x_sorted, offsets, src_index = dispatch(g, v["x"], v["topk_ids"], d["E"])
    if "grouped_matmul" in g.custom_ops:
        hidden = grouped_gemm(g, x_sorted, v["w13"], offsets, 2 * inter)
        act = g.op("Mul", silu(g, slice_last(g, hidden, 0, inter)), slice_last(g, hidden, inter, 2 * inter))
        y_sorted = grouped_gemm(g, act, v["w2"], offsets, width)
    else:

        def expert_mlp(body: GraphBuilder, rows: str, e: str) -> str:
            hidden = linear(body, rows, body.op("Gather", v["w13"], e))  # [m, 2I] = [gate | up]
            gate, up = body.op("Split", hidden, body.const([inter, inter]), axis=1, n_out=2)
            return linear(body, body.op("Mul", silu(body, gate), up), body.op("Gather", v["w2"], e))

        y_sorted = expert_loop(g, x_sorted, offsets, width, expert_mlp)
    return {"out": combine(g, y_sorted, src_index, v["topk_weights"], width)}


FUSED_MOE = OpGraph(
    name="fused_moe",
    inputs=(
        sig("x", F32, "T", "D"),
        sig("topk_weights", F32, "T", "k"),
        sig("topk_ids", I32, "T", "k"),
        sig("w13", F32, "E", "2I", "D"),
        sig("w2", F32, "E", "D", "I"),
    ),
    outputs=(sig("out", F32, "T", "D"),),
    options_from_config=lambda cfg: {},
    dims_from_config=lambda cfg: {
        "D": cfg.hidden_size,
        "k": cfg.num_experts_per_tok,
        "E": cfg.n_routed_experts,
        "I": cfg.moe_intermediate_size,
        "2I": 2 * cfg.moe_intermediate_size,
    },
    build=_build_fused_moe,
)

GRAPHS = (MOE_GATE, MOE_DISPATCH, GROUPED_MATMUL, MOE_COMBINE, FUSED_MOE)
