"""Sparse flash attention on Kunlunxin: fwd_kvcache_mla with indices (decode) and sparse_prefill_fwd_opt (prefill),
as vllm_kunlun/v1/attention/backends/mla/flashmla_sparse.py calls them, with the contract's conventions at the edge.

    indices [T, topk] request-local positions (invalid: -1, >= seq_lens_k, or not addressed by the block table)
      -> flat cache rows (block_table[b, p // bs] * bs + p % bs), -1 where invalid        (what the kernels index)
    kv_cache [blocks, bs, 576] (contiguous)      -> kv [blocks * bs, 576]: a view, no copy
    every sequence with the same q_len n <= 2    -> fwd_kvcache_mla(q [B, n, H, 576], indices [B, n, topk],
                                                    kv_lod = seq_lens_k on the host and the device, max_seq_kv)
                                                    -> out, and lse = max_logits + log(p_sums)
    otherwise (prefill, chunked prefill, mixed)  -> sparse_prefill_fwd_opt(q [T, H, 576], indices [T, 1, topk],
                                                    q lod = cu_seqlens_q on the host and the device, kv lod = the
                                                    same, is_causal=True: exactly vllm-kunlun's call) -> out, lse
    a token with no valid index                  -> out = 0, lse = -inf (the kernels leave it undefined)

The prefill lse: flashmla.py's docstring says base 2 (copied from FlashMLA), the Kunlun note beside it says it is
the CUDA kernel's base-2 value divided by log2(e), i.e. natural. PREFILL_LSE_BASE2 records which one this adapter
believes (the note); flip it if hardware shows the docstring right (docs/vendors.md says how to check).
bf16 only (the docstrings' dtype); fp16 / fp32, quantized caches (fwd_kvcache_mla asserts a non-uint8 cache) and
non-contiguous caches run the portable path.
"""

from __future__ import annotations

import torch
from torch import Tensor

from backends.kunlun.runtime import kernel, on_host, portable, why_not_kernel
from glm5_hal.kv_formats import AUTO
from glm5_hal.paged import key_slots, token_sequences
from glm5_hal.vendor_conventions import contract_empty_rows, lse_from_base2, lse_from_max_and_sum

LATENT, ROPE = 512, 64  # d_v "can only be 512"; the rows are 576 wide
MAX_DECODE_Q = 2  # fwd_kvcache_mla: "only support seq_len_q <= 2"
PREFILL_LSE_BASE2 = False  # see the module docstring


def sparse_flash_attention_unsupported(q: Tensor, kv_cache: Tensor, d_v: int, kv_cache_dtype: str) -> str | None:
    """Why neither Kunlun sparse MLA kernel can take these inputs, or None if one can."""
    why = why_not_kernel(q)
    if why is not None:
        return why
    if kv_cache_dtype != AUTO:
        return f"{kv_cache_dtype}: vllm-kunlun 0.11.1's sparse MLA kernels read bf16 caches only"
    if q.dtype != torch.bfloat16 or kv_cache.dtype != torch.bfloat16:
        return f"the sparse MLA kernels take bf16 queries and caches, got {q.dtype}/{kv_cache.dtype}"
    if q.shape[2] != LATENT + ROPE or d_v != LATENT:
        return f"the sparse MLA kernels take rows of {LATENT}+{ROPE} with V = the first {LATENT}"
    if not kv_cache.is_contiguous():
        return "a non-contiguous cache: the kernels read it as one [slots, 576] tensor"
    if q.shape[0] == 0:
        return "no tokens"
    return None


def flat_rows(indices: Tensor, seq_lens_k: Tensor, seqs: Tensor, block_table: Tensor, kv_cache: Tensor) -> Tensor:
    """[T, topk] request-local positions -> [T, topk] int32 flat cache rows, -1 where invalid (-1, past the
    sequence's keys, or not addressed by its block table)."""
    idx = indices.to(torch.int64)
    slots, addressable = key_slots(block_table, seqs, idx, kv_cache.shape[1], kv_cache.shape[0])
    valid = (idx >= 0) & (idx < seq_lens_k.to(torch.int64)[seqs, None]) & addressable
    return torch.where(valid, slots, -1).to(torch.int32)


