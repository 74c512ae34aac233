"""Lightning indexer of the Triton backend: key scores I[t, s] = sum_j w[t, j] * ReLU(q[t, j] . k[s]) and top-k.

[indexer_logits]     one program per (BLOCK_T consecutive query tokens, tile of BLOCK_S key positions): the
                     tokens' queries [BLOCK_T * BLOCK_HI, DI] against the tile's gathered keys [DI, BLOCK_S] in
                     one dot, ReLU, then each token's head reduction with its weights, in registers: [T, HI, S]
                     never exists. Tokens of one sequence share its keys, so a prefill reads each key tile once
                     per BLOCK_T tokens and fills the dot's rows (GLM-5 has 32 index heads: one token alone is
                     half of a Hopper MMA's 64 rows); a tile of tokens that spans sequences takes one pass per
                     sequence. A decode batch (under 2 new tokens a sequence) runs 1 token a program
                     (tokens_per_program). Key positions past a token's own (the causal rule) are -inf; a tile
                     wholly past every token's is not read at all.
[lightning_indexer]  the logits kernel over a tile of tokens at a time, then each row's top-k in the contract's
                     order (equal scores by the lower position): backends/triton/topk.py's radix select, one
                     program per row (topk up to its MAX_K), or glm5_hal.topk's torch ops (topk_select="torch",
                     and past MAX_K).
A quantized key cache (fp8_index, int8_index) is read as codes in the load path: the dot runs on the codes (exact
in the query's dtype) and each key's score is multiplied by its scale afterwards.

Why a select of its own: glm5_hal.topk puts around torch.topk's select (of k + 1) the contract's order of ties: a
sort of those, a composite select where a tie crosses the boundary, and a flag read back to the host to decide it.
On an H200 (Triton 3.6, perf/triton_gpu.py, docs/backends.md), at 64 tokens over 64K keys, those ops took 40-61%
of the op in two runs (1.76 / 1.93 ms, the logits kernel alone 1.05 / 0.76 ms). The kernel gives the same values
and positions in the same order, bit for bit, in one launch and with no host read; it has not been timed on a GPU
yet (perf/triton_gpu.py prints both selects at decode and prefill).
Reference: ops_reference/indexer.py
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from backends.triton.quantized_cache import aligned_cache, code_of, index_key_scale, layout_of, load_index_codes
from backends.triton.runtime import DOT_UPCAST, interpreting, unit_stride_arguments
from backends.triton.sparse_attention import key_rows, token_sequences
from backends.triton.topk import MAX_K, select_topk
from glm5_hal.kv_formats import AUTO
from glm5_hal.topk import topk_lower_position_ties

# Key positions per program: a [HI, DI] x [DI, 128] tensor-core dot on GPU (64 x 128 x 128 at GLM-5), and few
# enough programs for the interpreter, whose cost is per program.
_BLOCK_S = 128
# Rows of the logits kernel's dot (query tokens x heads) wanted where consecutive tokens share a sequence: a GLM-5
# token has 32 index heads, under the M = 64 of a Hopper warpgroup's MMA, and each token read its key tile alone.
_DOT_ROWS = 128
MAX_TOKENS_PER_PROGRAM = 8
# Most bytes the dot's operands (the q rows and the key tile, BLOCK_D wide: what the kernel keeps in shared memory)
# may take where the guess picks the tokens: under the 99 KB a block may use on sm_86 / sm_89, the smallest limit of
# the GPUs the compile check covers (fp32 at GLM-5 dims with 4 tokens would take 128 KB).
_DOT_OPERAND_BYTES = 96 * 1024
# Logit rows materialised at once by lightning_indexer (fp32 bytes); bounds its memory at long contexts.
_LOGIT_TILE_BYTES = 256 * 1024 * 1024


@triton.jit
def _indexer_logits_kernel(
    # Pointers
    q_ptr,  # [T, HI, DI]
    weights_ptr,  # [T, HI] fp32
    k_ptr,  # [num_blocks, BLOCK_SIZE, DI] (or a format's uint8 rows [.., .., row_bytes]), any block / slot strides
    block_table_ptr,  # [B, max_blocks] int32
    seq_lens_k_ptr,  # [B] int32
    cu_seqlens_q_ptr,  # [B+1] int32
    logits_ptr,  # [rows, width] fp32, written; row r holds token token_offset + r
    # Sizes
    token_offset,
    num_rows,
    num_heads,
    head_dim,
    num_seqs,
    max_blocks,
    num_blocks,
    width,
    # Strides (elements)
    stride_qt,
    stride_qh,
    stride_qd,
    stride_wt,
    stride_wh,
    stride_k_block,
    stride_k_slot,
    stride_kd,
    stride_bt_b,
    stride_lt,
    stride_ls,
    # Meta-parameters
    BLOCK_SIZE: tl.constexpr,  # cache block size
    BLOCK_B: tl.constexpr,  # >= B
    BLOCK_T: tl.constexpr,  # query tokens per program (consecutive rows)
    BLOCK_HI: tl.constexpr,  # >= HI; BLOCK_T * BLOCK_HI >= 16 (tl.dot's minimum)
    BLOCK_D: tl.constexpr,  # >= DI
    BLOCK_S: tl.constexpr,  # key positions per program
    DOT_UPCAST: tl.constexpr,  # the interpreter's bf16 dot is wrong: widen operands to fp32 there
    KEY_CODE: tl.constexpr,  # CODE_FLOAT, or the code kind of a quantized key cache (triton/quantized_cache.py)
    KEY_SCALES_OFFSET: tl.constexpr,  # byte offset of a quantized key's fp32 scale
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T] logit rows
    row_ok = rows < num_rows
    tokens = token_offset + rows
    tile_start = tl.program_id(1) * BLOCK_S
    key_pos = tile_start + tl.arange(0, BLOCK_S)
    seqs = token_sequences(cu_seqlens_q_ptr, num_seqs, tokens, BLOCK_B)  # [BLOCK_T]
    # Each token's own position: seq_lens_k[b] - (new tokens of b) + (its index among them); -1 past the rows.
    positions = tl.load(seq_lens_k_ptr + seqs, mask=row_ok, other=0) - tl.load(
        cu_seqlens_q_ptr + seqs + 1, mask=row_ok, other=0
    )
    positions = tl.where(row_ok, positions + tokens, -1)
    out_ptrs = logits_ptr + rows[:, None] * stride_lt + key_pos[None, :] * stride_ls  # [BLOCK_T, BLOCK_S]
    out_ok = row_ok[:, None] & (key_pos < width)[None, :]
    heads = tl.arange(0, BLOCK_HI)
    dims = tl.arange(0, BLOCK_D)
    head_ok = heads < num_heads
    dim_ok = dims < head_dim
    # Rows whose token sees no key of the tile (the causal rule) are -inf; the passes below write the others.
    future = tile_start > positions[:, None]
    tl.store(out_ptrs, tl.full((BLOCK_T, BLOCK_S), float("-inf"), tl.float32), mask=out_ok & future)
    # Consecutive tokens mostly share a sequence (a prefill), and then the tile's keys are read once for all of them;
    # a tile that spans sequences takes one pass per sequence, each over that sequence's own keys.
    first_seq = tl.min(tl.where(row_ok, seqs, num_seqs), axis=0)
    last_seq = tl.max(tl.where(row_ok, seqs, -1), axis=0)
    for step in range(0, last_seq - first_seq + 1):
        seq = first_seq + step  # a tensor in the interpreter too (its range yields ints)
        in_seq = row_ok & (seqs == seq)  # [BLOCK_T]
        last_position = tl.max(tl.where(in_seq, positions, -1), axis=0)
        if tile_start <= last_position:  # some token of the sequence sees a key of the tile
            # The dot's rows: token t's head j is row t * BLOCK_HI + j.
            q_ok = in_seq[:, None, None] & head_ok[None, :, None] & dim_ok[None, None, :]
            q = tl.load(
                q_ptr
                + tokens[:, None, None] * stride_qt
                + heads[None, :, None] * stride_qh
                + dims[None, None, :] * stride_qd,
                mask=q_ok,
                other=0.0,
            )
            q = tl.reshape(q, (BLOCK_T * BLOCK_HI, BLOCK_D))
            w_ok = in_seq[:, None] & head_ok[None, :]
            w = tl.load(weights_ptr + tokens[:, None] * stride_wt + heads[None, :] * stride_wh, mask=w_ok, other=0.0)
            w = tl.reshape(w, (BLOCK_T * BLOCK_HI,))
            rows_k, addressed = key_rows(
                block_table_ptr,
                stride_bt_b,
                seq,
                key_pos,
                max_blocks,
                num_blocks,
                stride_k_block,
                stride_k_slot,
                BLOCK_SIZE,
            )
            # A key in a block outside the cache is not a key (docs/ops.md "Paged caches").
            key_ok = (key_pos <= last_position) & addressed
            row_ptrs = k_ptr + rows_k  # [BLOCK_S]
            key_mask = key_ok[:, None] & dim_ok[None, :]
            keys = load_index_codes(row_ptrs[:, None], dims[None, :], key_mask, stride_kd, q.dtype, KEY_CODE)
            if DOT_UPCAST:
                q = q.to(tl.float32)
                keys = keys.to(tl.float32)
            # "ieee": fp32 operands must not be rounded to tf32 (fp32 parity is 1e-5); bf16/fp16 dots are unaffected.
            dots = tl.dot(q, tl.trans(keys), input_precision="ieee")  # [BLOCK_T * BLOCK_HI, BLOCK_S]
            # ReLU as a select, so NaN passes (tl.maximum may drop it: fmax on GPUs, nanmax in the interpreter).
            weighted = tl.reshape(tl.where(dots < 0.0, 0.0, dots) * w[:, None], (BLOCK_T, BLOCK_HI, BLOCK_S))
            # The head reduction per token -> [BLOCK_T, BLOCK_S]. A padding head (its q and weight 0) adds nothing,
            # not 0 x inf = NaN against a key holding an infinity, which the real heads' dots may all send to 0.
            scores = tl.sum(tl.where(head_ok[None, :, None], weighted, 0.0), axis=1)
            # Quantized keys' scales.
            scores = index_key_scale(scores, row_ptrs[None, :], key_ok[None, :], KEY_CODE, KEY_SCALES_OFFSET)
            visible = key_ok[None, :] & (key_pos[None, :] <= positions[:, None])
            tl.store(out_ptrs, tl.where(visible, scores, float("-inf")), mask=out_ok & in_seq[:, None] & ~future)


def _fill_logits(
    logits: Tensor,
    token_offset: int,
    q_idx: Tensor,
    weights: Tensor,
    index_k_cache: Tensor,
    block_table: Tensor,
    seq_lens_k: Tensor,
    cu_seqlens_q: Tensor,
    kv_cache_dtype: str,
    tokens_per_program: int,
) -> None:
    """Write the logits of tokens token_offset : token_offset + logits.shape[0] into logits [rows, width] fp32."""
    num_rows, width = logits.shape
    if num_rows == 0 or width == 0:
        return
    num_heads, head_dim = q_idx.shape[1], q_idx.shape[2]  # a quantized cache's rows are wider (row_bytes)
    block_s = _BLOCK_S
    block_t = tokens_per_program
    _indexer_logits_kernel[(triton.cdiv(num_rows, block_t), triton.cdiv(width, block_s))](
        q_idx,
        weights,
        index_k_cache,
        block_table,
        seq_lens_k,
        cu_seqlens_q,
        logits,
        token_offset=token_offset,
        num_rows=num_rows,
        num_heads=num_heads,
        head_dim=head_dim,
        num_seqs=seq_lens_k.shape[0],
        max_blocks=block_table.shape[1],
        num_blocks=index_k_cache.shape[0],
        width=width,
        stride_qt=q_idx.stride(0),
        stride_qh=q_idx.stride(1),
        stride_qd=q_idx.stride(2),
        stride_wt=weights.stride(0),
        stride_wh=weights.stride(1),
        stride_k_block=index_k_cache.stride(0),
        stride_k_slot=index_k_cache.stride(1),
        stride_kd=index_k_cache.stride(2),
        stride_bt_b=block_table.stride(0),
        stride_lt=logits.stride(0),
        stride_ls=logits.stride(1),
        BLOCK_SIZE=index_k_cache.shape[1],
        BLOCK_B=max(2, triton.next_power_of_2(seq_lens_k.shape[0])),
        BLOCK_T=block_t,
        BLOCK_HI=max(triton.cdiv(16, block_t), triton.next_power_of_2(num_heads)),
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_S=block_s,
        DOT_UPCAST=DOT_UPCAST,
        KEY_CODE=code_of(kv_cache_dtype),
        KEY_SCALES_OFFSET=layout_of(kv_cache_dtype)["SCALES_OFFSET"],
        num_warps=4 if interpreting() else 8,
    )


def tokens_per_program(num_tokens: int, num_seqs: int, num_heads: int, head_dim: int, element_size: int) -> int:
    """Query tokens per program of the logits kernel: 1 where the batch averages under 2 new tokens a sequence (a
    decode: each token's keys are its own, and a tile spanning sequences would take one pass per sequence); else
    enough tokens for _DOT_ROWS rows of the dot (GLM-5's 32 heads: 4; DeepSeek-V3.2's 64: 2), at most
    MAX_TOKENS_PER_PROGRAM, halved while the dot's operands of `element_size` bytes (q's dtype: a quantized cache's
    keys are decoded into it) would pass _DOT_OPERAND_BYTES. A first guess from the shapes, not yet timed on a GPU:
    perf/triton_gpu.py prints the indexer's prefill target at 1, 2, 4 and 8 tokens a program, which is what it
    should be tuned from."""
    if num_tokens < 2 * num_seqs:
        return 1
    block_hi = triton.next_power_of_2(max(num_heads, 1))
    block_d = max(16, triton.next_power_of_2(head_dim))
    tokens = max(1, min(_DOT_ROWS // block_hi, MAX_TOKENS_PER_PROGRAM))
    while tokens > 1 and (tokens * block_hi + _BLOCK_S) * block_d * element_size > _DOT_OPERAND_BYTES:
        tokens //= 2
    return tokens


def _checked_tokens_per_program(value: int | None, q_idx: Tensor, num_seqs: int) -> int:
    if value is None:
        num_tokens, num_heads, head_dim = q_idx.shape
        return tokens_per_program(num_tokens, num_seqs, num_heads, head_dim, q_idx.element_size())
    if value < 1 or value & (value - 1) or value > MAX_TOKENS_PER_PROGRAM:
        raise ValueError(f"tokens_per_program: expected a power of two in 1..{MAX_TOKENS_PER_PROGRAM}, got {value}")
    return value


def _default_select(ranked: int) -> str:
    """lightning_indexer's top-k: the kernel where it takes `ranked` keys, except under the interpreter, whose cost
    is per program and per operation (the kernel took 2.4 s a row at k = 2048 over 4K and 16K keys there, Triton
    3.9, AMD EPYC Zen 5; the indexer's parity and fuzz tests took 90 -> 226 s with it): glm5_hal.topk there, which
    the kernel equals bit for bit (parity_tests/test_triton_topk_unit.py runs the kernel under the interpreter)."""
    return "kernel" if ranked <= MAX_K and not interpreting() else "torch"


def _readable_cache(index_k_cache: Tensor, kv_cache_dtype: str) -> Tensor:
    """The cache as the kernel reads it: in place, or a copy where a quantized row's scale is misaligned."""
    return aligned_cache(index_k_cache, kv_cache_dtype)


@unit_stride_arguments()
def indexer_logits(
    q_idx: Tensor,
    weights: Tensor,
    index_k_cache: Tensor,
    block_table: Tensor,
    seq_lens_k: Tensor,
    cu_seqlens_q: Tensor,
    kv_cache_dtype: str = AUTO,
    *,
    tokens_per_program: int | None = None,
) -> Tensor:
    """The full score matrix (validated by glm5_hal.indexer_logits).

    q_idx: [T, HI, DI] bf16/fp16/fp32. weights: [T, HI] fp32. index_k_cache: [num_blocks, block_size, DI],
    q_idx's dtype, or the uint8 rows of a quantized kv_cache_dtype (decoded in the kernel as keys are loaded).
    block_table: [B, max_blocks] int32; seq_lens_k: [B] int32; cu_seqlens_q: [B+1] int32.

    Returns logits [T, max_blocks * block_size] fp32, -inf where key position s is past token t's position.

    tokens_per_program: query tokens per program of the kernel (a power of two up to MAX_TOKENS_PER_PROGRAM; None:
    the module's `tokens_per_program` guess); the logits are the same either way, up to the order of fp32 sums.
    """
    width = block_table.shape[1] * index_k_cache.shape[1]
    block_t = _checked_tokens_per_program(tokens_per_program, q_idx, seq_lens_k.shape[0])
    logits = torch.empty((q_idx.shape[0], width), dtype=torch.float32, device=q_idx.device)
    cache = _readable_cache(index_k_cache, kv_cache_dtype)
    _fill_logits(logits, 0, q_idx, weights, cache, block_table, seq_lens_k, cu_seqlens_q, kv_cache_dtype, block_t)
    return logits


@unit_stride_arguments()
def lightning_indexer(
    q_idx: Tensor,
    weights: Tensor,
    index_k_cache: Tensor,
    block_table: Tensor,
    seq_lens_k: Tensor,
    cu_seqlens_q: Tensor,
    topk: int,
    kv_cache_dtype: str = AUTO,
    *,
    tokens_per_program: int | None = None,
    topk_select: str | None = None,
) -> tuple[Tensor, Tensor]:
    """Top-`topk` visible keys per token (validated by glm5_hal.lightning_indexer); arguments as `indexer_logits`.

    Returns (indices [T, topk] int32: request-local key positions, best first, equal scores by lower position
    (glm5_hal.topk), -1 once the visible keys run out
    (and in the columns past the cache width when topk exceeds it); scores [T, topk] fp32: their logits, -inf
    where indices is -1). tokens_per_program: as in `indexer_logits`. topk_select: "kernel" (backends/triton/topk.py,
    for topk up to its MAX_K) or "torch" (glm5_hal.topk); None: `_default_select`. Both give the same bits.
    """
    num_tokens = q_idx.shape[0]
    width = block_table.shape[1] * index_k_cache.shape[1]
    device = q_idx.device
    block_t = _checked_tokens_per_program(tokens_per_program, q_idx, seq_lens_k.shape[0])
    index_k_cache = _readable_cache(index_k_cache, kv_cache_dtype)
    indices = torch.full((num_tokens, topk), -1, dtype=torch.int32, device=device)
    scores = torch.full((num_tokens, topk), float("-inf"), dtype=torch.float32, device=device)
    ranked = min(topk, width)  # columns past the cache width stay -1 / -inf from the fill above
    if topk_select is None:
        topk_select = _default_select(ranked)
    if topk_select not in ("kernel", "torch") or (topk_select == "kernel" and ranked > MAX_K):
        raise ValueError(
            f"topk_select: expected 'torch', or 'kernel' for at most {MAX_K} ranked keys; got {topk_select!r} for "
            f"{ranked}"
        )
    if num_tokens == 0 or ranked == 0:
        return indices, scores
    # A multiple of the tokens a program takes, so that only the last tile's last program has rows to spare.
    token_tile = max(1, min(num_tokens, _LOGIT_TILE_BYTES // (4 * width)))
    token_tile = min(num_tokens, triton.cdiv(token_tile, block_t) * block_t)
    logits = torch.empty((token_tile, width), dtype=torch.float32, device=device)
    for start in range(0, num_tokens, token_tile):
        tile = logits[: min(token_tile, num_tokens - start)]
        _fill_logits(
            tile, start, q_idx, weights, index_k_cache, block_table, seq_lens_k, cu_seqlens_q, kv_cache_dtype, block_t
        )
        # Sorted: NaN scores first (ranked above every number, as the contract says), equal scores by the lower
        # position, invisible (-inf) keys last.
        rows = slice(start, start + tile.shape[0])
        if topk_select == "kernel":
            select_topk(tile, ranked, scores[rows], indices[rows])
            continue
        best, columns = topk_lower_position_ties(tile, ranked)
        scores[rows, :ranked] = best
        indices[rows, :ranked] = torch.where(best == float("-inf"), -1, columns).to(torch.int32)
    return indices, scores
