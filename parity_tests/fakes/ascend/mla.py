"""Fake torch_npu MLA prolog kernels: npu_mla_prolog_v3 and npu_kv_rmsnorm_rope_cache.

Both apply the InterleaveRope formula (pairs read interleaved, written as halves) with a full-width cos/sin table,
and write the RMSNormed latent and the rotated key into split paged caches at the given indices.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

import ops_reference as ref
from fakes.ascend.basic import ACL_FORMAT_FRACTAL_NZ, interleave_rope_formula
from fakes.ascend.common import HALF_DTYPES, device_tensor, host, marked, not_modeled, poison, require

V3_HIDDEN = (6144, 7168, 7680)
V3_HEADS = (1, 2, 4, 8, 16, 32, 64, 128)
V3_BLOCK_SIZES = (16, 128)


def _check_cache_index(op: str, index: Tensor, capacity: int) -> np.ndarray:
    slots = host(index).reshape(-1)
    require(bool(((slots >= 0) & (slots < capacity)).all()), op, f"cache indices must lie in [0, {capacity})")
    require(np.unique(slots).size == slots.size, op, "cache indices must not repeat (the result is undefined)")
    return slots


def npu_mla_prolog_v3(
    token_x: Tensor,
    weight_dq: Tensor,
    weight_uq_qr: Tensor,
    weight_uk: Tensor,
    weight_dkv_kr: Tensor,
    rmsnorm_gamma_cq: Tensor,
    rmsnorm_gamma_ckv: Tensor,
    rope_sin: Tensor,
    rope_cos: Tensor,
    kv_cache: Tensor,
    kr_cache: Tensor,
    *,
    cache_index=None,
    dequant_scale_x=None,
    dequant_scale_w_dq=None,
    dequant_scale_w_uq_qr=None,
    dequant_scale_w_dkv_kr=None,
    quant_scale_ckv=None,
    quant_scale_ckr=None,
    smooth_scales_cq=None,
    actual_seq_len=None,
    k_nope_clip_alpha=None,
    rmsnorm_epsilon_cq=1e-5,
    rmsnorm_epsilon_ckv=1e-5,
    cache_mode="PA_BSND",
    query_norm_flag=False,
    weight_quant_mode=0,
    kv_cache_quant_mode=0,
    query_quant_mode=0,
    ckvkr_repo_mode=0,
    quant_scale_repo_mode=0,
    tile_size=128,
    qc_qr_scale=1.0,
    kc_scale=1.0,
    token_x_dtype=None,
    weight_dq_dtype=None,
    weight_uq_qr_dtype=None,
    weight_dkv_kr_dtype=None,
    kv_cache_dtype=None,
):
    """Non-quantized scenario: every tensor bf16; token_x (T, He) with He in {6144, 7168, 7680}; weight_dq
    (He, Hcq=1536), weight_uq_qr (Hcq, N*(D+Dr)), weight_dkv_kr (He, Hckv+Dr) in FRACTAL_NZ; weight_uk (N, D=128,
    Hckv=512) in ND; N in {1, 2, 4, ..., 128}; rope_sin/cos (T, Dr=64); kv_cache (BlockNum, BlockSize, 1, Hckv),
    kr_cache (BlockNum, BlockSize, 1, Dr), BlockSize 16 or 128, cache_mode PA_BSND; cache_index (T,) int64 in range.
    Returns (query, query_rope, dequant_scale_q_nope, query_norm, dequant_scale_q_norm); updates both caches."""
    op = "npu_mla_prolog_v3"
    not_modeled(
        weight_quant_mode == kv_cache_quant_mode == query_quant_mode == ckvkr_repo_mode == quant_scale_repo_mode == 0,
        op,
        "a quantized mode",
    )
    quant_inputs = (dequant_scale_x, dequant_scale_w_dq, dequant_scale_w_uq_qr, dequant_scale_w_dkv_kr)
    quant_inputs += (quant_scale_ckv, quant_scale_ckr, smooth_scales_cq, actual_seq_len, k_nope_clip_alpha)
    require(all(t is None for t in quant_inputs), op, "the non-quantized scenario takes no quantization parameters")
    not_modeled(token_x.dim() == 2, op, "the (B, S, He) token layout")
    not_modeled(cache_mode == "PA_BSND", op, f"cache_mode {cache_mode!r}")
    not_modeled(all(d is None for d in (token_x_dtype, weight_dq_dtype, weight_uq_qr_dtype)), op, "dtype overrides")

    tensors = {
        "token_x": token_x,
        "weight_dq": weight_dq,
        "weight_uq_qr": weight_uq_qr,
        "weight_uk": weight_uk,
        "weight_dkv_kr": weight_dkv_kr,
        "rmsnorm_gamma_cq": rmsnorm_gamma_cq,
        "rmsnorm_gamma_ckv": rmsnorm_gamma_ckv,
        "rope_sin": rope_sin,
        "rope_cos": rope_cos,
        "kv_cache": kv_cache,
        "kr_cache": kr_cache,
    }
    for name, t in tensors.items():
        require(t.dtype == torch.bfloat16, op, f"{name} must be bfloat16 in the non-quantized scenario, got {t.dtype}")
    for name in ("weight_dq", "weight_uq_qr", "weight_dkv_kr"):
        require(
            marked(tensors[name], "format") == ACL_FORMAT_FRACTAL_NZ,
            op,
            f"{name} must be in FRACTAL_NZ (torch_npu.npu_format_cast(weight, 29))",
        )
    require(marked(weight_uk, "format") in (None, 2), op, "weight_uk must be in ND format")

    num_tokens, hidden = token_x.shape
    heads, nope, kv_lora = weight_uk.shape
    q_lora = weight_dq.shape[1]
    rope = rope_sin.shape[-1]
    require(hidden in V3_HIDDEN, op, f"He must be one of {V3_HIDDEN}, got {hidden}")
    require(tuple(weight_dq.shape) == (hidden, 1536), op, f"weight_dq must be (He, 1536), got {tuple(weight_dq.shape)}")
    require(
        heads in V3_HEADS and nope == 128 and kv_lora == 512,
        op,
        f"weight_uk must be (N, 128, 512), got {tuple(weight_uk.shape)}",
    )
    require(rope == 64, op, f"Dr must be 64, got {rope}")
    require(tuple(weight_uq_qr.shape) == (q_lora, heads * (nope + rope)), op, "weight_uq_qr must be (Hcq, N*(D+Dr))")
    require(tuple(weight_dkv_kr.shape) == (hidden, kv_lora + rope), op, "weight_dkv_kr must be (He, Hckv+Dr)")
    require(tuple(rmsnorm_gamma_cq.shape) == (q_lora,), op, "rmsnorm_gamma_cq must be (Hcq,)")
    require(tuple(rmsnorm_gamma_ckv.shape) == (kv_lora,), op, "rmsnorm_gamma_ckv must be (Hckv,)")
    for name, t in (("rope_sin", rope_sin), ("rope_cos", rope_cos)):
        require(
            tuple(t.shape) == (num_tokens, rope),
            op,
            f"{name} must be (T, Dr) = {(num_tokens, rope)}, got {tuple(t.shape)}",
        )
    blocks, block_size = kv_cache.shape[:2]
    require(block_size in V3_BLOCK_SIZES, op, f"BlockSize must be 16 or 128, got {block_size}")
    require(
        tuple(kv_cache.shape) == (blocks, block_size, 1, kv_lora), op, "kv_cache must be (BlockNum, BlockSize, 1, Hckv)"
    )
    require(tuple(kr_cache.shape) == (blocks, block_size, 1, rope), op, "kr_cache must be (BlockNum, BlockSize, 1, Dr)")
    require(
        token_x.is_contiguous() and kv_cache.is_contiguous() and kr_cache.is_contiguous(),
        op,
        "ND inputs must be contiguous",
    )
    require(
        cache_index is not None and cache_index.dtype == torch.int64 and tuple(cache_index.shape) == (num_tokens,),
        op,
        "cache_index must be (T,) int64",
    )
    slots = _check_cache_index(op, cache_index, blocks * block_size)

    x = host(token_x)
    c_q = qc_qr_scale * ref.rms_norm(x @ host(weight_dq), host(rmsnorm_gamma_cq), rmsnorm_epsilon_cq)  # [T, Hcq]
    q = (c_q @ host(weight_uq_qr)).reshape(num_tokens, heads, nope + rope)
    query = np.einsum("thd,hdc->thc", q[..., :nope], host(weight_uk))
    cos, sin = host(rope_cos)[:, None, :], host(rope_sin)[:, None, :]
    query_rope = interleave_rope_formula(q[..., nope:], cos, sin)
    kv = x @ host(weight_dkv_kr)
    kv_cache.view(-1, kv_lora)[slots] = device_tensor(
        kc_scale * ref.rms_norm(kv[:, :kv_lora], host(rmsnorm_gamma_ckv), rmsnorm_epsilon_ckv), kv_cache.dtype, kv_cache
    )
    kr_cache.view(-1, rope)[slots] = device_tensor(
        interleave_rope_formula(kv[:, kv_lora:], cos[:, 0], sin[:, 0]), kr_cache.dtype, kr_cache
    )
    empty = torch.empty(0, dtype=torch.float32, device=token_x.device)
    query_norm = device_tensor(c_q, torch.bfloat16, token_x) if query_norm_flag else token_x.new_empty(0)
    return (
        device_tensor(query, torch.bfloat16, token_x),
        device_tensor(query_rope, torch.bfloat16, token_x),
        empty,
        query_norm,
        empty.clone(),
    )


def npu_kv_rmsnorm_rope_cache(
    kv: Tensor,
    gamma: Tensor,
    cos: Tensor,
    sin: Tensor,
    index: Tensor,
    k_cache: Tensor,
    ckv_cache: Tensor,
    *,
    k_rope_scale=None,
    c_kv_scale=None,
    k_rope_offset=None,
    c_kv_offset=None,
    v=None,
    epsilon=1e-5,
    cache_mode="Norm",
    is_output_kv=False,
):
    """kv: [B, 1, S, 576] bf16/fp16 (512 RMSNorm + 64 RoPE); gamma [512], cos/sin [B, 1, S, 64] in kv's dtype;
    PA/PA_BNSD mode: k_cache [block_num, block_size, 1, 64], ckv_cache [block_num, block_size, 1, 512] in kv's
    dtype (non-quantized), index [B*S] int64 global slots, unique, block_num >= ceil(S / block_size) * B.
    Returns (k_cache, ckv_cache, k_embed [B,1,S,64] and y [B,1,S,512] when is_output_kv, else undefined)."""
    op = "npu_kv_rmsnorm_rope_cache"
    not_modeled(cache_mode in ("PA", "PA_BNSD"), op, f"cache_mode {cache_mode!r}")
    quant = (k_rope_scale, c_kv_scale, k_rope_offset, c_kv_offset)
    not_modeled(all(t is None for t in quant), op, "the quantized caches")
    not_modeled(v is None, op, "the v input")
    require(
        kv.dim() == 4 and kv.shape[1] == 1 and kv.shape[3] == 576,
        op,
        f"kv must be [B, 1, S, 576], got {tuple(kv.shape)}",
    )
    require(kv.dtype in HALF_DTYPES, op, f"kv must be bfloat16/float16, got {kv.dtype}")
    batch, _, seq, _ = kv.shape
    require(gamma.dtype == kv.dtype and tuple(gamma.shape) == (512,), op, "gamma must be [512] in kv's dtype")
    for name, t in (("cos", cos), ("sin", sin)):
        require(
            t.dtype == kv.dtype and tuple(t.shape) == (batch, 1, seq, 64),
            op,
            f"{name} must be [B, 1, S, 64] in kv's dtype",
        )
    blocks, block_size = k_cache.shape[:2]
    require(tuple(k_cache.shape) == (blocks, block_size, 1, 64), op, "k_cache must be [block_num, block_size, 1, 64]")
    require(
        tuple(ckv_cache.shape) == (blocks, block_size, 1, 512), op, "ckv_cache must be [block_num, block_size, 1, 512]"
    )
    require(k_cache.dtype == kv.dtype and ckv_cache.dtype == kv.dtype, op, "non-quantized caches take kv's dtype")
    require(blocks >= math.ceil(seq / block_size) * batch, op, "block_num must be >= ceil(S / block_size) * B")
    require(index.dtype == torch.int64 and tuple(index.shape) == (batch * seq,), op, "index must be [B*S] int64")
    slots = _check_cache_index(op, index, blocks * block_size)

    x = host(kv).reshape(batch * seq, 576)
    y = ref.rms_norm(x[:, :512], host(gamma), epsilon)
    k_embed = interleave_rope_formula(x[:, 512:], host(cos).reshape(-1, 64), host(sin).reshape(-1, 64))
    ckv_cache.view(-1, 512)[slots] = device_tensor(y, kv.dtype, kv)
    k_cache.view(-1, 64)[slots] = device_tensor(k_embed, kv.dtype, kv)
    if not is_output_kv:
        return k_cache, ckv_cache, poison((batch, 1, seq, 64), kv.dtype, kv), poison((batch, 1, seq, 512), kv.dtype, kv)
    return (
        k_cache,
        ckv_cache,
        device_tensor(k_embed.reshape(batch, 1, seq, 64), kv.dtype, kv),
        device_tensor(y.reshape(batch, 1, seq, 512), kv.dtype, kv),
    )
