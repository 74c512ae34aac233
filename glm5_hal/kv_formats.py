"""Quantized KV and index-key caches (OPS.md section 7): the formats, their validation, and torch encode / decode.

    kv_cache_dtype   cache            row (bytes)                                                    row_bytes
    "auto"           either           the activations' float dtype, as without quantization          width * elem
    "fp8_ds_mla"     latent [576]     512 e4m3 | 4 fp32 scales (one per 128) | 64 bf16 RoPE          656
    "int8_mla"       latent [576]     512 int8 | 4 fp32 scales (one per 128) | 64 bf16 RoPE          656
    "fp8_index"      index key [128]  128 e4m3 | 1 fp32 scale                                        132
    "int8_index"     index key [128]  128 int8 | 1 fp32 scale                                        132

The layouts, their NumPy encode / decode and the exact rounding rules are the reference's
(ops_reference/kv_cache.py, the specification); this module re-exports the format table and adds what the public
ops and the torch-based backends share: `check_cache` (argument validation) and `encode_rows` / `decode_rows`
(torch, on any device). A quantized cache is a uint8 tensor [num_blocks, block_size, row_bytes].
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from glm5_hal.checks import check, check_tensor, fail, value_range
from glm5_hal.host_reads import host_reads_allowed
from glm5_hal.registry import registry
from glm5_hal.selection import BackendError, Resolution
from ops_reference.kv_cache import AUTO, E4M3_MAX, FORMATS, INT8_MAX, TILE, KVCacheFormat

LATENT = "latent"
INDEX = "index"
CACHE_DTYPE = torch.uint8
# The ops that write or read a cache, and which: they take `kv_cache_dtype=`.
OP_CACHE: dict[str, str] = {
    "mla_prolog": LATENT,
    "indexer_prolog": INDEX,
    "indexer_logits": INDEX,
    "lightning_indexer": INDEX,
    "sparse_flash_attention": LATENT,
}
# The argument each cache is passed as.
CACHE_ARGUMENT: dict[str, str] = {LATENT: "kv_cache", INDEX: "index_k_cache"}
# A deployment's choice for both caches at once ("fp8": FlashMLA's layout on NVIDIA / Hygon; "int8": Ascend "C8").
FAMILIES: dict[str, dict[str, str]] = {
    AUTO: {LATENT: AUTO, INDEX: AUTO},
    "fp8": {LATENT: "fp8_ds_mla", INDEX: "fp8_index"},
    "int8": {LATENT: "int8_mla", INDEX: "int8_index"},
}

__all__ = [
    "AUTO",
    "CACHE_ARGUMENT",
    "CACHE_DTYPE",
    "E4M3_MAX",
    "FAMILIES",
    "FORMATS",
    "INDEX",
    "INT8_MAX",
    "KVCacheFormat",
    "KVCacheFormatUnsupportedError",
    "LATENT",
    "OP_CACHE",
    "TILE",
    "bytes_per_token",
    "cache_format",
    "check_cache",
    "check_format_support",
    "decode_rows",
    "dispatch_kwargs",
    "encode_rows",
    "formats_for",
    "write_rows",
]


def formats_for(cache: str) -> tuple[str, ...]:
    """The kv_cache_dtype values a cache ("latent" or "index") accepts: "auto" first, then its formats."""
    return (AUTO, *(name for name, f in FORMATS.items() if f.cache == cache))


def cache_format(kv_cache_dtype: object, cache: str) -> KVCacheFormat | None:
    """The format `kv_cache_dtype` names for a `cache` ("latent" / "index") cache; None for "auto".

    Raises TypeError for a non-string, ValueError for a name that is not a format of that cache.
    """
    check(
        isinstance(kv_cache_dtype, str),
        TypeError,
        lambda: f"kv_cache_dtype: expected a str, got {type(kv_cache_dtype).__name__}",
    )
    allowed = formats_for(cache)
    check(
        kv_cache_dtype in allowed,
        ValueError,
        lambda: f"kv_cache_dtype: expected one of {allowed} for the {cache} cache, got {kv_cache_dtype!r}",
    )
    return FORMATS.get(kv_cache_dtype)  # type: ignore[arg-type]


def check_cache(
    name: str,
    cache: object,
    kv_cache_dtype: object,
    kind: str,
    dims: Sequence[int | str | None],
    activation_dtype: torch.dtype,
    sizes: dict[str, int],
) -> KVCacheFormat | None:
    """Validate a cache argument against its kv_cache_dtype; returns the format (None for "auto").

    dims: the float cache's dims, e.g. ["num_blocks", "block_size", "D"]; the last one names the row width.
    "auto": the cache must have `activation_dtype` and shape `dims` (as without quantization). A format: the cache
    must be uint8 [.., .., row_bytes], and the row width it stores (576 / 128) must agree with sizes[dims[-1]]
    (recorded there if not yet known), so the other arguments' widths are checked against it.
    """
    fmt = cache_format(kv_cache_dtype, kind)
    if fmt is None:
        if isinstance(cache, Tensor) and cache.dtype == CACHE_DTYPE:
            fail(
                TypeError,
                f"{name}: a uint8 cache holds a quantized format; pass kv_cache_dtype= one of "
                f"{formats_for(kind)[1:]} (got kv_cache_dtype='auto', which means a "
                f"{str(activation_dtype).removeprefix('torch.')} cache)",
            )
        check_tensor(name, cache, dims, (activation_dtype,), sizes)
        return None
    check_tensor(name, cache, [*dims[:-1], fmt.row_bytes], (CACHE_DTYPE,), sizes)
    width = dims[-1]
    if isinstance(width, str):
        known = sizes.setdefault(width, fmt.width)
        check(
            known == fmt.width,
            ValueError,
            lambda: (
                f"{name}: kv_cache_dtype {fmt.name!r} stores rows of {fmt.width} values ({_describe(fmt)}), so the "
                f"other arguments' {width} must be {fmt.width}, got {width} = {known}"
            ),
        )
    return fmt


def _describe(fmt: KVCacheFormat) -> str:
    parts = [f"{fmt.quantized_dims} {fmt.code}", f"{fmt.num_scales} fp32 scale{'s' * (fmt.num_scales > 1)}"]
    if fmt.rope_dims:
        parts.append(f"{fmt.rope_dims} bf16 RoPE")
    return " + ".join(parts)


def bytes_per_token(kv_cache_dtype: str, cache: str, width: int, dtype: torch.dtype) -> int:
    """Bytes one token's row takes in a `cache` cache of `width` values: row_bytes of a format, or width times
    the element size of `dtype` for "auto"."""
    fmt = cache_format(kv_cache_dtype, cache)
    return width * torch.empty(0, dtype=dtype).element_size() if fmt is None else fmt.row_bytes


# --------------------------------------------------------------------------------------------- torch encode / decode
def encode_rows(rows: Tensor, fmt: KVCacheFormat) -> Tensor:
    """rows [N, width] (any float dtype) -> their cache rows, uint8 [N, row_bytes], on rows' device.

    Computed in fp32: per tile of 128, scale = max|x| / qmax (1 for an all-zero tile), codes = x / scale rounded
    to nearest even in the format (e4m3 saturating at +-448; int8 clamped to +-127), RoPE dims rounded to bf16.
    A tile holding NaN gets scale NaN, one holding +-inf scale +inf, and either codes 0 (ops_reference.kv_cache).
    Bit-identical to ops_reference.kv_cache.encode_rows on fp32 rows except where x / scale lies within an fp32
    rounding of a code boundary (the reference divides in float64), and in the bits of a NaN.
    """
    n = rows.shape[0]
    x = rows.to(torch.float32)
    tiles = x[:, : fmt.quantized_dims].reshape(n, fmt.num_scales, TILE)
    amax = tiles.abs().amax(dim=-1)  # [N, tiles]; NaN propagates into the scale, inf gives scale inf
    scale = torch.where(amax == 0, torch.ones_like(amax), amax / fmt.qmax)
    ratio = tiles / scale[..., None]
    if fmt.code == "e4m3":
        codes = ratio.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    else:
        codes = torch.round(torch.nan_to_num(ratio, nan=0.0)).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
        codes = codes.view(torch.uint8)
    codes = codes.masked_fill(~torch.isfinite(scale)[..., None], 0)  # a NaN / inf tile: codes 0
    out = torch.empty(n, fmt.row_bytes, dtype=CACHE_DTYPE, device=rows.device)
    out[:, : fmt.scales_offset] = codes.reshape(n, fmt.quantized_dims)
    out[:, fmt.scales_offset : fmt.rope_offset] = scale.contiguous().view(CACHE_DTYPE)  # little-endian fp32
    if fmt.rope_dims:
        out[:, fmt.rope_offset :] = x[:, fmt.quantized_dims :].to(torch.bfloat16).contiguous().view(CACHE_DTYPE)
    return out


def write_rows(cache: Tensor, slot_mapping: Tensor, rows: Tensor, kv_cache_dtype: str = AUTO) -> None:
    """Write rows [T, width] into cache [num_blocks, block_size, D] at the flat slots slot_mapping [T] (int64,
    block * block_size + offset; -1 = skip the row, a padding token). For a quantized cache (kv_cache_dtype a
    format of FORMATS) each row is encoded first (encode_rows) and D is the format's row_bytes; for "auto" the rows
    are cast to the cache's dtype. What the prologs do for their cache, for callers that compute the rows
    themselves (a decomposed prolog, a serving engine's own projections)."""
    if not _every_slot_written(slot_mapping):  # drop the padding tokens' rows
        keep = slot_mapping >= 0
        rows, slot_mapping = rows[keep], slot_mapping[keep]
    encoded = rows if kv_cache_dtype == AUTO else encode_rows(rows, FORMATS[kv_cache_dtype])
    num_blocks, block_size = cache.shape[:2]
    if cache.stride(0) == block_size * cache.stride(1):  # the blocks are one run of rows: one copy by flat slot
        cache.view(num_blocks * block_size, *cache.shape[2:]).index_copy_(0, slot_mapping, encoded.to(cache.dtype))
    else:  # a strided view (an engine's pages longer than block_size rows) has no flat view: (block, offset)
        cache[slot_mapping // block_size, slot_mapping % block_size] = encoded.to(cache.dtype)


def _every_slot_written(slot_mapping: Tensor) -> bool:
    """Whether slot_mapping has no -1 (padding), when a host read may say so; the masked write is right either way,
    this only skips it (~10 us of boolean indexing a call on a CPU, in every layer of a decode step)."""
    if not host_reads_allowed(slot_mapping) or slot_mapping.numel() == 0:
        return False
    return value_range(slot_mapping)[0] >= 0


def _reinterpret(data: Tensor, dtype: torch.dtype) -> Tensor:
    """A uint8 slice [..., n * itemsize] viewed as `dtype` [..., n]; copied first only if its layout forbids a view."""
    try:
        return data.view(dtype)
    except RuntimeError:  # a view needs unit stride and itemsize-aligned strides and offset
        return data.contiguous().view(dtype)


# e4m3 code -> its fp32 value, all 256 codes (NaN codes included), made by torch's own conversion: a lookup in it
# gives the conversion's bits. Why: on a CPU torch converts float8 one element at a time, without vectors, which
# dominated a decode step's fp8_index lightning_indexer; a gather from this table is vectorized.
_E4M3_TABLE = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)


def _e4m3_values(codes: Tensor) -> Tensor:
    """uint8 e4m3 codes [...] -> fp32 values [...], bit for bit torch's float8_e4m3fn conversion."""
    if codes.device.type != "cpu":  # devices convert float8 at full speed
        return codes.view(torch.float8_e4m3fn).to(torch.float32)
    flat = _E4M3_TABLE.index_select(0, codes.reshape(-1).to(torch.int32))
    return flat.view(codes.shape)


def decode_rows(data: Tensor, fmt: KVCacheFormat) -> Tensor:
    """Cache rows uint8 [..., row_bytes] -> their values, fp32 [..., width] (code * scale; bf16 RoPE as stored).

    Codes and scales convert to fp32 exactly, so each value is the exact product code * scale rounded once to fp32
    (the reference keeps it exact in float64).
    """
    lead = data.shape[:-1]
    codes = data[..., : fmt.scales_offset]
    values = _e4m3_values(codes) if fmt.code == "e4m3" else codes.view(torch.int8).to(torch.float32)
    scales = _reinterpret(data[..., fmt.scales_offset : fmt.rope_offset], torch.float32)  # [..., tiles]
    quantized = (values.reshape(*lead, fmt.num_scales, TILE) * scales[..., None]).reshape(*lead, fmt.quantized_dims)
    if not fmt.rope_dims:
        return quantized
    rope = _reinterpret(data[..., fmt.rope_offset :], torch.bfloat16).to(torch.float32)
    return torch.cat((quantized, rope), dim=-1)


# ------------------------------------------------------------------------------------------------------ dispatch
class KVCacheFormatUnsupportedError(BackendError, ValueError):
    """A quantized cache reached a backend whose descriptor does not list its format (`Backend.kv_cache_dtypes`)."""


def dispatch_kwargs(kv_cache_dtype: str) -> dict[str, str]:
    """What the public ops pass to a backend: nothing for "auto" (so a backend that predates the quantized
    formats keeps working on float caches), kv_cache_dtype=<format> otherwise."""
    return {} if kv_cache_dtype == AUTO else {"kv_cache_dtype": kv_cache_dtype}


def check_format_support(resolution: Resolution, kv_cache_dtype: str) -> None:
    """Refuse a quantized cache for a backend that does not declare its format, naming the backends that do."""
    reg = registry()
    backend = reg.get(resolution.backend)
    if backend is not None and kv_cache_dtype in backend.kv_cache_dtypes:
        return
    # A backend that runs this op through another one (the vendor backends) supports what that one supports.
    delegate = reg.get(backend.delegates.get(resolution.op, "")) if backend is not None else None
    if delegate is not None and kv_cache_dtype in delegate.kv_cache_dtypes:
        return
    capable = [
        n for n in registry().names() if (b := registry().get(n)) is not None and kv_cache_dtype in b.kv_cache_dtypes
    ]
    raise KVCacheFormatUnsupportedError(
        f"{resolution.op}: kv_cache_dtype {kv_cache_dtype!r} is not supported by the backend selected for "
        f"{resolution.device_type}, {resolution.backend!r}; backends that read and write it: {capable or 'none'}"
    )
