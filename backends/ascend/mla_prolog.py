"""MLA prolog on Ascend: npu_mla_prolog_v3 where its documented shapes allow, else the unfused path vllm-ascend
calls NATIVE (matmuls + npu_rms_norm + npu_interleave_rope + npu_kv_rmsnorm_rope_cache).

    fused:    npu_mla_prolog_v3(x, W_DQ^T nz, W_UQ_QR^T nz, W_UK, W_DKV_KR^T nz, ..., query_norm_flag=True)
    unfused:  q_c = x W_DQ^T -> npu_rms_norm -> q W_UQ_QR^T -> [q_nope W_UK | npu_interleave_rope(q_pe)]
              kv = x W_DKV_KR^T -> npu_kv_rmsnorm_rope_cache(is_output_kv=True)
    both:     RoPE outputs come back pair-halved -> interleave_rope_pairs; the cache rows [c_kv | k_pe] go into the
              contract's one 576-wide cache with npu_scatter_nd_update_ at the writable slots.

Why scratch caches: both kernels write a split cache (512-wide latent + 64-wide RoPE, each [blocks, bs, 1, D]) that
cannot alias the contract's combined [blocks, bs, 576] rows, so they write T rows into a small scratch cache (block
size 16, cache_index 0..T-1) and the adapter copies those rows where slot_mapping says. The three projection
weights of the fused path are transposed and cast to FRACTAL_NZ once per weight tensor (glm5_hal.weight_cache).
Both paths keep q and its absorption in bf16 / fp16, so a qk_nope_head_dim below 16 runs the portable path
(glm5_hal.vendor_precision).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from backends.ascend.layouts import interleave_rope_pairs, rope_table_halves
from backends.ascend.quantized_cache import store_rows
from backends.ascend.runtime import ACL_FORMAT_FRACTAL_NZ, half_or_bf16, npu, portable
from glm5_hal.kv_formats import AUTO
from glm5_hal.vendor_precision import mla_prolog_chain_unsupported
from glm5_hal.weight_cache import derived

# npu_mla_prolog_v3's documented shape ranges (torch_npu 2.14.0): He hidden, Hcq q_lora, D qk_nope, Dr rope,
# Hckv kv_lora, N heads. GLM-5 (Hcq 2048, D 192) is outside them and takes the unfused path.
V3_HIDDEN = (6144, 7168, 7680)
V3_Q_LORA = 1536
V3_NOPE = 128
V3_HEADS = (1, 2, 4, 8, 16, 32, 64, 128)
KV_LORA = 512  # npu_kv_rmsnorm_rope_cache and npu_mla_prolog_v3: the RMSNorm part of a cache row
ROPE = 64  # npu_interleave_rope, npu_kv_rmsnorm_rope_cache, npu_mla_prolog_v3: the RoPE width
SCRATCH_BLOCK = 16  # a block size every kernel here accepts (npu_mla_prolog_v3: 16 or 128)


def v3_unsupported(x: Tensor, w_dq: Tensor, w_uk: Tensor, rope: int) -> str | None:
    """Why npu_mla_prolog_v3 cannot take these shapes/dtypes, or None if it can."""
    heads, nope, kv_lora = w_uk.shape
    if not hasattr(npu(), "npu_mla_prolog_v3"):
        return "this torch_npu has no npu_mla_prolog_v3"
    if x.dtype != torch.bfloat16:
        return f"npu_mla_prolog_v3 takes bf16 activations, got {x.dtype}"
    if x.shape[1] not in V3_HIDDEN or w_dq.shape[0] != V3_Q_LORA or nope != V3_NOPE or heads not in V3_HEADS:
        return (
            f"npu_mla_prolog_v3 takes hidden in {V3_HIDDEN}, q_lora {V3_Q_LORA}, qk_nope {V3_NOPE}, heads in "
            f"{V3_HEADS}; got {x.shape[1]}, {w_dq.shape[0]}, {nope}, {heads}"
        )
    if kv_lora != KV_LORA or rope != ROPE:
        return f"npu_mla_prolog_v3 takes kv_lora {KV_LORA} and rope {ROPE}, got {kv_lora} and {rope}"
    return None


def unfused_unsupported(x: Tensor, w_uk: Tensor, rope: int, kv_cache: Tensor) -> str | None:
    """Why the unfused NPU path cannot take these inputs, or None if it can."""
    if not half_or_bf16(x):
        return f"npu_interleave_rope / npu_kv_rmsnorm_rope_cache take bf16/fp16 activations, got {x.dtype}"
    if w_uk.shape[2] != KV_LORA or rope != ROPE:
        return f"npu_kv_rmsnorm_rope_cache takes a {KV_LORA} + {ROPE} cache row, got {w_uk.shape[2]} + {rope}"
    if not kv_cache.is_contiguous():
        return "kv_cache is not contiguous (its rows are written through a flat [slots, 576] view)"
    if x.shape[0] == 0:
        return "no tokens"
    return None


def _nz_transposed(weight: Tensor) -> Tensor:
    """nn.Linear weight [out, in] -> [in, out] in FRACTAL_NZ, as npu_mla_prolog_v3 takes its projections."""
    return npu().npu_format_cast(weight.t().contiguous(), ACL_FORMAT_FRACTAL_NZ)


def _scratch_caches(num_tokens: int, like: Tensor, rope: int) -> tuple[Tensor, Tensor]:
    """Split caches with room for `num_tokens` rows: ([blocks, 16, 1, 512], [blocks, 16, 1, rope])."""
    blocks = max(1, math.ceil(num_tokens / SCRATCH_BLOCK))
    return (
        like.new_empty(blocks, SCRATCH_BLOCK, 1, KV_LORA),
        like.new_empty(blocks, SCRATCH_BLOCK, 1, rope),
    )


def _prolog_v3(x, w_dq, gamma_cq, w_uq_qr, w_uk, w_dkv_kr, gamma_ckv, cos, sin, eps):
    """-> (q_lat [T,H,512], q_pe halved [T,H,64], q_norm [T,q_lora], c_kv [T,512], k_pe halved [T,64])."""
    num_tokens = x.shape[0]
    scratch_nope, scratch_rope = _scratch_caches(num_tokens, x, ROPE)
    q_lat, q_pe, _, q_norm, _ = npu().npu_mla_prolog_v3(
        token_x=x.contiguous(),
        weight_dq=derived(w_dq, "mla_prolog_v3.weight_dq", _nz_transposed),
        weight_uq_qr=derived(w_uq_qr, "mla_prolog_v3.weight_uq_qr", _nz_transposed),
        weight_uk=w_uk.contiguous(),
        weight_dkv_kr=derived(w_dkv_kr, "mla_prolog_v3.weight_dkv_kr", _nz_transposed),
        rmsnorm_gamma_cq=gamma_cq.contiguous(),
        rmsnorm_gamma_ckv=gamma_ckv.contiguous(),
        rope_sin=rope_table_halves(sin, x.dtype),
        rope_cos=rope_table_halves(cos, x.dtype),
        kv_cache=scratch_nope,
        kr_cache=scratch_rope,
        cache_index=torch.arange(num_tokens, dtype=torch.int64, device=x.device),
        rmsnorm_epsilon_cq=eps,
        rmsnorm_epsilon_ckv=eps,
        cache_mode="PA_BSND",
        query_norm_flag=True,
    )
    c_kv = scratch_nope.view(-1, KV_LORA)[:num_tokens]
    k_pe = scratch_rope.view(-1, ROPE)[:num_tokens]
    return q_lat, q_pe, q_norm, c_kv, k_pe


def _prolog_unfused(x, w_dq, gamma_cq, w_uq_qr, w_uk, w_dkv_kr, gamma_ckv, cos, sin, eps):
    """The same five tensors as `_prolog_v3`, from the unfused kernels."""
    kernels = npu()
    num_tokens, heads, nope = x.shape[0], w_uk.shape[0], w_uk.shape[1]
    cos_full, sin_full = rope_table_halves(cos, x.dtype), rope_table_halves(sin, x.dtype)  # [T, 64]

    q_norm = kernels.npu_rms_norm(x @ w_dq.t(), gamma_cq, epsilon=eps)[0]  # [T, q_lora]
    q = (q_norm @ w_uq_qr.t()).view(num_tokens, heads, nope + ROPE)
    q_lat = torch.bmm(q[..., :nope].transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, 512]
    q_pe = kernels.npu_interleave_rope(
        q[..., nope:].contiguous().view(num_tokens, heads, 1, ROPE),  # (B=T, N=H, S=1, D)
        cos_full.view(num_tokens, 1, 1, ROPE),
        sin_full.view(num_tokens, 1, 1, ROPE),
    ).view(num_tokens, heads, ROPE)

    kv = (x @ w_dkv_kr.t()).view(1, 1, num_tokens, KV_LORA + ROPE)  # (B=1, N=1, S=T, 576)
    scratch_nope, scratch_rope = _scratch_caches(num_tokens, x, ROPE)
    _, _, k_pe, c_kv = kernels.npu_kv_rmsnorm_rope_cache(
        kv,
        gamma_ckv.contiguous(),
        cos_full.view(1, 1, num_tokens, ROPE),
        sin_full.view(1, 1, num_tokens, ROPE),
        torch.arange(num_tokens, dtype=torch.int64, device=x.device),
        scratch_rope,
        scratch_nope,
        epsilon=eps,
        cache_mode="PA",
        is_output_kv=True,
    )
    return q_lat, q_pe, q_norm, c_kv.view(num_tokens, KV_LORA), k_pe.view(num_tokens, ROPE)


def mla_prolog(
    x, w_dq, gamma_cq, w_uq_qr, w_uk, w_dkv_kr, gamma_ckv, cos, sin, kv_cache, slot_mapping, eps, kv_cache_dtype=AUTO
):
    """glm5_hal.mla_prolog on torch_npu (arguments validated by the public op; see its docstring for shapes).

    x: [T, hidden]; w_dq [q_lora, hidden]; w_uq_qr [H*(nope+rope), q_lora]; w_uk [H, nope, kv_lora];
    w_dkv_kr [kv_lora+rope, hidden]; cos, sin [T, rope/2] fp32; kv_cache [blocks, bs, kv_lora+rope] (or uint8 rows
    of a quantized kv_cache_dtype, encoded in torch: backends/ascend/quantized_cache.py) written at slot_mapping
    [T] int64. Returns (q_lat [T,H,kv_lora], q_pe [T,H,rope] interleaved pairs, q_norm [T,q_lora]).
    """
    args = (x, w_dq, gamma_cq, w_uq_qr, w_uk, w_dkv_kr, gamma_ckv, cos, sin, kv_cache, slot_mapping, eps)
    rope = 2 * cos.shape[1]
    # q and its absorption stay in bf16 / fp16 on both NPU paths: a short qk_nope sum cannot hold the tolerance.
    unsupported = unfused_unsupported(x, w_uk, rope, kv_cache) or mla_prolog_chain_unsupported(x.dtype, w_uk.shape[1])
    if unsupported is not None:
        return portable("mla_prolog", unsupported)(*args, kv_cache_dtype=kv_cache_dtype)
    inputs = (x, w_dq, gamma_cq, w_uq_qr, w_uk, w_dkv_kr, gamma_ckv, cos, sin, eps)
    fused = v3_unsupported(x, w_dq, w_uk, rope) is None
    q_lat, q_pe_halves, q_norm, c_kv, k_pe_halves = _prolog_v3(*inputs) if fused else _prolog_unfused(*inputs)
    store_rows(kv_cache, slot_mapping, torch.cat([c_kv, interleave_rope_pairs(k_pe_halves)], dim=-1), kv_cache_dtype)
    return q_lat.to(x.dtype), interleave_rope_pairs(q_pe_halves).to(x.dtype), q_norm.to(x.dtype)
