"""Pieces every public op shares: the custom-op registration and the call that skips it in plain eager mode,
dispatch to the selected backend, and the paged ragged-batch checks."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import TypeVar

import torch
from torch.library import CustomOpDef

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

Body = TypeVar("Body", bound=Callable[..., object])

# Each public op's custom op -> the function it wraps (its body), for call_op.
_BODIES: dict[CustomOpDef, Callable[..., object]] = {}

# Tensor types whose calls nothing intercepts (nn.Parameter disables __torch_function__).
_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


def custom_op(
    name: str, mutates_args: tuple[str, ...] = (), namespace: str = NAMESPACE
) -> Callable[[Body], CustomOpDef]:
    """Register `body` as the custom op torch.ops.<namespace>.<name> (torch.library.custom_op), remembering the body
    so that call_op can run it without the op's dispatch in plain eager mode."""

    def register(body: Body) -> CustomOpDef:
        # The schema from the body itself: its annotations resolve in its own module.
        schema = torch.library.infer_schema(body, mutates_args=mutates_args)
        op = torch.library.custom_op(f"{namespace}::{name}", mutates_args=mutates_args, schema=schema)(
            _without_autocast(body)
        )
        _BODIES[op] = body
        return op

    return register


def _without_autocast(body: Body) -> Body:
    """`body` run with autocast off. Why: a custom op has no autocast rule of its own, so under `torch.autocast` the
    dispatcher falls through to the body with autocast still on, and the body's own fp32 GEMMs (the chunked-fp32
    int8 route, fp32 accumulations) would silently run in bf16. The ops define their output dtypes themselves."""

    @functools.wraps(body)
    def run(*args: object) -> object:
        if not _autocast():
            return body(*args)
        with torch._C._DisableAutocast():
            return body(*args)

    return run  # type: ignore[return-value]


def call_op(op: CustomOpDef, *args: object) -> object:
    """Run the public op's custom op `op` on validated arguments: its body directly in plain eager mode, else the op.

    Why: the custom op exists for what sees the dispatcher (torch.compile / export / make_fx, fake tensors,
    functionalization, vmap, autocast, the profiler's op names, tensor subclasses). In plain eager mode it only
    adds torch's Python layers around the body: ~0.015 ms per call with warm caches and ~0.18 ms once a decode
    step's weights have evicted them (measured on quant_matmul at GLM-5's kv_a_proj, 4 tokens, on a CPU), which is
    more than the int8 GEMM itself. The body is the same function either way, so the results are the same tensors.
    """
    if plain_eager(args):
        return _BODIES[op](*args)
    return op(*args)


# What plain_eager asks, bound once: each module attribute chain (torch._C._functorch...) costs dictionary
# lookups in memory a decode step has evicted from the caches, on every op call.
_is_compiling = torch.compiler.is_compiling
_dispatch_modes = torch._C._len_torch_dispatch_stack
_function_modes = torch._C._len_torch_function_stack
_functorch_transform = torch._C._functorch.peek_interpreter_stack
_autocast = torch._C._is_any_autocast_enabled
_grad_enabled = torch.is_grad_enabled
_profiler = torch.autograd.profiler  # its _is_profiler_enabled flag changes: read it on every call


def plain_eager(args: tuple[object, ...]) -> bool:
    """True when nothing would intercept a custom op called with `args`, so that its implementation may run directly
    (call_op's case; backends ask it for their own torch.library ops): not compiling, no dispatch / function mode,
    no functorch transform, no autocast, no profiler, and only plain tensors of which none needs grad (the ops
    define no backward: the op, not the body, is what reports that)."""
    if _is_compiling():  # first: dynamo must not trace the torch._C queries below
        return False
    if (
        _dispatch_modes()  # FakeTensorMode, make_fx, functionalization, user modes
        or _function_modes()  # `with torch.device(...)` and user function modes
        or _functorch_transform() is not None  # vmap / grad / functionalize
        or _autocast()
        or _profiler._is_profiler_enabled
    ):
        return False
    grad = _grad_enabled()
    for arg in args:
        if isinstance(arg, torch.Tensor) and (type(arg) not in _PLAIN_TENSOR_TYPES or (grad and arg.requires_grad)):
            return False
    return True


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
