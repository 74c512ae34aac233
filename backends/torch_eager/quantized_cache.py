"""Quantized caches in the torch backend (glm5_hal.kv_formats): rows are encoded on write and decoded as they are
gathered, so only the rows an op reads at a time (a key chunk, a token tile's topk rows) ever exist in fp32.

    write_rows(cache, slot_mapping, rows, kv_cache_dtype)   fp32 rows -> [encode] -> paged cache write
    row_reader(kv_cache_dtype)(gathered uint8 or float rows) -> fp32 values
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from torch import Tensor

from backends.torch_eager.paged import write_cache
from backends.torch_eager.primitives import COMPUTE_DTYPE
from glm5_hal.kv_formats import AUTO, FORMATS, decode_rows, encode_rows


def write_rows(cache: Tensor, slot_mapping: Tensor, rows: Tensor, kv_cache_dtype: str = AUTO) -> None:
    """rows [T, width] fp32 into cache at slot_mapping [T] (-1 = skip): cast to a float cache's dtype, or encoded
    into a quantized cache's uint8 rows [T, row_bytes]."""
    if kv_cache_dtype != AUTO:
        rows = encode_rows(rows, FORMATS[kv_cache_dtype])
    write_cache(cache, slot_mapping, rows)


def _upcast(rows: Tensor) -> Tensor:
    return rows.to(COMPUTE_DTYPE)


def row_reader(kv_cache_dtype: str = AUTO) -> Callable[[Tensor], Tensor]:
    """A function from gathered cache rows [..., row] (float, or uint8 of a format) to their fp32 values."""
    return _upcast if kv_cache_dtype == AUTO else partial(decode_rows, fmt=FORMATS[kv_cache_dtype])
