"""MLA prolog: [q down-proj -> RMSNorm -> q up-proj -> absorb W_UK | RoPE] and [kv down-proj -> RMSNorm | RoPE ->
cache write]; GEMMs on the path backends.torch_eager.gemm chose, everything else in fp32."""

from __future__ import annotations

import torch
from torch import Tensor

from backends.torch_eager.gemm import gemm_for
from backends.torch_eager.primitives import rms_norm, rope
from backends.torch_eager.quantized_cache import write_rows
from glm5_hal.kv_formats import AUTO


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
    kv_cache_dtype: str = AUTO,
) -> tuple[Tensor, Tensor, Tensor]:
    """Absorbed MLA queries and latent cache rows of T new tokens (arguments validated by glm5_hal.mla_prolog).

    x: [T, hidden]. w_dq: [q_lora, hidden]. gamma_cq: [q_lora]. w_uq_qr: [H * (nope + rope), q_lora], per head
    [q_nope | q_pe]. w_uk: [H, nope, kv_lora]. w_dkv_kr: [kv_lora + rope, hidden], rows [c_kv | k_pe].
    gamma_ckv: [kv_lora]. cos, sin: [T, rope / 2] fp32. kv_cache: [num_blocks, block_size, kv_lora + rope],
    written in place at slot_mapping [T] int64 (-1 = skip); a uint8 [num_blocks, block_size, row_bytes] cache
    of a quantized kv_cache_dtype gets the rows encoded (glm5_hal.kv_formats).

    Returns (q_lat [T, H, kv_lora], q_pe [T, H, rope], q_norm [T, q_lora]), all in x's dtype. The MLA RoPE is
    interleaved for both GLM-5 and DeepSeek-V3.2.
    """
    num_tokens = x.shape[0]
    num_heads, nope, kv_lora = w_uk.shape
    gemm = gemm_for(x.dtype, x.device)

    q_norm = rms_norm(gemm.linear(x, w_dq), gamma_cq, eps)  # [T, q_lora]
    q = gemm.linear(q_norm, w_uq_qr).view(num_tokens, num_heads, nope + 2 * cos.shape[1])  # [T, H, nope + rope]
    # Absorb W_UK head by head as one batched GEMM: [H, T, nope] @ [H, nope, kv_lora] -> [H, T, kv_lora].
    q_lat = gemm.bmm(q[..., :nope].transpose(0, 1), w_uk, output=True).transpose(0, 1)
    q_pe = rope(q[..., nope:], cos, sin, interleaved=True)  # [T, H, rope]

    kv = gemm.linear(x, w_dkv_kr)  # [T, kv_lora + rope]
    cache_row = torch.cat(
        (rms_norm(kv[:, :kv_lora], gamma_ckv, eps), rope(kv[:, kv_lora:], cos, sin, interleaved=True)), dim=-1
    )
    write_rows(kv_cache, slot_mapping, cache_row, kv_cache_dtype)
    return (
        q_lat.to(x.dtype).contiguous(),  # the transpose above leaves it head-major in memory
        q_pe.to(x.dtype),
        q_norm.to(x.dtype),
    )
