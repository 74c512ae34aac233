"""Sparse flash attention on MetaX through mcFlashMLA (MetaX-MACA/mcFlashMLA, flash_mla/flash_mla_interface.py).

    prefill (more query tokens than sequences), bf16, H a multiple of 64:
      flash_mla_sparse_fwd(q [T, H, 576], kv = the cache's rows [R, 1, 576] read in place, indices [T, 1, topk]
      = flat row of each valid key, -1 otherwise, sm_scale, d_v 512) -> (out [T, H, 512], max_logits, lse in
      base 2) -> lse * ln 2
    otherwise (decode), bf16 / fp16, power-of-two block size:
      get_mla_metadata + flash_mla_with_kvcache(q [T, 1, H, 576] (each query token a batch entry of one token),
      k_cache [blocks, bs, 1, 576], indices [T, 1, topk] = flat slots, -1 otherwise) -> (out [T, 1, H, 512],
      lse [T, H, 1] natural log)

The sparse paths of both kernels read the key at the index's row of the cache directly (the decode kernel's
copy_b32_sparse adds index * the slot stride to the cache's base; its block_table is shape-checked only), so the
contract's request-local positions become flat slots through the block table here, and every invalid entry
(-1, >= seq_lens_k, a block the table does not address) becomes -1, the only invalid value both kernels mask.
A token without a valid index, and a head whose keys all score -inf, get out = 0 and lse = -inf
(vendor_conventions.contract_empty_rows): the interface does not document those rows.
"""

from __future__ import annotations

import torch
from torch import Tensor

from backends.metax.runtime import kernel, portable
from glm5_hal.kv_formats import AUTO
from glm5_hal.paged import key_slots, slot_rows, token_sequences
from glm5_hal.vendor_conventions import contract_empty_rows, lse_from_base2

LIBRARY = "flash_mla"
ROW = 576  # head_dim of q and of a cache row (flash_api.cpp: TORCH_CHECK(head_size == 576))
LATENT = 512  # d_v: "Can only be 512" (flash_mla_sparse_fwd's docstring)
PREFILL_HEADS = 64  # sparse_prefill_fwd: TORCH_CHECK(h_q % 64 == 0 && h_q >= 64)
DECODE_DTYPES = (torch.bfloat16, torch.float16)
# The decode kernel forms an element offset as int index * int slot stride (copy_b32_sparse in csrc/utils/utils.h):
# a cache whose last slot lies 2^31 elements or more from its first overflows that product.
INT32_LIMIT = 2**31 - 1


def _unsupported(q: Tensor, kv_cache: Tensor, d_v: int, kv_cache_dtype: str) -> str | None:
    if kv_cache_dtype != AUTO:
        return f"{kv_cache_dtype}: mcFlashMLA's sparse kernels read bf16/fp16 rows ('Sparse fp8 MLA is not supported')"
    if q.shape[-1] != ROW or d_v != LATENT:
        return f"mcFlashMLA takes {ROW}-wide rows with d_v = {LATENT}"
    if kv_cache.dtype != q.dtype or q.dtype not in DECODE_DTYPES:
        return f"mcFlashMLA takes bf16/fp16 queries and a cache of the same dtype, got {q.dtype} / {kv_cache.dtype}"
    if kv_cache.stride(-1) != 1 or q.shape[0] == 0:
        return "no tokens, or cache rows not contiguous in their last dim"
    return None


def _prefill_unsupported(q: Tensor, num_seqs: int) -> str | None:
    if q.shape[0] <= num_seqs:
        return "decode-shaped batch (no more query tokens than sequences)"
    if q.dtype != torch.bfloat16 or q.shape[1] % PREFILL_HEADS:
        return f"flash_mla_sparse_fwd takes bf16 and a multiple of {PREFILL_HEADS} heads"
    return None


