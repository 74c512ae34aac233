"""Fake vllm-kunlun MoE kernels: moe_sigmoid_group_topk_norm -> gen_block_statistic -> moe_pre_sorted -> moe_fc ->
moe_post, the chain vllm_kunlun/ops/_kunlun_ops.py runs for a bf16 MoE layer.

vllm-kunlun documents these kernels only through their names, shapes and the way its callers chain them; the
fake's semantics are the ones that chain implies (docs/vendors.md lists them as what hardware must confirm):
- moe_sigmoid_group_topk_norm: DeepSeek-V3's routing (sigmoid scores, selection by score + bias among the
  topk_group groups of best top-2 sum, unbiased weights normalised to 1, times `scale`); k = topk_index's width.
- gen_block_statistic: per block of tokens, how many of their assignments each expert got; moe_pre_sorted reads
  it, so the fake refuses a statistic that was not made from the same topk ids.
- moe_pre_sorted: rows grouped by expert (moe_expand), sorted_tokens_num_lod = row offsets [E+1], expert_m = rows
  per expert, moe_index[t * k + j] = the row assignment (t, j) landed in. The order of rows WITHIN an expert is
  not documented: the fake puts them in descending assignment order, the opposite of the contract's, so nothing
  downstream may rely on it.
- moe_fc (sort_mode, no activation, no quantization): y row r = x row r @ weight[e(r)]^T, e(r) from the offsets.
- moe_post: y[t] = sum_j normed_scale[t, j] * dequant_scale[t, j] * x.flat[moe_index[t, j]].
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

import ops_reference as ref
from fakes.kunlun.common import ACTIVATION_DTYPES, not_modeled, require, require_lengths, require_output
from fakes.schema_fake import device_tensor, host


def _block_statistic(ids: np.ndarray, blocks: int, experts: int) -> np.ndarray:
    """[blocks, E] counts of each expert among the assignments of each of `blocks` equal runs of tokens."""
    stats = np.zeros((blocks, experts), np.int64)
    for b, part in enumerate(np.array_split(ids, blocks)):
        stats[b] = np.bincount(part.reshape(-1), minlength=experts)
    return stats


def _topk_ids(op: str, topk_ids: Tensor, experts: int) -> np.ndarray:
    require(
        topk_ids.dtype == torch.int32 and topk_ids.dim() == 2,
        op,
        f"topk ids must be int32 [M, k], got {topk_ids.dtype} {tuple(topk_ids.shape)}",
    )
    ids = host(topk_ids)
    require(bool(((ids >= 0) & (ids < experts)).all()), op, f"topk ids must lie in [0, {experts})")
    return ids


def moe_sigmoid_group_topk_norm(
    x: Tensor,
    topk_index: Tensor,
    norm_score: Tensor,
    block_static: Tensor,
    bias: Tensor,
    scale: float,
    n_group: int,
    topk_group: int,
) -> None:
    op = "moe_sigmoid_group_topk_norm"
    require(x.dtype == torch.float32 and x.dim() == 2, op, f"x must be fp32 [M, E], got {x.dtype} {tuple(x.shape)}")
    tokens, experts = x.shape
    top_k = topk_index.shape[-1]
    require(1 <= top_k <= experts, op, f"k = topk_index's width must lie in [1, E], got {top_k}")
    require(
        n_group >= 1 and experts % n_group == 0 and 1 <= topk_group <= n_group,
        op,
        f"E = {experts} must split into n_group = {n_group} groups, 1 <= topk_group <= n_group",
    )
    require_output(op, "topk_index", topk_index, ((tokens, top_k),), torch.int32)
    require_output(op, "norm_score", norm_score, ((tokens, top_k),), torch.float32)
    require(
        block_static.dtype == torch.int32 and block_static.dim() == 2 and block_static.shape[1] == experts,
        op,
        "block_static must be int32 [blocks, E]",
    )
    require(bias.dtype == torch.float32 and tuple(bias.shape) == (experts,), op, "bias must be fp32 [E]")
    logits, shift = host(x), host(bias)
    not_modeled(not (np.isnan(logits).any() or np.isnan(shift).any()), op, "NaN scores (their rank is not documented)")
    weights, ids = ref.moe_gate(
        logits,
        shift,
        top_k=top_k,
        n_group=n_group,
        topk_group=topk_group,
        routed_scaling_factor=scale,
        norm_topk_prob=True,
        scoring="sigmoid",
    )
    topk_index.copy_(device_tensor(ids, torch.int32, x))
    norm_score.copy_(device_tensor(weights, torch.float32, x))
    block_static.copy_(device_tensor(_block_statistic(ids, block_static.shape[0], experts), torch.int32, x))


def gen_block_statistic(topk_ids: Tensor, block_statistic: Tensor) -> None:
    op = "gen_block_statistic"
    require(
        block_statistic.dtype == torch.int32 and block_statistic.dim() == 2 and block_statistic.is_contiguous(),
        op,
        "block_statistic must be contiguous int32 [blocks, E]",
    )
    blocks, experts = block_statistic.shape
    ids = _topk_ids(op, topk_ids, experts)
    block_statistic.copy_(device_tensor(_block_statistic(ids, blocks, experts), torch.int32, topk_ids))


def moe_pre_sorted(
    x: Tensor,
    topk_index: Tensor,
    block_statistic: Tensor,
    moe_expand: Tensor,
    moe_index: Tensor,
    expert_m: Tensor,
    sorted_tokens_num_lod: Tensor,
    index_have_neg: bool = False,
) -> None:
    op = "moe_pre_sorted"
    not_modeled(not index_have_neg, op, "index_have_neg (expert ids of -1)")
    require(
        x.dim() == 2 and x.dtype in ACTIVATION_DTYPES and x.is_contiguous(),
        op,
        f"x must be contiguous bf16/fp16 [M, D], got {x.dtype} {tuple(x.shape)}",
    )
    experts = expert_m.numel()
    ids = _topk_ids(op, topk_index, experts)
    require(ids.shape[0] == x.shape[0], op, "topk_index must have a row per token of x")
    require(
        block_statistic.dim() == 2 and block_statistic.shape[1] == experts, op, "block_statistic must be [blocks, E]"
    )
    made = _block_statistic(ids, block_statistic.shape[0], experts)
    require(
        np.array_equal(host(block_statistic), made),
        op,
        "block_statistic must come from gen_block_statistic over the same topk ids",
    )
    rows = ids.size
    require_output(op, "moe_expand", moe_expand, ((rows, x.shape[1]),), x.dtype)
    require_output(op, "moe_index", moe_index, ((rows,),), torch.int32)
    require_output(op, "expert_m", expert_m, ((experts,),), torch.int32)
    require_output(op, "sorted_tokens_num_lod", sorted_tokens_num_lod, ((experts + 1,),), torch.int32)
    flat = ids.reshape(-1)
    # Experts ascending; within one, assignments DEscending (undocumented: see the module docstring).
    order = np.lexsort((-np.arange(rows), flat))  # order[r] = the assignment in row r
    row_of = np.empty(rows, np.int64)
    row_of[order] = np.arange(rows)
    counts = np.bincount(flat, minlength=experts)
    moe_expand.copy_(x[torch.from_numpy(order // ids.shape[1]).to(x.device)])
    moe_index.copy_(device_tensor(row_of, torch.int32, x))
    expert_m.copy_(device_tensor(counts, torch.int32, x))
    sorted_tokens_num_lod.copy_(device_tensor(np.concatenate([[0], np.cumsum(counts)]), torch.int32, x))


def moe_fc(
    x: Tensor,
    weight: Tensor,
    sorted_tokens_num_lod: Tensor,
    sorted_tokens_idx: Tensor,
    moe_topk: int,
    y: Tensor,
    act: str | None = None,
    x_perchannel_max: Tensor | None = None,
    w_perchannel_max: Tensor | None = None,
    topk_ids: Tensor | None = None,
    topk_w: Tensor | None = None,
    bias: Tensor | None = None,
    tgemm_type: str | None = None,
    tweight_type: str | None = None,
    scale_n: int | None = 0,
    scale_k: int | None = 0,
    use_pack_int4: bool | None = False,
    sort_mode: bool | None = True,
) -> None:
    op = "moe_fc"
    not_modeled(act is None, op, f"act={act!r}")
    not_modeled(
        all(t is None for t in (x_perchannel_max, w_perchannel_max, topk_ids, topk_w, bias)),
        op,
        "quantized inputs, routing weights or bias",
    )
    not_modeled(tgemm_type is None and tweight_type is None and not scale_n and not scale_k, op, "GEMM type overrides")
    not_modeled(not use_pack_int4 and sort_mode in (None, True), op, "int4 weights or sort_mode=False")
    require(
        x.dim() == 2 and x.dtype in ACTIVATION_DTYPES and x.is_contiguous(),
        op,
        f"x must be contiguous bf16/fp16 [rows, K], got {x.dtype} {tuple(x.shape)}",
    )
    require(
        weight.dim() == 3 and weight.dtype == x.dtype and weight.is_contiguous(),
        op,
        "weight must be contiguous [E, N, K] in x's dtype",
    )
    rows, experts, n = x.shape[0], weight.shape[0], weight.shape[1]
    require(weight.shape[2] == x.shape[1], op, f"weight's K {weight.shape[2]} != x's {x.shape[1]}")
    require_lengths(op, "sorted_tokens_num_lod", sorted_tokens_num_lod, (experts + 1,))
    lod = host(sorted_tokens_num_lod)
    require(
        lod[0] == 0 and lod[-1] == rows and bool((np.diff(lod) >= 0).all()),
        op,
        f"sorted_tokens_num_lod must be non-decreasing offsets from 0 to {rows}",
    )
    require_lengths(op, "sorted_tokens_idx", sorted_tokens_idx, (rows,))
    require(
        np.array_equal(np.sort(host(sorted_tokens_idx)), np.arange(rows)),
        op,
        "sorted_tokens_idx must be a permutation of the rows",
    )
    require(moe_topk >= 1 and rows % moe_topk == 0, op, f"moe_topk {moe_topk} must divide the {rows} rows")
    require_output(op, "y", y, ((rows, n), (rows // moe_topk, moe_topk, n)), x.dtype)
    out = ref.grouped_matmul(host(x), host(weight), lod.astype(np.int64))
    y.copy_(device_tensor(out, x.dtype, x).view(y.shape))


def moe_post(x: Tensor, moe_index: Tensor, normed_scale: Tensor, dequant_scale: Tensor, y: Tensor) -> None:
    op = "moe_post"
    require(
        x.dim() == 3 and x.dtype in ACTIVATION_DTYPES and x.is_contiguous(),
        op,
        f"x must be contiguous bf16/fp16 [M, k, D], got {x.dtype} {tuple(x.shape)}",
    )
    tokens, top_k, width = x.shape
    require_lengths(op, "moe_index", moe_index, (tokens, top_k))
    index = host(moe_index)
    require(
        np.array_equal(np.sort(index.reshape(-1)), np.arange(tokens * top_k)),
        op,
        "moe_index must be a permutation of the M * k rows",
    )
    for name, t in (("normed_scale", normed_scale), ("dequant_scale", dequant_scale)):
        require(t.dtype == torch.float32 and tuple(t.shape) == (tokens, top_k), op, f"{name} must be fp32 [M, k]")
    require_output(op, "y", y, ((tokens, width),), x.dtype)
    rows = host(x).reshape(tokens * top_k, width)
    weights = host(normed_scale) * host(dequant_scale)
    y.copy_(device_tensor(np.einsum("tk,tkd->td", weights, rows[index]), x.dtype, x))
