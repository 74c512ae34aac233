"""Pieces every public op shares: dispatch to the selected backend, and the paged ragged-batch checks."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from glm5_hal.checks import (
    INDEX_DTYPES,
    VERIFICATION_DTYPE,
    check_block_size,
    check_index_range,
    check_ragged_layout,
    check_same_device,
    check_tensor,
)
from glm5_hal.kv_formats import check_format_support
from glm5_hal.selection import check_float64_support, resolve

NAMESPACE = "glm5_hal"


def dispatch(op: str, device: torch.device, *args: object, **kwargs: object) -> object:
    """Run `op` with the backend selected for `device` (arguments already validated).

    float64 tensor arguments (the verification mode) run only on a backend that supports it; otherwise this
    raises glm5_hal.selection.Float64UnsupportedError (a TypeError) naming the op, the backend and who does.
    Likewise a quantized cache (a `kv_cache_dtype` keyword) runs only on a backend that declares its format.
    """
    resolution = resolve(op, device.type)
    if _has_float64(args) or _has_float64(kwargs.values()):
        check_float64_support(resolution)
    if "kv_cache_dtype" in kwargs:
        check_format_support(resolution, kwargs["kv_cache_dtype"])
    return resolution.implementation(*args, **kwargs)


def _has_float64(values: Iterable[object]) -> bool:
    """Whether any of `values` is a float64 tensor. On every call of every op, so kept to one identity test per
    argument (~1.5 us for 12 arguments; dispatch's `resolve` costs ~40 us): torch dtypes are singletons."""
    for value in values:
        if getattr(value, "dtype", None) is VERIFICATION_DTYPE:
            return True
    return False


def check_paged_batch(
    cache_name: str,
    cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens_k: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    num_tokens: int,
    sizes: dict[str, int],
) -> None:
    """Check the ragged token-major batch and the paged cache it reads (OPS.md "Conventions").

    cache: [num_blocks, block_size, D]. block_table: [B, max_blocks] int32. seq_lens_k: [B] int32 (keys in
    context, new tokens included). cu_seqlens_q: [B+1] int32 prefix sums of new tokens, ending at T.
    """
    check_block_size(cache_name, cache)
    check_tensor("block_table", block_table, ["B", "max_blocks"], INDEX_DTYPES, sizes)
    check_tensor("seq_lens_k", seq_lens_k, ["B"], INDEX_DTYPES, sizes)
    sizes["B+1"] = sizes["B"] + 1
    check_tensor("cu_seqlens_q", cu_seqlens_q, ["B+1"], INDEX_DTYPES, sizes)
    check_same_device(**{cache_name: cache}, block_table=block_table, seq_lens_k=seq_lens_k, cu_seqlens_q=cu_seqlens_q)
    check_ragged_layout(cu_seqlens_q, seq_lens_k, block_table, num_tokens, cache.shape[0], cache.shape[1])


def check_cache_write(
    cache_name: str, cache: torch.Tensor, slot_mapping: torch.Tensor, num_tokens: int, sizes: dict[str, int]
) -> None:
    """slot_mapping: [T] int64, one cache slot per token (block * block_size + offset), -1 = do not write."""
    check_block_size(cache_name, cache)
    check_tensor("slot_mapping", slot_mapping, [num_tokens], (torch.int64,), sizes)
    check_same_device(**{cache_name: cache}, slot_mapping=slot_mapping)
    num_slots = cache.shape[0] * cache.shape[1]
    check_index_range(
        "slot_mapping", slot_mapping, -1, num_slots, lambda: f"-1 or a slot of the {num_slots}-slot cache"
    )
