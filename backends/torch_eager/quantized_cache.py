"""Quantized caches in the torch backend (glm5_hal.kv_formats): rows are encoded on write and decoded as they are
gathered, so only the rows an op reads at a time (a key chunk, a token tile's topk rows) ever exist decoded.

    write_rows(cache, slot_mapping, rows, kv_cache_dtype)          fp32 rows -> [encode] -> paged cache write
    row_reader(kv_cache_dtype, operand)(gathered uint8 or float rows) -> a float cache's rows in the GEMM operand
                                                                        dtype, a quantized cache's decoded in fp32

Decoded rows stay fp32 on every path: a half-precision GEMM path (backends.torch_eager.gemm) takes an fp32 operand
as hi + lo parts, so no decoded value is rounded.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
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


def row_reader(kv_cache_dtype: str = AUTO, operand: torch.dtype = COMPUTE_DTYPE) -> Callable[[Tensor], Tensor]:
    """A function from gathered cache rows [..., row] (float, or uint8 of a format) to their values [..., width]: a
    float cache's rows in `operand` (the dtype the op's GEMMs take), a quantized cache's decoded rows in fp32."""
    if kv_cache_dtype == AUTO:
        return lambda rows: rows.to(operand)
    fmt = FORMATS[kv_cache_dtype]
    # decode_rows gives each value exactly rounded to fp32, and it stays fp32: a half-precision Gemm takes an fp32
    # operand as two parts instead of rounding it (backends/torch_eager/gemm.py).
    return lambda rows: decode_rows(rows, fmt)
