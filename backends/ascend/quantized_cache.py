"""Quantized caches on Ascend (glm5_hal.kv_formats), mapped onto torch_npu where its documented layouts allow.

    prologs (every format)     rows from the same NPU kernels as a float cache -> kv_formats.encode_rows ->
                               npu_scatter_nd_update_ of the bytes (viewed as int8, the kernel's documented dtype)
    sparse_flash_attention     int8_mla: npu_kv_quant_sparse_flash_attention on the selected rows (below);
                               fp8_ds_mla: the portable torch path (A2/A3 kernels take no e4m3 cache)
    lightning_indexer          quantized keys: the portable torch path (below)

npu_kv_quant_sparse_flash_attention (torch_npu 2.14.0 docs) reads an int8 PA_BSND key whose rows are "int8 k_nope,
k_rope in the query's dtype and the fp32 quantization parameters concatenated along D" with per-tile-128 scales
(key_quant_mode 2, quant_scale_repo_mode 1, tile_size 128, rope_head_dim 64): 512 + 128 + 16 = 656 bytes, the
same row as int8_mla in another order ([codes | RoPE | scales] against int8_mla's [codes | scales | RoPE]). The
adapter gathers each token's selected rows (as the float adapter does), moves the 16 scale bytes behind the RoPE
bytes, and gives the kernel those rows as a small paged cache, one "sequence" per token. The kernel returns no
softmax statistics, so the contract's natural-log lse is computed in torch from the same gathered rows.

npu_quant_lightning_indexer is not used: it reads keys from a separate contiguous int8 tensor with fp16 scales
(on A2/A3) and needs int8-quantized queries, so it would need a repack of the whole index cache on every call and
would score with quantized queries, which the contract's float-query scores do not; int8_index and fp8_index run
the portable path. The cache layout cannot be changed to the kernel's at write time either: the formats are a
contract, every backend reads the same bytes.
"""

from __future__ import annotations

import torch
from torch import Tensor

from backends.ascend.layouts import gathered_rows, selected_positions
from backends.ascend.runtime import npu, write_cache_rows
from glm5_hal.kv_formats import AUTO, FORMATS, decode_rows, encode_rows
from glm5_hal.paged import token_sequences

KERNEL_FORMATS = ("int8_mla",)  # the formats npu_kv_quant_sparse_flash_attention reads
KERNEL_BLOCK = 16  # block size of the per-token scratch caches: the smallest the paged NPU kernels document
QUANT_MODE_PER_TILE = 2  # key_quant_mode / value_quant_mode: per-tile
SCALES_WITH_DATA = 1  # quant_scale_repo_mode: scales stored in the rows ("combine")
GATHER_BUDGET = 1 << 26  # bytes of gathered rows held at once


def store_rows(cache: Tensor, slot_mapping: Tensor, rows: Tensor, kv_cache_dtype: str) -> None:
    """rows [T, width] into cache at slot_mapping [T] (-1 = skip): as they are for a float cache, encoded for a
    quantized one (its uint8 bytes written as int8, the dtype npu_scatter_nd_update_ documents)."""
    if kv_cache_dtype == AUTO:
        write_cache_rows(cache, slot_mapping, rows)
        return
    encoded = encode_rows(rows, FORMATS[kv_cache_dtype])
    write_cache_rows(cache.view(torch.int8), slot_mapping, encoded.view(torch.int8))


def kernel_rows(rows: Tensor) -> Tensor:
    """int8_mla rows uint8 [..., 656] -> the kernel's combined rows int8 [..., 656]: [512 codes | 64 bf16 RoPE |
    4 fp32 scales]."""
    fmt = FORMATS["int8_mla"]
    codes, scales, rope = (
        rows[..., : fmt.scales_offset],
        rows[..., fmt.scales_offset : fmt.rope_offset],
        rows[..., fmt.rope_offset :],
    )
    return torch.cat([codes, rope, scales], dim=-1).view(torch.int8)


