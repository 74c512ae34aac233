"""Sparse flash attention (DSA over absorbed MLA): per token, gather its top-k latent rows once, then every head
attends over them: [gather -> scores [tile, H, topk] -> masked softmax -> @ V].

Tokens are processed in tiles sized to bound the working set; no tensor ever spans the whole context, only the
topk selected rows of each token. Where the probe chose a native route for this call's head count and the cache
holds bf16 rows, one native kernel per token does the scores, the fp32 softmax and the value product,
reading the selected rows in place (no gather, no copy of V, no [T, topk, H] scores in memory) with the same fp32
arithmetic (backends/torch_eager/native/sparse_attention.py: sparse_attention.c's vector builds, amx_attention.c
on AMX's route).
"""

from __future__ import annotations

import torch
from torch import Tensor

from backends.torch_eager.capabilities import ATTENTION
from backends.torch_eager.gemm import Gemm, gemm_for
from backends.torch_eager.native import sparse_attention as native_attention
from backends.torch_eager.paged import gather_rows
from backends.torch_eager.primitives import COMPUTE_DTYPE, rows_per_tile
from backends.torch_eager.quantized_cache import row_reader
from glm5_hal.host_reads import host_reads_allowed
from glm5_hal.kv_formats import AUTO
from glm5_hal.paged import key_slots, slot_rows, token_sequences


def native_kernel_runs(gemm: Gemm) -> bool:
    """Whether a call on route `gemm` runs the native kernel: a native route whose build of the kernel
    (sparse_attention.c for the vector builds, amx_attention.c for AMX's; native_attention.kernel_for) runs here."""
    return gemm.native and native_attention.availability(gemm.native_isa)[0]