def _decode(q, kv, rows, seq_lens_k, q_len, sm_scale) -> tuple[Tensor, Tensor]:
    batch = seq_lens_k.shape[0]
    num_tokens, num_heads, _ = q.shape
    out = torch.zeros(batch, q_len, num_heads, LATENT, dtype=q.dtype, device=q.device)
    row_max = torch.zeros(batch, q_len, num_heads, dtype=torch.float32, device=q.device)
    row_sum = torch.zeros_like(row_max)
    lengths = on_host(seq_lens_k)
    kernel("fwd_kvcache_mla")(
        q.contiguous().view(batch, q_len, num_heads, -1),
        kv,
        rows.view(batch, q_len, -1),
        lengths,
        out,
        row_max,
        row_sum,
        float(sm_scale),
        int(lengths.max()),
        kv_lod_xpu=seq_lens_k.to(torch.int32).contiguous(),
    )
    return out.view(num_tokens, num_heads, LATENT), lse_from_max_and_sum(row_max, row_sum).view(num_tokens, num_heads)


def _prefill(q, kv, rows, cu_seqlens_q, sm_scale) -> tuple[Tensor, Tensor]:
    num_tokens, num_heads, _ = q.shape
    out = torch.zeros(num_tokens, num_heads, LATENT, dtype=q.dtype, device=q.device)
    row_max = torch.zeros(num_tokens, num_heads, dtype=torch.float32, device=q.device)
    lse = torch.zeros_like(row_max)
    lod_host, lod = on_host(cu_seqlens_q), cu_seqlens_q.to(torch.int32).contiguous()
    kernel("sparse_prefill_fwd_opt")(
        q.contiguous(),
        kv,
        rows.unsqueeze(1),  # [T, h_kv = 1, topk]
        out,
        row_max,
        lse,
        float(sm_scale),
        qlod_cpu=lod_host,
        qlod_xpu=lod,
        kvlod_cpu=lod_host,  # the caller's lods (flat indices address the whole cache; see the module docstring)
        kvlod_xpu=lod,
        d_v=LATENT,
        is_causal=True,
    )
    return out, (lse_from_base2(lse) if PREFILL_LSE_BASE2 else lse)


def uniform_decode_length(cu_seqlens_q: Tensor) -> int | None:
    """q_len if every sequence has the same q_len in 1 .. MAX_DECODE_Q (one host read), else None."""
    q_lens = torch.diff(cu_seqlens_q.to(torch.int64)).cpu()
    if q_lens.numel() == 0 or not bool((q_lens == q_lens[0]).all()):
        return None
    q_len = int(q_lens[0])
    return q_len if 1 <= q_len <= MAX_DECODE_Q else None


def sparse_flash_attention(
    q, kv_cache, indices, block_table, seq_lens_k, cu_seqlens_q, sm_scale, d_v=512, kv_cache_dtype=AUTO
):
    """glm5_hal.sparse_flash_attention on Kunlunxin: -> (out [T, H, d_v] in q's dtype, lse [T, H] fp32).

    q [T, H, 576]; kv_cache [blocks, bs, 576]; indices [T, topk] int32 request-local positions (-1 and positions
    >= seq_lens_k[b] are invalid); block_table [B, max_blocks] int32; seq_lens_k [B] int32; cu_seqlens_q [B+1].
    """
    unsupported = sparse_flash_attention_unsupported(q, kv_cache, d_v, kv_cache_dtype)
    if unsupported is not None:
        return portable("sparse_flash_attention", unsupported)(
            q, kv_cache, indices, block_table, seq_lens_k, cu_seqlens_q, sm_scale, d_v, kv_cache_dtype=kv_cache_dtype
        )
    seqs = token_sequences(cu_seqlens_q, q.shape[0])
    rows = flat_rows(indices, seq_lens_k, seqs, block_table, kv_cache)
    kv = kv_cache.view(-1, kv_cache.shape[-1])  # contiguous: the same storage, no copy
    q_len = uniform_decode_length(cu_seqlens_q)
    if q_len is not None:
        out, lse = _decode(q, kv, rows, seq_lens_k, q_len, sm_scale)
    else:
        out, lse = _prefill(q, kv, rows, cu_seqlens_q, sm_scale)
    return contract_empty_rows(out, lse, ~(rows >= 0).any(dim=1))
