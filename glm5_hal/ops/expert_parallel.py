"""Expert parallelism (OPS.md section 6): the MoE token exchange between the ranks of a torch.distributed group.

[ep_dispatch]  local checks -> agree: one all_gather of a header (errors and values every rank must share)
               -> one all_gather of per-expert copy counts -> EPPlan (identical on every rank)
               -> the selected backend moves the rows -> EPDispatch(recv_x, recv_scale, expert_offsets, handle)
[experts]      each rank runs its E / W experts on recv_x (grouped by local expert, see expert_offsets)
[ep_combine]   local checks -> agree (the handle's dispatch number, the row width and dtype)
               -> the same backend moves the rows back and applies the routing weights -> out [T, D']

How the pair fits the registry. `ep_dispatch` and `ep_combine` are ops of the registry (glm5_hal.registry.
EP_OP_NAMES): a backend lists them in its op table, and GLM5_HAL_BACKEND, GLM5_HAL_OP_BACKENDS and use_backend select
them like any other op (`torch`: the portable exchange over all_to_all_single, for every device; `ascend`: torch_npu's
MC2 kernels where their documented constraints hold, the portable exchange otherwise; the vendor backends and
`triton` run the portable one). The selection is made for `ep_dispatch`; `ep_combine` always runs on the backend
whose ep_dispatch made the handle, because the handle holds that backend's route (an MC2 dispatch can only be
undone by its own combine).

They are plain Python functions, not torch.library custom ops like the others: a custom op's schema carries tensors
and scalars only, not the opaque handle the way back needs, and recv_x's row count is known only after the counts
exchange, which a fake (meta) implementation cannot give without an unbacked symbolic size. Under torch.compile,
torch handles the collectives and host reads inside them as it handles any torch.distributed code (the tests run
them eagerly). Neither has an ONNX form.

Failure behaviour (glm5_hal/distributed.py): a bad argument on any rank raises a ValueError / TypeError naming the
argument on EVERY rank before any data moves; every collective runs under the process group's timeout.
"""

from __future__ import annotations

import weakref
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from glm5_hal.checks import (
    ACTIVATION_DTYPES,
    FLOAT_OP_DTYPES,
    check,
    check_accumulation_tensor,
    check_positive_int,
    check_same_device,
    check_tensor,
)
from glm5_hal.distributed import (
    agree,
    all_gather_rows,
    control_device,
    data_device_problem,
    dtype_code,
    require_same,
    resolve_group,
)
from glm5_hal.ops.ep_plan import EPPlan
from glm5_hal.registry import registry
from glm5_hal.selection import Resolution, check_float64_support, resolve

# The values ep_dispatch / ep_combine agree on (see the require_same calls below).
DISPATCH_HEADER = 8  # num_experts, D, k, dtype, quantize, device type, backend, earlier dispatches on the group
COMBINE_HEADER = 3  # the handle's dispatch number, D', y's dtype
# ep_dispatch calls made on each live group, for the check that all ranks combine the same dispatch (weak keys: a
# group re-created after destroy_process_group starts again at 0, like its peers).
_dispatch_counts: weakref.WeakKeyDictionary[dist.ProcessGroup, int] = weakref.WeakKeyDictionary()


@dataclass(frozen=True, eq=False)
class EPHandle:
    """The way back of one ep_dispatch call, for ep_combine. Opaque: pass it on, do not read it.

    plan: the agreed EPPlan. backend: the backend that ran the dispatch (and runs the combine). state: that
    backend's route. device: where recv_x lives.
    """

    plan: EPPlan
    backend: str
    combine: Callable[..., Tensor] = field(repr=False)
    state: object = field(repr=False)
    device: torch.device

    def __repr__(self) -> str:
        p = self.plan
        return (
            f"EPHandle(dispatch #{p.sequence} on rank {p.rank} of {p.world_size}, backend {self.backend!r}, "
            f"T={p.tokens[p.rank]}, k={p.top_k}, R={p.recv_rows})"
        )


@dataclass(frozen=True)
class EPDispatch:
    """What ep_dispatch returns on each rank.

    recv_x: [R, D], x's dtype (int8 with quantize=True). The rows this rank's experts must process: grouped by
        LOCAL expert ascending; within an expert ordered by (source rank, source token, slot j).
    recv_scale: [R] fp32 with quantize=True (row i is recv_x[i] * recv_scale[i]); None otherwise.
    expert_offsets: [E/W + 1] int32. Rows of local expert l are recv_x[expert_offsets[l] : expert_offsets[l + 1]].
    handle: EPHandle, for ep_combine.
    """

    recv_x: Tensor
    recv_scale: Tensor | None
    expert_offsets: Tensor
    handle: EPHandle


def _crc(text: str) -> int:
    return zlib.crc32(text.encode())


