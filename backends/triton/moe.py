"""MoE kernels of the Triton backend: [gate] -> [dispatch] -> [grouped GEMMs] -> [combine], and `fused_moe`.

[moe_gate]        one program per block of tokens: scores, biased choice, group limit, top-k by repeated
                  argmax in registers (NaN first, ties to the lowest id), unbiased weights, normalisation, scaling
[moe_dispatch]    per block of assignments an expert histogram -> one program scans it into expert offsets
                  and per-block bases -> each assignment's row = base + its rank among the block's earlier
                  assignments to the same expert (stable) -> rows gathered into x_sorted
[grouped_matmul]  an index of (expert, first row) per BLOCK_M tile built on device from the offsets, then one
                  program per (tile, N tile); float, W8A8 and W4A8 variants share the index
[moe_combine]     out[t] = sum_j w[t, j] * y[row of (t, j)], rows found through the inverse permutation
[fused_moe]       dispatch -> grouped GEMM (w13) -> silu(gate) * up -> grouped GEMM (w2) -> combine, with fp32
                  intermediates (the second GEMM splits its activations into hi + lo halves of w2's dtype)

No host synchronisation anywhere: every grid is sized from shapes alone (the tile index has a bound of
cdiv(M, BLOCK_M) + E slots; slots past the real tile count are dead programs that own no rows).
Reference: ops_reference/moe.py
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from backends.triton.gemm_tuning import float_shapes, launch_gemm
from backends.triton.matmul import float_tile_matmul, interpreted_blocks, split_activations
from backends.triton.quant import cast_for_store, int8_tile_matmul, interpreted_int_blocks, w4a8_tile_matmul
from backends.triton.runtime import DOT_UPCAST, interpreting, unit_stride_arguments
from glm5_hal.checks import check, check_same_device, check_tensor

# Sentinel id for padding lanes of the gate's expert tile: larger than any real expert, so never a winner.
_NO_EXPERT = tl.constexpr(2**30)


# ------------------------------------------------------------------------------------------------- moe_gate
@triton.jit
def _moe_gate_kernel(
    # Pointers
    logits_ptr,  # [T, E] fp32 router logits
    bias_ptr,  # [E] fp32 selection bias (unused unless HAS_BIAS)
    weights_ptr,  # [T, top_k] fp32, written
    ids_ptr,  # [T, top_k] int32, written
    # Sizes and routing parameters
    num_tokens,
    experts_per_group,  # E / n_group
    n_group,
    topk_group,
    top_k,
    routed_scaling_factor,
    # Strides (elements)
    stride_lt,
    stride_le,
    stride_wt,
    stride_it,
    # Meta-parameters
    HAS_BIAS: tl.constexpr,
    SOFTMAX: tl.constexpr,  # softmax scores instead of sigmoid
    GROUPED: tl.constexpr,  # n_group > 1: only the topk_group best groups compete
    NORMALIZE: tl.constexpr,  # norm_topk_prob
    BLOCK_T: tl.constexpr,
    BLOCK_G: tl.constexpr,  # >= n_group
    BLOCK_EG: tl.constexpr,  # >= experts_per_group
    BLOCK_K: tl.constexpr,  # >= top_k
):
    # The expert axis is held as [group, member]: group limits are then plain reductions over the last axis.
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    token_ok = tokens < num_tokens
    group = tl.arange(0, BLOCK_G)[None, :, None]
    member = tl.arange(0, BLOCK_EG)[None, None, :]
    expert_ok = (group < n_group) & (member < experts_per_group)  # [1, BG, BEG]
    column = tl.where(expert_ok, group * experts_per_group + member, 0)
    expert = tl.where(expert_ok, column, _NO_EXPERT)  # padding lanes get an id no real expert has

    logits = tl.load(
        logits_ptr + tokens[:, None, None] * stride_lt + column * stride_le,
        mask=token_ok[:, None, None] & expert_ok,
        other=0.0,
    )
    if SOFTMAX:
        logits = tl.where(expert_ok, logits, float("-inf"))
        row_max = tl.max(tl.max(logits, axis=2), axis=1)
        p = tl.exp(logits - row_max[:, None, None])
        scores = p / tl.sum(tl.sum(p, axis=2), axis=1)[:, None, None]
    else:
        scores = 1.0 / (1.0 + tl.exp(-logits))
    scores = tl.where(expert_ok, scores, 0.0)
    choice = scores  # the bias moves the choice, never the weights
    if HAS_BIAS:
        choice += tl.load(bias_ptr + column, mask=expert_ok, other=0.0)
    choice = tl.where(expert_ok, choice, float("-inf"))

    # Every pick below ranks NaN above every number and breaks ties (NaN with NaN too) by the lowest id, as the
    # reference's stable NaN-first sort does (docs/ops.md "NaN"). NaN is found by x != x, never by max reductions,
    # which may skip it (fmax on GPUs, nanmax in the interpreter).
    if GROUPED:
        # Group score = its best biased score + its second best (the first maximum removed once); NaN if the group
        # holds a NaN (a NaN is always among its top two).
        is_nan = choice != choice
        group_nan = tl.max(is_nan.to(tl.int32), axis=2) > 0
        numbers = tl.where(is_nan, float("-inf"), choice)
        top1 = tl.max(numbers, axis=2)
        first = tl.min(tl.where(numbers == top1[:, :, None], member, BLOCK_EG), axis=2)
        top2 = tl.max(tl.where(member == first[:, :, None], float("-inf"), numbers), axis=2)
        group_score = tl.where(group_nan, float("nan"), top1 + top2)  # [BT, BG]; padding groups are -inf
        group_id = tl.arange(0, BLOCK_G)[None, :]
        keep = tl.zeros((BLOCK_T, BLOCK_G), tl.int32)
        for _ in range(topk_group):
            live = keep == 0
            g_nan = (group_score != group_score) & live
            g_numbers = tl.where(live & (group_score == group_score), group_score, float("-inf"))
            g_best = tl.max(g_numbers, axis=1)
            any_nan = tl.max(g_nan.to(tl.int32), axis=1) > 0
            candidate = tl.where(any_nan[:, None], g_nan, live & (g_numbers == g_best[:, None]))
            winner = tl.min(tl.where(candidate, group_id, BLOCK_G), axis=1)
            keep = tl.where(group_id == winner[:, None], 1, keep)
        choice = tl.where(keep[:, :, None] != 0, choice, float("-inf"))

    slot = tl.arange(0, BLOCK_K)[None, :]
    picked_weight = tl.zeros((BLOCK_T, BLOCK_K), tl.float32)
    picked_id = tl.zeros((BLOCK_T, BLOCK_K), tl.int32)
    taken = tl.zeros((BLOCK_T, BLOCK_G, BLOCK_EG), tl.int32)
    for k in range(top_k):
        live = (taken == 0) & expert_ok
        is_nan = (choice != choice) & live
        numbers = tl.where(live & (choice == choice), choice, float("-inf"))
        best = tl.max(tl.max(numbers, axis=2), axis=1)
        any_nan = tl.max(tl.max(is_nan.to(tl.int32), axis=2), axis=1) > 0
        candidate = tl.where(any_nan[:, None, None], is_nan, live & (numbers == best[:, None, None]))
        winner = tl.min(tl.min(tl.where(candidate, expert, _NO_EXPERT), axis=2), axis=1)
        hit = expert == winner[:, None, None]
        weight = tl.sum(tl.sum(tl.where(hit, scores, 0.0), axis=2), axis=1)
        taken = tl.where(hit, 1, taken)
        picked_weight = tl.where(slot == k, weight[:, None], picked_weight)
        picked_id = tl.where(slot == k, winner[:, None], picked_id)
    if NORMALIZE:
        picked_weight = picked_weight / (tl.sum(picked_weight, axis=1)[:, None] + 1e-20)
    picked_weight = picked_weight * routed_scaling_factor
    out_mask = token_ok[:, None] & (slot < top_k)
    tl.store(weights_ptr + tokens[:, None] * stride_wt + slot, picked_weight, mask=out_mask)
    tl.store(ids_ptr + tokens[:, None] * stride_it + slot, picked_id, mask=out_mask)


@unit_stride_arguments()
def moe_gate(
    router_logits: Tensor,
    bias: Tensor | None,
    *,
    top_k: int,
    n_group: int,
    topk_group: int,
    routed_scaling_factor: float,
    norm_topk_prob: bool,
    scoring: str,
) -> tuple[Tensor, Tensor]:
    """router_logits [T, E] fp32, bias [E] fp32 or None -> (topk_weights [T, top_k] fp32, topk_ids [T, top_k]
    int32), best biased score first; see glm5_hal.moe_gate for the routing rule."""
    num_tokens, num_experts = router_logits.shape
    check(scoring in ("sigmoid", "softmax"), ValueError, lambda: f"scoring: unsupported {scoring!r}")
    weights = torch.empty((num_tokens, top_k), dtype=torch.float32, device=router_logits.device)
    ids = torch.empty((num_tokens, top_k), dtype=torch.int32, device=router_logits.device)
    if num_tokens == 0:
        return weights, ids
    block_g = triton.next_power_of_2(n_group)
    block_eg = triton.next_power_of_2(num_experts // n_group)
    # ~4K fp32 per tile on a GPU (E = 256: 16 tokens a program); interpreted, one program covers the test batch.
    block_t = 64 if interpreting() else max(1, min(64, 4096 // (block_g * block_eg)))
    _moe_gate_kernel[(triton.cdiv(num_tokens, block_t),)](
        router_logits,
        router_logits if bias is None else bias,  # a valid pointer the kernel never reads without HAS_BIAS
        weights,
        ids,
        num_tokens=num_tokens,
        experts_per_group=num_experts // n_group,
        n_group=n_group,
        topk_group=topk_group,
        top_k=top_k,
        routed_scaling_factor=float(routed_scaling_factor),
        stride_lt=router_logits.stride(0),
        stride_le=router_logits.stride(1),
        stride_wt=weights.stride(0),
        stride_it=ids.stride(0),
        HAS_BIAS=bias is not None,
        SOFTMAX=scoring == "softmax",
        GROUPED=n_group > 1,
        NORMALIZE=bool(norm_topk_prob),
        BLOCK_T=block_t,
        BLOCK_G=block_g,
        BLOCK_EG=block_eg,
        BLOCK_K=triton.next_power_of_2(top_k),
    )
    return weights, ids


# --------------------------------------------------------------------------------------------- moe_dispatch
@triton.jit
def _block_histogram_kernel(
    ids_ptr,  # [T, k] int32/int64 expert ids; assignment a = t * k + j
    block_counts_ptr,  # [num_blocks, E] int32, written: assignments of each block per expert
    num_assignments,
    num_experts,
    top_k,
    stride_it,
    stride_ik,
    BLOCK_A: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    block = tl.program_id(0)
    a = block * BLOCK_A + tl.arange(0, BLOCK_A)
    ids = tl.load(ids_ptr + (a // top_k) * stride_it + (a % top_k) * stride_ik, mask=a < num_assignments, other=-1)
    for e0 in range(0, num_experts, BLOCK_E):
        experts = e0 + tl.arange(0, BLOCK_E)
        counts = tl.sum((ids.to(tl.int32)[:, None] == experts[None, :]).to(tl.int32), axis=0)
        tl.store(block_counts_ptr + block * num_experts + experts, counts, mask=experts < num_experts)


@triton.jit
def _scan_counts_kernel(
    block_counts_ptr,  # [num_blocks, E] int32
    block_base_ptr,  # [num_blocks, E] int32, written: first row of each (block, expert) run in x_sorted
    offsets_ptr,  # [E + 1] int64, written: expert_offsets
    num_blocks,
    num_experts,
    BLOCK_B: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    # One program: experts in chunks, in order, carrying the rows of the previous chunks.
    # offsets[0] = 0 is written by the caller (the buffer starts zeroed).
    rows_before = tl.zeros([BLOCK_E], tl.int32)  # the same value in every lane
    for e0 in range(0, num_experts, BLOCK_E):
        experts = e0 + tl.arange(0, BLOCK_E)
        expert_ok = experts < num_experts
        total = tl.zeros([BLOCK_E], tl.int32)
        for b0 in range(0, num_blocks, BLOCK_B):
            blocks = b0 + tl.arange(0, BLOCK_B)
            counts = tl.load(
                block_counts_ptr + blocks[:, None] * num_experts + experts[None, :],
                mask=(blocks < num_blocks)[:, None] & expert_ok[None, :],
                other=0,
            )
            total += tl.sum(counts, axis=0)
        ends = rows_before + tl.cumsum(total, axis=0)
        tl.store(offsets_ptr + experts + 1, ends.to(tl.int64), mask=expert_ok)
        # Blocks in order within each expert: that keeps equal experts in assignment order (stable).
        base = ends - total
        for b0 in range(0, num_blocks, BLOCK_B):
            blocks = b0 + tl.arange(0, BLOCK_B)
            mask = (blocks < num_blocks)[:, None] & expert_ok[None, :]
            counts = tl.load(block_counts_ptr + blocks[:, None] * num_experts + experts[None, :], mask=mask, other=0)
            tl.store(
                block_base_ptr + blocks[:, None] * num_experts + experts[None, :],
                base[None, :] + tl.cumsum(counts, axis=0) - counts,
                mask=mask,
            )
            base += tl.sum(counts, axis=0)
        rows_before += tl.sum(total, axis=0)


@triton.jit
def _assign_rows_kernel(
    ids_ptr,  # [T, k] int32/int64 expert ids
    block_base_ptr,  # [num_blocks, E] int32
    row_of_ptr,  # [T * k] int32, written: the x_sorted row of each assignment
    src_index_ptr,  # [T * k] int64, written: the assignment of each x_sorted row
    num_assignments,
    num_experts,
    top_k,
    stride_it,
    stride_ik,
    BLOCK_A: tl.constexpr,
):
    block = tl.program_id(0)
    lane = tl.arange(0, BLOCK_A)
    a = block * BLOCK_A + lane
    a_ok = a < num_assignments
    ids = tl.load(ids_ptr + (a // top_k) * stride_it + (a % top_k) * stride_ik, mask=a_ok, other=-1).to(tl.int32)
    # Rank among this block's earlier assignments to the same expert (masked lanes are last, so never counted).
    earlier_same = (ids[:, None] == ids[None, :]) & (lane[None, :] < lane[:, None])
    rank = tl.sum(earlier_same.to(tl.int32), axis=1)
    base = tl.load(block_base_ptr + block * num_experts + ids, mask=a_ok, other=0)
    row = base + rank
    tl.store(row_of_ptr + a, row, mask=a_ok)
    tl.store(src_index_ptr + row, a.to(tl.int64), mask=a_ok)


@triton.jit
def _gather_rows_kernel(
    x_ptr,  # [T, D]
    src_index_ptr,  # [M] int64 assignment of each output row
    out_ptr,  # [M, D], written: out[r] = x[src_index[r] // top_k]
    num_rows,
    width,
    top_k,
    stride_xt,
    stride_xd,
    stride_om,
    stride_od,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    row_ok = rows < num_rows
    mask = row_ok[:, None] & (cols < width)[None, :]
    token = tl.load(src_index_ptr + rows, mask=row_ok, other=0) // top_k
    values = tl.load(x_ptr + token[:, None] * stride_xt + cols[None, :] * stride_xd, mask=mask, other=0.0)
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :] * stride_od, values, mask=mask)


@dataclass(frozen=True)
class Dispatch:
    """moe_dispatch's outputs plus `row_of` [T * k] int32, the inverse of src_index (the x_sorted row of each
    assignment), which combine needs and dispatch gets for free."""

    x_sorted: Tensor
    expert_offsets: Tensor
    src_index: Tensor
    row_of: Tensor


def _rows_blocks(width: int) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_D) of the row-copying kernels (gather, combine, silu-and-mul)."""
    if interpreting():
        return 64, min(triton.next_power_of_2(width), 512)
    return 16, min(triton.next_power_of_2(width), 256)


