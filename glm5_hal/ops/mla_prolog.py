"""MLA prolog ("MLAPO" on Ascend): norms, down/up projections, RoPE and the latent KV-cache write, fused."""

from __future__ import annotations

import torch
from torch import Tensor

from glm5_hal.checks import (
    FLOAT_OP_DTYPES,
    check,
    check_accumulation_tensor,
    check_finite_float,
    check_same_device,
    check_tensor,
)
from glm5_hal.kv_formats import AUTO, LATENT, check_cache, dispatch_kwargs
from glm5_hal.ops.common import call_op, check_cache_write, custom_op, dispatch


def check_rope_tables(
    cos: Tensor, sin: Tensor, num_tokens: int | str, activation_dtype: torch.dtype, sizes: dict[str, int]
) -> int:
    """cos, sin: [T, rope/2] per-token RoPE tables in accumulation_dtype(activation_dtype) (fp32; fp64 for
    float64 activations). Returns the rope width (2 * cos.shape[1])."""
    check_accumulation_tensor("cos", cos, [num_tokens, "half_rope"], activation_dtype, sizes)
    check_accumulation_tensor("sin", sin, [num_tokens, "half_rope"], activation_dtype, sizes)
    return 2 * sizes["half_rope"]


@custom_op("mla_prolog", mutates_args=("kv_cache",))
def _mla_prolog_op(
    x: Tensor,
    w_dq: Tensor,
    gamma_cq: Tensor,
    w_uq_qr: Tensor,
    w_uk: Tensor,
    w_dkv_kr: Tensor,
    gamma_ckv: Tensor,
    cos: Tensor,
    sin: Tensor,
    kv_cache: Tensor,
    slot_mapping: Tensor,
    eps: float,
    kv_cache_dtype: str,
) -> tuple[Tensor, Tensor, Tensor]:
    return dispatch(
        "mla_prolog",
        x.device,
        x,
        w_dq,
        gamma_cq,
        w_uq_qr,
        w_uk,
        w_dkv_kr,
        gamma_ckv,
        cos,
        sin,
        kv_cache,
        slot_mapping,
        eps,
        **dispatch_kwargs(kv_cache_dtype),
    )


@_mla_prolog_op.register_fake
def _(x, w_dq, gamma_cq, w_uq_qr, w_uk, w_dkv_kr, gamma_ckv, cos, sin, kv_cache, slot_mapping, eps, kv_cache_dtype):
    num_tokens = x.shape[0]
    num_heads, _, kv_lora = w_uk.shape
    return (
        x.new_empty(num_tokens, num_heads, kv_lora),
        x.new_empty(num_tokens, num_heads, 2 * cos.shape[1]),
        x.new_empty(num_tokens, w_dq.shape[0]),
    )


