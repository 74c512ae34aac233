"""The exact int8 GEMMs torch offers, as routes the capability probe can check and the backends can call.

A route computes acc = x_q [M, K] @ w_q [N, K]^T for int8 codes with an int32 accumulator and hands it back as
fp32 (acc.to(float32), the conversion every quantized op applies before scaling), in two steps:

    prepared = route.prepare(w_q)          # once per weight: it may copy the weight into the kernel's layout
    acc = route.accumulate(x_q, prepared)  # [M, N] fp32 == fp32(int64 math), bit for bit

The accumulator is always a new tensor (never the weight, a cache or an input), so callers scale it in place.

Routes (fastest first where both run; backends.torch_eager.capabilities measures which one wins on a device):
- ONEDNN_U8S8: oneDNN's quantized linear (torch.ops.onednn, the kernels behind torch.compile's x86 int8 path), on
  CPUs. The weight is reordered once into oneDNN's blocked layout (`prepare`, slow: cache it); activations go in as
  u8 = x_q + 128 with zero point 128, which oneDNN removes exactly with a precomputed per-column weight sum. Exact
  where oneDNN runs it on VNNI / AMX dot-product instructions (int32 sums); on CPUs without them it may use 16-bit
  saturating pair sums (AVX2 vpmaddubsw), which is why the probe checks exactness on the device before use.
- NATIVE_VNNI: glm5-hal's own kernel (backends/torch_eager/native/int8_gemm.c) on CPUs with AVX-512 VNNI, u8 x s8 with
  the weight's zero point removed through the activations' row sums (exact modulo 2^32). The weight is copied once into
  panels of 64 columns that the kernel streams sequentially (software prefetch; activations broadcast 4 bytes at a
  time, one output per lane); its W4A8 variant reads int4 weights at 4 bits. The probe measures up to how many rows
  it beats the general route on a weight from memory (backends.torch_eager.capabilities).
- INT_MM: torch._int_mm, cuBLAS on CUDA (M > 16, K and N multiples of 8), oneDNN s8 x s8 on CPUs (any shape). The
  weight needs no preparation; on CPUs oneDNN reorders it on every call, so it trails ONEDNN_U8S8 there.

Nothing here decides whether a route is used: that is backends.torch_eager.capabilities (exactness and speed on the
device).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from backends.torch_eager.native import amx_gemm, int8_gemm

# u8 = s8 + 128: the zero point that maps int8 codes onto oneDNN's unsigned activations without loss.
U8_ZERO_POINT = 128


@dataclass(frozen=True)
class Int8Gemm:
    """One exact int8 GEMM route. `applies(m, k, n)` says whether it takes that shape; `prepare` and `accumulate`
    are described in the module docstring; `caches_weights`: whether `prepare` makes a copy worth keeping per
    weight (False: it returns the weight itself, which callers must not cache)."""

    name: str
    applies: Callable[[int, int, int, torch.device], bool]
    prepare: Callable[[Tensor], object]
    accumulate: Callable[[Tensor, object], Tensor]
    caches_weights: bool


def _onednn_available() -> bool:
    # torch.ops namespaces raise AttributeError / RuntimeError for an op this build lacks.
    try:
        return bool(torch.ops.onednn.qlinear_prepack.default and torch.ops.onednn.qlinear_pointwise.default)
    except (AttributeError, RuntimeError):
        return False


def _onednn_applies(m: int, k: int, n: int, device: torch.device) -> bool:
    return device.type == "cpu" and m > 0 and _onednn_available()


def _onednn_prepare(w_q: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """w_q [N, K] int8 -> (the oneDNN blocked weight, unit per-column scales [N] fp32, zero points [N] int64)."""
    n = w_q.shape[0]
    packed = torch.ops.onednn.qlinear_prepack(w_q.contiguous(), None)
    return packed, torch.ones(n, dtype=torch.float32), torch.zeros(n, dtype=torch.int64)


def _onednn_accumulate(x_q: Tensor, prepared: tuple[Tensor, Tensor, Tensor]) -> Tensor:
    packed, unit_scales, zero_points = prepared
    # x + 128 as u8, exactly (-128..127 -> 0..255): in two's complement that is the byte with its top bit flipped.
    x_u8 = x_q.view(torch.uint8) ^ U8_ZERO_POINT
    # Unit activation, weight and output scales, so the fp32 result is the int32 accumulator converted to fp32.
    return torch.ops.onednn.qlinear_pointwise(
        x_u8, 1.0, U8_ZERO_POINT, packed, unit_scales, zero_points, None, 1.0, 0, torch.float32, "none", [], ""
    )


def _int_mm_applies(m: int, k: int, n: int, device: torch.device) -> bool:
    if device.type == "cuda":  # cuBLAS int8 GEMM constraints checked by torch._int_mm on CUDA
        return m > 16 and k % 8 == 0 and n % 8 == 0
    return m > 0


def _int_mm_accumulate(x_q: Tensor, w_q: Tensor) -> Tensor:
    return torch._int_mm(x_q.contiguous(), w_q.contiguous().T).to(torch.float32)


def _native_applies(m: int, k: int, n: int, device: torch.device) -> bool:
    return device.type == "cpu" and m > 0 and int8_gemm.availability()[0]


def _native_accumulate(x_q: Tensor, prepared: int8_gemm.PanelWeight) -> Tensor:
    return int8_gemm.run_w8a8(x_q, prepared, None, None, None, torch.float32)


def _amx_applies(m: int, k: int, n: int, device: torch.device) -> bool:
    return device.type == "cpu" and m > 0 and amx_gemm.availability()[0]


def _amx_accumulate(x_q: Tensor, prepared: amx_gemm.S8Weight) -> Tensor:
    return amx_gemm.run_s8(x_q, prepared).to(torch.float32)


ONEDNN_U8S8 = Int8Gemm(
    "oneDNN u8 x s8 (prepacked weight)", _onednn_applies, _onednn_prepare, _onednn_accumulate, caches_weights=True
)
INT_MM = Int8Gemm("torch._int_mm", _int_mm_applies, lambda w_q: w_q, _int_mm_accumulate, caches_weights=False)
NATIVE_VNNI = Int8Gemm(
    "glm5-hal native VNNI (u8 x s8, weight in panels)",
    _native_applies,
    int8_gemm.prepare_w8a8,
    _native_accumulate,
    caches_weights=True,
)
AMX_S8 = Int8Gemm(
    "glm5-hal AMX (s8 x s8, weight in tile panels)",
    _amx_applies,
    amx_gemm.prepare_s8,
    _amx_accumulate,
    caches_weights=True,
)
# In order of preference: the probe takes the first exact route that beats fp32 (capabilities._decide_int8). AMX's
# TDPBSSD multiplies s8 x s8 into int32 tiles with no zero-point correction, at 2x VNNI's work per instruction.
ROUTES: tuple[Int8Gemm, ...] = (AMX_S8, ONEDNN_U8S8, NATIVE_VNNI, INT_MM)


def by_name(name: str) -> Int8Gemm:
    """The route called `name` (a KeyError lists the known ones)."""
    for route in ROUTES:
        if route.name == name:
            return route
    raise KeyError(f"int8 GEMM route {name!r}: expected one of {[r.name for r in ROUTES]}")


def exactness_cases(gen: torch.Generator, k: int) -> list[tuple[Tensor, Tensor, Tensor]]:
    """(x_q [M, K], w_q [N, K], want [M, N] fp32 = fp32(exact integer x_q @ w_q^T)) triples that expose an inexact
    int8 GEMM at depth k: all-extreme rows (-128 x -128 and 127 x -128 sum to +-2^14 * k, past int16 and past
    fp32's exact integers), random +-extremes (adjacent products that saturate 16-bit pair sums), and uniform codes;
    M = 1 (GEMV kernels), odd M and N, and shapes cuBLAS takes (M > 16, N a multiple of 8)."""
    extremes = torch.tensor([-128, 127], dtype=torch.int8)

    def pick(shape: tuple[int, int]) -> Tensor:
        return extremes[torch.randint(0, 2, shape, generator=gen)]

    def uniform(shape: tuple[int, int]) -> Tensor:
        return torch.randint(-128, 128, shape, generator=gen, dtype=torch.int8)

    x, w = uniform((5, k)), uniform((17, k))
    x[0], x[1], w[0], w[1] = -128, 127, -128, 127
    x_wide, w_wide = pick((40, k)), pick((24, k))
    x_wide[0], w_wide[0] = -128, -128
    pairs = [(x, w), (pick((5, k)), pick((17, k))), (pick((1, k)), pick((24, k))), (x_wide, w_wide)]
    # float64 holds every such sum exactly (|sum| <= 2^14 * k < 2^53), and its GEMM is fast, unlike int64's.
    return [(x, w, (x.to(torch.float64) @ w.to(torch.float64).T).to(torch.float32)) for x, w in pairs]


def is_exact(route: Int8Gemm, device: torch.device, cases: list[tuple[Tensor, Tensor, Tensor]]) -> tuple[bool, str]:
    """Whether `route` runs on `device` and equals `want` bit for bit on every case of `exactness_cases` whose shape
    it takes (at least one must be), with a reason either way."""
    checked = 0
    try:
        for x_q, w_q, want in cases:
            m, k = x_q.shape
            if not route.applies(m, k, w_q.shape[0], device):
                continue
            got = route.accumulate(x_q.to(device), route.prepare(w_q.to(device))).cpu()
            if not torch.equal(got, want):
                off = int((got != want).sum())
                return False, f"{off} of {want.numel()} accumulators differ from exact integer math at K={k}"
            checked += 1
    except (RuntimeError, NotImplementedError, AttributeError, TypeError) as exc:
        return False, f"does not run here ({str(exc).splitlines()[0][:160]})"
    if not checked:
        return False, "takes none of the exactness check's shapes here"
    return True, f"bit-exact against exact integer math at K={k} with -128/127 codes"