def _check_dispatch_args(
    x: object, topk_ids: object, num_experts: object, quantize: object, world: int, group: dist.ProcessGroup
) -> tuple[int, dict[str, int]]:
    """Metadata checks of ep_dispatch on this rank (no communication). Returns (num_experts, sizes)."""
    sizes: dict[str, int] = {}
    check(isinstance(quantize, bool), TypeError, lambda: f"quantize: expected a bool, got {quantize!r}")
    dtypes = ACTIVATION_DTYPES if quantize else FLOAT_OP_DTYPES  # int8 transport is dynamic_quant's contract
    check_tensor("x", x, ["T", "D"], dtypes, sizes)
    check_tensor("topk_ids", topk_ids, ["T", "k"], (torch.int32, torch.int64), sizes)
    check_same_device(x=x, topk_ids=topk_ids)
    num_experts = check_positive_int("num_experts", num_experts)
    check(
        num_experts % world == 0,
        ValueError,
        lambda: (
            f"num_experts: expected a multiple of the group's size W = {world} (rank r owns experts "
            f"[r * E/W, (r+1) * E/W)), got {num_experts}"
        ),
    )
    problem = data_device_problem(group, x.device)
    check(problem is None, ValueError, lambda: f"x: {problem}")
    return num_experts, sizes


def ep_dispatch(
    x: Tensor, topk_ids: Tensor, num_experts: int, *, group: dist.ProcessGroup | None = None, quantize: bool = False
) -> EPDispatch:
    """Send each token's copies to the ranks owning its experts; a collective: call it on every rank of `group`.

    Rank r of a group of W ranks owns the global experts [r * E/W, (r+1) * E/W). T may differ between ranks and may
    be 0; D, k, num_experts, x's dtype and quantize must be the same on every rank.

    Args:
        x: [T, D], bf16/fp16/fp32 (fp64 on a backend with the float64 verification mode). This rank's tokens.
        topk_ids: [T, k], int32 (or int64). Global expert ids in [0, num_experts), from moe_gate.
        num_experts: E, a multiple of the group's size.
        group: the process group (None: the default group). Its backend must exchange x's device (gloo: cpu).
        quantize: send each row as dynamic_quant's int8 codes plus an fp32 scale (D + 4 bytes instead of 2D or 4D;
            recv_x is then int8 and recv_scale holds the scales). x must be bf16/fp16/fp32.

    Returns:
        EPDispatch(recv_x [R, D], recv_scale [R] fp32 or None, expert_offsets [E/W + 1] int32, handle). recv_x rows
        are grouped by local expert ascending, within an expert ordered by (source rank, source token, slot j).

    Raises a ValueError / TypeError naming the argument on EVERY rank of the group, before any data moves, when any
    rank's arguments are invalid or ranks disagree on D, k, num_experts, dtype or quantize (glm5_hal/distributed.py).

    Reference: ops_reference/expert_parallel.py
    """
    group = resolve_group(group)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    device = x.device if isinstance(x, Tensor) else torch.device("cpu")
    error: Exception | None = None
    header: list[int] = []
    resolution = None
    try:
        num_experts, sizes = _check_dispatch_args(x, topk_ids, num_experts, quantize, world, group)
        resolution = resolve("ep_dispatch", x.device.type)
        if x.dtype == torch.float64:
            check_float64_support(resolution)
        header = [num_experts, sizes["D"], sizes["k"], dtype_code(x.dtype), int(quantize)]
        header += [_crc(x.device.type), _crc(resolution.backend), _dispatch_counts.get(group, 0)]
    except (ValueError, TypeError, RuntimeError) as exc:  # RuntimeError: the selected backend is unavailable here
        error = exc
    ctrl = control_device(group, device)
    table = agree("ep_dispatch", group, DISPATCH_HEADER, header, error, ctrl)
    columns = list(zip(*table))
    require_same("ep_dispatch", "num_experts", "number of experts", columns[0])
    require_same("ep_dispatch", "x", "row width D", columns[1])
    require_same("ep_dispatch", "topk_ids", "number of experts per token k", columns[2])
    require_same("ep_dispatch", "x", "dtype", columns[3])
    require_same("ep_dispatch", "quantize", "quantize flag", columns[4], [bool(v) for v in columns[4]])
    require_same("ep_dispatch", "x", "device type", columns[5])
    require_same("ep_dispatch", "GLM5_HAL_BACKEND", "backend selected for ep_dispatch", columns[6])
    require_same("ep_dispatch", "group", "number of earlier ep_dispatch calls on this group", columns[7])
    plan = _exchange_counts(x, topk_ids, num_experts, quantize, group, ctrl, rank, world)
    recv_x, recv_scale, state = resolution.implementation(x, topk_ids, plan)
    combine = registry().ops(resolution.backend).get("ep_combine")
    check(
        combine is not None,
        RuntimeError,
        lambda: f"backend {resolution.backend!r} implements ep_dispatch but not ep_combine",
    )
    handle = EPHandle(plan, resolution.backend, combine, state, x.device)
    return EPDispatch(recv_x, recv_scale, plan.expert_offsets(x.device), handle)


