"""Lightning indexer on MetaX: the scores on the portable path (MetaX publishes no indexer-score kernel), the
top-2048 selection by mcoplib's sgl_kernel.fast_topk.

    scores = indexer_logits(...)                   [T, S] fp32, -inf where a key is not visible (portable)
    lengths[t] = min(position(t) + 1, S)           visible keys of token t (positions 0 .. lengths - 1)
    fast_topk(scores, indices!, lengths, None)     indices [T, 2048] int32: the row's 0 .. lengths - 1 then -1
                                                   when lengths <= 2048, else positions of its 2048 best scores
    -> picks whose score is -inf (keys the block table does not address) become -1, valid picks first

fast_topk's k is fixed at 2048 (TopK in op/sglang/csrc/elementwise/topk.cu), GLM-5's and DeepSeek-V3.2's topk;
other k run the portable path. The kernel does not document which of exactly tied keys it keeps, nor how it ranks
NaN: the contract's lower-position rule holds on the portable path only, and a NaN score runs it while value
checks are on.
"""

from __future__ import annotations

import torch

from backends.metax.runtime import kernel, portable
from glm5_hal.checks import value_checks_enabled
from glm5_hal.kv_formats import AUTO
from glm5_hal.paged import token_positions, token_sequences
from glm5_hal.vendor_conventions import valid_first

LIBRARY = "mcoplib.sgl_kernel"
FAST_TOPK = 2048


def lightning_indexer(q_idx, weights, index_k_cache, block_table, seq_lens_k, cu_seqlens_q, topk, kv_cache_dtype=AUTO):
    """glm5_hal.lightning_indexer with fast_topk: -> (indices [T, topk] int32, scores [T, topk] fp32).

    q_idx [T, HI, DI]; weights [T, HI] fp32; index_k_cache [blocks, bs, DI] (or the uint8 rows of a quantized
    format, scored on the portable path); block_table [B, max_blocks] int32; seq_lens_k [B]; cu_seqlens_q [B+1].
    """
    args = (q_idx, weights, index_k_cache, block_table, seq_lens_k, cu_seqlens_q)
    num_tokens = q_idx.shape[0]
    if topk != FAST_TOPK or num_tokens == 0:
        reason = f"fast_topk selects exactly {FAST_TOPK} keys, asked for {topk}"
        return portable("lightning_indexer", reason)(*args, topk, kv_cache_dtype=kv_cache_dtype)
    scores = portable("indexer_logits", "no MetaX indexer-score kernel")(*args, kv_cache_dtype=kv_cache_dtype)
    if value_checks_enabled(scores) and bool(torch.isnan(scores).any()):
        reason = "a NaN score: fast_topk does not document how it ranks NaN"
        return portable("lightning_indexer", reason)(*args, topk, kv_cache_dtype=kv_cache_dtype)
    seqs = token_sequences(cu_seqlens_q, num_tokens)
    visible = token_positions(seq_lens_k, cu_seqlens_q, seqs) + 1
    lengths = visible.clamp(0, scores.shape[1]).to(torch.int32).contiguous()
    indices = torch.empty(num_tokens, FAST_TOPK, dtype=torch.int32, device=scores.device)
    kernel(LIBRARY, "fast_topk")(scores.contiguous(), indices, lengths, None)  # writes `indices`
    picked = scores.gather(1, indices.to(torch.int64).clamp(min=0))
    valid = (indices >= 0) & (picked != float("-inf"))
    indices = valid_first(indices, valid)
    picked = scores.gather(1, indices.to(torch.int64).clamp(min=0))
    return indices, torch.where(indices >= 0, picked, torch.full_like(picked, float("-inf")))