def sparse_flash_attention(
    q: Tensor,
    kv_cache: Tensor,
    indices: Tensor,
    block_table: Tensor,
    seq_lens_k: Tensor,
    cu_seqlens_q: Tensor,
    sm_scale: float,
    d_v: int = 512,
    kv_cache_dtype: str = AUTO,
) -> tuple[Tensor, Tensor]:
    """Attention of each token over its selected keys (validated by glm5_hal.sparse_flash_attention).

    q: [T, H, D]. kv_cache: [num_blocks, block_size, D], or uint8 rows of a quantized kv_cache_dtype, decoded as
    they are gathered; K = the whole row, V = its first d_v dims. indices:
    [T, topk] int32 request-local key positions; -1 and positions >= seq_lens_k[b] are ignored. block_table:
    [B, max_blocks] int32; seq_lens_k: [B] int32; cu_seqlens_q: [B+1] int32.

    Returns (out [T, H, d_v] in q's dtype, lse [T, H] fp32 natural log); a row with no valid index gives out = 0
    and lse = -inf.
    """
    num_tokens, num_heads, width = q.shape
    topk = indices.shape[1]
    block_size = kv_cache.shape[1]
    # The route for this call's head count (the probe measured the family at two); logits on gemm.logits, the softmax
    # statistics stay fp32.
    gemm = gemm_for(q.dtype, q.device, ATTENTION).at(num_heads)
    if (
        kv_cache_dtype == AUTO
        and kv_cache.dtype == q.dtype == torch.bfloat16
        and kv_cache.stride(2) == 1  # the kernels read rows contiguous in D (any other layout gathers, as before)
        and native_kernel_runs(gemm)
    ):
        # One kernel over the batch as the op takes it: it finds each key's row and drops the keys that are none
        # (the tests of key_slots below), so no slot tensor and no mask is made in torch. The op validated every
        # argument and the conditions above are the rest of what the kernel's wrapper would check again (validated).
        batch = (block_table, seq_lens_k, cu_seqlens_q)
        prefetch = gemm.row_prefetch or native_attention.DEFAULT_PREFETCH  # as the probe measured it here
        return native_attention.paged_attention(
            q, kv_cache, indices, *batch, sm_scale, d_v, isa=gemm.native_isa, validated=True, prefetch=prefetch
        )
    view = slot_rows(kv_cache)  # the cache read in place as rows [R, D] (or [R, row_bytes] uint8)
    rows = view.rows
    seqs = token_sequences(cu_seqlens_q, num_tokens)  # [T]
    key_limit = seq_lens_k.to(torch.int64)[seqs]  # [T]
    read_rows = row_reader(kv_cache_dtype, gemm.operand)  # float rows in the operand dtype, decoded ones fp32

    out = torch.empty(num_tokens, num_heads, d_v, dtype=q.dtype, device=q.device)
    lse = torch.empty(num_tokens, num_heads, dtype=COMPUTE_DTYPE, device=q.device)
    # Per token of a tile: its gathered rows (topk x D) and its scores (H x topk), in fp32.
    token_tile = rows_per_tile(topk * (width + num_heads))
    for start in range(0, num_tokens, token_tile):  # tiles of tokens bound memory; tokens are not looped
        tokens = slice(start, start + token_tile)
        idx = indices[tokens].to(torch.int64)  # [t, topk]
        # A key the block table cannot address (a block id outside the cache, with value checks off) is not a key.
        slots, addressable = key_slots(
            block_table,
            seqs[tokens],
            idx,
            block_size,
            kv_cache.shape[0],
            block_step=view.block_step,
            row_step=view.row_step,
        )  # [t, topk] rows of the view
        valid = (idx >= 0) & (idx < key_limit[tokens, None]) & addressable  # [t, topk]
        # An invalid key's table entry may be padding (any value): read slot 0 for it instead, and zero its row
        # after decoding, so that neither its address nor its contents (NaN in an unused slot, any bytes of a
        # quantized row) can reach the output.
        slots = torch.where(valid, slots, 0)
        kv = read_rows(gather_rows(rows, slots))  # [t, topk, D], all heads
        # Invalid keys are rare (short sequences, -1 padding): where a host read is allowed, find them once (a
        # count) and touch only their rows; masking every row with a broadcast mask costs more than the gather
        # itself on CPUs. Where it is not (graph capture, tracing), mask every row.
        any_invalid = True
        if host_reads_allowed(valid):
            invalid = (~valid).nonzero(as_tuple=True)  # ([n], [n])
            any_invalid = invalid[0].numel() > 0
            kv[invalid] = 0.0
        else:
            kv.masked_fill_(~valid[..., None], 0.0)

        scores = gemm.logits.bmm(q[tokens], kv.transpose(1, 2)).mul_(sm_scale)  # [t, H, topk] fp32
        if any_invalid:
            scores.masked_fill_(~valid[:, None, :], float("-inf"))
        probs, tile_lse = _softmax(scores)
        tile_out = gemm.bmm(probs, kv[..., :d_v], output=True)  # [t, H, d_v] fp32
        # A head whose scores are all -inf (an empty softmax, lse -inf) gets out = 0 whatever V holds (docs/ops.md
        # "Edge rules"): its product is 0, or NaN where V holds inf. Rare: masked only where one is found.
        empty = tile_lse == float("-inf")
        if not host_reads_allowed(empty) or bool(empty.any()):
            tile_out.masked_fill_(empty[..., None], 0.0)
        out[tokens], lse[tokens] = tile_out.to(q.dtype), tile_lse
    return out, lse


def _softmax(scores: Tensor) -> tuple[Tensor, Tensor]:
    """(probabilities, lse) of fp32 scores [t, H, topk] over the keys (-inf: not a key), in place: the probabilities are
    normalised before the value product, which makes that product the op's output (rounded to q's dtype right after),
    so a half-precision path needs no residual pass for it. A row without keys gives probabilities 0 (the contract's
    out = 0) and lse -inf (log(0))."""
    peak = scores.amax(dim=-1, keepdim=True)
    # A row with no valid key has peak -inf; shifting by 0 instead keeps exp() at exactly 0 and avoids nan. A +inf
    # peak stays, as in the reference: a +inf score gives inf - inf = NaN, and the head's lse and out are NaN.
    peak = torch.where(peak == float("-inf"), torch.zeros_like(peak), peak)
    # In place: a fresh [T, H, topk] tensor for exp() cost as much again as the softmax's own passes at decode (its
    # pages are new memory on every call), and the scores are not used after this.
    probs = scores.sub_(peak).exp_()  # unnormalised
    total = probs.sum(dim=-1, keepdim=True)  # 0 for an empty row
    probs.div_(total.clamp_min(torch.finfo(COMPUTE_DTYPE).tiny))
    return probs, (peak + torch.log(total)).squeeze(-1)
