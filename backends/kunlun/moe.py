"""MoE on Kunlunxin: moe_sigmoid_group_topk_norm -> gen_block_statistic + moe_pre_sorted -> moe_fc -> moe_post, the
chain vllm_kunlun/ops/_kunlun_ops.py runs for a bf16 layer (semantics as its callers chain them:
parity_tests/fakes/kunlun/moe.py, docs/vendors.md).

moe_gate:        moe_sigmoid_group_topk_norm(router_logits, bias (zeros when None), scale = routed_scaling_factor,
                 n_group, topk_group): sigmoid routing that always renormalises, so softmax scoring and
                 norm_topk_prob=False run the portable path
moe_dispatch:    portable: moe_pre_sorted does not document the order of rows within an expert, which the contract
                 fixes (stable by (token, slot))
grouped_matmul:  moe_fc(x_sorted, w [E, N, K], sorted_tokens_num_lod = expert_offsets as int32, rows already sorted:
                 sorted_tokens_idx = 0..M-1 with moe_topk 1)
moe_combine:     moe_post(y_sorted as [T, k, D], moe_index = inverse of src_index, normed_scale = topk_weights,
                 dequant_scale = 1): the only place routing weights are applied, as the contract wants
fused_moe:       gen_block_statistic, moe_pre_sorted, moe_fc(w13), silu(gate) * up in fp32, moe_fc(w2), moe_post;
                 moe_pre_sorted's moe_index (row of each assignment) is what moe_post gathers with, whatever the
                 order within an expert. Its kernels return bf16 / fp16 intermediates, so fp16 and bf16 with fewer
                 than 16 outputs per token run the portable path (glm5_hal.vendor_precision).
Every kernel here takes bf16/fp16 activations (what vllm-kunlun feeds them); fp32 runs the portable path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from backends.kunlun.runtime import kernel, portable, unavailable
from glm5_hal.checks import value_checks_enabled
from glm5_hal.vendor_conventions import invert_permutation
from glm5_hal.vendor_precision import fused_moe_chain_unsupported

ACTIVATIONS = (torch.bfloat16, torch.float16)
STATISTIC_BLOCKS = 12  # rows of the block statistic, as every vllm-kunlun caller allocates it


def moe_gate_unsupported(router_logits: Tensor, bias: Tensor | None, scoring: str, norm_topk_prob: bool) -> str | None:
    """Why moe_sigmoid_group_topk_norm cannot express this routing, or None if it can."""
    if unavailable():
        return unavailable()
    if scoring != "sigmoid" or not norm_topk_prob:
        return "moe_sigmoid_group_topk_norm scores with sigmoid and always renormalises"
    if router_logits.shape[0] == 0:
        return "no tokens"
    if value_checks_enabled(router_logits) and (
        bool(torch.isnan(router_logits).any()) or (bias is not None and bool(torch.isnan(bias).any()))
    ):
        # The contract ranks NaN first (docs/ops.md "NaN"); how the kernel ranks it is not documented.
        return "a NaN router logit or bias: the kernel does not document how it ranks NaN"
    return None


def moe_gate(router_logits, bias, *, top_k, n_group, topk_group, routed_scaling_factor, norm_topk_prob, scoring):
    """glm5_hal.moe_gate on Kunlunxin: router_logits [T, E] fp32, bias [E] fp32 or None
    -> (topk_weights [T, top_k] fp32, topk_ids [T, top_k] int32)."""
    unsupported = moe_gate_unsupported(router_logits, bias, scoring, norm_topk_prob)
    if unsupported is not None:
        return portable("moe_gate", unsupported)(
            router_logits,
            bias,
            top_k=top_k,
            n_group=n_group,
            topk_group=topk_group,
            routed_scaling_factor=routed_scaling_factor,
            norm_topk_prob=norm_topk_prob,
            scoring=scoring,
        )
    tokens, experts = router_logits.shape
    device = router_logits.device
    ids = torch.empty(tokens, top_k, dtype=torch.int32, device=device)
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=device)
    statistic = torch.zeros(STATISTIC_BLOCKS, experts, dtype=torch.int32, device=device)
    # A zero bias selects exactly as no bias (the kernel's bias is not optional).
    shift = torch.zeros(experts, dtype=torch.float32, device=device) if bias is None else bias.to(torch.float32)
    kernel("moe_sigmoid_group_topk_norm")(
        router_logits.to(torch.float32).contiguous(),
        ids,
        weights,
        statistic,
        shift.contiguous(),
        float(routed_scaling_factor),
        n_group,
        topk_group,
    )
    return weights, ids


def _expert_gemm(rows: Tensor, w: Tensor, lod: Tensor, row_index: Tensor, moe_topk: int) -> Tensor:
    """moe_fc: rows [M, K] grouped by expert (offsets lod [E+1] int32) times w[e]^T -> [M, N] in rows' dtype."""
    y = torch.empty(rows.shape[0], w.shape[1], dtype=rows.dtype, device=rows.device)
    kernel("moe_fc")(rows.contiguous(), w.contiguous(), lod, row_index, moe_topk, y)
    return y