def dispatch_assignments(x: Tensor, topk_ids: Tensor, num_experts: int) -> Dispatch:
    """x [T, D], topk_ids [T, k] int32/int64 -> the stable counting sort of the T * k assignments by expert."""
    num_tokens, top_k = topk_ids.shape
    num_assignments = num_tokens * top_k
    device = x.device
    src_index = torch.empty(num_assignments, dtype=torch.int64, device=device)
    row_of = torch.empty(num_assignments, dtype=torch.int32, device=device)
    offsets = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    x_sorted = torch.empty((num_assignments, x.shape[1]), dtype=x.dtype, device=device)
    if num_assignments == 0:
        return Dispatch(x_sorted, offsets, src_index, row_of)
    # GPU: the rank step compares BLOCK_A x BLOCK_A lanes, so keep it at 64. Interpreted: whole test batches.
    block_a = 256 if interpreting() else 64
    block_e = min(triton.next_power_of_2(num_experts), 64)
    num_blocks = triton.cdiv(num_assignments, block_a)
    block_counts = torch.empty((num_blocks, num_experts), dtype=torch.int32, device=device)
    block_base = torch.empty_like(block_counts)
    ids_strides = {"stride_it": topk_ids.stride(0), "stride_ik": topk_ids.stride(1)}
    _block_histogram_kernel[(num_blocks,)](
        topk_ids,
        block_counts,
        num_assignments=num_assignments,
        num_experts=num_experts,
        top_k=top_k,
        **ids_strides,
        BLOCK_A=block_a,
        BLOCK_E=block_e,
    )
    _scan_counts_kernel[(1,)](
        block_counts,
        block_base,
        offsets,
        num_blocks=num_blocks,
        num_experts=num_experts,
        BLOCK_B=min(triton.next_power_of_2(num_blocks), 64),
        BLOCK_E=block_e,
    )
    _assign_rows_kernel[(num_blocks,)](
        topk_ids,
        block_base,
        row_of,
        src_index,
        num_assignments=num_assignments,
        num_experts=num_experts,
        top_k=top_k,
        **ids_strides,
        BLOCK_A=block_a,
    )
    if x.shape[1] == 0:  # zero-width rows: the permutation above is the whole result
        return Dispatch(x_sorted, offsets, src_index, row_of)
    block_r, block_d = _rows_blocks(x.shape[1])
    _gather_rows_kernel[(triton.cdiv(num_assignments, block_r), triton.cdiv(x.shape[1], block_d))](
        x,
        src_index,
        x_sorted,
        num_rows=num_assignments,
        width=x.shape[1],
        top_k=top_k,
        stride_xt=x.stride(0),
        stride_xd=x.stride(1),
        stride_om=x_sorted.stride(0),
        stride_od=x_sorted.stride(1),
        BLOCK_R=block_r,
        BLOCK_D=block_d,
    )
    return Dispatch(x_sorted, offsets, src_index, row_of)


