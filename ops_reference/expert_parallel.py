"""Expert parallelism (OPS.md section 6): the token exchange of MoE EP, every rank's inputs in, every rank's out.

W ranks; rank r owns global experts [r * E/W, (r+1) * E/W). A token copy (source rank s, token t, slot j) goes to
expert e = topk_ids[s][t, j], i.e. to rank e // (E/W) as its local expert e % (E/W). On each rank the received rows
are grouped by local expert ascending and, within an expert, ordered by (s, t, j).
"""

from __future__ import annotations

import numpy as np

from ops_reference.quant import dynamic_quant


def ep_dispatch(xs, topk_ids, num_experts, *, quantize=False):
    """-> (per rank: (recv_x [R_r, D], recv_scale [R_r] or None, expert_offsets int64 [E/W + 1]), sources).

    xs: per rank [T_s, D] (T_s may be 0). topk_ids: per rank [T_s, k]. With quantize, each source row travels as
    dynamic_quant's int8 codes and scale: recv_x holds the codes (int8), recv_scale the scales.
    sources: per rank, per received row, the (s, t, j) it came from: what ep_combine sends back along.
    """
    world = len(xs)
    local = num_experts // world
    outputs, sources = [], []
    for r in range(world):
        rows, scales, came_from, offsets = [], [], [], [0]
        for local_expert in range(local):
            expert = r * local + local_expert
            for s in range(world):
                x = np.asarray(xs[s], np.float64)
                codes, scale = dynamic_quant(x) if quantize else (x, np.ones(x.shape[0]))
                ids = np.asarray(topk_ids[s])  # [T_s, k]
                for t in range(x.shape[0]):
                    for j in range(ids.shape[1]):
                        if ids[t, j] == expert:
                            rows.append(codes[t])
                            scales.append(scale[t])
                            came_from.append((s, t, j))
            offsets.append(len(rows))
        width = np.asarray(xs[r]).shape[1]
        recv_x = np.asarray(rows, np.int8 if quantize else np.float64).reshape(len(rows), width)
        recv_scale = np.asarray(scales, np.float64) if quantize else None
        outputs.append((recv_x, recv_scale, np.asarray(offsets, np.int64)))
        sources.append(came_from)
    return outputs, sources


def ep_combine(ys, topk_weights, sources):
    """-> per source rank s: out [T_s, D'] with out[t] = sum_j topk_weights[s][t, j] * (the row of (s, t, j)).

    ys: per rank [R_r, D'], the rows ep_dispatch gave that rank, in the same order (expert outputs).
    topk_weights: per rank [T_s, k]. sources: from ep_dispatch. Routing weights are applied here only.
    """
    width = np.asarray(ys[0]).shape[1]
    outs = [np.zeros((np.asarray(w).shape[0], width)) for w in topk_weights]
    for r, came_from in enumerate(sources):
        y = np.asarray(ys[r], np.float64)
        for row, (s, t, j) in enumerate(came_from):
            outs[s][t] += np.asarray(topk_weights[s], np.float64)[t, j] * y[row]
    return outs
