"""Fake mcFlashMLA: the flash_mla_cuda kernels (sparse_prefill_fwd, fwd_kvcache_mla in its sparse mode,
get_mla_metadata) checked as flash_api.cpp checks them and computed with ops_reference, and the `flash_mla` Python
interface with the published signatures (flash_mla/flash_mla_interface.py), calling them through torch.ops so that
every call meets the schema. A row without a valid index is poisoned: the interface does not document it."""

from __future__ import annotations

import math
from types import ModuleType

import numpy as np
import torch
from torch import Tensor

import ops_reference as ref
from fakes.metax.common import not_modeled, require
from fakes.schema_fake import device_tensor, host

ROW, LATENT = 576, 512
TILE_SCHEDULER_METADATA_SIZE = 8  # csrc/flash_api/flash_mla.h


def _attend(q: np.ndarray, rows: np.ndarray, idx: np.ndarray, valid: np.ndarray, sm_scale: float):
    """q [T, H, 576] over rows [R, 576] picked by idx [T, topk] where valid -> (out [T, H, 512], natural lse [T, H]),
    NaN for a token without a valid index. Computed by the reference on a one-block paged view of `rows`."""
    tokens = q.shape[0]
    cache = rows[None]  # [1, R, 576]: one block, identity table
    table = np.zeros((tokens, 1), np.int64)
    lens = np.full(tokens, rows.shape[0], np.int64)
    cu = np.arange(tokens + 1, dtype=np.int64)  # one query token per sequence
    out, lse = ref.sparse_flash_attention(q, cache, np.where(valid, idx, -1), table, lens, cu, sm_scale, LATENT)
    empty = ~valid.any(axis=1)
    return np.where(empty[:, None, None], np.nan, out), np.where(empty[:, None], np.nan, lse)


def sparse_prefill_fwd(q, kv, indices, sm_scale, d_v, indices_all_valid_per_q):
    op = "sparse_prefill_fwd"
    require(q.dtype == kv.dtype == torch.bfloat16, op, "q and kv bf16")
    require(indices.dtype == torch.int32 and indices_all_valid_per_q.dtype == torch.bool, op, "index dtypes")
    require(q.dim() == 3 and kv.dim() == 3 and indices.dim() == 3, op, "q [s_q, h_q, d], kv [s_kv, h_kv, d], indices")
    s_q, h_q, d_qk = q.shape
    s_kv, h_kv, _ = kv.shape
    require(h_q % 64 == 0 and h_q >= 64, op, "h_q % 64 == 0 && h_q >= 64")
    require(kv.shape[2] == d_qk == ROW and d_v == LATENT, op, "d_qk 576 (the instantiated kernel), d_v 512")
    not_modeled(h_kv == 1, op, "more than one kv head")
    require(indices.shape[:2] == (s_q, h_kv) and indices_all_valid_per_q.shape == (s_q, 1), op, "index shapes")
    require(q.stride(-1) == kv.stride(-1) == indices.stride(-1) == 1, op, "contiguous last dims")
    idx = host(indices)[:, 0]
    valid = (idx >= 0) & (idx < s_kv)  # "Invalid indices should be set to -1 or numbers >= s_kv"
    all_valid = host(indices_all_valid_per_q)[:, 0].astype(bool)
    require(bool(valid[all_valid].all()), op, "indices_all_valid_per_q set for a token with an invalid index")
    out, lse = _attend(host(q), host(kv)[:, 0], idx, valid, sm_scale)
    max_logits = np.full(lse.shape, np.nan)  # its definition is left to a README that does not give it
    return [
        device_tensor(out, torch.bfloat16, q),
        device_tensor(max_logits, torch.float32, q),
        device_tensor(lse / math.log(2.0), torch.float32, q),  # "2-based log-sum-exp"
    ]