@unit_stride_arguments()
def moe_dispatch(x: Tensor, topk_ids: Tensor, num_experts: int) -> tuple[Tensor, Tensor, Tensor]:
    """x [T, D], topk_ids [T, k] -> (x_sorted [T * k, D], expert_offsets int64 [E + 1], src_index int64 [T * k])."""
    d = dispatch_assignments(x, topk_ids, num_experts)
    return d.x_sorted, d.expert_offsets, d.src_index


# ---------------------------------------------------------------------------------------- expert tile index
@triton.jit
def _tile_index_kernel(
    offsets_ptr,  # [E + 1] int64 expert_offsets
    tile_expert_ptr,  # [num_slots] int32, written: the expert of each BLOCK_M tile, -1 past the last tile
    tile_row_ptr,  # [num_slots] int32, written: the tile's first row
    num_experts,
    num_slots,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,  # >= E
    BLOCK_S: tl.constexpr,
):
    experts = tl.arange(0, BLOCK_E)
    expert_ok = experts < num_experts
    start = tl.load(offsets_ptr + experts, mask=expert_ok, other=0).to(tl.int32)
    end = tl.load(offsets_ptr + experts + 1, mask=expert_ok, other=0).to(tl.int32)
    num_tiles = (end - start + BLOCK_M - 1) // BLOCK_M  # 0 for padding experts and zero-token experts
    tiles_end = tl.cumsum(num_tiles, axis=0)
    tiles_begin = tiles_end - num_tiles
    for s0 in range(0, num_slots, BLOCK_S):
        slots = s0 + tl.arange(0, BLOCK_S)
        # The owner of slot s is the number of experts whose tiles all come before s (E or more: a dead slot).
        owner = tl.sum((tiles_end[None, :] <= slots[:, None]).to(tl.int32), axis=1)
        is_owner = experts[None, :] == owner[:, None]
        first_row = tl.sum(tl.where(is_owner, start[None, :] + (slots[:, None] - tiles_begin[None, :]) * BLOCK_M, 0), 1)
        live = owner < num_experts
        slot_ok = slots < num_slots
        tl.store(tile_expert_ptr + slots, tl.where(live, owner, -1), mask=slot_ok)
        tl.store(tile_row_ptr + slots, first_row, mask=slot_ok)


