"""Sparse flash attention on Ascend: npu_sparse_flash_attention in absorbed-MLA mode (attention_mode=2) over the
selected latent rows, with its softmax max/sum turned into the contract's natural-log lse.

    indices [T, topk] (invalid: -1 or >= seq_lens_k, anywhere in the row)
      -> valid-first rows + flat slots through the block table                      (layouts)
      -> gather the selected 576-wide rows: key = value = latent [T*topk, 1, 512], key_rope [T*topk, 1, 64]
      -> npu_sparse_flash_attention(query [T,H,512], query_rope [T,H,64], layout TND/TND, one batch per token
         with actual_seq_lengths_kv = topk, 2*topk, ..., sparse_indices 0..n_t-1 then -1, return_softmax_lse)
      -> out [T, H, 512]; lse = max + log(sum); a token with no valid index: out = 0, lse = -inf

Why gather instead of passing the paged cache (PA_BSND) as vllm-ascend does: the kernel reads key, value and
key_rope as separate contiguous tensors, which the contract's combined [blocks, bs, 576] cache cannot provide
without copying all of it, and CANN refuses return_softmax_lse together with a PA_BSND key layout. Gathering only
the selected rows moves exactly the bytes the kernel would read anyway, and the TND key layout keeps the LSE.
Tokens are processed in tiles so the gathered rows stay bounded at real dims (topk 2048).
"""

from __future__ import annotations

import torch
from torch import Tensor

from backends.ascend.layouts import gathered_rows, natural_lse, selected_positions, uniform_prefix_sums
from backends.ascend.quantized_cache import KERNEL_FORMATS, sparse_flash_attention_int8
from backends.ascend.runtime import half_or_bf16, npu, portable
from glm5_hal.kv_formats import AUTO
from glm5_hal.paged import token_sequences
from glm5_hal.vendor_conventions import contract_empty_rows

LATENT = 512  # npu_sparse_flash_attention in attention_mode 2: query/key/value D = 512, rope D = 64
ROPE = 64
QUERY_HEADS = (1, 2, 4, 8, 16, 32, 64, 128)
GATHER_BUDGET = 1 << 26  # elements of gathered latent rows held at once (128 MiB in bf16)


def sparse_flash_attention_unsupported(q: Tensor, d_v: int) -> str | None:
    """Why npu_sparse_flash_attention cannot take these inputs, or None if it can."""
    num_tokens, num_heads, width = q.shape
    if not half_or_bf16(q):
        return f"npu_sparse_flash_attention takes bf16/fp16, got {q.dtype}"
    if width != LATENT + ROPE or d_v != LATENT:
        return (
            f"npu_sparse_flash_attention (attention_mode 2) takes rows of {LATENT}+{ROPE} with V = the first {LATENT}"
        )
    if num_heads not in QUERY_HEADS:
        return f"npu_sparse_flash_attention takes {QUERY_HEADS} query heads, got {num_heads}"
    if num_tokens == 0:
        return "no tokens"
    return None


def _attend_tile(q: Tensor, rows: Tensor, local: Tensor, sm_scale: float) -> tuple[Tensor, Tensor]:
    """One tile of t tokens: q [t, H, 576], rows [t, topk, 576] gathered, local [t, topk] int32 valid-first
    positions into each token's own rows. Returns (out [t, H, 512], lse [t, H] fp32)."""
    tokens, topk = local.shape
    flat = rows.reshape(tokens * topk, 1, LATENT + ROPE)
    latent = flat[..., :LATENT].contiguous()  # key and value: the same tensor, as attention_mode 2 requires
    out, softmax_max, softmax_sum = npu().npu_sparse_flash_attention(
        q[..., :LATENT].contiguous(),
        latent,
        latent,
        local.view(tokens, 1, topk).contiguous(),
        sm_scale,
        actual_seq_lengths_query=uniform_prefix_sums(tokens, 1, q.device),
        actual_seq_lengths_kv=uniform_prefix_sums(tokens, topk, q.device),
        query_rope=q[..., LATENT:].contiguous(),
        key_rope=flat[..., LATENT:].contiguous(),
        sparse_block_size=1,
        layout_query="TND",
        layout_kv="TND",
        sparse_mode=3,
        attention_mode=2,
        return_softmax_lse=True,
    )
    return out, natural_lse(softmax_max, softmax_sum)


def sparse_flash_attention(
    q, kv_cache, indices, block_table, seq_lens_k, cu_seqlens_q, sm_scale, d_v=512, kv_cache_dtype=AUTO
):
    """glm5_hal.sparse_flash_attention on torch_npu: -> (out [T, H, d_v] in q's dtype, lse [T, H] fp32).

    q [T, H, 576]; kv_cache [blocks, bs, 576]; indices [T, topk] int32 request-local positions (-1 and positions
    >= seq_lens_k[b] are invalid); block_table [B, max_blocks] int32; seq_lens_k [B] int32; cu_seqlens_q [B+1].
    An int8_mla cache runs npu_kv_quant_sparse_flash_attention, fp8_ds_mla the portable path
    (backends/ascend/quantized_cache.py).
    """
    unsupported = sparse_flash_attention_unsupported(q, d_v)
    if kv_cache_dtype != AUTO and kv_cache_dtype not in KERNEL_FORMATS:
        unsupported = f"{kv_cache_dtype}: no A2/A3 sparse attention kernel reads an e4m3 cache"
    elif kv_cache_dtype != AUTO and unsupported is None and q.dtype != torch.bfloat16:
        unsupported = f"npu_kv_quant_sparse_flash_attention takes a bf16 query, got {q.dtype}"
    if unsupported is not None:
        return portable("sparse_flash_attention", unsupported)(
            q, kv_cache, indices, block_table, seq_lens_k, cu_seqlens_q, sm_scale, d_v, kv_cache_dtype=kv_cache_dtype
        )
    if kv_cache_dtype != AUTO:
        return sparse_flash_attention_int8(q, kv_cache, indices, block_table, seq_lens_k, cu_seqlens_q, sm_scale)
    num_tokens, num_heads, width = q.shape
    topk = indices.shape[1]
    seqs = token_sequences(cu_seqlens_q, num_tokens)
    idx, ordered_valid, local = selected_positions(
        indices, seq_lens_k, seqs, block_table, kv_cache.shape[1], kv_cache.shape[0]
    )  # [T, topk] each, valid first

    out = torch.empty(num_tokens, num_heads, LATENT, dtype=q.dtype, device=q.device)
    lse = torch.empty(num_tokens, num_heads, dtype=torch.float32, device=q.device)
    tile = max(1, GATHER_BUDGET // (topk * width))
    for part, rows in gathered_rows(kv_cache, block_table, seqs, idx, ordered_valid, tile):
        out[part], lse[part] = _attend_tile(q[part], rows, local[part], float(sm_scale))  # rows [t, topk, 576]
    # The kernel leaves a row without any valid index undefined; the contract says out = 0 and lse = -inf. A head
    # whose scores were all -inf (lse -inf: an empty softmax, docs/ops.md "Edge rules") gets out = 0 as well.
    return contract_empty_rows(out, lse, ~ordered_valid.any(dim=1))
