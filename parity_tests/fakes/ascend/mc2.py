"""Fake torch_npu MC2 kernels: npu_moe_distribute_dispatch_v2 / npu_moe_distribute_combine_v2 (Atlas A3 rules).

Each rank's call really exchanges data with the other ranks of the communication domain named by `group_ep`, over
the gloo process group behind it: `install_hccl_comm_names()` gives gloo groups torch_npu's
`group._get_backend(device).get_hccl_comm_name(rank)`, returning a name this module resolves back to the group.

dispatch_v2 computes what torch_npu's documentation says (quant_mode 0: the tokens; 2: CastToInt8(x * 127 / max|x|)
per row, modelled as round half to even, with dynamic_scales = max|x| / 127), in the kernel's documented row order
(local expert, then source rank, then source token: ops_reference.ep_dispatch's order), into expand_x [A, H] with
A = global_bs * min(L, K); rows past those received are poisoned, as are an all-zero row's codes (its scale is 0:
127 / 0 overflows). assist_info_for_combine, ep_recv_counts and tp_recv_counts are documented as opaque: combine_v2
requires exactly the tensors its dispatch returned. combine_v2 sends the first rows back and returns
sum_k expert_scales[t, k] * row(t, k) in expand_x's dtype.

Rejected (FakeNpuError), from the A3 columns of the docs: x not bf16/fp16; BS outside 1..512; K outside 1..16 or
above E; H outside [1024, 8192] (dispatch) / [1024, 7168] (combine); W outside 2..768 (dispatch) / 2..384 (combine);
E outside 1..1024 / 1..512 or not a multiple of W; ids out of range or repeated in a row; quant_mode other than 0
and 2; ep_rank_id other than this rank's; differing E / W / global_bs / H / K / quant_mode across ranks; global_bs
other than max BS * W (or 0 with equal BS); HCCL_BUFFSIZE below the documented need. Not modelled (refused):
TP domains, shared-expert ranks, special experts, x_active_mask, scales, elastic_info, comm_quant_mode 2.
"""

from __future__ import annotations

import os

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

import ops_reference as ref
from fakes.ascend.common import HALF_DTYPES, INT8_POISON, device_tensor, host, not_modeled, poison, require

COMM_PREFIX = "fake-hccl:"
ASSIST_WIDTH = 128  # assist_info_for_combine holds A * 128 int32
_dispatched: dict[str, dict] = {}  # group_ep -> what the last dispatch_v2 on it returned (combine_v2 checks it)


def _fake_hccl_comm_name(backend: object, rank: int, init_comm: bool = True) -> str:
    """ProcessGroupGloo.get_hccl_comm_name, installed by install_hccl_comm_names: the name of the group whose CPU
    backend is `backend`. `rank` must be the global rank (torch_npu's documentation)."""
    require(rank == dist.get_rank(), "get_hccl_comm_name", f"rank must be the global rank {dist.get_rank()}")
    for group in dist.distributed_c10d._world.pg_map:
        try:
            if group._get_backend(torch.device("cpu")) is backend:
                return COMM_PREFIX + group.group_name
        except RuntimeError:  # a group without a CPU backend
            continue
    raise RuntimeError("get_hccl_comm_name: the backend belongs to no live process group")


def install_hccl_comm_names() -> None:
    """Give gloo process groups torch_npu's get_hccl_comm_name (for the duration of the process or the fixture)."""
    from torch._C._distributed_c10d import ProcessGroupGloo

    ProcessGroupGloo.get_hccl_comm_name = _fake_hccl_comm_name


def _comm(group_ep: str, op: str) -> dist.ProcessGroup:
    require(1 <= len(group_ep) < 128, op, "group_ep must be 1..127 characters")
    for group in dist.distributed_c10d._world.pg_map:
        if COMM_PREFIX + group.group_name == group_ep:
            return group
    raise RuntimeError(f"{op}: {group_ep!r} names no communication domain [strict torch_npu 2.14.0 fake]")


