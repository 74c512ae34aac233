"""Lightning indexer on Ascend: its prolog (matmuls + npu_rotary_mul + npu_scatter_nd_update_) and its top-k
selection (npu_lightning_indexer over the paged index-key cache).

    indexer_prolog:    q = q_norm W_IQ^T, k = LayerNorm(x W_IK^T), w = x W_IW^T * HI^-0.5 * DI^-0.5   (torch)
                       RoPE on the first `rope` dims -> npu_rotary_mul ("interleave" for GLM-5, "half" for
                       DeepSeek-V3.2); key rows -> npu_scatter_nd_update_ into the cache
    lightning_indexer: npu_lightning_indexer(query TND [T,HI,128], key PA_BSND [blocks,bs,1,128] (a view of the
                       cache), weights [T,HI] in the query dtype, actual_seq_lengths_query = prefix sums,
                       actual_seq_lengths_key = seq_lens_k, sparse_count = topk, sparse_mode = 3 (causal))
                       -> indices [T,1,topk]; the scores of the picked keys are recomputed in torch, because the
                       kernel returns them only when training on non-paged keys
    indexer_logits:    no kernel returns the full score matrix: delegated to the `torch` backend.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from backends.ascend.layouts import (
    blocks_outside_the_cache,
    key_slots,
    rope_table_halves,
    rope_table_pairs,
    tnd_prefix_sums,
)
from backends.ascend.quantized_cache import store_rows
from backends.ascend.runtime import half_or_bf16, npu, portable
from glm5_hal.host_reads import host_reads_allowed
from glm5_hal.kv_formats import AUTO
from glm5_hal.paged import token_sequences

# npu_lightning_indexer's documented ranges (torch_npu 2.14.0 docs and vllm-ascend's kernel README).
INDEX_HEAD_DIM = 128
MAX_QUERY_HEADS = 64
MAX_BLOCK_SIZE = 1024
SPARSE_COUNTS = frozenset((*range(1, 2049), 3072, 4096, 5120, 6144, 7168, 8192))
ROTARY_MAX_DIM = 896  # npu_rotary_mul: D < 896
ROTARY_MAX_HEADS = 1000  # npu_rotary_mul "interleave": B * N < 1000
GATHER_BUDGET = 1 << 24  # elements of gathered key rows held at once when rescoring the picked keys


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
    """glm5_hal.indexer_prolog on torch_npu (validated arguments; shapes as in the public op).

    x [T, hidden], q_norm [T, q_lora], w_iq [HI*DI, q_lora], w_ik [DI, hidden], k_norm_* [DI], w_iw [HI, hidden],
    cos/sin [T, rope/2] fp32, index_k_cache [blocks, bs, DI] (or uint8 rows of a quantized kv_cache_dtype, encoded
    in torch) written at slot_mapping [T] int64. Returns (q_idx [T, HI, DI] in x's dtype, weights [T, HI] fp32).
    """
    num_tokens, head_dim = x.shape[0], w_ik.shape[0]
    num_heads, rope = w_iw.shape[0], 2 * cos.shape[1]
    if num_tokens == 0 or not index_k_cache.is_contiguous() or rope >= ROTARY_MAX_DIM or num_heads >= ROTARY_MAX_HEADS:
        reason = "no tokens, a non-contiguous cache, or a RoPE shape npu_rotary_mul does not take"
        return portable("indexer_prolog", reason)(
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
            rope_interleaved=rope_interleaved,
            eps=eps,
            kv_cache_dtype=kv_cache_dtype,
        )
    kernels = npu()
    q = (q_norm @ w_iq.t()).view(num_tokens, num_heads, head_dim)
    # LayerNorm and the head weights in fp32: they feed a top-k ranking, where rounding decides ties.
    k = F.layer_norm((x @ w_ik.t()).float(), (head_dim,), k_norm_weight.float(), k_norm_bias.float(), eps)
    k = k.to(x.dtype)
    weights = (x.float() @ w_iw.float().t()) * (num_heads**-0.5 * head_dim**-0.5)

    mode = "interleave" if rope_interleaved else "half"
    table = rope_table_pairs if rope_interleaved else rope_table_halves
    r1 = table(cos, x.dtype).view(1, num_tokens, 1, rope)  # "1S1D" against a BSND input with B = 1, S = T
    r2 = table(sin, x.dtype).view(1, num_tokens, 1, rope)
    q_rot = kernels.npu_rotary_mul(q[..., :rope].contiguous().unsqueeze(0), r1, r2, rotary_mode=mode)
    k_rot = kernels.npu_rotary_mul(k[:, :rope].contiguous().view(1, num_tokens, 1, rope), r1, r2, rotary_mode=mode)
    q = torch.cat([q_rot.view(num_tokens, num_heads, rope), q[..., rope:]], dim=-1)
    k = torch.cat([k_rot.view(num_tokens, rope), k[:, rope:]], dim=-1)

    store_rows(index_k_cache, slot_mapping, k, kv_cache_dtype)
    return q.to(x.dtype), weights.float()


def lightning_indexer_unsupported(q_idx: Tensor, index_k_cache: Tensor, topk: int) -> str | None:
    """Why npu_lightning_indexer cannot take these inputs, or None if it can."""
    num_tokens, num_heads, head_dim = q_idx.shape
    block_size = index_k_cache.shape[1]
    if not half_or_bf16(q_idx):
        return f"npu_lightning_indexer takes bf16/fp16, got {q_idx.dtype}"
    if head_dim != INDEX_HEAD_DIM or num_heads > MAX_QUERY_HEADS:
        return f"npu_lightning_indexer takes head dim {INDEX_HEAD_DIM} and <= {MAX_QUERY_HEADS} heads"
    if block_size % 16 or block_size > MAX_BLOCK_SIZE:
        return f"npu_lightning_indexer takes a block size that is a multiple of 16 up to 1024, got {block_size}"
    if topk not in SPARSE_COUNTS:
        return f"npu_lightning_indexer takes sparse_count in 1..2048 or 3072..8192 step 1024, got {topk}"
    if num_tokens == 0 or not index_k_cache.is_contiguous():
        return "no tokens, or a non-contiguous cache (the kernel reads it in place)"
    return None


def _picked_scores(q_idx, weights, index_k_cache, block_table, seqs, indices) -> Tensor:
    """[T, topk] fp32 scores sum_j w[t,j] * ReLU(q[t,j] . k[idx]) of the picked keys; -inf where idx is -1."""
    num_tokens, topk = indices.shape
    rows = index_k_cache.view(-1, index_k_cache.shape[-1])
    scores = torch.empty(num_tokens, topk, dtype=torch.float32, device=q_idx.device)
    tile = max(1, GATHER_BUDGET // max(1, topk * rows.shape[1]))
    for start in range(0, num_tokens, tile):  # tiles bound the gathered rows, not a loop over tokens
        part = slice(start, start + tile)
        valid = indices[part] >= 0
        blocks, block_size = index_k_cache.shape[0], index_k_cache.shape[1]
        slots = key_slots(block_table, seqs[part], indices[part], valid, block_size, blocks)
        keys = rows[slots.clamp(min=0)].float()  # [t, topk, DI]
        dots = torch.relu(torch.einsum("thd,tkd->thk", q_idx[part].float(), keys))  # [t, HI, topk]
        picked = torch.einsum("th,thk->tk", weights[part].float(), dots)
        scores[part] = torch.where(valid, picked, torch.full_like(picked, float("-inf")))
    return scores


def lightning_indexer(q_idx, weights, index_k_cache, block_table, seq_lens_k, cu_seqlens_q, topk, kv_cache_dtype=AUTO):
    """glm5_hal.lightning_indexer on torch_npu: -> (indices [T, topk] int32, scores [T, topk] fp32).

    q_idx [T, HI, DI]; weights [T, HI] fp32; index_k_cache [blocks, bs, DI]; block_table [B, max_blocks] int32;
    seq_lens_k [B] int32; cu_seqlens_q [B+1] int32. Query token i of sequence b sees keys up to its position
    seq_lens_k[b] - q_len[b] + i: exactly the kernel's sparse_mode 3 ("rightDownCausal") with these lengths.
    A quantized key cache runs the portable path (backends/ascend/quantized_cache.py says why). One host read: whether
    a sequence uses a block outside the cache (possible only with value checks off), which the kernel cannot mask.
    """
    unsupported = lightning_indexer_unsupported(q_idx, index_k_cache, topk)
    if kv_cache_dtype != AUTO:
        unsupported = f"{kv_cache_dtype} keys: npu_quant_lightning_indexer needs separate int8 keys and int8 queries"
    blocks, block_size = index_k_cache.shape[0], index_k_cache.shape[1]
    outside = blocks_outside_the_cache(block_table, seq_lens_k, block_size, blocks)
    if unsupported is None and host_reads_allowed(outside) and bool(outside.any()):
        # Only with value checks off: the kernel reads the table itself, so it would read past the cache and rank
        # keys that are not keys (docs/ops.md "Paged caches"); the portable path masks them.
        unsupported = "a block a sequence uses is outside the cache (value checks off)"
    if unsupported is not None:
        return portable("lightning_indexer", unsupported)(
            q_idx, weights, index_k_cache, block_table, seq_lens_k, cu_seqlens_q, topk, kv_cache_dtype=kv_cache_dtype
        )
    num_tokens, _, head_dim = q_idx.shape
    indices, _ = npu().npu_lightning_indexer(
        q_idx.contiguous(),
        index_k_cache.view(blocks, block_size, 1, head_dim),
        weights.to(q_idx.dtype).contiguous(),  # the kernel takes weights in the query's dtype
        actual_seq_lengths_query=tnd_prefix_sums(cu_seqlens_q),
        actual_seq_lengths_key=seq_lens_k.to(torch.int32).contiguous(),
        # While a graph is captured (no host read) an id outside the cache is clamped into it: never a read past it.
        block_table=block_table.clamp(0, blocks - 1).to(torch.int32).contiguous(),
        layout_query="TND",
        layout_key="PA_BSND",
        sparse_count=topk,
        sparse_mode=3,
    )
    indices = indices.view(num_tokens, topk).to(torch.int32)
    seqs = token_sequences(cu_seqlens_q, num_tokens)
    return indices, _picked_scores(q_idx, weights, index_k_cache, block_table, seqs, indices)
