"""Lightning indexer scores on Kunlunxin over an `int8_index` key cache: I8_paged_mqa_logits (decode) and
I8_mqa_logits (prefill), then fast_topkv2 where topk is its fixed 2048, as vllm_kunlun/models/deepseek_v2.py does.

    q_idx [T, HI, 128] bf16   -> quant2d per (token, head) row: int8 codes and max; the scale max / 127 is folded
                                 into the head weights (ReLU(c * x) = c * ReLU(x) for c >= 0: exact)
    int8_index rows [blocks, bs, 132] (128 codes | fp32 scale)
                              -> the used blocks' codes, contiguous, and each position's scale: the kernels read
                                 codes and scales as separate tensors, which the contract's interleaved rows are not
    every sequence with the same q_len n <= 2
                              -> I8_paged_mqa_logits(q [B, n, HI, 128], [codes [B*nb, bs, 1, 128], scales [B, nb*bs]],
                                 block table 0..B*nb-1, context_lens = seq_lens_k) -> [B, n, nb*bs], causal, -inf past
    otherwise                 -> per sequence, I8_mqa_logits(q rows, [codes [S, 128], scales [S]], lens [0, q_len] /
                                 [0, S]) -> [q_len, S], masked causally here (vllm-kunlun masks after it, too)
    lightning_indexer         -> topk == 2048: fast_topkv2(logits, visible key counts); else glm5_hal.topk's
                                 deterministic top-k of the kernel's logits; scores = the picked logits

Tolerance: the kernels take int8 queries, so the query is quantized per (token, head) (max / 127, half a code at
most per element: 1/254 of the row's largest |q|). That is coarser than fp32 and of the order of bf16 rounding, so
only bf16 queries take the kernels and are judged at bf16's tolerance (unchanged); fp32 and fp16 queries, float
caches and the fp8 formats run the portable path. Ties: fast_topkv2 does not document which of exactly tied keys it
keeps (the contract keeps the lower position): GLM5_HAL_OP_BACKENDS=lightning_indexer=torch keeps the rule.
"""

from __future__ import annotations

import torch
from torch import Tensor

from backends.kunlun.runtime import kernel, on_host, portable, why_not_kernel
from glm5_hal.kv_formats import FORMATS
from glm5_hal.paged import token_positions, token_sequences
from glm5_hal.topk import topk_lower_position_ties
from glm5_hal.vendor_conventions import contract_quant_scale, valid_first

KERNEL_FORMAT = "int8_index"
HEAD_DIM = 128
FAST_TOPK = 2048  # fast_topkv2's only k
MAX_DECODE_Q = 2  # the decode kernel serves vLLM's decode steps (one token, or two with a draft token)
INT8_MAX = 127.0


def indexer_unsupported(q_idx: Tensor, index_k_cache: Tensor, kv_cache_dtype: str) -> str | None:
    """Why the int8 indexer kernels cannot take these inputs, or None if they can."""
    why = why_not_kernel(q_idx)
    if why is not None:
        return why
    if kv_cache_dtype != KERNEL_FORMAT:
        return f"the indexer kernels read int8 keys: the {KERNEL_FORMAT} cache, not {kv_cache_dtype}"
    if q_idx.dtype != torch.bfloat16:
        return f"int8 query quantization is within bf16's tolerance only: bf16 queries, got {q_idx.dtype}"
    if q_idx.shape[2] != HEAD_DIM or q_idx.shape[0] == 0:
        return f"the indexer kernels take {HEAD_DIM}-dim heads (and at least one token)"
    return None


def _int8_query(q_idx: Tensor, weights: Tensor) -> tuple[Tensor, Tensor]:
    """q [T, HI, D] -> (codes [T, HI, D] int8, weights [T, HI] fp32 with each row's scale folded in)."""
    rows = q_idx.reshape(-1, q_idx.shape[-1]).contiguous()
    codes = torch.empty(rows.shape, dtype=torch.int8, device=q_idx.device)
    row_max = torch.empty(rows.shape[0], 1, dtype=torch.float32, device=q_idx.device)
    kernel("quant2d")(rows, codes, row_max, True)
    codes, scale = contract_quant_scale(codes, row_max[:, 0] / INT8_MAX)  # an all-zero row: codes 0
    return codes.view(q_idx.shape), weights.to(torch.float32) * scale.view(q_idx.shape[:2])