def _decode_unsupported(kv_cache: Tensor) -> str | None:
    block_size = kv_cache.shape[1]
    if block_size & (block_size - 1):
        return f"flash_mla_with_kvcache takes a power-of-two block size (README), got {block_size}"
    view = slot_rows(kv_cache)
    if view.row_step != 1:
        return "flash_mla_with_kvcache addresses slots as index * slot stride: the block stride is not a multiple"
    if view.rows.shape[0] * kv_cache.stride(1) > INT32_LIMIT:
        return "flash_mla_with_kvcache's int32 element offsets do not reach every slot of this cache"
    return None


def _flat_indices(indices, block_table, seq_lens_k, seqs, kv_cache) -> tuple[Tensor, Tensor]:
    """-> (rows [T, topk] int32 of the cache's slot_rows view, -1 where invalid; whether each token has any)."""
    view = slot_rows(kv_cache)
    idx = indices.to(torch.int64)
    slots, addressable = key_slots(
        block_table,
        seqs,
        idx,
        kv_cache.shape[1],
        kv_cache.shape[0],
        block_step=view.block_step,
        row_step=view.row_step,
    )
    valid = (idx >= 0) & (idx < seq_lens_k.to(torch.int64)[seqs, None]) & addressable
    return torch.where(valid, slots, -1).to(torch.int32), valid.any(dim=1)


def sparse_flash_attention(
    q, kv_cache, indices, block_table, seq_lens_k, cu_seqlens_q, sm_scale, d_v=512, kv_cache_dtype=AUTO
):
    """glm5_hal.sparse_flash_attention on mcFlashMLA: -> (out [T, H, d_v] in q's dtype, lse [T, H] fp32).

    q [T, H, 576]; kv_cache [blocks, bs, 576] (bf16/fp16, same dtype as q); indices [T, topk] int32
    request-local positions (-1 and positions >= seq_lens_k[b] are invalid); block_table [B, max_blocks] int32;
    seq_lens_k [B] int32; cu_seqlens_q [B+1] int32. Other inputs run the portable path.
    """
    num_seqs = block_table.shape[0]
    reason = _unsupported(q, kv_cache, d_v, kv_cache_dtype)
    prefill = reason is None and _prefill_unsupported(q, num_seqs) is None
    if reason is None and not prefill:
        reason = _decode_unsupported(kv_cache)
    if reason is not None:
        return portable("sparse_flash_attention", reason)(
            q, kv_cache, indices, block_table, seq_lens_k, cu_seqlens_q, sm_scale, d_v, kv_cache_dtype=kv_cache_dtype
        )
    num_tokens, num_heads, _ = q.shape
    seqs = token_sequences(cu_seqlens_q, num_tokens)
    rows, any_valid = _flat_indices(indices, block_table, seq_lens_k, seqs, kv_cache)
    if prefill:
        out, _, lse2 = kernel(LIBRARY, "flash_mla_sparse_fwd")(
            q.contiguous(), slot_rows(kv_cache).rows.unsqueeze(1), rows.unsqueeze(1), float(sm_scale), d_v
        )
        lse = lse_from_base2(lse2)
    else:
        cache_seqlens = seq_lens_k.to(torch.int32)[seqs].contiguous()
        metadata, splits = kernel(LIBRARY, "get_mla_metadata")(
            cache_seqlens, num_heads, 1, num_heads, False, indices.shape[1]
        )  # one query token per batch entry: num_q_tokens_per_head_k = H, one latent head
        out, lse = kernel(LIBRARY, "flash_mla_with_kvcache")(
            q.unsqueeze(1).contiguous(),
            kv_cache.unsqueeze(2),
            block_table.to(torch.int32)[seqs].contiguous(),  # shape-checked only on the sparse path
            cache_seqlens,
            d_v,
            metadata,
            splits,
            softmax_scale=float(sm_scale),
            causal=False,  # "causal must be false if sparse attention is enabled"
            indices=rows.unsqueeze(1).contiguous(),
        )
        out, lse = out[:, 0], lse[..., 0].to(torch.float32)
    return contract_empty_rows(out.to(q.dtype), lse, ~any_valid)