def _buffer_check(op: str, local: int, max_bs: int, world: int, hidden: int, top_k: int) -> None:
    align = lambda v, to: -(-v // to) * to  # noqa: E731
    experts = local * max_bs * world * align(align(2 * hidden, 32) + 64, 512)
    needed = 2 * (experts + top_k * max_bs * align(2 * hidden, 512))
    budget = int(os.environ.get("HCCL_BUFFSIZE", "200")) * 2**20
    require(needed <= budget, op, f"HCCL_BUFFSIZE ({budget >> 20} MB) is below the {needed} bytes this call needs")


def _refuse_unused(op: str, group_tp: str, sizes: tuple[int, int, int, int, int]) -> None:
    """What both kernels document but the backend never uses: a TP domain, shared experts and their cards.
    sizes: (tp_world_size, tp_rank_id, expert_shard_type, shared_expert_num, shared_expert_rank_num)."""
    tp_world_size, tp_rank_id, expert_shard_type, shared_expert_num, shared_expert_rank_num = sizes
    not_modeled(group_tp == "" and tp_world_size in (0, 1) and tp_rank_id == 0, op, "a TP domain")
    not_modeled(expert_shard_type == 0 and shared_expert_num == shared_expert_rank_num == 0, op, "shared experts")


def _everyone(group: dist.ProcessGroup, payload: object) -> list:
    gathered: list[object] = [None] * group.size()
    dist.all_gather_object(gathered, payload, group=group)
    return gathered


def npu_moe_distribute_dispatch_v2(
    x: Tensor,
    expert_ids: Tensor,
    group_ep: str,
    ep_world_size: int,
    ep_rank_id: int,
    moe_expert_num: int,
    *,
    scales=None,
    x_active_mask=None,
    expert_scales=None,
    elastic_info=None,
    performance_info=None,
    group_tp="",
    tp_world_size=0,
    tp_rank_id=0,
    expert_shard_type=0,
    shared_expert_num=1,
    shared_expert_rank_num=0,
    quant_mode=0,
    global_bs=0,
    expert_token_nums_type=1,
    comm_alg="",
    zero_expert_num=0,
    copy_expert_num=0,
    const_expert_num=0,
    y_dtype=None,
    x_dtype=None,
    scales_dtype=None,
):
    """-> (expand_x [A, H], dynamic_scales [A] fp32, assist_info_for_combine [A * 128] int32, expert_token_nums [L]
    int64, ep_recv_counts [W * L] int32, tp_recv_counts [1] int32, expand_scales [A] fp32 (undefined on A3))."""
    op = "npu_moe_distribute_dispatch_v2"
    not_modeled(scales is None and x_active_mask is None and expert_scales is None, op, "scales / masks")
    not_modeled(elastic_info is None and performance_info is None, op, "elastic_info / performance_info")
    _refuse_unused(
        op, group_tp, (tp_world_size, tp_rank_id, expert_shard_type, shared_expert_num, shared_expert_rank_num)
    )
    not_modeled(zero_expert_num == copy_expert_num == const_expert_num == 0, op, "special experts")
    not_modeled(comm_alg in ("", "fullmesh_v1"), op, f"comm_alg {comm_alg!r}")
    not_modeled(y_dtype is None and x_dtype is None and scales_dtype is None, op, "dtype overrides")
    require(x.dim() == 2 and x.dtype in HALF_DTYPES, op, f"x must be 2-D bf16/fp16, got {x.dtype} {tuple(x.shape)}")
    require(
        expert_ids.dim() == 2 and expert_ids.dtype == torch.int32 and expert_ids.shape[0] == x.shape[0],
        op,
        "expert_ids must be [BS, K] int32 with x's BS",
    )
    bs, top_k = expert_ids.shape
    hidden = x.shape[1]
    require(0 < bs <= 512, op, f"BS must lie in (0, 512] on A3, got {bs}")
    require(0 < top_k <= 16 and top_k <= moe_expert_num, op, f"K must lie in (0, 16] and not exceed E, got {top_k}")
    require(1024 <= hidden <= 8192, op, f"H must lie in [1024, 8192] on A3, got {hidden}")
    group = _comm(group_ep, op)
    world = group.size()
    require(ep_world_size == world, op, f"ep_world_size {ep_world_size} != the domain's size {world}")
    require(2 <= world <= 768, op, f"ep_world_size must lie in [2, 768] on A3, got {world}")
    require(ep_rank_id == dist.get_rank(group), op, f"ep_rank_id {ep_rank_id} is not this card's id in the domain")
    require(
        1 <= moe_expert_num <= 1024 and moe_expert_num % world == 0,
        op,
        f"moe_expert_num must lie in [1, 1024] and be a multiple of ep_world_size, got {moe_expert_num}",
    )
    ids = host(expert_ids)
    require(bool(((ids >= 0) & (ids < moe_expert_num)).all()), op, "expert_ids must lie in [0, moe_expert_num)")
    require(all(len(set(row)) == top_k for row in ids.tolist()), op, "the K experts of a row must be distinct")
    require(quant_mode in (0, 2), op, f"quant_mode must be 0 or 2, got {quant_mode}")
    require(expert_token_nums_type in (0, 1), op, f"expert_token_nums_type must be 0 or 1: {expert_token_nums_type}")
    meta = (moe_expert_num, world, global_bs, quant_mode, hidden, top_k, x.dtype)
    everyone = _everyone(group, (meta, host(x), ids))
    require(all(m == meta for m, _, _ in everyone), op, "E, W, global_bs, quant_mode, H, K and dtype must agree")
    sizes = [xs.shape[0] for _, xs, _ in everyone]
    max_bs = max(sizes)
    require(
        global_bs == max_bs * world or (global_bs == 0 and len(set(sizes)) == 1),
        op,
        f"global_bs must be max_bs * ep_world_size = {max_bs * world} (or 0 when every BS is equal), got {global_bs}",
    )
    local = moe_expert_num // world
    _buffer_check(op, local, max_bs, world, hidden, top_k)

    xs = [xs for _, xs, _ in everyone]
    outputs, sources = ref.ep_dispatch(xs, [i for _, _, i in everyone], moe_expert_num, quantize=quant_mode == 2)
    rows, row_scales, offsets = outputs[ep_rank_id]
    received = rows.shape[0]
    capacity = (global_bs or bs * world) * min(local, top_k)  # A
    expand_x = poison((capacity, hidden), torch.int8 if quant_mode == 2 else x.dtype, x)
    dynamic_scales = poison((capacity,), torch.float32, x)
    if received:
        if quant_mode == 2:  # an all-zero row: 127 / max|x| overflows, its codes are undefined and its scale 0
            zero = np.array([not xs[s][t].any() for s, t, _ in sources[ep_rank_id]])
            rows = np.where(zero[:, None], INT8_POISON, rows)
            dynamic_scales[:received] = device_tensor(np.where(zero, 0.0, row_scales), torch.float32, x)
        expand_x[:received] = device_tensor(rows, expand_x.dtype, x)
    assist = torch.full((capacity * ASSIST_WIDTH,), -1, dtype=torch.int32)
    for row, origin in enumerate(sources[ep_rank_id]):
        assist[row * ASSIST_WIDTH : row * ASSIST_WIDTH + 3] = torch.tensor(origin, dtype=torch.int32)
    counts = np.diff(offsets)
    all_ids = [i for _, _, i in everyone]
    by_rank = [[int((ids_s == ep_rank_id * local + e).sum()) for ids_s in all_ids] for e in range(local)]
    ep_recv_counts = np.cumsum(np.asarray(by_rank).reshape(-1))  # (local expert, source rank) order, prefix sums
    token_nums = counts if expert_token_nums_type == 1 else np.cumsum(counts)
    outs = (
        expand_x,
        dynamic_scales,
        assist.to(x.device),
        device_tensor(token_nums, torch.int64, x),
        device_tensor(ep_recv_counts, torch.int32, x),
        torch.full((1,), -1, dtype=torch.int32, device=x.device),
        poison((capacity,), torch.float32, x),
    )
    _dispatched[group_ep] = {
        "meta": (ep_world_size, ep_rank_id, moe_expert_num, global_bs),
        "tensors": tuple(t.clone() for t in (expert_ids, outs[2], outs[4], outs[5])),
        "rows": received,
        "capacity": capacity,
        "hidden": hidden,
        "sources": sources,
        "sizes": sizes,
    }
    return outs


def npu_moe_distribute_combine_v2(
    expand_x: Tensor,
    expert_ids: Tensor,
    assist_info_for_combine: Tensor,
    ep_send_counts: Tensor,
    expert_scales: Tensor,
    group_ep: str,
    ep_world_size: int,
    ep_rank_id: int,
    moe_expert_num: int,
    *,
    tp_send_counts=None,
    x_active_mask=None,
    expand_scales=None,
    shared_expert_x=None,
    elastic_info=None,
    ori_x=None,
    const_expert_alpha_1=None,
    const_expert_alpha_2=None,
    const_expert_v=None,
    performance_info=None,
    group_tp="",
    tp_world_size=0,
    tp_rank_id=0,
    expert_shard_type=0,
    shared_expert_num=1,
    shared_expert_rank_num=0,
    global_bs=0,
    comm_quant_mode=0,
    comm_alg="",
    zero_expert_num=0,
    copy_expert_num=0,
    const_expert_num=0,
):
    """-> x [BS, H] in expand_x's dtype: sum_k expert_scales[t, k] * (the row of (this rank, t, k))."""
    op = "npu_moe_distribute_combine_v2"
    not_modeled(x_active_mask is None and expand_scales is None and shared_expert_x is None, op, "masks / extras")
    not_modeled(elastic_info is None and ori_x is None and performance_info is None, op, "elastic / special experts")
    not_modeled(const_expert_alpha_1 is None and const_expert_alpha_2 is None and const_expert_v is None, op, "consts")
    _refuse_unused(
        op, group_tp, (tp_world_size, tp_rank_id, expert_shard_type, shared_expert_num, shared_expert_rank_num)
    )
    not_modeled(zero_expert_num == copy_expert_num == const_expert_num == 0, op, "special experts")
    not_modeled(comm_quant_mode == 0 and comm_alg in ("", "fullmesh_v1"), op, "communication quantization / comm_alg")
    record = _dispatched.get(group_ep)
    require(record is not None, op, "no npu_moe_distribute_dispatch_v2 ran on this domain")
    group = _comm(group_ep, op)
    world = group.size()
    require(2 <= world <= 384, op, f"ep_world_size must lie in [2, 384] on A3, got {world}")
    require(1 <= moe_expert_num <= 512, op, f"moe_expert_num must lie in [1, 512], got {moe_expert_num}")
    require(
        record["meta"] == (ep_world_size, ep_rank_id, moe_expert_num, global_bs),
        op,
        "ep_world_size, ep_rank_id, moe_expert_num and global_bs must be those of the dispatch",
    )
    passed = (expert_ids, assist_info_for_combine, ep_send_counts, tp_send_counts)
    require(
        all(t is not None and torch.equal(t.cpu(), kept.cpu()) for t, kept in zip(passed, record["tensors"])),
        op,
        "expert_ids, assist_info_for_combine, ep_send_counts and tp_send_counts must be the dispatch's, untouched",
    )
    hidden = expand_x.shape[1] if expand_x.dim() == 2 else -1
    require(
        expand_x.dim() == 2 and expand_x.dtype in HALF_DTYPES and expand_x.shape[0] == record["capacity"],
        op,
        f"expand_x must be [A = {record['capacity']}, H] bf16/fp16, got {expand_x.dtype} {tuple(expand_x.shape)}",
    )
    require(hidden == record["hidden"] and 1024 <= hidden <= 7168, op, "H must be the dispatch's, in [1024, 7168]")
    bs, top_k = expert_ids.shape
    require(
        expert_scales.dtype == torch.float32 and tuple(expert_scales.shape) == (bs, top_k),
        op,
        "expert_scales must be [BS, K] float32",
    )
    everyone = _everyone(group, (host(expand_x[: record["rows"]]), host(expert_scales)))
    outs = ref.ep_combine([y for y, _ in everyone], [w for _, w in everyone], record["sources"])
    return device_tensor(outs[ep_rank_id], expand_x.dtype, expand_x)