def _paged_keys(cache: Tensor, block_table: Tensor, used: int) -> tuple[Tensor, Tensor]:
    """The first `used` blocks of each sequence: (codes [B * used, bs, 1, D] int8 contiguous, scales [B, used * bs]
    fp32). Table entries outside the cache read block 0; their keys are masked by the caller."""
    fmt = FORMATS[KERNEL_FORMAT]
    blocks = block_table[:, :used].to(torch.int64)
    blocks = torch.where((blocks >= 0) & (blocks < cache.shape[0]), blocks, 0)
    rows = cache[blocks.reshape(-1)]  # [B * used, bs, 132]: only the blocks the kernels would read
    codes = rows[..., : fmt.scales_offset].contiguous().view(torch.int8).unsqueeze(2)
    scales = rows[..., fmt.scales_offset : fmt.scales_offset + 4].contiguous().view(torch.float32)
    return codes, scales.reshape(block_table.shape[0], -1)


def _decode_logits(codes, weights, cache, block_table, seq_lens_k, q_len, width) -> Tensor:
    batch, block_size = seq_lens_k.shape[0], cache.shape[1]
    lengths = on_host(seq_lens_k)
    used = max(1, -(-int(lengths.max()) // block_size))
    keys, scales = _paged_keys(cache, block_table, used)
    logits = torch.empty(batch, q_len, used * block_size, dtype=torch.float32, device=codes.device)
    kernel("I8_paged_mqa_logits")(
        codes.view(batch, q_len, *codes.shape[1:]),
        [keys, scales],
        weights.view(batch, q_len, -1).contiguous(),
        [lengths, seq_lens_k.to(torch.int32).contiguous()],
        torch.arange(batch * used, dtype=torch.int32, device=codes.device).view(batch, used),
        used * block_size,
        True,
        logits,
    )
    out = torch.full((batch * q_len, width), float("-inf"), dtype=torch.float32, device=codes.device)
    span = min(width, used * block_size)
    out[:, :span] = logits.view(batch * q_len, -1)[:, :span]
    return out


def _prefill_logits(codes, weights, cache, block_table, seq_lens_k, cu_seqlens_q, width) -> Tensor:
    out = torch.full((codes.shape[0], width), float("-inf"), dtype=torch.float32, device=codes.device)
    block_size = cache.shape[1]
    lod, lengths = cu_seqlens_q.cpu().tolist(), seq_lens_k.cpu().tolist()
    for b, length in enumerate(lengths):
        start, end = lod[b], lod[b + 1]
        if end == start or length == 0:
            continue
        used = -(-length // block_size)
        keys, scales = _paged_keys(cache, block_table[b : b + 1], used)
        logits = torch.empty(end - start, length, dtype=torch.float32, device=codes.device)
        kernel("I8_mqa_logits")(
            codes[start:end].contiguous(),
            [keys.view(-1, HEAD_DIM)[:length].contiguous(), scales[0, :length].contiguous()],
            weights[start:end].contiguous(),
            _lens(end - start, codes.device),
            _lens(length, codes.device),
            logits,
            True,
        )
        out[start:end, : min(length, width)] = logits[:, :width]
    return out


def _lens(n: int, device: torch.device) -> list[Tensor]:
    """A single sequence of n as the (host, device) lods the kernel takes."""
    lod = torch.tensor([0, n], dtype=torch.int32)
    return [lod, lod.to(device)]


def _visible(logits: Tensor, block_table: Tensor, seq_lens_k: Tensor, cu_seqlens_q: Tensor, cache: Tensor) -> Tensor:
    """logits [T, width] with -inf where key s is not visible to token t: after its position, or in a block the
    table does not address (docs/ops.md "Paged caches")."""
    seqs = token_sequences(cu_seqlens_q, logits.shape[0])
    columns = torch.arange(logits.shape[1], device=logits.device)
    positions = token_positions(seq_lens_k, cu_seqlens_q, seqs)
    blocks = block_table.to(torch.int64)[seqs][:, columns // cache.shape[1]]
    visible = (columns[None, :] <= positions[:, None]) & (blocks >= 0) & (blocks < cache.shape[0])
    return logits.masked_fill(~visible, float("-inf"))


def _logits(q_idx, weights, index_k_cache, block_table, seq_lens_k, cu_seqlens_q) -> Tensor:
    width = block_table.shape[1] * index_k_cache.shape[1]
    codes, folded = _int8_query(q_idx, weights)
    q_len = _uniform_q_len(cu_seqlens_q)
    if q_len is not None:
        logits = _decode_logits(codes, folded, index_k_cache, block_table, seq_lens_k, q_len, width)
    else:
        logits = _prefill_logits(codes, folded, index_k_cache, block_table, seq_lens_k, cu_seqlens_q, width)
    return _visible(logits, block_table, seq_lens_k, cu_seqlens_q, index_k_cache)


def _uniform_q_len(cu_seqlens_q: Tensor) -> int | None:
    q_lens = torch.diff(cu_seqlens_q.to(torch.int64)).cpu()
    if q_lens.numel() == 0 or not bool((q_lens == q_lens[0]).all()) or not 1 <= int(q_lens[0]) <= MAX_DECODE_Q:
        return None
    return int(q_lens[0])


def indexer_logits(q_idx, weights, index_k_cache, block_table, seq_lens_k, cu_seqlens_q, kv_cache_dtype="auto"):
    """glm5_hal.indexer_logits on Kunlunxin: -> [T, max_blocks * block_size] fp32, -inf where not visible.

    q_idx [T, HI, 128]; weights [T, HI] fp32; index_k_cache [blocks, bs, 132] uint8 (int8_index) or float rows;
    block_table [B, max_blocks] int32; seq_lens_k [B] int32; cu_seqlens_q [B+1] int32.
    """
    unsupported = indexer_unsupported(q_idx, index_k_cache, kv_cache_dtype)
    if unsupported is not None:
        return portable("indexer_logits", unsupported)(
            q_idx, weights, index_k_cache, block_table, seq_lens_k, cu_seqlens_q, kv_cache_dtype=kv_cache_dtype
        )
    return _logits(q_idx, weights, index_k_cache, block_table, seq_lens_k, cu_seqlens_q)


def lightning_indexer(
    q_idx, weights, index_k_cache, block_table, seq_lens_k, cu_seqlens_q, topk, kv_cache_dtype="auto"
):
    """glm5_hal.lightning_indexer on Kunlunxin: -> (indices [T, topk] int32 request-local positions, -1 after the
    visible keys run out; scores [T, topk] fp32, -inf there). Arguments as indexer_logits."""
    unsupported = indexer_unsupported(q_idx, index_k_cache, kv_cache_dtype)
    if unsupported is not None:
        return portable("lightning_indexer", unsupported)(
            q_idx, weights, index_k_cache, block_table, seq_lens_k, cu_seqlens_q, topk, kv_cache_dtype=kv_cache_dtype
        )
    logits = _logits(q_idx, weights, index_k_cache, block_table, seq_lens_k, cu_seqlens_q)
    num_tokens, width = logits.shape
    # NaN scores: fast_topkv2 does not document their rank; the contract ranks them first (the path below does).
    if topk == FAST_TOPK and width >= FAST_TOPK and not bool(torch.isnan(logits).any()):
        seqs = token_sequences(cu_seqlens_q, num_tokens)
        visible = (token_positions(seq_lens_k, cu_seqlens_q, seqs) + 1).clamp(0, width)
        picked = kernel("fast_topkv2")(logits, visible.to(torch.int32), FAST_TOPK).to(torch.int64)
        scores = logits.gather(1, picked.clamp(min=0))
        # Keys the block table does not address are visible by position but -inf: they are not keys (-1).
        valid = (picked >= 0) & (scores > float("-inf"))
        indices = valid_first(picked, valid)
        return indices.to(torch.int32), logits.gather(1, indices.clamp(min=0)).masked_fill(indices < 0, float("-inf"))
    ranked = min(topk, width)
    best, columns = topk_lower_position_ties(logits, ranked)
    indices = torch.full((num_tokens, topk), -1, dtype=torch.int32, device=logits.device)
    scores = torch.full((num_tokens, topk), float("-inf"), dtype=torch.float32, device=logits.device)
    indices[:, :ranked] = torch.where(best == float("-inf"), -1, columns).to(torch.int32)
    scores[:, :ranked] = best
    return indices, scores