def _gemm_unsupported(x: Tensor, w: Tensor) -> str | None:
    if unavailable():
        return unavailable()
    if x.dtype not in ACTIVATIONS or w.dtype != x.dtype:
        return f"moe_fc takes bf16/fp16 rows and weights of one dtype, got {x.dtype}/{w.dtype}"
    if x.shape[0] == 0:
        return "no rows"
    return None


def grouped_matmul(x_sorted, w, expert_offsets):
    """glm5_hal.grouped_matmul on Kunlunxin: x_sorted [M, K], w [E, N, K], expert_offsets [E+1] -> [M, N]."""
    unsupported = _gemm_unsupported(x_sorted, w)
    if unsupported is not None:
        return portable("grouped_matmul", unsupported)(x_sorted, w, expert_offsets)
    rows = torch.arange(x_sorted.shape[0], dtype=torch.int32, device=x_sorted.device)  # already in expert order
    return _expert_gemm(x_sorted, w, expert_offsets.to(torch.int32).contiguous(), rows, 1)


def _post(y_sorted: Tensor, row_of_assignment: Tensor, topk_weights: Tensor) -> Tensor:
    """moe_post: out [T, D] = sum_j topk_weights[t, j] * y_sorted[row_of_assignment[t * k + j]]."""
    tokens, top_k = topk_weights.shape
    out = torch.empty(tokens, y_sorted.shape[1], dtype=y_sorted.dtype, device=y_sorted.device)
    weights = topk_weights.to(torch.float32).contiguous()
    kernel("moe_post")(
        y_sorted.contiguous().view(tokens, top_k, -1),
        row_of_assignment.to(torch.int32).view(tokens, top_k),
        weights,
        torch.ones_like(weights),  # no dequantization: the rows are bf16 / fp16 already
        out,
    )
    return out


def moe_combine(y_sorted, src_index, topk_weights):
    """glm5_hal.moe_combine on Kunlunxin: y_sorted [T*k, D], src_index [T*k] int64, topk_weights [T, k] fp32
    -> out [T, D] = sum_j topk_weights[t, j] * (the row that came from assignment t*k + j)."""
    if unavailable() or y_sorted.dtype not in ACTIVATIONS or y_sorted.shape[0] == 0:
        reason = unavailable() or "moe_post takes bf16/fp16 rows (and at least one)"
        return portable("moe_combine", reason)(y_sorted, src_index, topk_weights)
    return _post(y_sorted, invert_permutation(src_index), topk_weights)


def fused_moe(x, topk_weights, topk_ids, w13, w2):
    """glm5_hal.fused_moe on Kunlunxin: x [T, D], topk_weights [T, k] fp32, topk_ids [T, k], w13 [E, 2I, D],
    w2 [E, D, I] -> out [T, D]."""
    unsupported = _gemm_unsupported(x, w13) or _gemm_unsupported(x, w2)
    if unsupported is None and topk_ids.numel() == 0:
        unsupported = "no assignments"
    # moe_fc and moe_post return bf16 / fp16: fp16, and bf16 with few outputs per token, miss the tolerance through
    # the chain's roundings (glm5_hal.vendor_precision, measured on the strict fake).
    unsupported = unsupported or fused_moe_chain_unsupported(x.dtype, x.shape[1])
    if unsupported is not None:
        return portable("fused_moe", unsupported)(x, topk_weights, topk_ids, w13, w2)
    tokens, top_k = topk_ids.shape
    experts, device = w13.shape[0], x.device
    ids = topk_ids.to(torch.int32).contiguous()
    statistic = torch.zeros(STATISTIC_BLOCKS, experts, dtype=torch.int32, device=device)
    kernel("gen_block_statistic")(ids, statistic)
    rows = torch.empty(tokens * top_k, x.shape[1], dtype=x.dtype, device=device)
    row_of_assignment = torch.empty(tokens * top_k, dtype=torch.int32, device=device)
    counts = torch.empty(experts, dtype=torch.int32, device=device)
    lod = torch.empty(experts + 1, dtype=torch.int32, device=device)
    kernel("moe_pre_sorted")(x.contiguous(), ids, statistic, rows, row_of_assignment, counts, lod)
    gate_up = _expert_gemm(rows, w13, lod, row_of_assignment, top_k).float()
    gate, up = gate_up.chunk(2, dim=-1)
    hidden = (F.silu(gate) * up).to(x.dtype)  # fp32 activation, rounded once into the GEMM's input dtype
    return _post(_expert_gemm(hidden, w2, lod, row_of_assignment, top_k), row_of_assignment, topk_weights)
