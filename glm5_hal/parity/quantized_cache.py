"""Parity of the quantized cache formats (OPS.md section 7): the cases, and how a written cache is judged.

Readers (indexer_logits, lightning_indexer, sparse_flash_attention) run every float-cache case of their op on
the SAME stored bytes: the case's float cache is encoded once by the NumPy reference (ops_reference.kv_cache),
with some tiles zeroed first (an all-zero tile has scale 1), and every backend and the reference read those
bytes. The reference decodes them in float64 and applies the float op, so a reader is judged exactly like the
float case, at the same tolerances: quantization error is not parity error.

Writers (mla_prolog, indexer_prolog) compute their rows in the activation dtype and quantize them, so the bytes
they store may differ from the reference's where a value sits near a code boundary. A written row is judged by
`compare_quantized_cache`: each stored value must lie within half a quantization step (of the backend's own
scale: the rounding the format allows) plus the dtype's tolerance of the reference's unquantized float64 value,
each scale within the dtype's tolerance of max|tile| / qmax, and every row not written must keep its bytes. The
tolerance is of each value's error scale where the prolog gives one (a normalized row of a cancelling projection:
glm5_hal.parity.specs), else of the value itself. A tile
the reference holds NaN / inf in must store scale NaN / +inf and codes 0, and NaN / inf RoPE values as themselves.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np
import torch

from glm5_hal.kv_formats import CACHE_ARGUMENT, OP_CACHE
from glm5_hal.kv_formats import encode_rows as torch_encode_rows
from glm5_hal.parity.case import Build, Case
from glm5_hal.parity.compare import TOLERANCE, Verdict, to_numpy
from ops_reference.kv_cache import FORMATS, TILE, KVCacheFormat, decode_bf16, decode_rows, encode_bf16, encode_rows

WRITERS = ("mla_prolog", "indexer_prolog")
ZERO_TILE_EVERY = 7  # every 7th cache slot's first tile is zeroed before encoding (scale 1, codes 0)


def formats_of(op: str) -> list[str]:
    """The quantized formats of the cache `op` reads or writes."""
    return [name for name, f in FORMATS.items() if f.cache == OP_CACHE[op]]


def encode_cache(cache: torch.Tensor, fmt: KVCacheFormat, *, zero_tiles: bool = True, reference: bool = True):
    """A float cache [num_blocks, block_size, width] as uint8 [num_blocks, block_size, row_bytes]: the reference's
    bytes (NumPy, float64), or with reference=False the torch encoder's (fast at long contexts). With zero_tiles,
    the first tile of every ZERO_TILE_EVERY-th slot is zeroed first."""
    blocks, block_size, width = cache.shape
    rows = cache.detach().reshape(-1, width).clone()
    if zero_tiles:
        rows[::ZERO_TILE_EVERY, :TILE] = 0.0
    if not reference:
        return torch_encode_rows(rows, fmt).reshape(blocks, block_size, fmt.row_bytes)
    encoded = encode_rows(rows.cpu().to(torch.float64).numpy(), fmt)
    return torch.from_numpy(encoded).reshape(blocks, block_size, fmt.row_bytes)


def store_nonfinite_tiles(cache: torch.Tensor, fmt: KVCacheFormat, *, nan_every: int, inf_every: int) -> None:
    """Store, in place, the bytes a writer stores for a tile holding NaN (scale NaN, codes 0) in the first tile of
    every `nan_every`-th slot of `cache` (uint8 [num_blocks, block_size, row_bytes], contiguous), and those of a
    tile holding inf (scale +inf, codes 0) in the last tile of every `inf_every`-th slot."""
    rows = cache.view(-1, fmt.row_bytes)
    first, last = fmt.scales_offset, fmt.rope_offset - 4  # byte offsets of the first and the last scale
    rows[::nan_every, :TILE] = 0
    rows[::nan_every, first : first + 4] = torch.tensor([float("nan")]).view(torch.uint8)
    rows[::inf_every, fmt.quantized_dims - TILE : fmt.quantized_dims] = 0
    rows[::inf_every, last : last + 4] = torch.tensor([float("inf")]).view(torch.uint8)


def quantized_build(build: Build, kv_cache_dtype: str, *, zero_tiles: bool = True, reference: bool = True) -> Build:
    """`build` with its cache argument encoded in `kv_cache_dtype` (encode_cache) and passed as kv_cache_dtype=."""
    fmt = FORMATS[kv_cache_dtype]
    name = CACHE_ARGUMENT[fmt.cache]

    def build_quantized(gen: torch.Generator, dtype: torch.dtype) -> dict:
        inputs = build(gen, dtype)
        inputs[name] = encode_cache(inputs[name], fmt, zero_tiles=zero_tiles, reference=reference)
        inputs["kv_cache_dtype"] = kv_cache_dtype
        return inputs

    return build_quantized


def with_quantized_cache(case: Case, kv_cache_dtype: str) -> Case:
    """`case` with its cache argument encoded in `kv_cache_dtype` (the reference's bytes, some tiles zeroed)."""
    return dataclasses.replace(
        case, name=f"{case.name}_{kv_cache_dtype}", build=quantized_build(case.build, kv_cache_dtype)
    )


def with_zero_written_tile(case: Case, kv_cache_dtype: str) -> Case:
    """A writer case whose new rows have an all-zero first tile (scale 1, codes 0 must be stored): the latent
    row's first 128 dims come from zero rows of w_dkv_kr; an index key is LayerNorm'ed with zero weight and bias."""
    quantized = with_quantized_cache(case, kv_cache_dtype)
    zeroed: dict[str, Callable[[dict], None]] = {
        "mla_prolog": lambda inputs: inputs["w_dkv_kr"][:TILE].zero_(),
        "indexer_prolog": lambda inputs: (inputs["k_norm_weight"].zero_(), inputs["k_norm_bias"].zero_()),
    }

    def build(gen: torch.Generator, dtype: torch.dtype) -> dict:
        inputs = quantized.build(gen, dtype)
        zeroed[case.op](inputs)
        return inputs

    return dataclasses.replace(case, name=f"zero_tile_written_{kv_cache_dtype}", group="corner", build=build)


def quantized_variants(cases: Sequence[Case]) -> list[Case]:
    """Every case of a cache-reading or -writing op, once per quantized format of its cache, plus a written zero
    tile per writer and format. Writers at real model dims are left out: their cache rows have the mini preset's
    widths (576 / 128), and the projection GEMMs around them, not the write, are what real dims add."""
    found = []
    for case in cases:
        if case.op in OP_CACHE and not (case.slow and case.op in WRITERS):
            found += [with_quantized_cache(case, fmt) for fmt in formats_of(case.op)]
    for op in WRITERS:
        first = next(c for c in cases if c.op == op and not c.slow)
        found += [with_zero_written_tile(first, fmt) for fmt in formats_of(op)]
    return found


# ------------------------------------------------------------------------------------------- judging a write
def _half_e4m3_step(magnitude: np.ndarray) -> np.ndarray:
    """Half the spacing of float8_e4m3fn values around `magnitude` (in code units): 2^(binade - 3) / 2."""
    _, exponent = np.frexp(magnitude)
    return np.ldexp(0.5, np.maximum(exponent - 1, -6) - 3)


def _half_bf16_ulp(magnitude: np.ndarray) -> np.ndarray:
    _, exponent = np.frexp(magnitude)
    return np.ldexp(0.5, np.maximum(exponent - 1, -126) - 7)


def compare_quantized_cache(
    name: str,
    out: torch.Tensor,
    before: np.ndarray,
    written_rows: np.ndarray,
    reference_cache: np.ndarray,
    slots: np.ndarray,
    fmt: KVCacheFormat,
    dtype: torch.dtype,
    row_scales: np.ndarray | None = None,
) -> Verdict:
    """out: the cache after the write, uint8 [num_blocks, block_size, row_bytes]; before: its bytes before;
    written_rows: the reference's unquantized float64 rows [T, width] for flat slots `slots` [T] (-1 = not
    written); reference_cache: the bytes the reference stores; row_scales [T, width]: what each written value's
    error is relative to where that is not the value itself (glm5_hal.parity.specs: a normalized row of a
    cancelling projection), at least the value. The rel_err reported is that of the stored values against the
    reference's stored values (0 when the bytes agree), not the quantization error."""
    tol = TOLERANCE[dtype]
    got = to_numpy(out).astype(np.uint8).reshape(-1, fmt.row_bytes)
    was = np.asarray(before, np.uint8).reshape(-1, fmt.row_bytes)
    if got.shape != was.shape:
        return Verdict(name, False, float("inf"), f"shape {out.shape} != the cache's {before.shape}")
    keep = slots >= 0
    untouched = np.ones(got.shape[0], bool)
    untouched[slots[keep]] = False
    if not np.array_equal(got[untouched], was[untouched]):
        changed = int((got[untouched] != was[untouched]).any(axis=1).sum())
        return Verdict(name, False, float("inf"), f"{changed} rows that no token writes were changed")
    want = written_rows[keep]  # [n, width]
    sizes = np.abs(want) if row_scales is None else np.maximum(np.abs(want), np.nan_to_num(row_scales[keep]))
    stored = got[slots[keep]]  # [n, row_bytes]
    decoded = decode_rows(stored, fmt)
    if want.size == 0:
        return Verdict(name, True, 0.0)
    reference = decode_rows(np.asarray(reference_cache, np.uint8).reshape(-1, fmt.row_bytes)[slots[keep]], fmt)
    both = np.isfinite(decoded) & np.isfinite(reference)  # (NaN / inf positions are judged below)
    rel = float(np.linalg.norm(decoded[both] - reference[both]) / max(np.linalg.norm(reference[both]), 1e-300))

    n, q = want.shape[0], fmt.quantized_dims
    tiles = want[:, :q].reshape(n, fmt.num_scales, TILE)
    scales = np.ascontiguousarray(stored[:, fmt.scales_offset : fmt.rope_offset]).view("<f4").astype(np.float64)
    # A tile holding NaN / inf (ops_reference.kv_cache): scale NaN / +inf and codes 0, whatever else it holds.
    nan_tile = np.isnan(tiles).any(axis=-1)  # [n, tiles]
    inf_tile = np.isinf(tiles).any(axis=-1) & ~nan_tile
    codes = stored[:, :q].reshape(n, fmt.num_scales, TILE)
    if not (np.isnan(scales[nan_tile]).all() and (scales[inf_tile] == np.inf).all()):
        return Verdict(name, False, rel, "a tile holding NaN / inf must store scale NaN / +inf")
    if (codes[nan_tile | inf_tile] != 0).any():
        return Verdict(name, False, rel, "a tile holding NaN / inf must store codes 0")
    finite = ~(nan_tile | inf_tile)
    tiles, scales, got_tiles = tiles[finite], scales[finite], decoded[:, :q].reshape(n, fmt.num_scales, TILE)[finite]
    tile_sizes = sizes[:, :q].reshape(n, fmt.num_scales, TILE)[finite]

    amax = np.abs(tiles).max(axis=-1)  # [finite tiles]
    size_max = tile_sizes.max(axis=-1)  # amax where each value is judged against itself
    want_scales = np.where(amax == 0, 1.0, amax / fmt.qmax)
    scale_err = np.abs(scales - want_scales) / np.where(amax == 0, 1.0, size_max / fmt.qmax)
    if not (scale_err <= tol).all():
        return Verdict(name, False, rel, f"scales off by up to {scale_err.max():.3g} relative (tolerance {tol:g})")

    # Quantized dims: within half a step of the backend's own scale, plus the dtype's tolerance of the tile.
    in_codes = np.maximum(np.abs(tiles), np.abs(got_tiles)) / scales[..., None]
    half_step = (_half_e4m3_step(in_codes) if fmt.code == "e4m3" else 0.5) * scales[..., None]
    bound = half_step + tol * (tile_sizes + size_max[..., None])
    excess = np.abs(got_tiles - tiles) - bound
    if (excess > 0).any():
        return Verdict(name, False, rel, f"{int((excess > 0).sum())} quantized values beyond half a step + tolerance")
    # RoPE dims: bf16 rounding of the value, plus the dtype's tolerance; where that rounding is NaN or +-inf
    # (NaN, inf, or a value past bf16's range), exactly that.
    rope, got_rope = want[:, q:], decoded[:, q:]
    if rope.size:
        rounded = decode_bf16(encode_bf16(rope))
        special = ~np.isfinite(rounded)
        if not np.array_equal(rounded[special], got_rope[special], equal_nan=True):
            return Verdict(name, False, rel, "a NaN / inf RoPE value was not stored as NaN / that inf")
        rope, got_rope = np.where(special, 0.0, rope), np.where(special, 0.0, got_rope)
        rope_sizes = np.where(special, 0.0, sizes[:, q:])
        row_max = rope_sizes.max(axis=1, keepdims=True)
        bound = _half_bf16_ulp(np.maximum(np.abs(rope), np.abs(got_rope))) + tol * (rope_sizes + row_max)
        if not (np.abs(got_rope - rope) <= bound).all():
            return Verdict(name, False, rel, "bf16 RoPE values beyond bf16 rounding + tolerance")
    return Verdict(name, True, rel)
