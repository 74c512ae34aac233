"""Expert parallelism on Ascend: torch_npu's MC2 kernels where their documented constraints hold, the portable
all_to_all_single exchange (over HCCL) otherwise.

ep_dispatch:  npu_moe_distribute_dispatch_v2(x, expert_ids = topk_ids int32, group_ep, ep_world_size = W,
              ep_rank_id, moe_expert_num = E, shared_expert_num = 0, quant_mode = 2 (int8 + per-row dynamic scale)
              or 0, global_bs = max T * W, expert_token_nums_type = 1)
              -> expand_x [A, H]: the received rows grouped by local expert, then source rank, then source token
              (the kernel's design: a rank's expandIdx counts a token's place among the tokens its source sends to
              that expert; epRecvCount is the [W, L] count matrix transposed to expert-major), which is the contract's
              order since a row names an expert at most once. Only the first R rows are defined: R, and
              expert_offsets, come from the agreed plan. quant_mode 2's dynamic_scales are max|x| / 127 per row:
              recv_scale after the contract's zero-row rule (scale 1, codes 0).
ep_combine:   npu_moe_distribute_combine_v2(expand_x = y padded to A rows, expert_ids, assist_info_for_combine,
              ep_send_counts = dispatch's ep_recv_counts, expert_scales = topk_weights fp32, the same group and
              sizes) -> [T, H]: the routing-weighted sum, the contract's combine. The tensors dispatch returns for
              combine are passed through untouched (their values differ between products and versions).

The MC2 path is taken when (torch_npu's documentation of dispatch_v2 / combine_v2, Atlas A3 columns):
    an Atlas A3 NPU (torch_npu.npu.get_soc_version() in 250..255); x bf16 / fp16; 2 <= W <= 384; E <= 512;
    1024 <= H <= 7168 (GLM-5's 6144 and DeepSeek-V3.2's 7168 both fit); every rank has 1..512 tokens; k <= 16;
    no row of topk_ids names an expert twice; HCCL_BUFFSIZE (MB, default 200) >= 2 * (L * max_T * W *
    Align512(Align32(2H) + 64) + k * max_T * Align512(2H)) bytes.
Otherwise (an A2 NPU, whose dispatch_v2 needs 16..256 ranks and a comm_alg choice; fp32; a rank without tokens; ...)
the portable exchange runs. Every condition is a function of the agreed plan and of the machine (SoC, HCCL_BUFFSIZE,
the same on every rank), so every rank takes the same path. ep_combine takes the MC2 path back when its dispatch
did and y has the dispatch's width and dtype; otherwise the portable way back, with the route derived from the plan.

The MC2 kernels want a communication domain no other operator uses: the first MC2 exchange on a group creates a
second group over the same ranks for them (once); the agreement exchanges stay on the user's group.
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from backends.ascend.runtime import npu, portable
from glm5_hal.ops.ep_plan import EPPlan
from glm5_hal.vendor_conventions import contract_quant_scale

A3_SOC_VERSIONS = range(250, 256)  # torch_npu.npu.get_soc_version() of Atlas A3 (A2: 220..225)
MAX_WORLD = 384  # combine_v2 on A3: ep_world_size in [2, 384] (dispatch_v2 takes up to 768)
MAX_EXPERTS = 512  # combine_v2: moe_expert_num in [1, 512]
HIDDEN_RANGE = range(1024, 7168 + 1)  # combine_v2 on A3: H in [1024, 7168]
MAX_TOKENS = 512  # A3: 0 < BS <= 512 tokens per rank
MAX_TOP_K = 16  # 0 < K <= 16
DEFAULT_HCCL_BUFFSIZE_MB = 200
QUANT_DYNAMIC = 2  # quant_mode 2: int8 codes + per-row dynamic scales
# The MC2 kernels' own group, per user group (weak keys: it goes with the group it serves).
_MC2_GROUPS: weakref.WeakKeyDictionary[dist.ProcessGroup, dist.ProcessGroup] = weakref.WeakKeyDictionary()


def _align(value: int, to: int) -> int:
    return -(-value // to) * to


def hccl_buffer_needed(plan: EPPlan) -> int:
    """Bytes of HCCL buffer dispatch_v2 / combine_v2 need on A3 (fullmesh_v1 formula of their documentation)."""
    max_tokens, hidden = max(plan.tokens), plan.hidden
    experts = plan.local_experts * max_tokens * plan.world_size * _align(_align(2 * hidden, 32) + 64, 512)
    shared = plan.top_k * max_tokens * _align(2 * hidden, 512)  # (K + shared_expert_num), shared_expert_num = 0
    return 2 * (experts + shared)


def _soc_version() -> int | None:
    try:
        return int(npu().npu.get_soc_version())
    except Exception:  # an older torch_npu without it, or no device: not an A3 we can vouch for
        return None


def mc2_unsupported(plan: EPPlan) -> str | None:
    """Why dispatch_v2 / combine_v2 cannot run this exchange (module docstring), or None if they can."""
    soc = _soc_version()
    if soc not in A3_SOC_VERSIONS:
        return f"MC2 is mapped on Atlas A3 (soc 250..255), this NPU reports {soc}"
    if plan.dtype not in (torch.bfloat16, torch.float16):
        return "dispatch_v2 takes bf16 / fp16 tokens"
    if not 2 <= plan.world_size <= MAX_WORLD:
        return f"combine_v2 takes 2..{MAX_WORLD} ranks"
    if plan.num_experts > MAX_EXPERTS:
        return f"combine_v2 takes at most {MAX_EXPERTS} experts"
    if plan.hidden not in HIDDEN_RANGE:
        return f"combine_v2 takes H in [{HIDDEN_RANGE.start}, {HIDDEN_RANGE.stop - 1}] on A3"
    if min(plan.tokens) < 1 or max(plan.tokens) > MAX_TOKENS:
        return f"dispatch_v2 takes 1..{MAX_TOKENS} tokens on every rank"
    if plan.top_k > MAX_TOP_K:
        return f"dispatch_v2 takes k <= {MAX_TOP_K}"
    if not plan.rows_unique:
        return "dispatch_v2 takes rows of topk_ids with distinct experts"
    budget = int(os.environ.get("HCCL_BUFFSIZE", DEFAULT_HCCL_BUFFSIZE_MB)) * 2**20
    if hccl_buffer_needed(plan) > budget:
        return f"HCCL_BUFFSIZE is {budget >> 20} MB, the exchange needs {-(-hccl_buffer_needed(plan) // 2**20)} MB"
    return None


def _mc2_group(group: dist.ProcessGroup) -> dist.ProcessGroup:
    """The group the MC2 kernels use for `group`'s ranks: created once, used by nothing else."""
    if group not in _MC2_GROUPS:
        _MC2_GROUPS[group] = dist.new_group(dist.get_process_group_ranks(group), use_local_synchronization=True)
    return _MC2_GROUPS[group]


