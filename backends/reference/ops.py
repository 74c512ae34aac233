"""Adapters from the public op signatures to ops_reference: tensors -> float64 arrays -> tensors.

Outputs the contract fixes at fp32 (indexer weights and scores, lse, routing weights) come back in
accumulation_dtype of the activations: fp32 normally, float64 in the float64 verification mode, where every
output is then the reference's float64 result itself, unrounded.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor

import ops_reference as ref
from glm5_hal.checks import accumulation_dtype
from glm5_hal.kv_formats import AUTO


def _host(t: Tensor | None) -> np.ndarray | None:
    """A host NumPy copy: floating tensors become float64 (bf16 has no NumPy dtype), integers keep theirs."""
    if t is None:
        return None
    t = t.detach().cpu()
    return (t.to(torch.float64) if t.is_floating_point() else t).numpy()


def _back(a: np.ndarray, like: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """`a` as a tensor on `like`'s device, in `dtype` (default: like's dtype); 0-d arrays stay 0-d (a per-token
    scale of a 1-D input is a scalar), unlike np.ascontiguousarray's."""
    return torch.from_numpy(np.require(a, requirements="C")).to(device=like.device, dtype=dtype or like.dtype)


def _write_back(cache: Tensor, new_cache: np.ndarray) -> None:
    # Rows the op did not write round-trip exactly (dtype -> float64 -> dtype; uint8 bytes as they are), so
    # copying all of it is safe.
    cache.copy_(_back(new_cache, cache))


def mla_prolog(
    x, w_dq, gamma_cq, w_uq_qr, w_uk, w_dkv_kr, gamma_ckv, cos, sin, kv_cache, slot_mapping, eps, kv_cache_dtype=AUTO
):
    q_lat, q_pe, q_norm, new_cache = ref.mla_prolog(
        *map(_host, (x, w_dq, gamma_cq, w_uq_qr, w_uk, w_dkv_kr, gamma_ckv, cos, sin, kv_cache, slot_mapping)),
        eps,
        kv_cache_dtype,
    )
    _write_back(kv_cache, new_cache)
    return _back(q_lat, x), _back(q_pe, x), _back(q_norm, x)


def indexer_prolog(
    x,
    q_norm,
    w_iq,
    w_ik,
    k_norm_weight,
    k_norm_bias,
    w_iw,
    cos,
    sin,
    index_k_cache,
    slot_mapping,
    *,
    rope_interleaved,
    eps=1e-6,
    kv_cache_dtype=AUTO,
):
    q_idx, weights, new_cache = ref.indexer_prolog(
        *map(_host, (x, q_norm, w_iq, w_ik, k_norm_weight, k_norm_bias, w_iw, cos, sin, index_k_cache, slot_mapping)),
        rope_interleaved=rope_interleaved,
        eps=eps,
        kv_cache_dtype=kv_cache_dtype,
    )
    _write_back(index_k_cache, new_cache)
    return _back(q_idx, x), _back(weights, x, accumulation_dtype(x.dtype))


def indexer_logits(q_idx, weights, index_k_cache, block_table, seq_lens_k, cu_seqlens_q, kv_cache_dtype=AUTO):
    logits = ref.indexer_logits(
        *map(_host, (q_idx, weights, index_k_cache, block_table, seq_lens_k, cu_seqlens_q)), kv_cache_dtype
    )
    return _back(logits, q_idx, accumulation_dtype(q_idx.dtype))


def lightning_indexer(q_idx, weights, index_k_cache, block_table, seq_lens_k, cu_seqlens_q, topk, kv_cache_dtype=AUTO):
    indices, scores = ref.lightning_indexer(
        *map(_host, (q_idx, weights, index_k_cache, block_table, seq_lens_k, cu_seqlens_q)), topk, kv_cache_dtype
    )
    return _back(indices, q_idx, torch.int32), _back(scores, q_idx, accumulation_dtype(q_idx.dtype))


def sparse_flash_attention(
    q, kv_cache, indices, block_table, seq_lens_k, cu_seqlens_q, sm_scale, d_v=512, kv_cache_dtype=AUTO
):
    out, lse = ref.sparse_flash_attention(
        *map(_host, (q, kv_cache, indices, block_table, seq_lens_k, cu_seqlens_q)), sm_scale, d_v, kv_cache_dtype
    )
    return _back(out, q), _back(lse, q, accumulation_dtype(q.dtype))


def moe_gate(router_logits, bias, *, top_k, n_group, topk_group, routed_scaling_factor, norm_topk_prob, scoring):
    weights, ids = ref.moe_gate(
        _host(router_logits),
        _host(bias),
        top_k=top_k,
        n_group=n_group,
        topk_group=topk_group,
        routed_scaling_factor=routed_scaling_factor,
        norm_topk_prob=norm_topk_prob,
        scoring=scoring,
    )
    # topk_weights keep router_logits' dtype: fp32, or fp64 in the verification mode.
    return _back(weights, router_logits), _back(ids, router_logits, torch.int32)


def moe_dispatch(x, topk_ids, num_experts):
    x_sorted, offsets, src_index = ref.moe_dispatch(_host(x), _host(topk_ids), num_experts)
    return _back(x_sorted, x), _back(offsets, x, torch.int64), _back(src_index, x, torch.int64)


def grouped_matmul(x_sorted, w, expert_offsets):
    return _back(ref.grouped_matmul(_host(x_sorted), _host(w), _host(expert_offsets)), x_sorted)


def moe_combine(y_sorted, src_index, topk_weights):
    return _back(ref.moe_combine(_host(y_sorted), _host(src_index), _host(topk_weights)), y_sorted)


def fused_moe(x, topk_weights, topk_ids, w13, w2):
    return _back(ref.fused_moe(*map(_host, (x, topk_weights, topk_ids, w13, w2))), x)


def dynamic_quant(x):
    q, scale = ref.dynamic_quant(_host(x))
    return _back(q, x, torch.int8), _back(scale, x, torch.float32)


def quant_matmul(x_q, x_scale, w_q, w_scale, bias=None, out_dtype=torch.bfloat16):
    y = ref.quant_matmul(*map(_host, (x_q, x_scale, w_q, w_scale, bias)))
    return _back(y, x_q, out_dtype)


def w4a8_matmul(x_q, x_scale, w_packed, w_scale, group_size=None, out_dtype=torch.bfloat16):
    y = ref.w4a8_matmul(*map(_host, (x_q, x_scale, w_packed, w_scale)), group_size)
    return _back(y, x_q, out_dtype)


def hadamard_transform(x, *, scale=None):
    return _back(ref.hadamard_transform(_host(x), scale=scale), x)


OPS: dict[str, Callable] = {
    "mla_prolog": mla_prolog,
    "indexer_prolog": indexer_prolog,
    "indexer_logits": indexer_logits,
    "lightning_indexer": lightning_indexer,
    "sparse_flash_attention": sparse_flash_attention,
    "moe_gate": moe_gate,
    "moe_dispatch": moe_dispatch,
    "grouped_matmul": grouped_matmul,
    "moe_combine": moe_combine,
    "fused_moe": fused_moe,
    "dynamic_quant": dynamic_quant,
    "quant_matmul": quant_matmul,
    "w4a8_matmul": w4a8_matmul,
    "hadamard_transform": hadamard_transform,
}
