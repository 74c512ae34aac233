"""The reference backend's expert-parallel exchange: every rank gathers every rank's inputs and runs the float64
NumPy reference of the whole exchange (ops_reference/expert_parallel.py), keeping its own part. Exact and slow (each
rank receives all the data), the float64 verification mode included.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

import ops_reference as ref
from backends.reference.ops import _back, _host
from glm5_hal.ops.ep_plan import EPPlan


def _everyone(plan: EPPlan, *arrays: object) -> list[tuple]:
    """Every rank's `arrays` (host NumPy), in rank order."""
    gathered: list[object] = [None] * plan.world_size
    dist.all_gather_object(gathered, arrays, group=plan.group)
    return gathered


def ep_dispatch(x: Tensor, topk_ids: Tensor, plan: EPPlan) -> tuple[Tensor, Tensor | None, list]:
    """-> (recv_x, recv_scale, the sources of every rank's rows: what ep_combine follows back)."""
    everyone = _everyone(plan, _host(x), _host(topk_ids))
    outputs, sources = ref.ep_dispatch(
        [xs for xs, _ in everyone], [ids for _, ids in everyone], plan.num_experts, quantize=plan.quantize
    )
    recv_x, recv_scale, _ = outputs[plan.rank]
    if plan.quantize:
        return _back(recv_x, x, torch.int8), _back(recv_scale, x, torch.float32), sources
    return _back(recv_x, x), None, sources


def ep_combine(y: Tensor, topk_weights: Tensor, plan: EPPlan, sources: list) -> Tensor:
    everyone = _everyone(plan, _host(y), _host(topk_weights))
    outs = ref.ep_combine([ys for ys, _ in everyone], [w for _, w in everyone], sources)
    return _back(outs[plan.rank], y)
