"""Fake mcoplib kernels (quant, top-k, MoE gate) written from their sources' semantics, computed in float64 with
ops_reference where the formula is the contract's. Outputs the sources leave undefined are poisoned."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

import ops_reference as ref
from fakes.metax.common import not_modeled, require
from fakes.schema_fake import INT8_POISON, device_tensor, host

FLOATS = (torch.float32, torch.float16, torch.bfloat16)
FAST_TOPK = 2048  # TopK in op/sglang/csrc/elementwise/topk.cu
INV_127 = np.float32(0.0078740157)  # the constant int8_quant_kernels.cu multiplies max|x| by


def dynamic_scaled_int8_quant(result: Tensor, input: Tensor, scale: Tensor, azp: Tensor | None) -> None:
    op = "dynamic_scaled_int8_quant"
    not_modeled(azp is None, op, "the asymmetric mode (azp)")
    require(input.dtype in FLOATS and input.is_contiguous(), op, "input: contiguous fp32 / fp16 / bf16")
    require(result.dtype == torch.int8 and result.is_contiguous() and result.shape == input.shape, op, "result")
    tokens = input.numel() // max(1, input.shape[-1])
    require(scale.dtype == torch.float32 and scale.is_contiguous() and scale.numel() == tokens, op, "scale")
    x = input.detach().to(torch.float32).reshape(tokens, -1).numpy()
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        absx = np.abs(x)
        absmax = np.where(np.isnan(absx), 0, absx).max(axis=1).astype(np.float32)  # its `>` max skips NaN
        codes = np.clip(np.rint(x * (np.float32(127) * (np.float32(1) / absmax))[:, None]), -127, 127)
    # A zero row (0 * inf), a row holding NaN or inf: its codes are not defined by the kernel.
    undefined = (absmax == 0) | ~np.isfinite(absmax) | np.isnan(x).any(axis=1)
    codes = np.where(undefined[:, None], INT8_POISON, codes)
    result.copy_(torch.from_numpy(codes.astype(np.int8)).view(result.shape))
    scale.copy_(torch.from_numpy(absmax * INV_127).view(scale.shape))


def cutlass_scaled_mm(out: Tensor, a: Tensor, b: Tensor, a_scales: Tensor, b_scales: Tensor, bias: Tensor | None):
    op = "cutlass_scaled_mm"
    require(a.dim() == b.dim() == out.dim() == 2, op, "a, b, out: 2-D")
    require(out.shape[0] == a.shape[0] and a.shape[1] == b.shape[0] and b.shape[1] == out.shape[1], op, "shapes")
    require(a.dtype == b.dtype == torch.int8, op, "int8 a and b (the int8 path is the one modelled)")
    require(out.dtype in (torch.bfloat16, torch.float16), op, "out: bf16 or fp16")
    require(a_scales.numel() in (1, a.shape[0]) and b_scales.numel() in (1, b.shape[1]), op, "scale sizes")
    require(a.stride(1) == 1 and out.stride(1) == 1, op, "a and out row-major")
    require(b.stride(0) == 1, op, "b column-major")
    require(out.stride(0) % 16 == 0 and b.stride(1) % 16 == 0, op, "16 byte alignment")
    require(a_scales.is_contiguous() and b_scales.is_contiguous(), op, "contiguous scales")
    require(a_scales.dtype == b_scales.dtype == torch.float32, op, "fp32 scales")
    if bias is not None:
        require(bias.numel() == b.shape[1] and bias.is_contiguous() and bias.dtype == out.dtype, op, "bias")
    y = ref.int_matmul(host(a), host(b).T) * host(a_scales).reshape(-1, 1) * host(b_scales).reshape(1, -1)
    if bias is not None:
        y = y + host(bias)[None, :]
    out.copy_(device_tensor(y, out.dtype, out))


def fast_topk(score: Tensor, indices: Tensor, lengths: Tensor, row_starts: Tensor | None) -> None:
    op = "fast_topk"
    require(score.dim() == 2 and score.stride(1) == 1 and score.dtype == torch.float32, op, "score [B, S] fp32")
    rows = score.shape[0]
    require(lengths.dim() == 1 and lengths.is_contiguous() and lengths.shape[0] == rows, op, "lengths [B]")
    require(lengths.dtype == torch.int32, op, "lengths int32")
    require(indices.dim() == 2 and indices.is_contiguous() and indices.shape == (rows, FAST_TOPK), op, "indices")
    require(indices.dtype == torch.int32, op, "indices int32")
    starts = np.zeros(rows, np.int64)
    if row_starts is not None:
        require(row_starts.dim() == 1 and row_starts.shape[0] == rows, op, "row_starts [B]")
        starts = host(row_starts)
    s, n = host(score), host(lengths)
    out = np.full((rows, FAST_TOPK), -1, np.int64)
    order_seed = np.random.default_rng(0)
    for r in range(rows):
        require(0 <= n[r] and starts[r] + n[r] <= score.shape[1], op, "a row's keys inside score")
        if n[r] <= FAST_TOPK:
            out[r, : n[r]] = np.arange(n[r])  # the kernel's naive path: positions in order, then -1
            continue
        row = s[r, starts[r] : starts[r] + n[r]]
        if np.isnan(row).any():
            out[r] = 0  # how the radix select ranks NaN is not defined: a poison set (one position, repeated)
            continue
        best = np.argsort(-row, kind="stable")[:FAST_TOPK]
        out[r] = order_seed.permutation(best)  # the order of the picks is not documented either
    indices.copy_(torch.from_numpy(out.astype(np.int32)))


def _finite_rows(x: np.ndarray) -> np.ndarray:
    return np.isfinite(x).all(axis=1)


def grouped_topk(scores, n_group, topk_group, topk, renormalize, routed_scaling_factor, bias, scoring_func):
    op = "grouped_topk"
    require(scores.dim() == 2, op, "scores must be a 2D Tensor")
    num_experts = scores.shape[1]
    require(num_experts % n_group == 0, op, "num_experts should be divisible by n_group")
    require(n_group <= 32 and topk <= 32, op, "n_group <= 32 and topk <= 32")
    require(scoring_func in (0, 1), op, "scoring_func must be SCORING_NONE (0) or SCORING_SIGMOID (1)")
    not_modeled(scoring_func == 1, op, "SCORING_NONE")
    require(scores.dtype in FLOATS and bias.dtype in FLOATS and bias.numel() == num_experts, op, "dtypes, bias")
    not_modeled(n_group == 1 or num_experts // n_group >= 2, op, "groups of one expert")
    logits, b = host(scores), host(bias).reshape(-1)
    weights, ids = ref.moe_gate(
        logits,
        b,
        top_k=topk,
        n_group=n_group,
        topk_group=topk_group,
        routed_scaling_factor=routed_scaling_factor,
        norm_topk_prob=renormalize,
        scoring="sigmoid",
    )
    finite = _finite_rows(logits)[:, None]  # the kernel drops non-finite scores: not the contract's rule
    weights, ids = np.where(finite, weights, np.nan), np.where(finite, ids, -1)
    return device_tensor(weights, torch.float32, scores), device_tensor(ids, torch.int32, scores)


def moe_fused_gate(
    input, bias, num_expert_group, topk_group, topk, num_fused_shared_experts, routed_scaling_factor, apply_on_output
):
    op = "moe_fused_gate"
    require(input.dtype == bias.dtype, op, "input and bias should have the same dtype")
    num_experts = input.shape[1]
    require(num_experts & (num_experts - 1) == 0, op, "num_experts must be a power of 2")
    require(num_experts % num_expert_group == 0, op, "num_experts must be divisible by num_expert_group")
    per_group = num_experts // num_expert_group
    require(8 <= per_group <= 32, op, "8 <= num_experts / num_expert_group <= 32 (MAX_VPT; the dynamic kernel)")
    require(input.is_contiguous() and bias.is_contiguous(), op, "contiguous input and bias (vector loads)")
    not_modeled(num_fused_shared_experts == 0, op, "fused shared experts")
    logits, b = host(input), host(bias).reshape(-1)
    picked, ids = ref.moe_gate(
        logits,
        b,
        top_k=topk,
        n_group=num_expert_group,
        topk_group=topk_group,
        routed_scaling_factor=1.0,
        norm_topk_prob=False,
        scoring="sigmoid",
    )
    weights = picked / picked.sum(axis=1, keepdims=True)  # always renormalised, and without the contract's 1e-20
    if apply_on_output:
        weights = weights * routed_scaling_factor
    finite = _finite_rows(logits)[:, None]  # NaN compares false in its argmax: how it ranks NaN is not defined
    weights, ids = np.where(finite, weights, np.nan), np.where(finite, ids, -1)
    return [device_tensor(weights, torch.float32, input), device_tensor(ids, torch.int32, input)]