def get_mla_metadata(seqlens_k, num_q_tokens_per_head_k, h_k, h_q, is_fp8_kvcache, topk):
    op = "get_mla_metadata"
    require(seqlens_k.dtype == torch.int32 and seqlens_k.is_contiguous(), op, "seqlens_k contiguous int32")
    require(topk is None or h_q is not None, op, "num_heads_q must be provided when topk is provided")
    not_modeled(topk is not None and not is_fp8_kvcache, op, "the dense or fp8 decode")
    # The scheduler's split is the kernel's business; what the fake keeps is what the decode call must match.
    meta = torch.zeros(1, TILE_SCHEDULER_METADATA_SIZE, dtype=torch.int32, device=seqlens_k.device)
    meta[0, :5] = torch.tensor([seqlens_k.shape[0], num_q_tokens_per_head_k, h_k, h_q, topk], dtype=torch.int32)
    return [meta, torch.zeros(seqlens_k.shape[0] + 1, dtype=torch.int32, device=seqlens_k.device)]


def fwd_kvcache_mla(
    q,
    kcache,
    vcache,
    head_size_v,
    seqlens_k,
    block_table,
    softmax_scale,
    is_causal,
    tile_scheduler_metadata,
    num_splits,
    is_fp8_kvcache,
    indices,
    indices_all_valid_per_q,
    cp_world_size,
    cp_rank,
    cp_tot_seqused_k,
):
    op = "fwd_kvcache_mla"
    not_modeled(indices is not None and vcache is None and cp_world_size == 1, op, "dense decode, vcache, CP")
    require(q.dtype in (torch.bfloat16, torch.float16) and kcache.dtype == q.dtype, op, "bf16/fp16 q and cache")
    require(not is_fp8_kvcache, op, "flash mla with kvcache api not support fp8 now")
    require(q.stride(-1) == 1 and kcache.stride(-1) == 1, op, "contiguous last dimension")
    require(block_table.dtype == torch.int32 and block_table.stride(-1) == 1, op, "block_table int32")
    require(indices.dtype == torch.int32 and indices.stride(-1) == 1, op, "indices int32, contiguous last dim")
    require(indices_all_valid_per_q.dtype == torch.bool, op, "indices_all_valid_per_q bool")
    require(q.dim() == 4 and kcache.dim() == 4, op, "q [b, s_q, h_q, d], kcache [blocks, bs, h_k, d]")
    batch, s_q, h_q, head_size = q.shape
    blocks, block_size, h_k, _ = kcache.shape
    require(head_size == ROW and kcache.shape[3] == ROW, op, "head_size == 576")
    require(head_size_v % 32 == 0, op, "head_size_v should be a multiple of 32")
    not_modeled(head_size_v == LATENT and h_k == 1, op, "d_v other than 512 or several kv heads")
    require(batch > 0 and h_q % h_k == 0, op, "batch > 0, h_q a multiple of h_k")
    require(h_q >= 64 or s_q == 1, op, "sparse decoding head q must greter than 64 when seqlen q > 1")
    require(block_size & (block_size - 1) == 0, op, "a power-of-two block size (README)")
    require(block_table.dim() == 2 and block_table.shape[0] == batch, op, "block_table [b, max_blocks]")
    require(seqlens_k.dtype == torch.int32 and seqlens_k.is_contiguous(), op, "seqlens_k contiguous int32")
    require(tuple(seqlens_k.shape) == (batch,), op, "seqlens_k [b]")
    require(not is_causal, op, "causal must be `false` if sparse attention is enabled")
    require(cp_rank == 0, op, "When context parallelism is disabled, cp_rank must be zero")
    require(num_splits.dtype == torch.int32 and num_splits.is_contiguous(), op, "num_splits int32")
    require(num_splits.numel() == batch + 1, op, "num_splits [b + 1] (from get_mla_metadata)")
    require(tile_scheduler_metadata.dtype == torch.int32, op, "tile_scheduler_metadata int32")
    require(tile_scheduler_metadata.shape[1] == TILE_SCHEDULER_METADATA_SIZE, op, "TileSchedulerMetaDataSize")
    topk = indices.shape[-1]
    planned = tile_scheduler_metadata[0, :5].tolist()
    require(planned == [batch, s_q * h_q // h_k, h_k, h_q, topk], op, "metadata made for another call")
    require(tuple(indices.shape) == (batch, s_q, topk), op, "indices [b, s_q, topk]")
    # The kernel reads index i at element i * stride(1) from the cache's start, for every index >= 0.
    idx = host(indices).reshape(batch * s_q, topk)
    valid = idx >= 0
    step = kcache.stride(1)
    span = (blocks - 1) * kcache.stride(0) + (block_size - 1) * step + ROW
    require(bool((idx[valid] * step + ROW <= span).all()), op, "an index past the cache")
    count = (span - ROW) // step + 1 if step else 1  # rows whose ROW elements lie inside the cache
    rows = torch.as_strided(kcache, (count, ROW), (step, 1), kcache.storage_offset())
    out, lse = _attend(host(q).reshape(batch * s_q, h_q, ROW), host(rows), idx, valid, softmax_scale)
    out = out.reshape(batch, s_q, h_q, LATENT)
    lse = lse.reshape(batch, s_q, h_q).transpose(0, 2, 1)  # [b, h_q, s_q], natural log (softmax.h)
    return [device_tensor(out, q.dtype, q), device_tensor(lse, torch.float32, q)]


def interface(ops: object) -> ModuleType:
    """The `flash_mla` package as flash_mla/flash_mla_interface.py presents it, over the fake kernels `ops`."""
    module = ModuleType("flash_mla", "glm5-hal strict fake of mcFlashMLA's Python interface")

    def get_mla_metadata(
        cache_seqlens, num_q_tokens_per_head_k, num_heads_k, num_heads_q=None, is_fp8_kvcache=False, topk=None
    ):
        return tuple(
            ops.get_mla_metadata(cache_seqlens, num_q_tokens_per_head_k, num_heads_k, num_heads_q, is_fp8_kvcache, topk)
        )

    def flash_mla_with_kvcache(
        q: Tensor,
        k_cache: Tensor,
        block_table: Tensor,
        cache_seqlens: Tensor,
        head_dim_v: int,
        tile_scheduler_metadata: Tensor,
        num_splits: Tensor,
        softmax_scale: float | None = None,
        causal: bool = False,
        is_fp8_kvcache: bool = False,
        indices: Tensor | None = None,
        indices_all_valid_per_q: Tensor | None = None,
        descale_q: Tensor | None = None,
        descale_k: Tensor | None = None,
        cp_world_size=1,
        cp_rank=0,
        cp_tot_seqlen_k=None,
    ):
        if softmax_scale is None:
            softmax_scale = q.shape[-1] ** -0.5
        if indices is not None:
            assert not causal, "causal must be `false` if sparse attention is enabled."
        assert (descale_q is None) == (descale_k is None), "descale_q and descale_k: both None or both not None"
        if indices_all_valid_per_q is None:
            indices_all_valid_per_q = torch.zeros(q.shape[0], q.shape[1], 1, dtype=torch.bool, device=q.device)
        out, lse = ops.fwd_kvcache_mla(
            q,
            k_cache,
            None,
            head_dim_v,
            cache_seqlens,
            block_table,
            softmax_scale,
            causal,
            tile_scheduler_metadata,
            num_splits,
            is_fp8_kvcache,
            indices,
            indices_all_valid_per_q,
            cp_world_size,
            cp_rank,
            cp_tot_seqlen_k,
        )
        return out, lse

    def flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v=512, indices_all_valid_per_q=None):
        if indices_all_valid_per_q is None:
            indices_all_valid_per_q = torch.zeros(q.shape[0], 1, dtype=torch.bool, device=q.device)
        return tuple(ops.sparse_prefill_fwd(q, kv, indices, sm_scale, d_v, indices_all_valid_per_q))

    module.get_mla_metadata = get_mla_metadata
    module.flash_mla_with_kvcache = flash_mla_with_kvcache
    module.flash_mla_sparse_fwd = flash_mla_sparse_fwd
    return module
