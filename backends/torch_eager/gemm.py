"""The float GEMMs of one op call, in the precision backends.torch_eager.capabilities chose for the call's device and
activation dtype.

    gemm = gemm_for(x.dtype, x.device)
    y = gemm.linear(h, weight)      # [..., in] @ [out, in]^T -> [..., out] fp32
    s = gemm.bmm(a, b)              # [B, M, K] @ [B, K, N] -> [B, M, N] fp32

Two paths, one interface:
- FP32 (fp32 activations always; bf16 / fp16 where the probe found no faster unit, or GLM5_HAL_FAST_PATHS=0): the
  operands are upcast to fp32, exactly the code the backend ran before it had fast paths.
- half-precision operands (bf16 / fp16 activations where the probe says so): the GEMMs run in the activation dtype
  and accumulate in fp32, and still nothing is rounded that the fp32 path keeps (the contract accumulates in fp32,
  and an op's intermediates feed cancelling sums: a q_norm row nearly orthogonal to a weight row, LayerNorm's
  centring, the weighted sum over experts or indexer heads, so one rounding of an intermediate to bf16 can be
  amplified many times past the bf16 tolerance; the fuzz suite finds such inputs at small widths):
  * an fp32 operand (an intermediate: q_norm, the SwiGLU activation, softmax probabilities, decoded cache rows)
    enters as the sum of two parts in the operand dtype, hi = round(x) and lo = round(x - hi) (x to ~2^-16);
  * the result comes back in fp32 where the device's GEMM can return it (out_dtype), or where
    backends.torch_eager.native's bf16 x bf16 -> fp32 kernel runs (CPUs with AVX-512 BF16: `native`); elsewhere (other
    CPUs: bf16 results only) the rounded result r is followed by r' = addmm(r, a, b, beta=-1), whose fp32 accumulator
    holds exactly the rounding error, and the sum r + r' is the fp32 result to ~2^-16 (the probe checks once per device
    that the GEMM adds in fp32 before it rounds; where it does not, the half path is not used).
  A product that is the op's output (rounded to the activation dtype right after: `output=True`) skips the
  residual: its result is rounded anyway. With an fp32 operand's two parts, each part's product is rounded before
  their fp32 sum, which adds at most one more rounding of the output's own size (2^-9 |out|, plus 2^-18 of the
  magnitudes summed): unlike a rounded operand, cancellation inside the product does not amplify it. Sparse
  attention normalises its probabilities first so that its value product is such an output. The parts of an
  operand are stacked into one GEMM, so a product reads its weight once per pass. Where few rows favour another
  route than many (the weight's bytes, not the arithmetic, set the time there), the weight family's products pick
  their route by row count (`RoutedGemm`, the split measured by the probe). A product whose parts and passes
  multiply its half-precision work past `max_work` (the probe's measured half / fp32 speed ratio over the
  required margin) takes the fp32 GEMM: on a CPU that returns bf16 only, an fp32 operand times a bf16 one is four
  GEMMs' work (two parts, two passes), no faster than one fp32 GEMM.
  Everything around the GEMMs (norms, RoPE, softmax statistics, lse) stays fp32.

`gemm.logits` (products that feed a softmax) is the same path: the results are fp32-accurate on both kinds of device.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from backends.torch_eager.capabilities import FP32 as FP32_NAME
from backends.torch_eager.capabilities import NATIVE, WEIGHTS, Route, capabilities
from backends.torch_eager.native import amx_gemm, bf16_gemm
from backends.torch_eager.primitives import COMPUTE_DTYPE, linear


def _stacked_parts(t: Tensor, dtype: torch.dtype, dim: int) -> tuple[Tensor, int]:
    """t as a sum of `dtype` parts stacked along `dim`, and their count: (t, 1) if t already is `dtype`, else
    ([hi, lo] along dim, 2) with hi = t clamped to dtype's largest finite value, rounded, and lo = the rest, rounded.
    Written into one buffer: no separate copies of the parts to concatenate.

    The clamp keeps hi finite for every finite t: rounded to nearest, an fp32 value within 0.4% of FLT_MAX (past
    bf16's largest finite number) became inf, so its product was inf, and NaN through a zero weight, where the true
    product is finite (docs/ops.md "Edge rules"). There hi is that largest number and lo the exact rest. An
    infinite t gives hi the largest number and lo the infinity, and NaN both parts NaN, so a split value propagates
    inf and NaN through a product as the unsplit one does."""
    if t.dtype == dtype:
        return t, 1
    size = t.shape[dim]
    shape = list(t.shape)
    shape[dim] = 2 * size
    stacked = t.new_empty(shape, dtype=dtype)
    largest = torch.finfo(dtype).max
    # Rounded as it is stored, then the values that rounded past the largest (and the infinities) clamped to it:
    # an in-place pass over the half-precision part, no fp32 temporary.
    hi = stacked.narrow(dim, 0, size).copy_(t).clamp_(-largest, largest)
    # t - hi is exact in fp32 where t is finite (t and hi share a binade past bf16's largest number); inf - largest
    # is inf, NaN stays NaN.
    stacked.narrow(dim, size, size).copy_(torch.sub(t, hi))
    return stacked, 2


@dataclass(frozen=True)
class Gemm:
    """operand: the dtype GEMM operands are given in (COMPUTE_DTYPE = the fp32 path). fp32_output: the GEMM returns
    its fp32 accumulators (torch.mm / torch.bmm with out_dtype=float32); otherwise its rounded result is corrected
    by the residual GEMM (see the module docstring). max_work: products
    whose half-precision GEMMs would do more than this many times the product's own work (parts of fp32 operands
    times passes) take the fp32 GEMM. native: the fp32 results come from backends.torch_eager.native.bf16_gemm (a CPU
    kernel torch lacks; fp32_output is then True); a product that is the op's output still takes torch's GEMM, whose
    rounded result is all it needs, and which is the faster one where the arithmetic, not the weight, sets the time.
    """

    operand: torch.dtype
    fp32_output: bool = True
    max_work: float = math.inf
    native: bool = False
    native_isa: str = bf16_gemm.FAST  # the native kernels' build (native/build.py ISAS) where `native`
    # Whether torch's own half-precision GEMM is fast here. False on a CPU without units for the dtype (torch emulates
    # it there, ~15x slower than fp32 at prefill sizes): the native kernel then also takes the op's outputs, and a
    # product it does not take runs in fp32.
    torch_half: bool = True
    # Where torch's half GEMM is fast: the op's outputs too take the native kernel in products of fewer rows than
    # this (rows of work: an fp32 operand's two parts count twice), where the probe measured it faster than one
    # pass of torch's GEMM (decode, where the weight's bytes set the time); 0: never.
    outputs_below: float = 0.0
    # Sparse attention's native kernel: how it asks for the rows it reads next (native.sparse_attention.ROW_PREFETCHES;
    # "": the kernel's default), as the probe measured fastest here from memory. The results are the same bits.
    row_prefetch: str = ""

    @property
    def half(self) -> bool:
        return self.operand != COMPUTE_DTYPE

    @property
    def logits(self) -> Gemm:
        """The path for products that feed a softmax: this one (its results are fp32-accurate either way)."""
        return self

    def at(self, count: int) -> Gemm:
        """The route for a call of `count` heads (RoutedGemm.at): this one, whatever the count."""
        return self

    def for_rows(self, a: Tensor, rows: int) -> Gemm:
        """The route for a product of `rows` rows of `a` (RoutedGemm.for_rows): this one, whatever the rows."""
        return self

    @property
    def vector_kernels(self) -> bool:
        """Whether the vector ISAs' fused kernels without an AMX build run on this path (the indexer prolog,
        indexer_prolog.c): a native route other than AMX's, which runs that op as torch code over its GEMM. Sparse
        attention and the indexer's scores have AMX kernels of their own (amx_attention.c, amx_index_scores.c,
        amx_quantized_index_scores.c; the backend's sparse_attention.native_kernel_runs, indexer.scoring_kernel)."""
        return self.native and self.native_isa != amx_gemm.FAST

    def takes_native(self, b: Tensor, output: bool, rows: int) -> bool:
        """Whether a product with column operand b and `rows` rows of work (a's stacked parts) runs on
        backends.torch_eager.native's kernel. Not where b is an fp32 operand: b is the weight-like one (a weight, the
        cache rows), and splitting it into parts with torch ops costs more per element (~0.9 ns on this project's CPU)
        than the kernel spends on it at these row counts (an fp32 `a`, activations of few rows, is split cheaply).
        Where the product is the op's output and torch's half GEMM is fast, torch's rounded result is enough: the
        native kernel takes it only below `outputs_below` rows, and only where b is read in place (K-contiguous, as a
        weight [N, K] is; another layout would be copied on every call)."""
        if not self.native or b.dtype != self.operand:
            return False
        if not output or not self.torch_half:
            return True
        return rows < self.outputs_below and (b.shape[-2] <= 1 or b.stride(-2) == 1)

    def takes_half(self, a: Tensor, b: Tensor, rows: int, output: bool) -> bool:
        """Whether a product of a and b (any float dtypes) with `rows` rows runs on the half-precision path."""
        if not self.half:
            return False
        a_parts = 1 if a.dtype == self.operand else 2
        native = self.takes_native(b, output, rows * a_parts)
        if not self.torch_half and not native:
            return False  # torch's emulated half GEMM would run it: fp32 is faster
        parts = a_parts * (1 if b.dtype == self.operand else 2)
        # One pass where the GEMM returns fp32 (torch's out_dtype, or the native kernel where it takes the product),
        # or where the result is the op's output; else the residual's second pass.
        one_pass = output or (self.fp32_output and (not self.native or native))
        return parts * (1 if one_pass else 2) <= self.max_work

    def _product(self, a: Tensor, b: Tensor, matmul, matmul_add, output: bool) -> Tensor:
        """a [..., M, K] @ b [..., K, N] in fp32: sum over the parts of a and b of a_i @ b_j (lo x lo left out: below
        fp32's precision). The parts are stacked (a's along rows, b's along columns) so that each pass reads the
        weight once: one GEMM, plus the residual GEMM where the result comes back rounded."""
        rows, cols = a.shape[-2], b.shape[-1]
        stacked_a, a_parts = _stacked_parts(a, self.operand, -2)  # a's parts along rows
        if self.takes_native(b, output, rows * a_parts):
            # b is in the operand dtype here (takes_native): one part; b^T is the [N, K] the kernel reads.
            b_parts = 1
            if stacked_a.dim() == 2:
                blocks = self._native_bmm_nt(stacked_a[None], b.mT[None])[0]
            else:
                blocks = self._native_bmm_nt(stacked_a, b.mT)
        else:
            stacked_b, b_parts = _stacked_parts(b, self.operand, -1)  # b's along columns
            if self.fp32_output and not self.native:
                blocks = matmul(stacked_a, stacked_b, out_dtype=COMPUTE_DTYPE)
            else:
                rounded = matmul(stacked_a, stacked_b)
                blocks = rounded.to(COMPUTE_DTYPE)
                if not output:
                    # The accumulator of addmm(r, a, b, beta=-1) starts at -r, so it ends at the rounding error of
                    # r. It is not finite only where r is not (r = +-inf or NaN, whose residual is NaN or inf): there
                    # r alone is the answer, so such a residual counts as 0 (one in-place pass over the bf16
                    # residual; the fp32 sum then adds the bf16 residual without a converted copy).
                    residual = matmul_add(rounded, stacked_a, stacked_b, beta=-1)
                    blocks.add_(residual.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0))
        total = blocks[..., :rows, :cols]
        for i, j in ((1, 0), (0, 1)):  # hi x lo and lo x hi, where those parts exist
            if i < a_parts and j < b_parts:
                total = total + blocks[..., i * rows : (i + 1) * rows, j * cols : (j + 1) * cols]
        return total

    def _native_bmm_nt(self, a: Tensor, b: Tensor) -> Tensor:
        """a [B, M, K] bf16 @ b [B, N, K]^T bf16 -> [B, M, N] fp32 on the native build of this path: AMX's own kernel
        (amx_gemm.c) or bf16_gemm.c's build for native_isa."""
        if self.native_isa == amx_gemm.FAST:
            return amx_gemm.bmm_nt(a, b)
        return bf16_gemm.bmm_nt(a, b, isa=self.native_isa)

    def bmm(self, a: Tensor, b: Tensor, *, output: bool = False) -> Tensor:
        """a [B, M, K] @ b [B, K, N] -> [B, M, N] fp32 (any float dtypes in; an fp32 operand is not rounded).
        output: the result is the op's output, rounded to the activation dtype right after."""
        if not self.takes_half(a, b, a.shape[1], output):
            return torch.bmm(a.to(COMPUTE_DTYPE), b.to(COMPUTE_DTYPE))
        return self._product(a, b, torch.bmm, torch.baddbmm, output)

    def linear(self, x: Tensor, weight: Tensor, *, output: bool = False) -> Tensor:
        """x [..., in] (any float dtype) @ weight [out, in]^T -> [..., out] fp32 (an fp32 x is not rounded).
        output: the result is the op's output, rounded to the activation dtype right after.

        A weight in another dtype than `operand` (an fp32 weight beside bf16 activations) takes the fp32 path:
        rounding a weight on every call would cost a full copy and lose its precision.
        """
        flat = x.reshape(-1, x.shape[-1])
        if weight.dtype != self.operand or not self.takes_half(flat, weight, flat.shape[0], output):
            return linear(x.to(COMPUTE_DTYPE), weight)
        return self._product(flat, weight.T, torch.mm, torch.addmm, output).view(*x.shape[:-1], weight.shape[0])


