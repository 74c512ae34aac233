"""How a backend's output is judged against the float64 reference (DESIGN.md "Correctness policy").

- Floating outputs: inf/nan positions must match exactly first; then the norm-relative error
  ||out - ref|| / ||ref|| and every element's error |out - ref| <= tol * (|ref| + max|ref|) must be within the
  tolerance of the case's activation dtype (fp32 1e-5, bf16 1.6e-2, fp16 1e-3: FlagGems' resolutions), each
  element's error counted beyond the contract's absolute floor (ABSOLUTE_FLOOR, 2^-110) or the output format's own
  rounding among its subnormals where that is coarser (fp16: 2^-25). Some outputs are judged against another
  scale than |ref| (`scale`): lse against max(1, |lse|) (an fp32 sum's error is absolute in its log), sums that
  cancel (projections, indexer scores) against their terms' root-sum-square (glm5_hal.parity.specs).
- Integer outputs (ids, offsets, int32 accumulators): exactly equal.
- Top-k index sets: checked for validity exactly (range, causality, uniqueness, -1 tail of the right length)
  and compared as sets through the reference scores, so any correct top-k set passes ties.
- Per-token int8 codes: exact, except where x / scale lies within a hair of a rounding boundary in float64
  (a backend computing in fp32 may round the other way there, by one).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

TOLERANCE: dict[torch.dtype, float] = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 1e-3}
# The absolute floor of the contract (docs/ops.md "Edge rules"): below the relative tolerances, an output may miss
# the reference by this much. Half-precision units (AVX-512 BF16's VDPBF16PS, AMX, tensor cores) flush subnormal
# operands and products to zero, each losing less than 2^-126 (fp32's smallest normal number); a sum of up to 2^16
# of them (every reduction of GLM-5 / DeepSeek-V3.2: topk 2048 x 2 parts, K <= 18432) loses less than 2^-110.
ABSOLUTE_FLOOR = 2.0**-110


@dataclass(frozen=True)
class Verdict:
    """The judgement of one output: passed, the worst relative error seen (0 for exact), and why if not."""

    output: str
    passed: bool
    rel_err: float
    detail: str = ""


def to_numpy(t: torch.Tensor | np.ndarray) -> np.ndarray:
    if isinstance(t, np.ndarray):
        return t
    t = t.detach().cpu()
    return (t.to(torch.float64) if t.is_floating_point() else t).numpy()


def output_floor(dtype: torch.dtype) -> float:
    """The absolute error an output stored in `dtype` may carry beyond the tolerances: ABSOLUTE_FLOOR, or rounding
    to `dtype` itself where that is coarser. Below its smallest normal number a format's values are evenly spaced
    (fp16: 2^-24 apart), so rounding there is an absolute error of up to half that spacing (fp16: 2^-25, ~3e-8),
    which no relative tolerance holds: an fp16 output of 1e-6 is rounded by up to 3%."""
    if not dtype.is_floating_point:
        return ABSOLUTE_FLOOR
    info = torch.finfo(dtype)
    return max(ABSOLUTE_FLOOR, info.tiny * info.eps / 2)


def compare_float(
    name: str, out: torch.Tensor, ref: np.ndarray, dtype: torch.dtype, *, scale: np.ndarray | None = None
) -> Verdict:
    """out against the float64 ref at the tolerance of activation dtype `dtype` (module docstring). scale: what each
    element's error is relative to, where that is not |ref| (same shape as ref): a quantity whose fp32 error is
    absolute (lse: max(1, |lse|)), or a sum with cancellation (judged against its terms' root-sum-square)."""
    tol = TOLERANCE[dtype]
    floor = output_floor(out.dtype) if isinstance(out, torch.Tensor) else ABSOLUTE_FLOOR
    got = to_numpy(out).astype(np.float64)
    want = np.asarray(ref, dtype=np.float64)
    if got.shape != want.shape:
        return Verdict(name, False, float("inf"), f"shape {got.shape} != reference {want.shape}")
    special = ~np.isfinite(want)
    if not np.array_equal(np.isnan(got), np.isnan(want)) or not np.array_equal(
        got[special & ~np.isnan(want)], want[special & ~np.isnan(want)]
    ):
        bad = int(((np.isnan(got) != np.isnan(want)) | (special & (got != want) & ~np.isnan(want))).sum())
        return Verdict(name, False, float("inf"), f"{bad} inf/nan positions differ from the reference")
    if not np.isfinite(got[~special]).all():
        return Verdict(name, False, float("inf"), "inf/nan where the reference is finite")
    # Errors within the floor are no error (values of ~1e-36 flushed to 0 by a half-precision unit; an fp16 output
    # rounded among its subnormals).
    diff = np.maximum(np.abs(got[~special] - want[~special]) - floor, 0.0)
    ref_abs = np.abs(want[~special]) if scale is None else np.abs(np.asarray(scale, np.float64)[~special])
    ref_norm = float(np.linalg.norm(ref_abs))
    rel = float(np.linalg.norm(diff)) / ref_norm if ref_norm > 0 else float(np.linalg.norm(diff))
    largest = float(ref_abs.max()) if ref_abs.size else 0.0
    elem_ok = diff <= tol * (ref_abs + largest)
    if rel > tol:
        return Verdict(name, False, rel, f"relative error {rel:.3g} > {tol:g}")
    if not elem_ok.all():
        worst = float((diff / (ref_abs + largest + 1e-300)).max())
        return Verdict(name, False, rel, f"{int((~elem_ok).sum())} elements off by up to {worst:.3g} x tolerance scale")
    return Verdict(name, True, rel)


def compare_exact(name: str, out: torch.Tensor, ref: np.ndarray) -> Verdict:
    got = to_numpy(out)
    want = np.asarray(ref)
    if got.shape != want.shape:
        return Verdict(name, False, float("inf"), f"shape {got.shape} != reference {want.shape}")
    got, want = got.astype(np.float64), want.astype(np.float64)
    # NaN equals NaN here: an exact output (a copy, a permutation) carries a NaN input to the same place, and a NaN
    # where the reference has none, or a number where it has NaN, still differs.
    mismatched = int(((got != want) & ~(np.isnan(got) & np.isnan(want))).sum())
    if mismatched:
        return Verdict(name, False, float("inf"), f"{mismatched} of {got.size} values differ (exact comparison)")
    return Verdict(name, True, 0.0)


def compare_topk(
    name: str,
    indices: torch.Tensor,
    ref_logits: np.ndarray,
    topk: int,
    dtype: torch.dtype,
    *,
    scales: np.ndarray | None = None,
) -> Verdict:
    """Indices [T, topk] against the reference logits [T, S] (-inf = not visible). scales [T, S]: what each
    logit's rounding is relative to (glm5_hal.parity.specs: its terms' root-sum-square), else |logit|; a row is
    judged against its largest.

    NaN ranks above every number (docs/ops.md "NaN"): the keys the reference scores NaN must all be picked (or,
    when there are more of them than topk, the lowest-positioned ones: NaN ties NaN); the rest is judged as a
    top-k of the numbers, within the dtype's tolerance (exact ties are judged by test_topk_ties).
    """
    got = to_numpy(indices).astype(np.int64)
    if got.shape != (ref_logits.shape[0], topk):
        return Verdict(name, False, float("inf"), f"shape {got.shape} != ({ref_logits.shape[0]}, {topk})")
    tol = TOLERANCE[dtype]
    worst = 0.0
    for t, row in enumerate(got):
        scores = ref_logits[t]
        nan = np.isnan(scores)
        visible = np.flatnonzero(nan | (scores > -np.inf))
        n_valid = min(topk, visible.size)
        head, tail = row[:n_valid], row[n_valid:]
        if (tail != -1).any():
            return Verdict(name, False, float("inf"), f"row {t}: expected -1 after the first {n_valid} entries")
        if ((head < 0) | (head >= scores.size)).any() or (scores[np.clip(head, 0, None)] == -np.inf).any():
            return Verdict(name, False, float("inf"), f"row {t}: an index is -1, out of range or not visible")
        if np.unique(head).size != head.size:
            return Verdict(name, False, float("inf"), f"row {t}: duplicate indices")
        n_nan = min(int(nan.sum()), n_valid)
        first_nan = np.flatnonzero(nan)[:n_nan]  # the NaN keys that rank first: the lowest positions
        if not np.array_equal(np.sort(head[nan[head]]), first_nan):
            return Verdict(
                name,
                False,
                float("inf"),
                f"row {t}: picked NaN-scored keys {np.sort(head[nan[head]]).tolist()}, expected {first_nan.tolist()}",
            )
        head, visible, n_valid = head[~nan[head]], visible[~nan[visible]], n_valid - n_nan
        if n_valid == 0:
            continue
        # Any set whose weakest member is at least the true k-th best score (up to rounding) is a top-k set.
        kth_best = np.sort(scores[visible])[::-1][n_valid - 1]
        weakest = scores[head].min()
        finite = visible[np.isfinite(scores[visible])]
        sizes = np.abs(scores[finite]) if scales is None else np.abs(scales[t, finite])
        row_scale = sizes.max(initial=0.0) or 1.0
        shortfall = (kth_best - weakest) / row_scale
        worst = max(worst, float(shortfall))
        if shortfall > tol:
            return Verdict(
                name,
                False,
                worst,
                f"row {t}: selected score {weakest:.6g} below the k-th best {kth_best:.6g} beyond tolerance",
            )
    return Verdict(name, True, worst)


def compare_unchanged(name: str, after: torch.Tensor, before: torch.Tensor) -> Verdict:
    """An input the op must only read: the same values (NaN where NaN) after the call as before."""
    got, want = to_numpy(after), to_numpy(before)
    same = (got == want) | (np.isnan(got) & np.isnan(want)) if got.dtype.kind == "f" else got == want
    if got.shape != want.shape or not np.all(same):
        return Verdict(name, False, float("inf"), "an input the op must only read was modified")
    return Verdict(name, True, 0.0)


def compare_int8_codes(name: str, q: torch.Tensor, ref_q: np.ndarray, x: np.ndarray, ref_scale: np.ndarray) -> Verdict:
    got = to_numpy(q).astype(np.int64)
    want = np.asarray(ref_q, dtype=np.int64)
    if got.shape != want.shape:
        return Verdict(name, False, float("inf"), f"shape {got.shape} != reference {want.shape}")
    with np.errstate(invalid="ignore", divide="ignore"):  # rows holding NaN / inf: their codes are 0, compared below
        ratio = x / ref_scale[..., None]
    near_boundary = np.abs(np.abs(ratio - np.floor(ratio)) - 0.5) < 1e-4
    diff = np.abs(got - want)
    bad = (diff > 1) | ((diff == 1) & ~near_boundary)
    if bad.any():
        return Verdict(name, False, float("inf"), f"{int(bad.sum())} int8 codes differ away from rounding ties")
    return Verdict(name, True, 0.0)