def mla_prolog(
    x: Tensor,
    w_dq: Tensor,
    gamma_cq: Tensor,
    w_uq_qr: Tensor,
    w_uk: Tensor,
    w_dkv_kr: Tensor,
    gamma_ckv: Tensor,
    cos: Tensor,
    sin: Tensor,
    kv_cache: Tensor,
    slot_mapping: Tensor,
    eps: float,
    *,
    kv_cache_dtype: str = AUTO,
) -> tuple[Tensor, Tensor, Tensor]:
    """Everything MLA does before attention, for T new tokens; writes their latent KV rows into the cache.

    Args:
        x: [T, hidden], bf16/fp16/fp32, or fp64 (verification mode, reference backend). Normed hidden states
            (the layer's input_layernorm already applied).
        w_dq: [q_lora, hidden]. q_a_proj. gamma_cq: [q_lora]. q_a_layernorm weight.
        w_uq_qr: [H * (nope + rope), q_lora]. q_b_proj; per head the rows are [q_nope | q_pe].
        w_uk: [H, nope, kv_lora]. The K half of kv_b_proj, absorbed into the query.
        w_dkv_kr: [kv_lora + rope, hidden]. kv_a_proj_with_mqa; rows [c_kv | k_pe].
        gamma_ckv: [kv_lora]. kv_a_layernorm weight.
        cos, sin: [T, rope / 2], fp32 (fp64 for fp64 x). RoPE tables at each token's position (MLA RoPE is
            interleaved).
        kv_cache: [num_blocks, block_size, kv_lora + rope], x's dtype; or with a quantized kv_cache_dtype,
            [num_blocks, block_size, row_bytes] uint8 (glm5_hal.kv_formats). Written in place at `slot_mapping`.
        slot_mapping: [T], int64. Cache slot of each token (block * block_size + offset); -1 = do not write.
        eps: RMSNorm epsilon of both norms (GLM-5 1e-5, DeepSeek-V3.2 1e-6).
        kv_cache_dtype: "auto" (a float cache), "fp8_ds_mla" or "int8_mla" (rows quantized on write: 512 codes in
            tiles of 128 with fp32 scales, 64 bf16 RoPE values; needs kv_lora 512 and rope 64).
        All weights have x's dtype and device.

    Returns:
        q_lat: [T, H, kv_lora]. q_nope[t, h] @ w_uk[h], the absorbed no-RoPE query.
        q_pe: [T, H, rope]. RoPE(q_pe). The attention query is cat([q_lat, q_pe], -1) (576 wide).
        q_norm: [T, q_lora]. RMSNorm(x @ w_dq^T, gamma_cq); the lightning indexer's input.
        The cache row of token t becomes [RMSNorm(c_kv, gamma_ckv) | RoPE(k_pe)].

    Reference: ops_reference/mla_prolog.py
    """
    sizes: dict[str, int] = {}
    check_tensor("x", x, ["T", "hidden"], FLOAT_OP_DTYPES, sizes)
    dtype = x.dtype
    check_tensor("w_dq", w_dq, ["q_lora", "hidden"], (dtype,), sizes)
    check_tensor("gamma_cq", gamma_cq, ["q_lora"], (dtype,), sizes)
    check_tensor("w_uk", w_uk, ["H", "nope", "kv_lora"], (dtype,), sizes)
    rope = check_rope_tables(cos, sin, "T", dtype, sizes)
    sizes["H*(nope+rope)"] = sizes["H"] * (sizes["nope"] + rope)
    sizes["kv_lora+rope"] = sizes["kv_lora"] + rope
    check_tensor("w_uq_qr", w_uq_qr, ["H*(nope+rope)", "q_lora"], (dtype,), sizes)
    check_tensor("w_dkv_kr", w_dkv_kr, ["kv_lora+rope", "hidden"], (dtype,), sizes)
    check_tensor("gamma_ckv", gamma_ckv, ["kv_lora"], (dtype,), sizes)
    fmt = check_cache("kv_cache", kv_cache, kv_cache_dtype, LATENT, [None, None, "kv_lora+rope"], dtype, sizes)
    check(
        fmt is None or (sizes["kv_lora"], rope) == (fmt.quantized_dims, fmt.rope_dims),
        ValueError,
        lambda: (
            f"kv_cache_dtype: {kv_cache_dtype!r} quantizes {fmt.quantized_dims} latent dims and keeps {fmt.rope_dims} "
            f"RoPE dims, got kv_lora {sizes['kv_lora']} (w_uk) and rope {rope} (cos)"
        ),
    )
    check_cache_write("kv_cache", kv_cache, slot_mapping, sizes["T"], sizes)
    eps = check_finite_float("eps", eps, positive=True)
    check_same_device(
        x=x,
        w_dq=w_dq,
        gamma_cq=gamma_cq,
        w_uq_qr=w_uq_qr,
        w_uk=w_uk,
        w_dkv_kr=w_dkv_kr,
        gamma_ckv=gamma_ckv,
        cos=cos,
        sin=sin,
        kv_cache=kv_cache,
        slot_mapping=slot_mapping,
    )
    return call_op(
        _mla_prolog_op,
        x,
        w_dq,
        gamma_cq,
        w_uq_qr,
        w_uk,
        w_dkv_kr,
        gamma_ckv,
        cos,
        sin,
        kv_cache,
        slot_mapping,
        eps,
        kv_cache_dtype,
    )
