"""Lightning indexer: [q/k projections -> LayerNorm -> RoPE on the leading dims -> cache write] (the prolog), then
per token I[t, s] = sum_j w[t, j] * ReLU(q[t, j] . k[s]) over the visible keys (the logits), then top-k.

The scores are computed tile by tile: a tile of tokens against a chunk of key positions, with the head
reduction done inside the tile, so the [T, HI, S] product never exists (only [tokens, HI, chunk]). Where the probe
chose a native route for the family (capabilities: `indexer` over bf16 rows, `quantized_indexer` over fp8_index /
int8_index rows), one native kernel does a token tile's products, ReLU and head reduction with the keys read in place
from the cache (same fp32 arithmetic, no gathered copy and no [tokens, HI, chunk] intermediate): indexer_scores.c over
bf16 rows, quantized_index_scores.c over quantized rows, decoded in the kernel exactly as kv_formats decodes them (on
AMX's route, amx_index_scores.c and amx_quantized_index_scores.c: the products on tiles).
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch import Tensor

from backends.torch_eager.capabilities import INDEXER, QUANTIZED_INDEXER
from backends.torch_eager.gemm import Gemm, gemm_for
from backends.torch_eager.native import indexer_prolog as native_prolog
from backends.torch_eager.native import indexer_scores as native_scores
from backends.torch_eager.native import quantized_index_scores as native_quantized_scores
from backends.torch_eager.paged import gather_rows
from backends.torch_eager.primitives import COMPUTE_DTYPE, layer_norm, linear, rope_leading, rows_per_tile
from backends.torch_eager.quantized_cache import row_reader, write_rows
from backends.torch_eager.topk import topk_positions
from glm5_hal.host_reads import host_reads_allowed
from glm5_hal.kv_formats import AUTO
from glm5_hal.paged import token_positions, token_sequences

# Key positions scored per step; the token tile is then sized so that the gathered keys and the per-head dot
# products of one step stay within the tile budget.
KEY_CHUNK = 2048


def indexer_prolog(
    x: Tensor,
    q_norm: Tensor,
    w_iq: Tensor,
    w_ik: Tensor,
    k_norm_weight: Tensor,
    k_norm_bias: Tensor,
    w_iw: Tensor,
    cos: Tensor,
    sin: Tensor,
    index_k_cache: Tensor,
    slot_mapping: Tensor,
    *,
    rope_interleaved: bool,
    eps: float = 1e-6,
    kv_cache_dtype: str = AUTO,
) -> tuple[Tensor, Tensor]:
    """Indexer queries and head weights of T new tokens; writes their keys (validated by glm5_hal.indexer_prolog).

    x: [T, hidden]. q_norm: [T, q_lora]. w_iq: [HI * DI, q_lora]. w_ik: [DI, hidden]. k_norm_weight, k_norm_bias:
    [DI]. w_iw: [HI, hidden]. cos, sin: [T, rope / 2] fp32 (RoPE on the FIRST rope dims). index_k_cache:
    [num_blocks, block_size, DI], written in place at slot_mapping [T] int64 (-1 = skip); uint8
    [num_blocks, block_size, row_bytes] with the keys encoded for a quantized kv_cache_dtype.

    Returns (q_idx [T, HI, DI] in x's dtype, weights [T, HI] fp32 = (x @ w_iw^T) * HI^-0.5 * DI^-0.5).
    """
    num_heads, head_dim = w_iw.shape[0], w_ik.shape[0]  # not the cache's width: a quantized row is row_bytes wide
    gemm = gemm_for(x.dtype, x.device)
    route = gemm.for_rows(x, x.shape[0])
    # A decode step on the native route: the whole prolog in two native calls (the same fp32 arithmetic), where
    # the ops below would cost a few dozen dispatches for a few microseconds of arithmetic. The op validated the
    # shapes and `takes` the rest of what the kernel's wrapper would check again.
    if route.vector_kernels and native_prolog.takes(x, q_norm, (w_iq, w_ik, w_iw), index_k_cache, kv_cache_dtype):
        if native_prolog.availability(route.native_isa)[0]:
            return native_prolog.prolog(
                x, q_norm, w_iq, w_ik, k_norm_weight, k_norm_bias, w_iw, cos, sin, index_k_cache, slot_mapping,
                interleaved=rope_interleaved, eps=eps, kv_cache_dtype=kv_cache_dtype, isa=route.native_isa,
                validated=True,
            )  # fmt: skip
    q = gemm.linear(q_norm, w_iq).view(x.shape[0], num_heads, head_dim)  # [T, HI, DI]
    k = layer_norm(gemm.linear(x, w_ik), k_norm_weight, k_norm_bias, eps)  # [T, DI]
    # q's heads and k rotated as one [T, HI + 1, DI] tensor: the same elementwise arithmetic in half the ops (a
    # decode step's prolog is a few dozen small ops, each costing more than its arithmetic).
    rotated = rope_leading(torch.cat((q, k[:, None]), dim=1), cos, sin, interleaved=rope_interleaved)
    q, k = rotated[:, :num_heads], rotated[:, num_heads]
    # The head weights are an fp32 output: always fp32 products (HI rows of weight, a negligible GEMM).
    weights = linear(x.to(COMPUTE_DTYPE), w_iw) * (num_heads**-0.5 * head_dim**-0.5)  # [T, HI]
    write_rows(index_k_cache, slot_mapping, k, kv_cache_dtype)
    return q.to(x.dtype).contiguous(), weights  # q is a view of the rotated [T, HI + 1, DI]: contiguous, as promised


def scoring_kernel(gemm: Gemm, kv_cache_dtype: str) -> ModuleType | None:
    """The native module whose kernel scores a call on route `gemm` over a cache of kv_cache_dtype (bf16 q and rows
    for a float cache; the caller checks those), where it runs here: indexer_scores over bf16 rows,
    quantized_index_scores over quantized index rows (each with its vector builds, and an AMX kernel for AMX's route:
    amx_index_scores.c, amx_quantized_index_scores.c); None for the torch code."""
    if not gemm.native:
        return None
    if kv_cache_dtype == AUTO:
        module = native_scores
    elif kv_cache_dtype in native_quantized_scores.CODES:
        module = native_quantized_scores
    else:
        return None
    return module if module.availability(gemm.native_isa)[0] else None


class _ScoringBatch:
    """What every tile of one scoring call shares: queries, fp32 head weights, token sequences and positions, and
    the cache as rows of flat slots (float, or uint8 rows of a quantized format, decoded as they are gathered)."""

    def __init__(
        self,
        q_idx: Tensor,
        weights: Tensor,
        index_k_cache: Tensor,
        block_table: Tensor,
        seq_lens_k: Tensor,
        cu_seqlens_q: Tensor,
        kv_cache_dtype: str = AUTO,
    ) -> None:
        num_tokens, num_heads, head_dim = q_idx.shape
        # q . k products; the head reduction stays fp32. Quantized rows are their own family (decoded first).
        family = INDEXER if kv_cache_dtype == AUTO else QUANTIZED_INDEXER
        self.gemm = gemm_for(q_idx.dtype, q_idx.device, family)
        # Keys reach the q . k GEMM in its operand dtype, decoded first where the cache holds a quantized format.
        self.read_rows = row_reader(kv_cache_dtype, self.gemm.operand)
        self.kv_cache_dtype = kv_cache_dtype
        # One native kernel for products, ReLU and head reduction on a native path (scoring_kernel), with the rows
        # read in place (contiguous in a row; other layouts gather, as before): bf16 queries over a bf16 cache, or any
        # float queries over quantized index rows (decoded in the kernel).
        float_rows = kv_cache_dtype == AUTO and index_k_cache.dtype == q_idx.dtype == torch.bfloat16
        self.fused = (
            (float_rows or kv_cache_dtype != AUTO)
            and index_k_cache.stride(-1) == 1
            and scoring_kernel(self.gemm, kv_cache_dtype) is not None
        )
        self.q = q_idx  # converted per tile, so a bf16 batch never exists whole in fp32
        self.weights = weights.to(COMPUTE_DTYPE)  # [T, HI]
        self.cache = index_k_cache  # [num_blocks, block_size, DI]
        self.block_table = block_table
        self.block_size = index_k_cache.shape[1]
        self.width = block_table.shape[1] * self.block_size  # every key position the block table can address
        self.seq_lens_k, self.cu_seqlens_q = seq_lens_k, cu_seqlens_q
        # A kernel that takes the paged batch finds each token's sequence, position and table row itself.
        self.paged = self.fused and kv_cache_dtype != AUTO
        if not self.paged:
            self.seqs = token_sequences(cu_seqlens_q, num_tokens)  # [T]
            self.positions = token_positions(seq_lens_k, cu_seqlens_q, self.seqs)  # [T]
        # Keys are gathered a whole cache block at a time (one contiguous copy per block instead of one per key,
        # about 4x faster on CPU), so a chunk is a whole number of blocks.
        self.blocks_per_chunk = max(1, min(KEY_CHUNK, max(self.width, 1)) // self.block_size)
        self.key_chunk = self.blocks_per_chunk * self.block_size
        # Per token of a tile: the gathered key chunk (DI wide) plus the per-head dot products (HI wide).
        self.token_tile = rows_per_tile(self.key_chunk * (head_dim + num_heads))

    @property
    def row_prefetch(self) -> str:
        """How the quantized rows' kernel asks for the next chunk's rows: as the probe measured it fastest here
        (capabilities._with_row_prefetch), else the kernel's default. The same bits either way."""
        return self.gemm.row_prefetch or native_quantized_scores.DEFAULT_PREFETCH

    def token_tiles(self) -> range:
        # A loop over tiles of tokens (not over tokens) that bounds the working set.
        return range(0, self.q.shape[0], self.token_tile)

    def row_logits(self, start: int, out: Tensor) -> None:
        """Fill out [tile, width] fp32 with the logits of tokens start : start + tile (-inf where not visible)."""
        tokens = slice(start, start + out.shape[0])
        if self.paged:
            # The op validated every argument and the route's conditions hold (__init__): the kernel's wrapper would
            # only check them again. out is this tile's [tile, width] rows of a contiguous fp32 buffer.
            q, weights = self.q[tokens], self.weights[tokens]
            args = (q, weights, self.cache, self.block_table, self.seq_lens_k, self.cu_seqlens_q, self.width)
            native_quantized_scores.paged_scores(
                *args,
                self.kv_cache_dtype,
                first_token=start,
                out=out,
                isa=self.gemm.native_isa,
                validated=True,
                prefetch=self.row_prefetch,
            )
            return
        seqs, positions = self.seqs[tokens], self.positions[tokens]
        last_block = self.cache.shape[0] - 1
        if self.fused:
            # Table entries past a sequence's blocks may hold anything: clamped (the kernel reads only real blocks),
            # and past positions[t] anyway. A visible key in a block outside the cache (value checks off) is masked
            # after: docs/ops.md ("Paged caches") makes it not a key.
            raw = self.block_table[seqs]
            tables = raw.clamp(0, last_block)
            limits = positions + 1  # key positions <= the token's own are visible
            q, weights, isa = self.q[tokens], self.weights[tokens], self.gemm.native_isa
            if self.kv_cache_dtype == AUTO:
                native_scores.scores(q, weights, self.cache, tables, limits, self.width, out=out, isa=isa)
            else:
                native_quantized_scores.scores(
                    q,
                    weights,
                    self.cache,
                    tables,
                    limits,
                    self.width,
                    self.kv_cache_dtype,
                    out=out,
                    isa=isa,
                    prefetch=self.row_prefetch,
                )
            self._mask_blocks_outside_the_cache(raw, positions, out)
            return
        q = self.q[tokens].to(self.gemm.operand)  # [t, HI, DI]
        head_weights = self.weights[tokens].unsqueeze(1)  # [t, 1, HI]
        for first_block in range(0, self.block_table.shape[1], self.blocks_per_chunk):
            # Table entries past a sequence's blocks may hold anything: clamp them; their keys are masked below.
            block_ids = self.block_table[seqs, first_block : first_block + self.blocks_per_chunk].long()  # [t, nb]
            in_cache = (block_ids >= 0) & (block_ids <= last_block)  # else not a key (docs/ops.md "Paged caches")
            keys = self.read_rows(gather_rows(self.cache, block_ids.clamp_(0, last_block)).flatten(1, 2))  # [t, c, DI]
            key_start = first_block * self.block_size
            key_pos = torch.arange(key_start, key_start + keys.shape[1], device=q.device)  # [c]
            relu_dots = self.gemm.bmm(q, keys.transpose(1, 2)).relu_()  # [t, HI, c] fp32
            scores = torch.bmm(head_weights, relu_dots).squeeze(1)  # head reduction: [t, c]
            visible = key_pos[None, :] <= positions[:, None]  # causal; also keeps s < seq_lens_k
            visible &= in_cache.repeat_interleave(self.block_size, dim=1)
            out[:, key_start : key_start + key_pos.shape[0]] = scores.masked_fill_(~visible, float("-inf"))

    def _mask_blocks_outside_the_cache(self, tables: Tensor, positions: Tensor, out: Tensor) -> None:
        """Set to -inf the visible keys of out [t, width] whose block id in tables [t, max_blocks] is not a block of
        the cache. Validation refuses such ids where value checks run, so this usually costs one reduction of tables;
        the [t, width] mask is built only where a visible key has one (or a host read is not allowed)."""
        if host_reads_allowed(tables) and tables.numel():
            # Usually every entry is a block of the cache (vLLM pads its tables with block 0): one reduction says so.
            lowest, highest = tables.aminmax()
            if int(lowest) >= 0 and int(highest) < self.cache.shape[0]:
                return
        first_key = torch.arange(tables.shape[1], device=tables.device) * self.block_size  # [max_blocks]
        outside = ((tables < 0) | (tables >= self.cache.shape[0])) & (first_key[None, :] <= positions[:, None])
        if host_reads_allowed(outside) and not bool(outside.any()):
            return
        keys = outside.repeat_interleave(self.block_size, dim=1)[:, : out.shape[1]]  # [t, width]
        out.masked_fill_(keys, float("-inf"))


def indexer_logits(
    q_idx: Tensor,
    weights: Tensor,
    index_k_cache: Tensor,
    block_table: Tensor,
    seq_lens_k: Tensor,
    cu_seqlens_q: Tensor,
    kv_cache_dtype: str = AUTO,
) -> Tensor:
    """The full score matrix (validated by glm5_hal.indexer_logits).

    q_idx: [T, HI, DI]. weights: [T, HI] fp32. index_k_cache: [num_blocks, block_size, DI] (or uint8 rows of a
    quantized kv_cache_dtype). block_table: [B, max_blocks] int32; seq_lens_k: [B] int32; cu_seqlens_q: [B+1] int32.

    Returns logits [T, max_blocks * block_size] fp32, -inf where key position s is not visible to token t.
    """
    batch = _ScoringBatch(q_idx, weights, index_k_cache, block_table, seq_lens_k, cu_seqlens_q, kv_cache_dtype)
    logits = torch.empty(q_idx.shape[0], batch.width, dtype=COMPUTE_DTYPE, device=q_idx.device)
    for start in batch.token_tiles():
        batch.row_logits(start, logits[start : start + batch.token_tile])
    return logits


def lightning_indexer(
    q_idx: Tensor,
    weights: Tensor,
    index_k_cache: Tensor,
    block_table: Tensor,
    seq_lens_k: Tensor,
    cu_seqlens_q: Tensor,
    topk: int,
    kv_cache_dtype: str = AUTO,
) -> tuple[Tensor, Tensor]:
    """Top-`topk` visible keys per token (validated by glm5_hal.lightning_indexer); arguments as `indexer_logits`.

    Returns (indices [T, topk] int32: request-local key positions, best first, equal scores by lower position,
    -1 after the visible keys run out; scores [T, topk] fp32: their logits, -inf where indices is -1). Only one
    token tile's logit rows exist at a time.
    """
    batch = _ScoringBatch(q_idx, weights, index_k_cache, block_table, seq_lens_k, cu_seqlens_q, kv_cache_dtype)
    num_tokens, device = q_idx.shape[0], q_idx.device
    # A block table narrower than topk: rank all its columns, the -1 / -inf padding comes from the fill below.
    ranked = min(topk, batch.width)
    if ranked == topk and num_tokens <= batch.token_tile:  # one tile, no padding columns (decode): no fill, no copy
        logits = torch.empty(num_tokens, batch.width, dtype=COMPUTE_DTYPE, device=device)
        batch.row_logits(0, logits)
        best, positions = topk_positions(logits, topk)  # sorted as below
        return positions, best
    indices = torch.full((num_tokens, topk), -1, dtype=torch.int32, device=device)
    scores = torch.full((num_tokens, topk), float("-inf"), dtype=COMPUTE_DTYPE, device=device)
    row_logits = torch.empty(min(batch.token_tile, num_tokens), batch.width, dtype=COMPUTE_DTYPE, device=device)
    for start in batch.token_tiles():
        tile = row_logits[: min(batch.token_tile, num_tokens - start)]
        batch.row_logits(start, tile)
        # Sorted: NaN scores first (ranked above every number, as the contract says), equal scores by the lower
        # position, invisible (-inf) keys last.
        best, positions = topk_positions(tile, ranked)
        rows = slice(start, start + tile.shape[0])
        scores[rows, :ranked] = best
        indices[rows, :ranked] = positions
    return indices, scores
