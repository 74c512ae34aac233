"""Expert parallelism over torch.distributed.all_to_all_single: the portable exchange, on every device and process
group backend torch.distributed has (gloo on CPU, NCCL on CUDA, HCCL on Ascend, ...).

ep_dispatch:  the T * k copies in send order (glm5_hal.ops.ep_plan) -> one all_to_all_single with the plan's split
              sizes -> receive_order puts them local-expert major. With quantize, each copy travels as its D int8
              codes followed by the 4 bytes of its fp32 scale: one int8 message of D + 4 bytes per row.
ep_combine:   y back into receive-buffer order -> all_to_all_single with the split sizes swapped -> per token the
              weighted sum of its k rows (moe_combine's arithmetic: fp32, weights applied here only).

The split sizes come from the plan ep_dispatch agreed on (one all_gather of the per-expert counts), so no further
exchange of counts is needed and nothing here synchronises with the host.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from backends.torch_eager.moe import _combine
from backends.torch_eager.quant import dynamic_quant
from glm5_hal.ops.ep_plan import EPPlan, EPRoute

SCALE_BYTES = 4  # an fp32 scale, travelling as int8 bytes behind its row's codes


def _pack_quantized(x: Tensor) -> Tensor:
    """[T, D] float -> [T, D + 4] int8: dynamic_quant's codes, then the scale's bytes."""
    codes, scale = dynamic_quant(x)
    return torch.cat([codes, scale.to(torch.float32).contiguous().view(torch.int8).view(-1, SCALE_BYTES)], dim=1)


def _unpack_quantized(rows: Tensor) -> tuple[Tensor, Tensor]:
    """[R, D + 4] int8 -> (codes [R, D] int8, scales [R] fp32)."""
    width = rows.shape[1] - SCALE_BYTES
    return rows[:, :width].contiguous(), rows[:, width:].contiguous().view(torch.float32).view(-1)


def ep_dispatch(x: Tensor, topk_ids: Tensor, plan: EPPlan) -> tuple[Tensor, Tensor | None, EPRoute]:
    """glm5_hal.ep_dispatch's exchange (arguments validated and agreed by it).

    x: [T, D]; topk_ids: [T, k]. Returns (recv_x [R, D] (int8 with plan.quantize), recv_scale [R] fp32 or None,
    the route ep_combine takes back).
    """
    route = plan.route(topk_ids)
    source = _pack_quantized(x) if plan.quantize else x
    rows = source[route.send_order // plan.top_k]  # [T * k, width], grouped by destination rank
    received = rows.new_empty(plan.recv_rows, rows.shape[1])
    dist.all_to_all_single(received, rows, plan.recv_splits, plan.send_splits, group=plan.group)
    received = received[route.receive_order]
    if plan.quantize:
        recv_x, recv_scale = _unpack_quantized(received)
        return recv_x, recv_scale, route
    return received, None, route


def ep_combine(y: Tensor, topk_weights: Tensor, plan: EPPlan, route: EPRoute) -> Tensor:
    """glm5_hal.ep_combine's exchange: y [R, D'] in recv_x's order, topk_weights [T, k] -> out [T, D'] in y's dtype."""
    back = y.new_empty(y.shape).index_copy_(0, route.receive_order, y)  # the receive buffer's order
    returned = y.new_empty(sum(plan.send_splits), y.shape[1])  # send order: moe_dispatch's x_sorted order
    dist.all_to_all_single(returned, back, plan.send_splits, plan.recv_splits, group=plan.group)
    return _combine(returned, route.send_order, topk_weights).to(y.dtype)