def _comm_name(group: dist.ProcessGroup, device: torch.device) -> str:
    # torch_npu documents get_hccl_comm_name's argument as the global rank.
    return group._get_backend(device).get_hccl_comm_name(dist.get_rank())


@dataclass(frozen=True)
class _MC2Route:
    """What combine_v2 needs back from dispatch_v2, passed through untouched."""

    group_ep: str
    global_bs: int
    rows: int  # A: expand_x's rows
    expert_ids: Tensor
    assist_info: Tensor
    ep_recv_counts: Tensor
    tp_recv_counts: Tensor


@dataclass(frozen=True)
class _PortableRoute:
    """The portable exchange ran (inner: its route)."""

    inner: object


def _mc2_sizes(plan: EPPlan) -> dict[str, object]:
    return {"ep_world_size": plan.world_size, "ep_rank_id": plan.rank, "moe_expert_num": plan.num_experts}


def ep_dispatch(x: Tensor, topk_ids: Tensor, plan: EPPlan) -> tuple[Tensor, Tensor | None, object]:
    """glm5_hal.ep_dispatch on torch_npu (x [T, D], topk_ids [T, k]) -> (recv_x, recv_scale, route)."""
    unsupported = mc2_unsupported(plan)
    if unsupported is not None:
        recv_x, recv_scale, route = portable("ep_dispatch", unsupported)(x, topk_ids, plan)
        return recv_x, recv_scale, _PortableRoute(route)
    group_ep = _comm_name(_mc2_group(plan.group), x.device)
    global_bs = max(plan.tokens) * plan.world_size
    expert_ids = topk_ids.to(torch.int32).contiguous()
    expand_x, scales, assist_info, _, ep_recv_counts, tp_recv_counts, _ = npu().npu_moe_distribute_dispatch_v2(
        x.contiguous(),
        expert_ids,
        group_ep,
        **_mc2_sizes(plan),
        shared_expert_num=0,  # no shared-expert ranks: the model adds its shared expert itself
        quant_mode=QUANT_DYNAMIC if plan.quantize else 0,
        global_bs=global_bs,
        expert_token_nums_type=1,
    )
    rows = plan.recv_rows
    route = _MC2Route(group_ep, global_bs, expand_x.shape[0], expert_ids, assist_info, ep_recv_counts, tp_recv_counts)
    if plan.quantize:
        codes, scale = contract_quant_scale(expand_x[:rows], scales[:rows].to(torch.float32))
        return codes, scale, route
    return expand_x[:rows], None, route


def ep_combine(y: Tensor, topk_weights: Tensor, plan: EPPlan, route: object) -> Tensor:
    """glm5_hal.ep_combine on torch_npu: y [R, D'], topk_weights [T, k] -> out [T, D'] in y's dtype."""
    if isinstance(route, _PortableRoute):
        return portable("ep_combine", "its dispatch ran the portable exchange")(y, topk_weights, plan, route.inner)
    if y.shape[1] != plan.hidden or y.dtype != plan.dtype:
        reason = "combine_v2 returns rows of the dispatched width and dtype"
        return portable("ep_combine", reason)(y, topk_weights, plan, plan.route(route.expert_ids))
    expand_x = y.new_zeros(route.rows, y.shape[1])
    expand_x[: y.shape[0]] = y
    return npu().npu_moe_distribute_combine_v2(
        expand_x,
        route.expert_ids,
        route.assist_info,
        route.ep_recv_counts,
        topk_weights.to(torch.float32).contiguous(),
        route.group_ep,
        **_mc2_sizes(plan),
        tp_send_counts=route.tp_recv_counts,
        shared_expert_num=0,
        global_bs=route.global_bs,
    )