@dataclass(frozen=True)
class ExpertTiles:
    """BLOCK_M row tiles of the expert segments, built on device: tile s covers rows tile_row[s] .. the smaller of
    tile_row[s] + block_m and the expert's end, with weights of expert tile_expert[s] (-1: no such tile)."""

    tile_expert: Tensor  # [num_slots] int32
    tile_row: Tensor  # [num_slots] int32
    block_m: int

    @property
    def num_slots(self) -> int:
        return self.tile_expert.shape[0]


def expert_tiles(expert_offsets: Tensor, num_rows: int, block_m: int) -> ExpertTiles:
    """The tile index of rows grouped by expert_offsets [E + 1] int64, for tiles of block_m rows."""
    num_experts = expert_offsets.shape[0] - 1
    # Each expert adds at most one partial tile; each live tile owns at least one row.
    num_slots = max(1, min(triton.cdiv(num_rows, block_m) + num_experts, num_rows))
    tile_expert = torch.empty(num_slots, dtype=torch.int32, device=expert_offsets.device)
    tile_row = torch.empty_like(tile_expert)
    _tile_index_kernel[(1,)](
        expert_offsets,
        tile_expert,
        tile_row,
        num_experts=num_experts,
        num_slots=num_slots,
        BLOCK_M=block_m,
        BLOCK_E=triton.next_power_of_2(num_experts),
        BLOCK_S=256 if interpreting() else 32,
    )
    return ExpertTiles(tile_expert, tile_row, block_m)