def _exchange_counts(
    x: Tensor,
    topk_ids: Tensor,
    num_experts: int,
    quantize: bool,
    group: dist.ProcessGroup,
    ctrl: torch.device,
    rank: int,
    world: int,
) -> EPPlan:
    """One all_gather of [copies per global expert (E), ids in range, rows unique, T] per rank -> the EPPlan.

    The expert-id range check rides in this exchange (computed on the device, no extra host sync), so it runs
    whatever GLM5_HAL_CHECK_VALUES says: out-of-range ids would corrupt every rank's split sizes.
    """
    ids = topk_ids.reshape(-1).to(torch.int64)
    in_range = ((ids >= 0) & (ids < num_experts)).all()
    counts = torch.bincount(ids.clamp(0, num_experts - 1), minlength=num_experts)
    sorted_rows = topk_ids.sort(dim=1).values
    rows_unique = (sorted_rows[:, 1:] != sorted_rows[:, :-1]).all()
    flags = torch.stack([in_range, rows_unique]).to(torch.int64)
    tokens = torch.tensor([x.shape[0]], dtype=torch.int64, device=ids.device)
    table = all_gather_rows(torch.cat([counts, flags, tokens]).to(ctrl), group).tolist()
    bad = [r for r, row in enumerate(table) if not row[num_experts]]
    if bad:
        where = "this rank" if rank in bad else f"rank(s) {bad}"
        raise ValueError(
            f"topk_ids: expected expert ids in [0, num_experts = {num_experts}), got ids outside on {where} "
            f"[ep_dispatch raised this on all {world} ranks of the group before exchanging any data]"
        )
    sequence = _dispatch_counts.get(group, 0)
    _dispatch_counts[group] = sequence + 1
    return EPPlan(
        group=group,
        rank=rank,
        world_size=world,
        num_experts=num_experts,
        hidden=x.shape[1],
        top_k=topk_ids.shape[1],
        dtype=x.dtype,
        quantize=quantize,
        tokens=tuple(row[num_experts + 2] for row in table),
        counts=tuple(tuple(row[:num_experts]) for row in table),
        rows_unique=all(row[num_experts + 1] for row in table),
        sequence=sequence,
    )


def ep_combine(y: Tensor, topk_weights: Tensor, handle: EPHandle) -> Tensor:
    """Send the expert outputs back to their tokens' ranks and sum them with the routing weights; a collective.

    out[t] = sum_j topk_weights[t, j] * y(row of (this rank, t, j)): the routing weights are applied here and
    nowhere else, as in moe_combine. Runs on the backend that ran the handle's ep_dispatch.

    Args:
        y: [R, D'], bf16/fp16/fp32 (fp64 on a backend with the float64 verification mode). One output row per row of
            that dispatch's recv_x, in the same order (D' may differ from D; it must be the same on every rank).
        topk_weights: [T, k], fp32 (fp64 for fp64 y). This rank's routing weights, from moe_gate.
        handle: the EPHandle of this rank's ep_dispatch; every rank must pass the handle of the same dispatch call.

    Returns:
        out: [T, D'] in y's dtype, accumulated in fp32 (fp64 for fp64 y).

    Raises a ValueError / TypeError naming the argument on EVERY rank before any data moves when any rank's y,
    topk_weights or handle does not fit (a mismatched handle included).

    Reference: ops_reference/expert_parallel.py
    """
    check(
        isinstance(handle, EPHandle),
        TypeError,
        lambda: f"handle: expected the EPHandle of an ep_dispatch result, got {type(handle).__name__}",
    )
    plan = handle.plan
    error: Exception | None = None
    header: list[int] = []
    try:
        sizes = {"T": plan.tokens[plan.rank], "k": plan.top_k}
        check_tensor("y", y, [None, None], FLOAT_OP_DTYPES)
        check(
            y.shape[0] == plan.recv_rows,
            ValueError,
            lambda: (
                f"y: expected [R, D'] with R = {plan.recv_rows}, the rows this rank's ep_dispatch returned (handle "
                f"{handle!r}), got shape {tuple(y.shape)}; is it the handle of another dispatch?"
            ),
        )
        check_accumulation_tensor("topk_weights", topk_weights, ["T", "k"], y.dtype, sizes)
        check_same_device(y=y, topk_weights=topk_weights)
        check(
            y.device == handle.device,
            ValueError,
            lambda: f"y: expected it on {handle.device}, where its ep_dispatch ran, got {y.device}",
        )
        if y.dtype == torch.float64:
            how = "the backend of the handle's ep_dispatch"
            check_float64_support(
                Resolution("ep_combine", y.device.type, handle.backend, handle.backend, handle.combine, how)
            )
        header = [plan.sequence, y.shape[1], dtype_code(y.dtype)]
    except (ValueError, TypeError) as exc:
        error = exc
    table = agree("ep_combine", plan.group, COMBINE_HEADER, header, error, control_device(plan.group, handle.device))
    columns = list(zip(*table))
    require_same("ep_combine", "handle", "ep_dispatch call (its number on the group)", columns[0])
    require_same("ep_combine", "y", "row width D'", columns[1])
    require_same("ep_combine", "y", "dtype", columns[2])
    return handle.combine(y, topk_weights, plan, handle.state)
