"""MoE routing on MetaX: mcoplib's sgl_kernel.moe_fused_gate and _moe_C.grouped_topk.

    grouped_topk(scores = router logits, n_group, topk_group, topk, renormalize = norm_topk_prob,
                 routed_scaling_factor, bias (zeros when None), scoring_func 1 = sigmoid)
        sigmoid, + bias for selection, groups by the sum of their two best biased scores, weights = unbiased
        scores * factor / (their sum + 1e-20) when renormalising: the contract's formula, within
        n_group <= 32 and topk <= 32 (its TORCH_CHECKs)
    moe_fused_gate(logits, bias, n_group, topk_group, topk, 0 fused shared experts, factor, True)
        the same selection in one kernel, but it always renormalises and without the 1e-20: used for sigmoid with
        norm_topk_prob where E is a power of two and 8 <= E / n_group <= 32 (its checks and documented cases), and
        only where value checks show every logit >= MIN_FUSED_LOGIT (below that the missing 1e-20 could show)

Softmax scoring runs the portable path (grouped_topk scores with sigmoid or not at all). Neither kernel ranks NaN
the contract's way (grouped_topk drops non-finite scores), so a NaN logit runs the portable path while value
checks are on. Both break ties to the lower expert id and keep the lower group, as the contract does.
"""

from __future__ import annotations

import torch
from torch import Tensor

from backends.metax.runtime import available, kernel, portable
from glm5_hal.checks import value_checks_enabled

GROUPED = "mcoplib._moe_C"
FUSED = "mcoplib.sgl_kernel"
MAX_GROUPS = 32  # grouped_topk: "n_group should be smaller than or equal to 32"
MAX_TOPK = 32  # grouped_topk: "topk should be smaller than or equal to 32"
FUSED_PER_GROUP = (8, 32)  # moe_fused_gate: MAX_VPT = 32; "require 8 <= num_experts / num_expert_group <= 32"
# sigmoid(-30) = 9.4e-14: a top-k sum of at least that makes the contract's + 1e-20 a relative 1e-7, far inside
# fp32's tolerance, so moe_fused_gate's sum without it gives the same weights.
MIN_FUSED_LOGIT = -30.0


def _unsupported(router_logits: Tensor, top_k: int, n_group: int, scoring: str) -> str | None:
    num_tokens, num_experts = router_logits.shape
    if scoring != "sigmoid":
        return "grouped_topk / moe_fused_gate score with sigmoid (softmax is not among their scoring functions)"
    if n_group > MAX_GROUPS or top_k > MAX_TOPK or num_experts % n_group:
        return f"grouped_topk takes n_group <= {MAX_GROUPS} dividing E and top_k <= {MAX_TOPK}"
    if n_group > 1 and num_experts // n_group < 2:
        return "a group score is the sum of two experts' scores: groups need two experts"
    if num_tokens == 0:
        return "no tokens"
    return None


def _fused_fits(router_logits: Tensor, n_group: int, norm_topk_prob: bool) -> bool:
    num_experts = router_logits.shape[1]
    low, high = FUSED_PER_GROUP
    return (
        norm_topk_prob
        and available(FUSED)[0]
        and num_experts & (num_experts - 1) == 0
        and low <= num_experts // n_group <= high
        and value_checks_enabled(router_logits)
        and bool((router_logits >= MIN_FUSED_LOGIT).all())
    )


def moe_gate(router_logits, bias, *, top_k, n_group, topk_group, routed_scaling_factor, norm_topk_prob, scoring):
    """glm5_hal.moe_gate on mcoplib: router_logits [T, E] fp32, bias [E] fp32 or None
    -> (topk_weights [T, top_k] fp32, topk_ids [T, top_k] int32)."""
    reason = _unsupported(router_logits, top_k, n_group, scoring)
    if reason is None and value_checks_enabled(router_logits):
        if bool(torch.isnan(router_logits).any()) or (bias is not None and bool(torch.isnan(bias).any())):
            reason = "a NaN router logit or bias: the kernels drop non-finite scores, the contract ranks NaN first"
    if reason is not None:
        return portable("moe_gate", reason)(
            router_logits,
            bias,
            top_k=top_k,
            n_group=n_group,
            topk_group=topk_group,
            routed_scaling_factor=routed_scaling_factor,
            norm_topk_prob=norm_topk_prob,
            scoring=scoring,
        )
    logits = router_logits.to(torch.float32).contiguous()
    bias = torch.zeros_like(logits[0]) if bias is None else bias.to(torch.float32).contiguous()
    if _fused_fits(logits, n_group, norm_topk_prob):
        weights, ids = kernel(FUSED, "moe_fused_gate")(
            logits, bias, n_group, topk_group, top_k, 0, float(routed_scaling_factor), True
        )
    else:
        weights, ids = kernel(GROUPED, "grouped_topk")(
            logits, n_group, topk_group, top_k, bool(norm_topk_prob), float(routed_scaling_factor), bias, 1
        )
    return weights.to(torch.float32), ids.to(torch.int32)