@triton.jit
def _expert_tile(tile_expert_ptr, tile_row_ptr, offsets_ptr, K, BLOCK_M: tl.constexpr):
    """This program's tile: -> (expert as int64, rows [BLOCK_M], row_mask, k_end). A dead tile gets expert 0, no
    rows and k_end 0, so its K loop is empty and it stores nothing."""
    tile = tl.program_id(0)
    expert = tl.load(tile_expert_ptr + tile)
    live = expert >= 0
    expert = tl.maximum(expert, 0).to(tl.int64)  # int64: expert * expert-stride exceeds 2^31 at GLM-5 sizes
    rows = tl.load(tile_row_ptr + tile) + tl.arange(0, BLOCK_M)
    # (A dead tile's end of 0 rather than `mask & live`: the interpreter turns block & scalar bool into ints.)
    row_mask = rows < tl.where(live, tl.load(offsets_ptr + expert + 1), 0)
    return expert, rows, row_mask, tl.where(live, K, 0)


# ------------------------------------------------------------------------------------------ grouped GEMMs
@triton.jit
def _grouped_matmul_kernel(
    # Pointers
    x_ptr,  # [M, K] rows grouped by expert (w's dtype, or fp32 with SPLIT)
    w_ptr,  # [E, N, K]
    y_ptr,  # [M, N], written (any float dtype)
    offsets_ptr,  # [E + 1] int64
    tile_expert_ptr,  # [num_slots] int32
    tile_row_ptr,  # [num_slots] int32
    # Sizes
    N,
    K,
    # Strides (elements)
    stride_xm,
    stride_xk,
    stride_we,
    stride_wn,
    stride_wk,
    stride_ym,
    stride_yn,
    # Meta-parameters
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
    SPLIT: tl.constexpr,
):
    expert, rows, row_mask, k_end = _expert_tile(tile_expert_ptr, tile_row_ptr, offsets_ptr, K, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    acc = float_tile_matmul(
        x_ptr, w_ptr + expert * stride_we, rows, row_mask, cols, col_mask, k_end,
        stride_xm, stride_xk, stride_wn, stride_wk, BLOCK_M, BLOCK_N, BLOCK_K, DOT_UPCAST, SPLIT,
    )  # fmt: skip
    tl.store(
        y_ptr + rows[:, None] * stride_ym + cols[None, :] * stride_yn,
        cast_for_store(acc, y_ptr.dtype.element_ty),
        mask=row_mask[:, None] & col_mask[None, :],
    )


@triton.jit
def _grouped_quant_matmul_kernel(
    # Pointers
    x_ptr,  # [M, K] int8 rows grouped by expert
    x_scale_ptr,  # [M] fp32
    w_ptr,  # [E, N, K] int8
    w_scale_ptr,  # [E, N] fp32
    y_ptr,  # [M, N] out dtype, written
    offsets_ptr,
    tile_expert_ptr,
    tile_row_ptr,
    # Sizes
    N,
    K,
    # Strides (elements)
    stride_xm,
    stride_xk,
    stride_we,
    stride_wn,
    stride_wk,
    stride_se,
    stride_sn,
    stride_ym,
    stride_yn,
    # Meta-parameters
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    expert, rows, row_mask, k_end = _expert_tile(tile_expert_ptr, tile_row_ptr, offsets_ptr, K, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    acc = int8_tile_matmul(
        x_ptr, w_ptr + expert * stride_we, rows, row_mask, cols, col_mask, k_end,
        stride_xm, stride_xk, stride_wn, stride_wk, BLOCK_M, BLOCK_N, BLOCK_K,
    )  # fmt: skip
    x_scale = tl.load(x_scale_ptr + rows, mask=row_mask, other=0.0)
    w_scale = tl.load(w_scale_ptr + expert * stride_se + cols * stride_sn, mask=col_mask, other=0.0)
    tl.store(
        y_ptr + rows[:, None] * stride_ym + cols[None, :] * stride_yn,
        cast_for_store(acc.to(tl.float32) * x_scale[:, None] * w_scale[None, :], y_ptr.dtype.element_ty),
        mask=row_mask[:, None] & col_mask[None, :],
    )


@triton.jit
def _grouped_w4a8_matmul_kernel(
    # Pointers
    x_ptr,  # [M, K] int8 rows grouped by expert
    x_scale_ptr,  # [M] fp32
    w_ptr,  # [E, N, K/2] uint8, two int4 per byte along K
    w_scale_ptr,  # [E, N, K / group_size] fp32
    y_ptr,  # [M, N] out dtype, written
    offsets_ptr,
    tile_expert_ptr,
    tile_row_ptr,
    # Sizes
    N,
    K,
    group_size,
    # Strides (elements)
    stride_xm,
    stride_xk,
    stride_we,
    stride_wn,
    stride_wk,
    stride_se,
    stride_sn,
    stride_sg,
    stride_ym,
    stride_yn,
    # Meta-parameters
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    expert, rows, row_mask, k_end = _expert_tile(tile_expert_ptr, tile_row_ptr, offsets_ptr, K, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    acc = w4a8_tile_matmul(
        x_ptr, w_ptr + expert * stride_we, w_scale_ptr + expert * stride_se, rows, row_mask, cols, col_mask,
        k_end, group_size, stride_xm, stride_xk, stride_wn, stride_wk, stride_sn, stride_sg,
        BLOCK_M, BLOCK_N, BLOCK_K,
    )  # fmt: skip
    x_scale = tl.load(x_scale_ptr + rows, mask=row_mask, other=0.0)
    tl.store(
        y_ptr + rows[:, None] * stride_ym + cols[None, :] * stride_yn,
        cast_for_store(acc * x_scale[:, None], y_ptr.dtype.element_ty),
        mask=row_mask[:, None] & col_mask[None, :],
    )


def _block_m(num_rows: int, num_experts: int) -> int:
    """Rows per tile: about the mean rows per expert, between 16 (tensor-core minimum) and 64 (128 interpreted)."""
    mean_rows = triton.next_power_of_2(max(1, triton.cdiv(num_rows, max(num_experts, 1))))
    return max(16, min(128 if interpreting() else 64, mean_rows))


def _launch_grouped(
    kernel: triton.JITFunction,
    shapes: str,
    interpreted: dict[str, int],
    tiles: ExpertTiles,
    expert_offsets: Tensor,
    x: Tensor,
    w: Tensor,
    y: Tensor,
    **kernel_specific: object,
) -> None:
    """Launch a grouped GEMM kernel (x [M, K] rows grouped by expert, w [E, N, K or K/2], y [M, N]) over the tile
    index and N, with the arguments every grouped kernel takes; tiles as backends/triton/gemm_tuning.py gives them
    (`interpreted`: the interpreter's BLOCK_N and BLOCK_K)."""
    n, k = y.shape[1], x.shape[1]
    launch_gemm(
        kernel,
        shapes,
        lambda block_n: (tiles.num_slots, triton.cdiv(n, block_n)),
        interpreted,
        x_ptr=x,
        w_ptr=w,
        y_ptr=y,
        offsets_ptr=expert_offsets,
        tile_expert_ptr=tiles.tile_expert,
        tile_row_ptr=tiles.tile_row,
        N=n,
        K=k,
        stride_xm=x.stride(0),
        stride_xk=x.stride(1),
        stride_we=w.stride(0),
        stride_wn=w.stride(1),
        stride_wk=w.stride(2),
        stride_ym=y.stride(0),
        stride_yn=y.stride(1),
        BLOCK_M=tiles.block_m,
        **kernel_specific,
    )


def grouped_matmul_tiles(
    x_sorted: Tensor,
    w: Tensor,
    tiles: ExpertTiles,
    expert_offsets: Tensor,
    *,
    out_dtype: torch.dtype | None = None,
) -> Tensor:
    """grouped_matmul over a prebuilt tile index (fused_moe reuses one index for both of its GEMMs).

    x_sorted: in w's dtype, or fp32 (an intermediate, split into hi + lo halves: backends/triton/matmul.py).
    out_dtype: y's dtype (default x_sorted's); fp32 keeps an intermediate unrounded.
    """
    num_rows, k = x_sorted.shape
    n = w.shape[1]
    y = torch.empty((num_rows, n), dtype=out_dtype or x_sorted.dtype, device=x_sorted.device)
    if num_rows == 0 or n == 0:
        return y
    _launch_grouped(
        _grouped_matmul_kernel,
        float_shapes(x_sorted.dtype == torch.float32),
        interpreted_blocks(n, k),
        tiles,
        expert_offsets,
        x_sorted,
        w,
        y,
        DOT_UPCAST=DOT_UPCAST,
        SPLIT=split_activations(x_sorted, w),
    )
    return y


@unit_stride_arguments()
def grouped_matmul(x_sorted: Tensor, w: Tensor, expert_offsets: Tensor) -> Tensor:
    """x_sorted [M, K] grouped by expert, w [E, N, K], expert_offsets [E + 1] int64 -> y [M, N] (x's dtype),
    y[r] = x_sorted[r] @ w[e(r)]^T with fp32 accumulation."""
    num_rows = x_sorted.shape[0]
    if num_rows == 0:
        return x_sorted.new_empty((0, w.shape[1]))
    tiles = expert_tiles(expert_offsets, num_rows, _block_m(num_rows, w.shape[0]))
    return grouped_matmul_tiles(x_sorted, w, tiles, expert_offsets)


def _check_grouped_int8_inputs(
    x_q: Tensor, x_scale: Tensor, expert_offsets: Tensor, out_dtype: torch.dtype, sizes: dict[str, int]
) -> None:
    check_tensor("x_q", x_q, ["M", "K"], (torch.int8,), sizes)
    check_tensor("x_scale", x_scale, ["M"], (torch.float32,), sizes)
    sizes["E+1"] = sizes["E"] + 1
    check_tensor("expert_offsets", expert_offsets, ["E+1"], (torch.int64,), sizes)
    check(
        out_dtype in (torch.bfloat16, torch.float16, torch.float32),
        TypeError,
        lambda: f"out_dtype: expected torch.bfloat16, torch.float16 or torch.float32, got {out_dtype!r}",
    )


@unit_stride_arguments()
def grouped_quant_matmul(
    x_q: Tensor,
    x_scale: Tensor,
    w_q: Tensor,
    w_scale: Tensor,
    expert_offsets: Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
) -> Tensor:
    """Grouped W8A8 GEMM (not a public op yet): each expert's rows through `quant_matmul` with its weights.

    Args:
        x_q: [M, K], int8. Rows grouped by expert (dynamic_quant of x_sorted). x_scale: [M], fp32.
        w_q: [E, N, K], int8. w_scale: [E, N], fp32. Per expert, per output channel.
        expert_offsets: [E + 1], int64. Row range of each expert (0 ... M, non-decreasing; not value-checked).
        out_dtype: bf16, fp16 or fp32.

    Returns:
        y: [M, N], out_dtype. y[r] = int32(x_q[r] @ w_q[e]^T) * x_scale[r] * w_scale[e] for r in expert e.

    Reference: ops_reference/quant.py quant_matmul, per expert.
    """
    sizes: dict[str, int] = {}
    check_tensor("w_q", w_q, ["E", "N", "K"], (torch.int8,), sizes)
    check_tensor("w_scale", w_scale, ["E", "N"], (torch.float32,), sizes)
    _check_grouped_int8_inputs(x_q, x_scale, expert_offsets, out_dtype, sizes)
    check_same_device(x_q=x_q, x_scale=x_scale, w_q=w_q, w_scale=w_scale, expert_offsets=expert_offsets)
    (num_rows, k), n = x_q.shape, w_q.shape[1]
    y = torch.empty((num_rows, n), dtype=out_dtype, device=x_q.device)
    if num_rows == 0 or n == 0:
        return y
    tiles = expert_tiles(expert_offsets, num_rows, _block_m(num_rows, w_q.shape[0]))
    _launch_grouped(
        _grouped_quant_matmul_kernel,
        "int8",
        interpreted_int_blocks(n, k),
        tiles,
        expert_offsets,
        x_q,
        w_q,
        y,
        x_scale_ptr=x_scale,
        w_scale_ptr=w_scale,
        stride_se=w_scale.stride(0),
        stride_sn=w_scale.stride(1),
    )
    return y


@unit_stride_arguments()
def grouped_w4a8_matmul(
    x_q: Tensor,
    x_scale: Tensor,
    w_packed: Tensor,
    w_scale: Tensor,
    expert_offsets: Tensor,
    group_size: int | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> Tensor:
    """Grouped W4A8 GEMM (not a public op yet): each expert's rows through `w4a8_matmul` with its weights.

    Args:
        x_q: [M, K], int8. Rows grouped by expert. x_scale: [M], fp32.
        w_packed: [E, N, K / 2], uint8. int4 in [-8, 7], even k in the low nibble, odd k in the high one.
        w_scale: [E, N] fp32 (group_size None: per output channel) or [E, N, K / group_size] fp32.
        expert_offsets: [E + 1], int64. Row range of each expert (0 ... M, non-decreasing; not value-checked).
        group_size: K-elements per weight scale, an even divisor of K; None = one scale per channel.
        out_dtype: bf16, fp16 or fp32.

    Returns:
        y: [M, N], out_dtype. Per expert, each K-group accumulated exactly in int32, times its weight scale,
            summed, times x_scale.

    Reference: ops_reference/quant.py w4a8_matmul, per expert.
    """
    sizes: dict[str, int] = {}
    check_tensor("x_q", x_q, ["M", "K"], (torch.int8,), sizes)
    k = sizes["K"]
    check(k % 2 == 0, ValueError, lambda: f"x_q: expected an even K (int4 weights pack two per byte), got K = {k}")
    check_tensor("w_packed", w_packed, ["E", "N", k // 2], (torch.uint8,), sizes)
    if group_size is None:
        check_tensor("w_scale", w_scale, ["E", "N"], (torch.float32,), sizes)
    else:
        check(
            isinstance(group_size, int) and group_size > 0 and group_size % 2 == 0 and k % group_size == 0,
            ValueError,
            lambda: f"group_size: expected None or an even divisor of K = {k}, got {group_size!r}",
        )
        check_tensor("w_scale", w_scale, ["E", "N", k // group_size], (torch.float32,), sizes)
    _check_grouped_int8_inputs(x_q, x_scale, expert_offsets, out_dtype, sizes)
    check_same_device(x_q=x_q, x_scale=x_scale, w_packed=w_packed, w_scale=w_scale, expert_offsets=expert_offsets)
    num_rows, n = x_q.shape[0], w_packed.shape[1]
    y = torch.empty((num_rows, n), dtype=out_dtype, device=x_q.device)
    if num_rows == 0 or n == 0:
        return y
    scales = w_scale.reshape(w_scale.shape[0], n, -1)  # per channel = one group of K
    group = k if group_size is None else group_size
    tiles = expert_tiles(expert_offsets, num_rows, _block_m(num_rows, w_packed.shape[0]))
    _launch_grouped(
        _grouped_w4a8_matmul_kernel,
        "int8",
        interpreted_int_blocks(n, group),
        tiles,
        expert_offsets,
        x_q,
        w_packed,
        y,
        x_scale_ptr=x_scale,
        w_scale_ptr=scales,
        group_size=group,
        stride_se=scales.stride(0),
        stride_sn=scales.stride(1),
        stride_sg=scales.stride(2),
    )
    return y


# ---------------------------------------------------------------------------------- combine, silu-and-mul
@triton.jit
def _invert_permutation_kernel(src_index_ptr, row_of_ptr, num_rows, BLOCK: tl.constexpr):
    """row_of[src_index[r]] = r. Values outside [0, num_rows) are skipped: validation rules them out, and with value
    checks off they must not become stores outside row_of."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = rows < num_rows
    assignment = tl.load(src_index_ptr + rows, mask=ok, other=0)
    ok &= (assignment >= 0) & (assignment < num_rows)
    tl.store(row_of_ptr + assignment, rows, mask=ok)


@triton.jit
def _combine_kernel(
    y_ptr,  # [T * k, D] expert outputs in x_sorted order
    row_of_ptr,  # [T * k] int32: the y row of assignment t * k + j
    weights_ptr,  # [T, k] fp32 routing weights
    out_ptr,  # [T, D], written
    num_tokens,
    width,
    top_k,
    stride_ym,
    stride_yd,
    stride_wt,
    stride_wk,
    stride_ot,
    stride_od,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    token_ok = tokens < num_tokens
    mask = token_ok[:, None] & (cols < width)[None, :]
    acc = tl.zeros((BLOCK_T, BLOCK_D), tl.float32)
    for j in range(top_k):  # slots in order: a fixed, deterministic summation order
        rows = tl.load(row_of_ptr + tokens * top_k + j, mask=token_ok, other=-1)
        weight = tl.load(weights_ptr + tokens * stride_wt + j * stride_wk, mask=token_ok, other=0.0)
        # row -1: an assignment no row came from (only with value checks off); it reads nothing.
        y = tl.load(
            y_ptr + rows[:, None] * stride_ym + cols[None, :] * stride_yd, mask=mask & (rows >= 0)[:, None], other=0.0
        )
        acc += weight[:, None] * y.to(tl.float32)
    tl.store(
        out_ptr + tokens[:, None] * stride_ot + cols[None, :] * stride_od,
        cast_for_store(acc, out_ptr.dtype.element_ty),
        mask=mask,
    )


def combine_rows(
    y_sorted: Tensor, row_of: Tensor, topk_weights: Tensor, out_dtype: torch.dtype | None = None
) -> Tensor:
    """y_sorted [T * k, D], row_of [T * k] int32 (y row of each assignment), topk_weights [T, k] -> out [T, D] in
    out_dtype (default y_sorted's)."""
    num_tokens, top_k = topk_weights.shape
    width = y_sorted.shape[1]
    out = torch.empty((num_tokens, width), dtype=out_dtype or y_sorted.dtype, device=y_sorted.device)
    if num_tokens == 0 or width == 0:
        return out
    block_t, block_d = _rows_blocks(width)
    _combine_kernel[(triton.cdiv(num_tokens, block_t), triton.cdiv(width, block_d))](
        y_sorted,
        row_of,
        topk_weights,
        out,
        num_tokens=num_tokens,
        width=width,
        top_k=top_k,
        stride_ym=y_sorted.stride(0),
        stride_yd=y_sorted.stride(1),
        stride_wt=topk_weights.stride(0),
        stride_wk=topk_weights.stride(1),
        stride_ot=out.stride(0),
        stride_od=out.stride(1),
        BLOCK_T=block_t,
        BLOCK_D=block_d,
    )
    return out


@unit_stride_arguments()
def moe_combine(y_sorted: Tensor, src_index: Tensor, topk_weights: Tensor) -> Tensor:
    """y_sorted [T * k, D], src_index [T * k] int64 (a permutation), topk_weights [T, k] fp32 -> out [T, D]
    = sum_j topk_weights[t, j] * y_sorted[row of assignment t * k + j]."""
    num_rows = src_index.shape[0]
    row_of = torch.full((num_rows,), -1, dtype=torch.int32, device=src_index.device)
    if num_rows > 0:
        block = 1024
        _invert_permutation_kernel[(triton.cdiv(num_rows, block),)](src_index, row_of, num_rows=num_rows, BLOCK=block)
    return combine_rows(y_sorted, row_of, topk_weights)


@triton.jit
def _silu_and_mul_kernel(
    h_ptr,  # [M, 2 * I]: gate columns then up columns
    out_ptr,  # [M, I], written: silu(gate) * up
    num_rows,
    inter,
    stride_hm,
    stride_hd,
    stride_om,
    stride_od,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = (rows < num_rows)[:, None] & (cols < inter)[None, :]
    gate_ptrs = h_ptr + rows[:, None] * stride_hm + cols[None, :] * stride_hd
    gate = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_ptrs + inter * stride_hd, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    offsets = rows[:, None] * stride_om + cols[None, :] * stride_od
    tl.store(out_ptr + offsets, cast_for_store(out, out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(h: Tensor) -> Tensor:
    """h [M, 2 * I] ([gate | up]) -> silu(gate) * up [M, I] in h's dtype, fp32 math."""
    num_rows, inter = h.shape[0], h.shape[1] // 2
    out = torch.empty((num_rows, inter), dtype=h.dtype, device=h.device)
    if num_rows == 0 or inter == 0:
        return out
    block_r, block_d = _rows_blocks(inter)
    _silu_and_mul_kernel[(triton.cdiv(num_rows, block_r), triton.cdiv(inter, block_d))](
        h,
        out,
        num_rows=num_rows,
        inter=inter,
        stride_hm=h.stride(0),
        stride_hd=h.stride(1),
        stride_om=out.stride(0),
        stride_od=out.stride(1),
        BLOCK_R=block_r,
        BLOCK_D=block_d,
    )
    return out


@unit_stride_arguments()
def fused_moe(x: Tensor, topk_weights: Tensor, topk_ids: Tensor, w13: Tensor, w2: Tensor) -> Tensor:
    """x [T, D], topk_weights [T, k] fp32, topk_ids [T, k], w13 [E, 2I, D], w2 [E, D, I] -> out [T, D] (x's
    dtype): dispatch, grouped GEMM with w13, silu(gate) * up, grouped GEMM with w2, weighted combine. The
    expert intermediates stay fp32 (see below); only the output is rounded to x's dtype."""
    num_experts = w13.shape[0]
    routed = dispatch_assignments(x, topk_ids, num_experts)
    num_rows = routed.x_sorted.shape[0]
    if num_rows == 0:
        return torch.zeros_like(x)
    tiles = expert_tiles(routed.expert_offsets, num_rows, _block_m(num_rows, num_experts))
    # The intermediates stay fp32 (h, the activations, y; backends/triton/matmul.py says why). The second GEMM
    # still runs on w2's dtype: it splits the fp32 activations into hi + lo halves of that dtype in registers,
    # which doubles its dots but not its weight reads.
    h = grouped_matmul_tiles(routed.x_sorted, w13, tiles, routed.expert_offsets, out_dtype=torch.float32)
    activated = silu_and_mul(h)
    y = grouped_matmul_tiles(activated, w2, tiles, routed.expert_offsets, out_dtype=torch.float32)
    return combine_rows(y, routed.row_of, topk_weights, out_dtype=x.dtype)