def _lse(q: Tensor, rows: Tensor, valid: Tensor, sm_scale: float) -> Tensor:
    """Natural-log logsumexp [t, H] fp32 of sm_scale * q . K over the valid gathered rows (q [t, H, 576], rows
    [t, k, 656] int8_mla bytes, valid [t, k]); -inf for a token without any."""
    keys = decode_rows(rows, FORMATS["int8_mla"])  # [t, k, 576] fp32: only this tile's selected rows
    scores = torch.bmm(q.float(), keys.transpose(1, 2)).mul_(sm_scale)  # [t, H, k]
    return torch.logsumexp(scores.masked_fill_(~valid[:, None, :], float("-inf")), dim=-1)


def sparse_flash_attention_int8(q, kv_cache, indices, block_table, seq_lens_k, cu_seqlens_q, sm_scale):
    """glm5_hal.sparse_flash_attention over an int8_mla cache on npu_kv_quant_sparse_flash_attention.

    q [T, H, 576] bf16; kv_cache [blocks, bs, 656] uint8 (int8_mla); indices [T, topk] int32 request-local
    positions (-1 and >= seq_lens_k[b] invalid). Returns (out [T, H, 512] bf16, lse [T, H] fp32).
    """
    num_tokens, num_heads, width = q.shape
    topk = indices.shape[1]
    row_bytes = kv_cache.shape[-1]
    seqs = token_sequences(cu_seqlens_q, num_tokens)
    idx, ordered_valid, local = selected_positions(
        indices, seq_lens_k, seqs, block_table, kv_cache.shape[1], kv_cache.shape[0]
    )  # [T, topk] each, valid first
    blocks_per_token = -(-topk // KERNEL_BLOCK)
    padded = blocks_per_token * KERNEL_BLOCK

    out = torch.empty(num_tokens, num_heads, 512, dtype=q.dtype, device=q.device)
    lse = torch.empty(num_tokens, num_heads, dtype=torch.float32, device=q.device)
    tile = max(1, GATHER_BUDGET // (padded * row_bytes))
    for part, rows in gathered_rows(kv_cache, block_table, seqs, idx, ordered_valid, tile):
        tokens = rows.shape[0]  # rows: [t, topk, 656]
        scratch = torch.zeros(tokens, padded, row_bytes, dtype=torch.int8, device=q.device)
        scratch[:, :topk] = kernel_rows(rows)
        key = scratch.view(tokens * blocks_per_token, KERNEL_BLOCK, 1, row_bytes)  # PA_BSND, one sequence a token
        out[part] = (
            npu()
            .npu_kv_quant_sparse_flash_attention(
                q[part].contiguous().view(tokens, 1, num_heads, width),  # BSND: B = tokens, S = 1
                key,
                key,  # attention_mode 2: K and V are one tensor
                local[part].view(tokens, 1, 1, topk).contiguous(),
                float(sm_scale),
                QUANT_MODE_PER_TILE,
                QUANT_MODE_PER_TILE,
                block_table=torch.arange(tokens * blocks_per_token, dtype=torch.int32, device=q.device).view(
                    tokens, -1
                ),
                actual_seq_lengths_kv=torch.full((tokens,), topk, dtype=torch.int32, device=q.device),
                layout_query="BSND",
                layout_kv="PA_BSND",
                sparse_mode=3,
                attention_mode=2,
                quant_scale_repo_mode=SCALES_WITH_DATA,
                tile_size=128,
                rope_head_dim=width - 512,
            )
            .view(tokens, num_heads, 512)
        )
        lse[part] = _lse(q[part], rows, ordered_valid[part], float(sm_scale))
    # The kernel leaves a row without any valid index undefined; the contract says out = 0 and lse = -inf.
    return out.masked_fill(~ordered_valid.any(dim=1)[:, None, None], 0), lse
