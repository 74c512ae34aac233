"""The absorbed up-projections of glm5-hal's MLA layers in vLLM: which product multiplies q_nope by W_UK and the
latent attention output by W_UV at every step, and the weights' layout for it.

vLLM's MLA layer (MLAAttention) makes these two batched products itself, around the backend's forward_mqa:
q_nope [heads, tokens, qk_nope] x W_UK_T [heads, qk_nope, kv_lora] and latent [heads, tokens, kv_lora] x W_UV
[heads, kv_lora, v_head]. At a decode token each is one row per head against the whole weight, so its time is the
weight's bytes plus the product's own overhead. Two routes, the same values:

- `PACKED`: vLLM's CPU batched GEMM (`torch.ops._C.bmm_cpu`, the kernel vLLM's own AMX MLA backend uses for these
  products) over copies of the weights packed once by `torch.ops._C.convert_weight_packed`. MLAAttention takes it
  where the layer's `is_amx_bmm_enabled` is set, reading the packed weights from the attention impl; W_UK_T / W_UV
  are then dropped (vLLM derives them again from kv_b_proj on a reload).
- `BMM`: torch.bmm over W_UK_T / W_UV stored with the contracted dim contiguous (contract_along_contiguous_dims).

The route is chosen once per process and per (dtype, dims) by `choose_route`: packed only where vLLM's build has the
kernels, they run on this CPU for these dims (they refuse dims that are not multiples of 32, and fp16 without
AMX-FP16), their product agrees with an fp64 one within bf16 / fp16 rounding, and, unless
GLM5_HAL_VLLM_PACKED_UP_PROJ=1 says to take it wherever that holds, it is faster than torch.bmm at a decode token
(measured here: interleaved, the best of PROBE_REPS each). GLM5_HAL_VLLM_PACKED_UP_PROJ=0 keeps torch.bmm. fp32
weights always keep vLLM's torch.bmm in vLLM's layout: fp32 tokens are compared bit for bit with glm5-hal's.

Measured on an AMD EPYC Zen 4 (AVX-512 BF16, no AMX), one thread, 4 heads, bf16, one token: W_UV (512 x 256 a head)
18 against 58 us warm and 98-115 against 216-296 us with the LLC overwritten; W_UK_T (192 x 512) 14 against 47 us
warm; the same bits. At 64 to 2048 tokens packed is 1.03-1.12x as fast (docs/vllm.md).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from glm5_hal.environment import setting
from glm5_hal.vllm.settings import LOGGER, OFF, ON

logger = logging.getLogger(LOGGER)

PACKED_ENV = "GLM5_HAL_VLLM_PACKED_UP_PROJ"
AUTO = "auto"
_SETTINGS = (AUTO, ON, OFF)

PACKED, BMM = "packed", "bmm"
# vLLM's MLA layer's names of the two weights (W_UK_T [heads, qk_nope, kv_lora], W_UV [heads, kv_lora, v_head]).
UP_PROJECTIONS = ("W_UK_T", "W_UV")
HALF_DTYPES = (torch.bfloat16, torch.float16)
PROBE_REPS = 20  # timed calls of each route, interleaved; the best of each is compared
PROBE_TOKENS = (1, 5)  # token counts the packed product's values are checked at (a decode token, a ragged few)


@dataclass(frozen=True)
class UpProjectionShape:
    """One MLA layer's up-projections: heads, qk_nope (W_UK's input), kv_lora, v_head (W_UV's output), dtype."""

    heads: int
    qk_nope: int
    kv_lora: int
    v_head: int
    dtype: torch.dtype

    def describe(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return f"{dtype}, {self.heads} heads, qk_nope {self.qk_nope}, kv_lora {self.kv_lora}, v_head {self.v_head}"


@dataclass(frozen=True)
class RouteChoice:
    """The route for a shape and the sentence saying why."""

    route: str
    reason: str


@dataclass(frozen=True)
class PackedKernels:
    """vLLM's CPU batched GEMM and its weight packing: pack(w [b, out, in]) -> packed; bmm(out [b, m, out],
    x [b, m, in], packed, is_vnni, scale) writes out[b] = x[b] @ w[b]^T."""

    pack: Callable[[Tensor], Tensor]
    bmm: Callable[..., None]


def packed_setting() -> str:
    """GLM5_HAL_VLLM_PACKED_UP_PROJ: "auto" (unset or empty too), "1" or "0"; a ValueError names any other value."""
    value = setting(PACKED_ENV, AUTO).strip().lower() or AUTO
    if value not in _SETTINGS:
        raise ValueError(f"{PACKED_ENV}: expected one of {_SETTINGS}, got {value!r}")
    return value


def vllm_packed_kernels() -> PackedKernels | None:
    """vLLM's bmm_cpu and convert_weight_packed where this vLLM build registers them (its CPU builds with the SGL
    kernels), else None."""
    try:
        namespace = torch.ops._C
        return PackedKernels(pack=namespace.convert_weight_packed, bmm=namespace.bmm_cpu)
    except (AttributeError, RuntimeError):
        return None


def within_rounding(out: Tensor, x: Tensor, w: Tensor) -> bool:
    """Whether out [b, m, out_dim] is x [b, m, in] @ w[b]^T (w [b, out_dim, in]) up to the output's rounding to
    bf16 / fp16 and an fp32 sum of `in` products: |out - exact| <= 2^-8 |exact| + in x 2^-23 (|x| @ |w|), exact in
    fp64 (NaN anywhere in out fails)."""
    x64, w64 = x.double(), w.double()
    exact, magnitude = torch.bmm(x64, w64.mT), torch.bmm(x64.abs(), w64.abs().mT)
    bound = 2.0**-8 * exact.abs() + x.shape[-1] * 2.0**-23 * magnitude
    return bool(((out.double() - exact).abs() <= bound).all())


def packed_product_error(kernels: PackedKernels, shape: UpProjectionShape, seed: int = 0) -> str:
    """Why the packed kernels cannot take these up-projections ("" if they can): an error they raise, or a product
    outside `within_rounding`'s bound, at each of PROBE_TOKENS on random operands."""
    generator = torch.Generator().manual_seed(seed)
    # W_UK as the kernel takes it ([heads, kv_lora, qk_nope]: out x in) and W_UV ([heads, v_head, kv_lora])
    for name, (out_dim, in_dim) in (("W_UK", (shape.kv_lora, shape.qk_nope)), ("W_UV", (shape.v_head, shape.kv_lora))):
        w = torch.randn(shape.heads, out_dim, in_dim, generator=generator).to(shape.dtype)
        try:
            packed = kernels.pack(w)
            for tokens in PROBE_TOKENS:
                x = torch.randn(tokens, shape.heads, in_dim, generator=generator).to(shape.dtype).transpose(0, 1)
                out = torch.full((tokens, shape.heads, out_dim), float("nan"), dtype=shape.dtype)
                kernels.bmm(out.transpose(0, 1), x, packed, True, None)
                if not within_rounding(out.transpose(0, 1), x, w):
                    return f"vLLM's bmm_cpu disagreed with an fp64 {name} product (token count {tokens})"
        except (RuntimeError, ValueError, TypeError) as exc:
            said = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            return f"vLLM's packed kernels refused {name}: {said}"
    return ""


def _decode_seconds(kernels: PackedKernels, shape: UpProjectionShape) -> tuple[float, float]:
    """The best of PROBE_REPS interleaved timings of both products at one decode token: (torch.bmm over the compact
    layout, the packed kernels)."""
    generator = torch.Generator().manual_seed(1)
    dims = ((shape.kv_lora, shape.qk_nope), (shape.v_head, shape.kv_lora))
    weights = [torch.randn(shape.heads, o, i, generator=generator).to(shape.dtype) for o, i in dims]
    packed = [kernels.pack(w) for w in weights]
    xs = [torch.randn(1, shape.heads, i, generator=generator).to(shape.dtype).transpose(0, 1) for _, i in dims]
    outs = [torch.empty(1, shape.heads, o, dtype=shape.dtype).transpose(0, 1) for o, _ in dims]

    def with_bmm() -> None:
        for x, w, out in zip(xs, weights, outs, strict=True):
            torch.bmm(x, w.mT, out=out)

    def with_packed() -> None:
        for x, p, out in zip(xs, packed, outs, strict=True):
            kernels.bmm(out, x, p, True, None)

    best = {with_bmm: float("inf"), with_packed: float("inf")}
    for call in best:
        call()  # first-call setup is not speed
    for _ in range(PROBE_REPS):
        for call in best:
            start = time.perf_counter()
            call()
            best[call] = min(best[call], time.perf_counter() - start)
    return best[with_bmm], best[with_packed]


_choices: dict[tuple[str, UpProjectionShape], RouteChoice] = {}


def choose_route(shape: UpProjectionShape, kernels: PackedKernels | None = None) -> RouteChoice:
    """The route for one layer's up-projections (module docstring); measured once per process per setting and
    shape, and logged then. kernels: vLLM's (the default) or a stand-in (tests)."""
    mode = packed_setting()
    key = (mode, shape)
    if kernels is None and key in _choices:
        return _choices[key]
    found = kernels if kernels is not None else vllm_packed_kernels()
    choice = _decide(mode, shape, found)
    if kernels is None:
        _choices[key] = choice
        logger.info("glm5-hal vLLM plugin: absorbed up-projections (%s): %s", shape.describe(), choice.reason)
    return choice


def _decide(mode: str, shape: UpProjectionShape, kernels: PackedKernels | None) -> RouteChoice:
    if mode == OFF:
        return RouteChoice(BMM, f"torch.bmm ({PACKED_ENV}=0)")
    if shape.dtype not in HALF_DTYPES:
        return RouteChoice(BMM, "torch.bmm in vLLM's layout (fp32 tokens are compared bit for bit with glm5-hal's)")
    if kernels is None:
        return RouteChoice(BMM, "torch.bmm (this vLLM build has no bmm_cpu / convert_weight_packed)")
    error = packed_product_error(kernels, shape)
    if error:
        return RouteChoice(BMM, f"torch.bmm ({error})")
    if mode == ON:
        return RouteChoice(PACKED, f"vLLM's bmm_cpu over packed weights ({PACKED_ENV}=1)")
    bmm_s, packed_s = _decode_seconds(kernels, shape)
    timing = f"one decode token, both products: {packed_s * 1e6:.0f} us packed, {bmm_s * 1e6:.0f} us torch.bmm"
    if packed_s < bmm_s:
        return RouteChoice(PACKED, f"vLLM's bmm_cpu over packed weights ({timing})")
    return RouteChoice(BMM, f"torch.bmm ({timing})")


def layer_shape(attn: Any) -> UpProjectionShape | None:
    """The up-projections' shape of vLLM's MLA layer `attn` after its own weight processing (None where it holds no
    3-D CPU W_UK_T / W_UV, e.g. a platform whose MLA layer keeps other weights)."""
    w_uk, w_uv = (getattr(attn, name, None) for name in UP_PROJECTIONS)
    if not all(isinstance(w, Tensor) and w.dim() == 3 and w.device.type == "cpu" for w in (w_uk, w_uv)):
        return None
    heads, qk_nope, kv_lora = w_uk.shape
    return UpProjectionShape(heads, qk_nope, kv_lora, w_uv.shape[-1], w_uk.dtype)


def contract_along_contiguous_dims(attn: Any) -> None:
    """Store attn's half-precision up-projections on the CPU as compact [heads, out, reduction] tensors viewed as
    [heads, reduction, out]: the dim torch.bmm contracts (-2) contiguous and each head's matrix right after the
    previous one. The same values in another layout. vLLM copies W_UK_T into a contiguous [heads, qk_nope, kv_lora]
    parameter, whose contracted dim is strided: torch's CPU bf16 bmm took ~5x longer over it at one decode token
    (0.59 against 0.11 ms for 4 heads x 192 x 512 on an AVX2 Zen 3). W_UV is a view into kv_b_proj's rows, contracted
    dim contiguous but heads 448 rows apart instead of 256: the bmm took 10x longer over it (0.55 against 0.054 ms
    for 4 heads x 512 x 256, Zen 4; docs/vllm.md#speed). fp32 weights keep vLLM's layout (fp32 tokens are compared
    bit for bit with glm5-hal's, and a new layout may change the order of a GEMM's sums)."""
    for name in UP_PROJECTIONS:
        weight = getattr(attn, name, None)
        if not isinstance(weight, Tensor) or weight.dim() != 3 or weight.dtype not in HALF_DTYPES:
            continue
        if weight.device.type != "cpu" or weight.mT.is_contiguous():
            continue
        # A reload copies into the parameter in place (vLLM's replace_parameter with prefer_copy), whatever its layout.
        setattr(attn, name, torch.nn.Parameter(weight.detach().mT.contiguous().mT, requires_grad=False))


def use_packed(attn: Any, kernels: PackedKernels) -> None:
    """Give attn's impl the packed copies of W_UK_T / W_UV that MLAAttention's packed route reads
    (`_w_uk_packed` [heads, kv_lora, qk_nope], `_w_uv_packed` [heads, v_head, kv_lora], no scale), set the route
    and drop the unpacked weights."""
    impl = attn.impl
    impl._w_uk_packed = kernels.pack(attn.W_UK_T.detach().mT.contiguous())
    impl._w_uv_packed = kernels.pack(attn.W_UV.detach().mT.contiguous())
    impl._w_scale = None
    for name in UP_PROJECTIONS:
        setattr(attn, name, None)
    attn.is_amx_bmm_enabled = True


def route_after_loading(attn: Any) -> None:
    """Choose the up-projections' route of vLLM's MLA layer `attn` each time its weights are processed (the first
    load and every reload): attn's own process_weights_after_loading first, on vLLM's torch.bmm route, which derives
    W_UK_T / W_UV from kv_b_proj; then the chosen route's layout."""
    own = attn.process_weights_after_loading

    def process_weights_after_loading(act_dtype: torch.dtype) -> None:
        attn.is_amx_bmm_enabled = False  # vLLM's processing skips W_UK_T / W_UV (and drops kv_b_proj) when set
        own(act_dtype)
        shape, kernels = layer_shape(attn), vllm_packed_kernels()
        if shape is not None and kernels is not None and choose_route(shape).route == PACKED:
            use_packed(attn, kernels)
        else:
            contract_along_contiguous_dims(attn)

    attn.process_weights_after_loading = process_weights_after_loading
