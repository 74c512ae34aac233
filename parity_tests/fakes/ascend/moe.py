"""Fake torch_npu MoE kernels: npu_moe_gating_top_k, npu_moe_init_routing_v2, npu_grouped_matmul,
npu_moe_token_unpermute.

Gating follows the MoeGatingTopK formula of the CANN docs (norm, bias for selection only, group scores by max or
top-2 sum, top-k, gather the unbiased scores, renormalise for sigmoid, scale). Routing is a stable sort of the
flattened expert ids (the MoeInitRoutingV3 golden of torch_npu.npu_moe_init_routing_v2). Unpermute gathers
T[k] = permuted[sorted_indices[k]] and sums each token's top-k rows weighted by probs.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

import ops_reference as ref
from fakes.ascend.common import (
    FLOAT_DTYPES,
    SCALAR_TYPES,
    device_tensor,
    host,
    is_transposed_2d,
    not_modeled,
    poison,
    require,
)


def npu_moe_gating_top_k(
    x: Tensor,
    k: int,
    *,
    bias=None,
    input_ids=None,
    tid2eid=None,
    k_group=1,
    group_count=1,
    group_select_mode=0,
    renorm=0,
    norm_type=0,
    out_flag=False,
    routed_scaling_factor=1.0,
    eps=1e-20,
):
    """x [T, E <= 2048] fp16/bf16/fp32; bias [E] in x's dtype; 1 <= k <= E / group_count * k_group; 1 <= k_group <=
    group_count; E % group_count == 0, E / group_count > 2, align32(E / group_count) * group_count <= 2048;
    group_select_mode 0 (max) or 1 (top-2 sum); renorm 0 only; norm_type 0 softmax / 1 sigmoid.
    -> (y [T, k] x's dtype, expert_idx [T, k] int32, norm_out [T, E] fp32 if out_flag)."""
    op = "npu_moe_gating_top_k"
    not_modeled(input_ids is None and tid2eid is None, op, "the hash mode (input_ids, tid2eid)")
    require(
        x.dim() == 2 and x.dtype in FLOAT_DTYPES,
        op,
        f"x must be 2-D float16/bfloat16/float32, got {x.dtype} {tuple(x.shape)}",
    )
    num_experts = x.shape[1]
    require(num_experts <= 2048, op, f"the expert count must be <= 2048, got {num_experts}")
    require(
        bias is None or (bias.dtype == x.dtype and tuple(bias.shape) == (num_experts,)),
        op,
        "bias must be [E] in x's dtype",
    )
    require(group_count > 0 and num_experts % group_count == 0, op, "group_count must divide the expert count")
    per_group = num_experts // group_count
    require(per_group > 2, op, f"E / group_count must be > 2, got {per_group}")
    require(
        -(-per_group // 32) * 32 * group_count <= 2048, op, "align32(E / group_count) * group_count must be <= 2048"
    )
    require(1 <= k_group <= group_count, op, f"k_group must lie in [1, group_count], got {k_group}")
    require(1 <= k <= per_group * k_group, op, f"k must lie in [1, E / group_count * k_group], got {k}")
    require(group_select_mode in (0, 1), op, f"group_select_mode must be 0 or 1, got {group_select_mode}")
    require(renorm == 0, op, f"renorm only supports 0, got {renorm}")
    require(norm_type in (0, 1), op, f"norm_type must be 0 (softmax) or 1 (sigmoid), got {norm_type}")

    logits = host(x)
    if norm_type == 1:
        norm = 1.0 / (1.0 + np.exp(-logits))
    else:
        shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
        norm = shifted / shifted.sum(axis=1, keepdims=True)
    select = norm if bias is None else norm + host(bias)
    if group_count > 1:
        grouped = select.reshape(-1, group_count, per_group)
        top = np.sort(grouped, axis=-1)
        score = top[..., -1] if group_select_mode == 0 else top[..., -2:].sum(-1)
        kept = np.argsort(-score, axis=1, kind="stable")[:, :k_group]
        mask = np.zeros(score.shape, bool)
        np.put_along_axis(mask, kept, True, axis=1)
        select = np.where(np.repeat(mask, per_group, axis=1), select, -np.inf)
    ids = np.argsort(-select, axis=1, kind="stable")[:, :k]
    y = np.take_along_axis(norm, ids, axis=1)
    if norm_type == 1:
        y = y / (y.sum(axis=1, keepdims=True) + eps)
    y = y * routed_scaling_factor
    norm_out = device_tensor(norm, torch.float32, x) if out_flag else poison(tuple(x.shape), torch.float32, x)
    return device_tensor(y, x.dtype, x), device_tensor(ids, torch.int32, x), norm_out


def npu_moe_init_routing_v2(
    x: Tensor,
    expert_idx: Tensor,
    *,
    scale=None,
    offset=None,
    active_num=-1,
    expert_capacity=-1,
    expert_num=-1,
    drop_pad_mode=0,
    expert_tokens_num_type=0,
    expert_tokens_num_flag=False,
    quant_mode=-1,
    active_expert_range=(),
    row_idx_type=0,
    x_dtype=None,
):
    """x [T, H] fp16/bf16/fp32; expert_idx [T, K] int32 in [0, expert_num); expert_num in (0, 10240];
    drop_pad_mode 0 only; expert_tokens_num_type 1 (count) or 2 (key_value) only, with expert_tokens_num_flag True;
    quant_mode -1 (no quantization) modeled. -> (expanded_x [T*K, H] grouped by expert ascending, stable in
    assignment order; expanded_row_idx [T*K] int32: row_idx_type 0 assignment -> row, 1 row -> assignment;
    per-expert counts int64; expanded_scale [T*K] fp32, undefined without `scale`)."""
    op = "npu_moe_init_routing_v2"
    not_modeled(quant_mode == -1 and scale is None and offset is None, op, "quantized routing and scale inputs")
    not_modeled(
        x_dtype is None and (active_num in (-1, 0) or active_num >= expert_idx.numel()), op, "active_num limits"
    )
    require(
        x.dim() == 2 and expert_idx.dim() == 2 and x.shape[0] == expert_idx.shape[0],
        op,
        "x [T, H] and expert_idx [T, K] must match",
    )
    require(x.dtype in FLOAT_DTYPES + (torch.int8,), op, f"x dtype {x.dtype} is not supported")
    require(expert_idx.dtype == torch.int32, op, f"expert_idx must be int32, got {expert_idx.dtype}")
    require(0 < expert_num <= 10240, op, f"expert_num must lie in (0, 10240], got {expert_num}")
    require(drop_pad_mode == 0, op, "drop_pad_mode only supports 0 (dropless)")
    require(
        expert_tokens_num_type in (1, 2),
        op,
        f"expert_tokens_num_type only supports 1 and 2, got {expert_tokens_num_type}",
    )
    require(expert_tokens_num_flag, op, "expert_tokens_num_flag only supports True")
    require(row_idx_type in (0, 1), op, f"row_idx_type must be 0 or 1, got {row_idx_type}")
    not_modeled(expert_tokens_num_type == 1, op, "the key_value expert count output")
    start, end = (0, expert_num) if len(active_expert_range) == 0 else tuple(active_expert_range)
    require(
        0 <= start < end <= expert_num,
        op,
        f"active_expert_range must satisfy 0 <= start < end <= expert_num, got {active_expert_range}",
    )
    not_modeled((start, end) == (0, expert_num), op, "a partial active_expert_range")
    ids = host(expert_idx)
    require(bool(((ids >= 0) & (ids < expert_num)).all()), op, "expert ids must lie in [0, expert_num)")

    expanded_x, _, src_index = ref.moe_dispatch(host(x), ids, expert_num)  # stable sort by expert
    row_idx = src_index if row_idx_type == 1 else np.argsort(src_index)  # 0: assignment -> its row
    counts = np.bincount(ids.reshape(-1), minlength=expert_num)
    return (
        device_tensor(expanded_x, x.dtype, x),
        device_tensor(row_idx, torch.int32, x),
        device_tensor(counts, torch.int64, x),
        poison((ids.size,), torch.float32, x),
    )


def npu_grouped_matmul(
    x,
    weight,
    *,
    bias=None,
    scale=None,
    offset=None,
    antiquant_scale=None,
    antiquant_offset=None,
    per_token_scale=None,
    group_list=None,
    activation_input=None,
    activation_quant_scale=None,
    activation_quant_offset=None,
    split_item=0,
    group_type=None,
    group_list_type=0,
    act_type=0,
    tuning_config=None,
    output_dtype=None,
    x_dtype=None,
    weight_dtype=None,
    scale_dtype=None,
    per_token_scale_dtype=None,
):
    """The non-quantized single-tensor m-axis split ("单单单", group_type 0): x [[M, K]], weight [[E, K, N]] (or
    its transposed view of [E, N, K]) of one float dtype, group_list [E <= 1024] int64 (type 0 cumsum ending at M,
    type 1 counts summing to M, not of length 1), split_item 2 or 3, K and N below 65536, x not transposed.
    -> [y [M, N]]."""
    op = "npu_grouped_matmul"
    quant = (bias, scale, offset, antiquant_scale, antiquant_offset, per_token_scale)
    quant += (activation_input, activation_quant_scale, activation_quant_offset)
    not_modeled(all(t is None for t in quant), op, "bias, quantization and activation inputs")
    not_modeled(act_type == 0, op, f"act_type {act_type}")
    not_modeled(
        group_type == 0 and len(x) == 1 and len(weight) == 1, op, "layouts other than single-tensor group_type 0"
    )
    not_modeled(
        all(d is None for d in (x_dtype, weight_dtype, scale_dtype, per_token_scale_dtype)), op, "dtype overrides"
    )
    require(split_item in (2, 3), op, f"group_type 0 with single tensors needs split_item 2 or 3, got {split_item}")
    (a,), (w,) = x, weight
    require(
        a.dim() == 2 and w.dim() == 3, op, f"x must be 2-D and weight 3-D, got {tuple(a.shape)} and {tuple(w.shape)}"
    )
    require(
        a.dtype in FLOAT_DTYPES and w.dtype == a.dtype,
        op,
        f"x and weight must share a float dtype, got {a.dtype}/{w.dtype}",
    )
    require(a.is_contiguous(), op, "x does not support a transposed (non-contiguous) layout")
    require(
        w.is_contiguous() or is_transposed_2d(w),
        op,
        "weight must be contiguous or the transpose of a contiguous tensor",
    )
    experts, inner, outer = w.shape
    require(a.shape[1] == inner, op, f"x's K {a.shape[1]} must equal weight's K {inner}")
    require(inner < 65536 and outer < 65536, op, "K and N must be below the inner limit 65536")
    if output_dtype is not None:
        require(SCALAR_TYPES.get(output_dtype) == a.dtype, op, "output_dtype must be None or x's dtype")
    require(group_list is not None and group_list.dtype == torch.int64, op, "group_list must be an int64 tensor")
    require(tuple(group_list.shape) == (experts,) and experts <= 1024, op, "group_list must be [E] with E <= 1024")
    groups = host(group_list)
    require(group_list_type in (0, 1), op, f"group_list_type {group_list_type} needs int8 inputs")
    if group_list_type == 0:
        require(
            bool((groups >= 0).all() and (np.diff(groups) >= 0).all()), op, "a cumsum group_list must be non-decreasing"
        )
        require(groups[-1] == a.shape[0], op, "a cumsum group_list must end at M")
        offsets = np.concatenate([[0], groups])
    else:
        require(
            bool((groups >= 0).all()) and groups.size != 1,
            op,
            "a count group_list must be non-negative, not of length 1",
        )
        require(groups.sum() == a.shape[0], op, "a count group_list must sum to M")
        offsets = np.concatenate([[0], np.cumsum(groups)])
    y = ref.grouped_matmul(host(a), host(w).transpose(0, 2, 1), offsets)
    return [device_tensor(y, a.dtype, a)]


def npu_moe_token_unpermute(
    permuted_tokens: Tensor, sorted_indices: Tensor, probs=None, padded_mode=False, restore_shape=None
) -> Tensor:
    """permuted_tokens [T*K, H] fp16/bf16/fp32; sorted_indices [T*K] int32, a permutation (no repeats);
    probs [T, K <= 512] fp16/bf16/fp32; padded_mode False, restore_shape None.
    -> out [T, H] = sum_k probs[t, k] * permuted_tokens[sorted_indices[t*K + k]]."""
    op = "npu_moe_token_unpermute"
    require(
        not padded_mode and restore_shape is None, op, "only padded_mode=False with restore_shape=None is supported"
    )
    require(
        permuted_tokens.dim() == 2 and permuted_tokens.dtype in FLOAT_DTYPES,
        op,
        "permuted_tokens must be 2-D float16/bfloat16/float32",
    )
    require(sorted_indices.dim() == 1 and sorted_indices.dtype == torch.int32, op, "sorted_indices must be 1-D int32")
    rows = permuted_tokens.shape[0]
    require(sorted_indices.shape[0] == rows, op, "sorted_indices must have one entry per permuted row")
    order = host(sorted_indices)
    require(np.array_equal(np.sort(order), np.arange(rows)), op, "sorted_indices must be a permutation of [0, T*K)")
    not_modeled(probs is not None, op, "probs=None (top-1)")
    require(
        probs.dim() == 2 and probs.dtype in FLOAT_DTYPES and probs.shape[1] <= 512,
        op,
        "probs must be [T, K <= 512] float",
    )
    require(probs.numel() == rows, op, "probs must hold T*K weights")
    # The contract's combine takes src_index (row -> assignment): the inverse of sorted_indices.
    out = ref.moe_combine(host(permuted_tokens), np.argsort(order), host(probs))
    return device_tensor(out, permuted_tokens.dtype, permuted_tokens)
