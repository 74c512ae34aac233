"""What the collective ops share about torch.distributed: the group, where control tensors live, and agreement.

A collective op runs on every rank of a process group, and a rank that raises on its own leaves the others waiting
in the next collective. So every collective op of glm5-hal follows one protocol:

[local checks, no communication; an error is caught, not raised]
    -> agree(): one all_gather of a small int64 header per rank (the values every rank must share, or "I failed")
    -> a rank's error is raised on EVERY rank: its own message on it, "rank r: <that message>" on the others (same
       exception type, ValueError / TypeError naming the argument); a value that must be equal on every rank but is
       not (num_experts, the hidden size, the dtype) is a ValueError naming the argument, on every rank
[only then] the data collectives.

Only a `group` that is not a usable process group is raised locally (there is nobody to tell).

Timeouts: every collective runs under its process group's timeout (`torch.distributed.init_process_group(timeout=)`,
`new_group(timeout=)`). gloo and NCCL abort a collective that waits longer and raise on the waiting rank, and a peer
process that dies closes its connections, which fails the collective at once: a rank that never arrives fails its
peers after at most the timeout, never a hang forever. (torch's defaults are long: 30 min for gloo, 10 for NCCL;
pass a shorter one where a stuck job must fail fast.)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

# dtype <-> int, for headers that must agree across ranks (any fixed numbering works; it only has to be the same
# in every process).
DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 1,
    torch.bfloat16: 2,
    torch.float16: 3,
    torch.float64: 4,
    torch.int8: 5,
    torch.int32: 6,
    torch.int64: 7,
}
DTYPES_BY_CODE = {code: dtype for dtype, code in DTYPE_CODES.items()}


def dtype_code(dtype: torch.dtype) -> int:
    return DTYPE_CODES.get(dtype, 0)


def resolve_group(group: object) -> dist.ProcessGroup:
    """`group`, or the default process group for None; a TypeError / ValueError (raised on this rank only: without
    a group there is nobody to tell) when it is not a process group this process belongs to."""
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            "group: torch.distributed is not initialized; call torch.distributed.init_process_group() on every rank "
            "first (torchrun sets up the environment it reads)"
        )
    if group is None:
        group = dist.group.WORLD
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group: expected a torch.distributed.ProcessGroup or None, got {type(group).__name__}")
    if dist.get_rank(group) < 0:
        raise ValueError("group: this process is not a member of the process group it was given")
    return group


def backend_name(group: dist.ProcessGroup) -> str:
    """The group's backend as torch names it: "gloo", "nccl", "hccl", or "cpu:gloo,cuda:nccl" for a mixed group."""
    return str(dist.get_backend(group))


def control_device(group: dist.ProcessGroup, device: torch.device) -> torch.device:
    """Where the small control tensors of an exchange live: the CPU for a gloo-only group (gloo exchanges host
    memory), `device` (the data's device) for any other backend (NCCL, HCCL, or a mixed cpu/accelerator group)."""
    return torch.device("cpu") if backend_name(group) == "gloo" else device


def data_device_problem(group: dist.ProcessGroup, device: torch.device) -> str | None:
    """Why the group cannot exchange tensors on `device`, or None. Only the case torch would otherwise report deep
    inside the collective is caught: a gloo-only group and accelerator tensors."""
    if backend_name(group) == "gloo" and device.type != "cpu":
        return f"the group's backend is gloo, which exchanges CPU tensors, but the tensors are on {device}"
    return None


def all_gather_rows(values: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[n] from every rank -> [W, n] on every rank (row r = rank r's), in group rank order."""
    world = dist.get_world_size(group)
    out = values.new_empty(world * values.shape[0])  # the concatenated form: every backend takes it (gloo only it)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.12
    gather(out, values.contiguous(), group=group)
    return out.view(world, values.shape[0])


def _exception_type(exc: BaseException) -> type[Exception]:
    """The builtin type peers re-raise: ValueError / TypeError keep their meaning (which argument is wrong), the
    rest becomes RuntimeError."""
    for kind in (ValueError, TypeError):
        if isinstance(exc, kind):
            return kind
    return RuntimeError


def agree(
    op: str,
    group: dist.ProcessGroup,
    width: int,
    header: Sequence[int],
    error: Exception | None,
    device: torch.device,
) -> list[list[int]]:
    """Exchange every rank's `header` (`width` ints; ignored, and zeros sent, when `error` is set) and error status;
    returns the [W][width] table of headers (row r = rank r's) when no rank failed.

    If some rank passed an `error`, every rank raises: that rank its own error (as the builtin type, its message
    annotated), the others an exception of the same type naming the first failing rank and its message. The
    messages travel only then (all_gather_object), so the common path is one all_gather of W x (n + 1) ints.
    """
    values = [0, *map(int, header)] if error is None else [1] + [0] * width
    if len(values) != width + 1:
        raise RuntimeError(f"{op}: a header of {width} ints expected, got {list(header)} (a bug in glm5_hal)")
    table = all_gather_rows(torch.tensor(values, dtype=torch.int64, device=device), group).tolist()
    failed = [rank for rank, row in enumerate(table) if row[0]]
    if not failed:
        return [row[1:] for row in table]
    reports: list[object] = [None] * len(table)
    dist.all_gather_object(reports, None if error is None else (_exception_type(error).__name__, str(error)), group)
    rank, world = dist.get_rank(group), len(table)
    everywhere = f"{op} raised this on all {world} ranks of the group before exchanging any data"
    if error is not None:
        raise _exception_type(error)(f"{error} [rank {rank}; {everywhere}]") from error
    kind_name, message = reports[failed[0]]
    kind = {"ValueError": ValueError, "TypeError": TypeError}.get(kind_name, RuntimeError)
    others = f" (and rank(s) {failed[1:]})" if len(failed) > 1 else ""
    raise kind(f"rank {failed[0]}{others}: {message} [{everywhere}]")


def require_same(op: str, name: str, what: str, values: Sequence[int], shown: Sequence[object] | None = None) -> None:
    """ValueError naming `name`, raised identically on every rank, unless every rank holds the same value.
    values: one per rank (from agree's table); shown: how to print them (default: the values)."""
    if len(set(values)) > 1:
        shown = list(values if shown is None else shown)
        raise ValueError(f"{name}: expected the same {what} on every rank of the group, got {shown} (by rank) [{op}]")
