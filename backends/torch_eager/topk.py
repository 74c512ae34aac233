"""The torch backend's deterministic top-k: glm5_hal.topk's contract, on the native C kernel where it applies.

At decode (4 rows, k = 2048 of 16K scores, one thread) torch's select, the argsort and the many small ops of the
composite keys cost 0.8-1.1 ms, the C kernel's radix select and radix sort of the k chosen ~0.14 ms (native/topk.c).
Same values (bit for bit), columns and order, except that where a tie at -inf crosses the boundary the kernel
takes the lowest columns (as the composite select does) and torch's float select any (invisible keys: callers
mark them -1). Everything the kernel does not take (other devices and dtypes, graphs that may not read the host,
scores that need a gradient, rows past 2^31 columns, GLM5_HAL_NATIVE=0) runs glm5_hal.topk's torch ops.
"""

from __future__ import annotations

import torch
from torch import Tensor

from backends.torch_eager.native import topk as native_topk
from glm5_hal.host_reads import host_reads_allowed
from glm5_hal.topk import topk_lower_position_ties


def topk(scores: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The top-k columns of each row of scores [N, S] fp32 (k <= S), best first; equal scores by lower column.

    Returns (values [N, k] fp32, columns [N, k] int64), as glm5_hal.topk.topk_lower_position_ties.
    """
    if _takes_native(scores):
        return native_topk.topk(scores, k)
    return topk_lower_position_ties(scores, k)


def topk_positions(scores: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """`topk`'s values, and its columns as int32 positions with -1 where the value is -inf (the indexer's indices:
    a key no token sees is no key); one pass of the native kernel, or `topk` and two torch ops."""
    if _takes_native(scores):
        return native_topk.positions(scores, k)
    values, columns = topk_lower_position_ties(scores, k)
    return values, torch.where(values == float("-inf"), -1, columns).to(torch.int32)


def _takes_native(scores: Tensor) -> bool:
    if scores.device.type != "cpu" or scores.dtype != torch.float32 or scores.dim() != 2:
        return False
    # The native op has no backward: scores that need a gradient keep torch's differentiable select. It keeps
    # columns in 32 bits: longer rows keep torch's select too. Deciding to call it reads nothing from the host,
    # but the torch path's own rule for graphs that may not read it (composite select only) is kept as it was.
    differentiable = scores.requires_grad and torch.is_grad_enabled()
    return (
        host_reads_allowed(scores)
        and not differentiable
        and scores.shape[1] <= native_topk.MAX_WIDTH
        and native_topk.availability()[0]
    )