FP32 = Gemm(COMPUTE_DTYPE)


@dataclass(frozen=True)
class RoutedGemm:
    """Two routes of a family split by a count (capabilities.MEASURED_COUNTS): for the weight family, `small` for
    products of fewer than `split_rows` rows (decode: the weight's bytes set the time), `large` from there on
    (prefill: the arithmetic does); products of one op call may differ in rows (a prolog's projections do not), so
    each product picks its own. For sparse attention the count is the call's heads (`at`)."""

    small: Gemm
    large: Gemm
    split_rows: int

    @property
    def operand(self) -> torch.dtype:
        return self.large.operand

    @property
    def logits(self) -> RoutedGemm:
        return self

    def for_rows(self, a: Tensor, rows: int) -> Gemm:
        """The route for a product of `rows` rows of `a`: by the rows its GEMM really runs, which an fp32 `a`
        doubles (it enters as two stacked parts on a half-precision route: the split measured in those rows)."""
        half = self.small.operand if self.small.half else self.large.operand  # the routes' half-precision dtype
        parts = 1 if a.dtype == half else 2
        return self.small if rows * parts < self.split_rows else self.large

    def at(self, count: int) -> Gemm:
        """The route for a call whose count (sparse attention's heads) is `count`."""
        return self.small if count < self.split_rows else self.large

    def bmm(self, a: Tensor, b: Tensor, *, output: bool = False) -> Tensor:
        """As Gemm.bmm, on the route for a's rows."""
        return self.for_rows(a, a.shape[1]).bmm(a, b, output=output)

    def linear(self, x: Tensor, weight: Tensor, *, output: bool = False) -> Tensor:
        """As Gemm.linear, on the route for x's rows (all leading dims)."""
        return self.for_rows(x, x.numel() // max(x.shape[-1], 1)).linear(x, weight, output=output)


def from_route(activation: torch.dtype, route: Route) -> Gemm:
    """The Gemm of one route (capabilities.Route) for `activation` operands."""
    if route.name == FP32_NAME:
        return FP32
    if route.name == NATIVE:
        return Gemm(
            activation, True, route.max_work, True, route.isa, route.torch_half, route.outputs_below, route.prefetch
        )
    return Gemm(activation, route.fp32_output, route.max_work)


_forced: dict[str, Gemm | RoutedGemm] = {}


@contextlib.contextmanager
def forced_route(family: str, gemm: Gemm | RoutedGemm) -> Iterator[None]:
    """Run `family`'s products on `gemm` whatever the probe chose (route_workloads times each route this way)."""
    previous = _forced.get(family)
    _forced[family] = gemm
    try:
        yield
    finally:
        if previous is None:
            del _forced[family]
        else:
            _forced[family] = previous


def gemm_for(activation: torch.dtype, device: torch.device, family: str = WEIGHTS) -> Gemm | RoutedGemm:
    """The GEMM path of `family`'s products (capabilities.FAMILIES) whose activations are `activation` on `device`:
    fp32 unless the probe chose a half-precision route for bf16 / fp16 there."""
    if _forced and family in _forced and activation != COMPUTE_DTYPE:
        return _forced[family]
    caps = capabilities(device)
    # The Gemm objects (frozen) of one set of choices: made once, not per call (every op of a decode step asks).
    key = (id(caps), activation, family)
    held = _gemms.get(key)
    if held is not None and held[0] is caps:
        return held[1]
    choice = caps.half_choice(activation, family)
    if choice is None or not choice.use:
        gemm: Gemm | RoutedGemm = FP32
    else:
        small, large = from_route(activation, choice.small), from_route(activation, choice.large)
        gemm = large if small == large else RoutedGemm(small, large, choice.split_rows)
    _gemms[key] = (caps, gemm)  # the choices are held, so that their id cannot name other choices later
    return gemm


_gemms: dict[tuple[int, torch.dtype, str], tuple[object, Gemm | RoutedGemm]] = {}
