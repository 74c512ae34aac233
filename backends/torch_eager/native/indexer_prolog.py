"""The lightning indexer's prolog for the few tokens of a decode step in two native calls, on CPUs
(indexer_prolog.c): the three bf16 projections as fp32 sums of exact products, then LayerNorm, RoPE on the leading
dims, the head weights, q rounded to bf16 and the key written to the cache (a bf16 row, or encoded as
glm5_hal.kv_formats.encode_rows encodes it). At decode the torch path is a few dozen small ops whose dispatch costs
more than their arithmetic; this is the same fp32 arithmetic (sums in another order) in two calls.

    q_idx, weights = prolog(x, q_norm, w_iq, w_ik, norm_weight, norm_bias, w_iw, cos, sin, cache, slot_mapping,
                            interleaved=True, eps=1e-6, kv_cache_dtype="fp8_index")
    # x [T, hidden] bf16, q_norm [T, q_lora] bf16 (rows contiguous); w_iq [HI * DI, q_lora], w_ik [DI, hidden],
    #   w_iw [HI, hidden] bf16 (rows contiguous); norm_weight, norm_bias [DI] float; cos, sin [T, rope / 2] float;
    # cache [num_blocks, block_size, DI] bf16 ("auto"), or uint8 [num_blocks, block_size, 132] rows of
    #   "fp8_index" / "int8_index" (DI = 128), written at slot_mapping [T] int64 (-1: not written)
    # -> q_idx [T, HI, DI] bf16, weights [T, HI] fp32 = (x @ w_iw^T) * HI^-0.5 * DI^-0.5

The projections run on torch's intra-op thread count, split by weight rows; the rest is one call. The custom op
torch.ops.glm5_hal.native_indexer_prolog is what aten-level spies, FakeTensor and torch.compile see. The caller
(backends.torch_eager.indexer) takes this path where the weight family's route for the call's rows is the native one
and the call has at most MAX_TOKENS tokens.
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from backends.torch_eager.native import build
from backends.torch_eager.native import threads as threads_
from glm5_hal.checks import check, value_range
from glm5_hal.kv_formats import AUTO, FORMATS
from glm5_hal.ops.common import plain_eager

AVX2 = "avx2"
# kv_cache_dtype -> the kernel's cache code (CACHE_* in indexer_prolog.c); "auto" is a bf16 cache here.
CODES = {AUTO: 0, "fp8_index": 1, "int8_index": 2}
# Tokens this path takes: the kernel reads each weight row once per 4 tokens, so past a decode batch the blocked GEMM
# of the torch path (which reads it once per call) does less memory traffic; a decode step of 16 sequences is
# still one pass of the weights per 4 tokens.
MAX_TOKENS = 16

_L, _P = ctypes.c_long, ctypes.c_void_p
_PROJECT_ARGTYPES = [_L] * 5 + [_P, _L, _P, _L, _P, _L, _P, _L, _P, _L, _P, _L, _L, _L]
_FINISH_ARGTYPES = [_L, _L, _L, _L, ctypes.c_int, _P, _L, _P, _P, ctypes.c_float, _P, _L, _P, _L, ctypes.c_float]
_FINISH_ARGTYPES += [_P, _P, _P, _L, _L, _L, _P, ctypes.c_int]
_ENCODE_ARGTYPES = [_P, _L, _L, _L, ctypes.c_int, _P, _L]


def _kernels(isa: str) -> tuple:
    project = build.function("indexer_prolog", isa, "glm5_indexer_prolog_project", _PROJECT_ARGTYPES)
    finish = build.function("indexer_prolog", isa, "glm5_indexer_prolog_finish", _FINISH_ARGTYPES)
    return project, finish


def availability(isa: str = AVX2) -> tuple[bool, str]:
    """(True, what runs) or (False, why not) for the kernel built for `isa` here (built on first use)."""
    return build.availability("indexer_prolog", isa)


def takes(x: Tensor, q_norm: Tensor, weights: tuple[Tensor, ...], cache: Tensor, kv_cache_dtype: str) -> bool:
    """Whether prolog() takes these arguments (the caller checked the route and the shapes): bf16 activations and
    weights on the CPU, the weights' rows and the cache's rows contiguous (activations of any layout are copied: a
    decode step's are a few KiB), at most MAX_TOKENS tokens, a cache it can write."""
    if x.shape[0] > MAX_TOKENS or x.device.type != "cpu" or kv_cache_dtype not in CODES:
        return False
    if kv_cache_dtype == AUTO and cache.dtype != torch.bfloat16:
        return False
    if kv_cache_dtype != AUTO and FORMATS[kv_cache_dtype].quantized_dims != weights[1].shape[0]:
        return False
    if cache.stride(-1) != 1:
        return False
    activations = x.dtype == q_norm.dtype == torch.bfloat16
    return activations and all(t.dtype == torch.bfloat16 and t.stride(-1) == 1 for t in weights)


def encode(rows: Tensor, kv_cache_dtype: str, *, isa: str = AVX2) -> Tensor:
    """rows [N, 128] fp32 -> uint8 [N, 132] as the prolog's kernel encodes a key row (the same C function), for
    comparing with glm5_hal.kv_formats.encode_rows, whose bytes it must be."""
    check(
        kv_cache_dtype in CODES and kv_cache_dtype != AUTO,
        ValueError,
        lambda: f"kv_cache_dtype: expected one of {tuple(CODES)[1:]}, got {kv_cache_dtype!r}",
    )
    fmt = FORMATS[kv_cache_dtype]
    check(
        rows.dim() == 2 and rows.dtype == torch.float32 and rows.shape[1] == fmt.quantized_dims,
        TypeError,
        lambda: f"rows: expected [N, {fmt.quantized_dims}] fp32, got {tuple(rows.shape)} {rows.dtype}",
    )
    rows = rows.contiguous()
    out = torch.empty(rows.shape[0], fmt.row_bytes, dtype=torch.uint8)
    encoder = build.function("indexer_prolog", isa, "glm5_encode_index_rows", _ENCODE_ARGTYPES)
    code = CODES[kv_cache_dtype]
    encoder(rows.data_ptr(), rows.shape[0], rows.stride(0), rows.shape[1], code, out.data_ptr(), out.stride(0))
    return out


def _run(
    x: Tensor,
    q_norm: Tensor,
    w_iq: Tensor,
    w_ik: Tensor,
    norm_weight: Tensor,
    norm_bias: Tensor,
    w_iw: Tensor,
    cos: Tensor,
    sin: Tensor,
    cache: Tensor,
    slot_mapping: Tensor,
    q_out: Tensor,
    weights_out: Tensor,
    eps: float,
    weight_scale: float,
    interleaved: bool,
    kv_cache_dtype: str,
    isa: str,
    threads: int | None,
) -> None:
    tokens, hidden = x.shape
    heads, dims, q_lora = w_iw.shape[0], w_ik.shape[0], q_norm.shape[1]
    if tokens == 0:
        return
    project, finish = _kernels(isa)
    x, q_norm = x.contiguous(), q_norm.contiguous()
    rows = heads * dims + dims + heads  # the stacked projection's rows: q's, k's, the head weights'
    proj = torch.empty(tokens, rows, dtype=torch.float32)
    args = (tokens, heads, dims, hidden, q_lora, x.data_ptr(), x.stride(0), q_norm.data_ptr(), q_norm.stride(0))
    args += (w_iq.data_ptr(), w_iq.stride(0), w_ik.data_ptr(), w_ik.stride(0), w_iw.data_ptr(), w_iw.stride(0))
    args += (proj.data_ptr(), proj.stride(0))
    flops = 2 * tokens * (heads * dims * q_lora + (dims + heads) * hidden)
    threads_.run_shares(project, args, threads_.split(rows, threads_.thread_count(flops, threads)))
    norm_w = norm_weight.to(torch.float32).contiguous()
    norm_b = norm_bias.to(torch.float32).contiguous()
    cos, sin = cos.to(torch.float32).contiguous(), sin.to(torch.float32).contiguous()
    slots = slot_mapping.to(torch.int64).contiguous()
    item = cache.element_size()  # the kernel addresses the cache in bytes
    args = (tokens, heads, dims, cos.shape[1], int(interleaved), proj.data_ptr(), proj.stride(0))
    args += (norm_w.data_ptr(), norm_b.data_ptr(), eps, cos.data_ptr(), cos.stride(0), sin.data_ptr(), sin.stride(0))
    args += (weight_scale, q_out.data_ptr(), weights_out.data_ptr(), cache.data_ptr(), cache.stride(0) * item)
    args += (cache.stride(1) * item, cache.shape[1], slots.data_ptr(), CODES[kv_cache_dtype])
    finish(*args)


def prolog(
    x: Tensor,
    q_norm: Tensor,
    w_iq: Tensor,
    w_ik: Tensor,
    norm_weight: Tensor,
    norm_bias: Tensor,
    w_iw: Tensor,
    cos: Tensor,
    sin: Tensor,
    cache: Tensor,
    slot_mapping: Tensor,
    *,
    interleaved: bool,
    eps: float,
    kv_cache_dtype: str = AUTO,
    isa: str = AVX2,
    threads: int | None = None,
    validated: bool = False,
) -> tuple[Tensor, Tensor]:
    """(q_idx, weights) as described in the module docstring; the key rows are written into `cache`. isa: the build
    (backends.torch_eager.native.build.ISAS). threads: default torch's. validated: the caller has established what
    this would check of the arguments' kinds and shapes: the torch backend, behind glm5_hal.indexer_prolog's
    validation and `takes` (a decode step otherwise runs every check twice, ~0.03 ms a layer inside an engine). The
    slots are bounded either way: the kernel writes at them, and the op's own range check is a value check that can be
    turned off."""
    heads, dims = w_iw.shape[0], w_ik.shape[0]
    if not validated:  # what the kernel takes: `takes`, and the shapes it reads
        tokens, hidden = x.shape
        check(
            takes(x, q_norm, (w_iq, w_ik, w_iw), cache, kv_cache_dtype),
            TypeError,
            lambda: (
                f"native indexer prolog: expected at most {MAX_TOKENS} tokens, bf16 CPU activations and weights (their "
                f"rows contiguous) and a bf16 or {tuple(CODES)[1:]} cache with contiguous rows, got {tokens} tokens, "
                f"x {x.dtype}, cache {cache.dtype} ({kv_cache_dtype})"
            ),
        )
        shapes = {
            "q_norm": (q_norm, (tokens, q_norm.shape[1])),
            "w_iq": (w_iq, (heads * dims, q_norm.shape[1])),
            "w_ik": (w_ik, (dims, hidden)),
            "w_iw": (w_iw, (heads, hidden)),
            "norm_weight": (norm_weight, (dims,)),
            "norm_bias": (norm_bias, (dims,)),
            "cos": (cos, (tokens, cos.shape[-1])),
            "sin": (sin, (tokens, cos.shape[-1])),
            "slot_mapping": (slot_mapping, (tokens,)),
        }
        for name, (t, shape) in shapes.items():
            check(
                tuple(t.shape) == shape,
                ValueError,
                lambda n=name, t=t, s=shape: f"{n}: expected {s}, got {tuple(t.shape)}",
            )
        check(
            2 * cos.shape[-1] <= dims,
            ValueError,
            lambda: f"cos, sin: expected [{tokens}, at most {dims // 2}], got {tuple(cos.shape)}",
        )
        row_width = dims if kv_cache_dtype == AUTO else FORMATS[kv_cache_dtype].row_bytes
        check(
            cache.dim() == 3 and cache.shape[2] == row_width,
            ValueError,
            lambda: f"cache: expected [num_blocks, block_size, {row_width}], got {tuple(cache.shape)}",
        )
    tokens = x.shape[0]
    if tokens:  # the kernel writes at these slots: one out of the cache would write past it
        lowest, highest = value_range(slot_mapping)
        slots = cache.shape[0] * cache.shape[1]
        check(
            lowest >= -1 and highest < slots,
            ValueError,
            lambda: f"slot_mapping: expected -1 or a slot of the {slots}-slot cache, got {slot_mapping.tolist()}",
        )
    q_out = torch.empty(tokens, heads, dims, dtype=torch.bfloat16)
    weights_out = torch.empty(tokens, heads, dtype=torch.float32)
    weight_scale = heads**-0.5 * dims**-0.5
    # The build is an argument of the op: torch.compile and FakeTensor see every build. In plain eager mode nothing
    # would see the op: its implementation runs directly (torch's dispatch costs more than a decode step's prolog).
    if threads is None and not plain_eager((x, q_norm, w_iq, cache)):
        torch.ops.glm5_hal.native_indexer_prolog(
            x, q_norm, w_iq, w_ik, norm_weight, norm_bias, w_iw, cos, sin, cache, slot_mapping, q_out, weights_out,
            eps, weight_scale, interleaved, kv_cache_dtype, isa,
        )  # fmt: skip
    else:
        _run(
            x, q_norm, w_iq, w_ik, norm_weight, norm_bias, w_iw, cos, sin, cache, slot_mapping, q_out, weights_out,
            eps, weight_scale, interleaved, kv_cache_dtype, isa, threads,
        )  # fmt: skip
    return q_out, weights_out


_LIBRARY = torch.library.Library("glm5_hal", "FRAGMENT")
_LIBRARY.define(
    "native_indexer_prolog(Tensor x, Tensor q_norm, Tensor w_iq, Tensor w_ik, Tensor norm_weight, Tensor norm_bias, "
    "Tensor w_iw, Tensor cos, Tensor sin, Tensor(a!) cache, Tensor slot_mapping, Tensor(b!) q_out, "
    f"Tensor(c!) weights_out, float eps, float weight_scale, bool interleaved, str kv_cache_dtype, str isa='{AVX2}') "
    "-> ()"
)


def _cpu_op(
    x: Tensor,
    q_norm: Tensor,
    w_iq: Tensor,
    w_ik: Tensor,
    norm_weight: Tensor,
    norm_bias: Tensor,
    w_iw: Tensor,
    cos: Tensor,
    sin: Tensor,
    cache: Tensor,
    slot_mapping: Tensor,
    q_out: Tensor,
    weights_out: Tensor,
    eps: float,
    weight_scale: float,
    interleaved: bool,
    kv_cache_dtype: str,
    isa: str = AVX2,  # the dispatcher passes only the arguments the caller gave
) -> None:
    _run(
        x, q_norm, w_iq, w_ik, norm_weight, norm_bias, w_iw, cos, sin, cache, slot_mapping, q_out, weights_out,
        eps, weight_scale, interleaved, kv_cache_dtype, isa, None,
    )  # fmt: skip


_LIBRARY.impl("native_indexer_prolog", _cpu_op, "CPU")


@torch.library.register_fake("glm5_hal::native_indexer_prolog")
def _fake(*args: object) -> None:
    return None  # the op only writes its mutable arguments (cache, q_out, weights_out)
