"""MLA prolog (OPS.md section 1): the absorbed query and the latent KV-cache row of each new token."""

from __future__ import annotations

import numpy as np

from ops_reference.kv_cache import AUTO
from ops_reference.norms import rms_norm
from ops_reference.paged_cache import write_cache
from ops_reference.rope import rope


def mla_prolog(
    x, w_dq, gamma_cq, w_uq_qr, w_uk, w_dkv_kr, gamma_ckv, cos, sin, kv_cache, slot_mapping, eps, kv_cache_dtype=AUTO
):
    """-> (q_lat [T,H,kv_lora], q_pe [T,H,rope], q_norm [T,q_lora], new kv_cache).

    x [T,hidden]; w_dq [q_lora,hidden]; gamma_cq [q_lora]; w_uq_qr [H*(nope+rope), q_lora] (per head
    [q_nope | q_pe]); w_uk [H, nope, kv_lora]; w_dkv_kr [kv_lora+rope, hidden] (rows [c_kv | k_pe]);
    gamma_ckv [kv_lora]; cos, sin [T, rope/2]; kv_cache [num_blocks, block_size, kv_lora+rope]; slot_mapping [T].
    The MLA RoPE is interleaved for both GLM-5 and DeepSeek-V3.2. kv_cache_dtype: "auto" (a float cache) or a
    latent format of ops_reference.kv_cache (a uint8 cache [num_blocks, block_size, row_bytes]; rows encoded).
    """
    x = np.asarray(x, np.float64)
    num_heads, nope, kv_lora = w_uk.shape
    rope_dim = 2 * cos.shape[1]

    q_norm = rms_norm(x @ w_dq.T, gamma_cq, eps)
    q = (q_norm @ w_uq_qr.T).reshape(x.shape[0], num_heads, nope + rope_dim)
    q_lat = np.einsum("thn,hnc->thc", q[..., :nope], w_uk)
    q_pe = rope(q[..., nope:], cos, sin, interleaved=True)

    kv = x @ w_dkv_kr.T
    row = np.concatenate(
        [rms_norm(kv[:, :kv_lora], gamma_ckv, eps), rope(kv[:, kv_lora:], cos, sin, interleaved=True)], -1
    )
    return q_lat, q_pe, q_norm, write_cache(kv_cache, slot_mapping, row, kv_cache_dtype)
