"""Input validation shared by every public op.

Public ops validate once, before dispatch, and raise ValueError / TypeError whose message names the argument,
what was expected and what came. Backends never re-validate user input.

Two kinds of checks:
- metadata checks (ndim, shape, dtype, device): always run, cost nothing;
- value checks (index ranges, monotone prefix sums): need the tensor's values, i.e. a device-to-host sync.
  They run in eager mode unless `GLM5_HAL_CHECK_VALUES=0`, and never while tracing (torch.compile, FakeTensor),
  where values do not exist.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from glm5_hal.environment import setting

# Activation dtypes of the quantized ops (dynamic_quant's input, quant_matmul / w4a8_matmul's out_dtype): their
# int8 / int4 codes and fp32 scales are the contract, so a float64 mode would verify nothing there.
ACTIVATION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The float64 verification mode (docs/ops.md): float ops computed end to end in float64, so that model-level
# identities (QuaRot's rotated model == the original) can be checked to ~1e-10. Only backends whose descriptor
# says `float64=True` run it (glm5_hal.selection.check_float64_support).
VERIFICATION_DTYPE = torch.float64
# Activation dtypes every float op (attention, indexer, MoE, Hadamard) accepts.
FLOAT_OP_DTYPES = (*ACTIVATION_DTYPES, VERIFICATION_DTYPE)
# What "fp32 by contract" tensors (RoPE tables, indexer head weights, router logits, routing weights, lse,
# indexer scores) may be: accumulation_dtype of some float-op activation dtype.
ACCUMULATION_DTYPES = (torch.float32, VERIFICATION_DTYPE)
INDEX_DTYPES = (torch.int32,)

Dims = Sequence["int | str | None"]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the tensors that are "fp32 by contract" for activations of `dtype`.

    float32 for bf16 / fp16 / fp32 activations (every backend accumulates in fp32), float64 for float64
    activations (the verification mode: widening any tensor to fp32 would round it and defeat the point).
    """
    return VERIFICATION_DTYPE if dtype == VERIFICATION_DTYPE else torch.float32


def fail(exc: type[Exception], message: str) -> None:
    raise exc(message)


def check(condition: bool, exc: type[Exception], message: Callable[[], str]) -> None:
    """Raise `exc(message())` unless `condition`; the message is built only on failure."""
    if not condition:
        raise exc(message())


def _shape_doc(dims: Dims) -> str:
    return "[" + ", ".join("*" if d is None else str(d) for d in dims) + "]"


def check_tensor(
    name: str,
    t: object,
    dims: Dims,
    dtypes: Sequence[torch.dtype],
    sizes: dict[str, int] | None = None,
) -> torch.Tensor:
    """Check that `t` is a tensor of rank len(dims) with one of `dtypes`.

    `dims` names each dimension: an int (or a symbolic size) is a required size, a str is a symbolic size that
    must agree with `sizes[str]` if already there (and is recorded in `sizes` otherwise), None accepts any size.
    Returns `t`. Sizes stay symbolic under torch.compile, and messages are built only on failure (formatting a
    symbolic size is a graph break).
    """
    # Plain `if`s rather than check(..., lambda: message): this runs for every tensor argument of every op call, and
    # making the message closures cost ~1 us per argument (more once a decode step has evicted the caches).
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        expected = " or ".join(_dtype_name(d) for d in dtypes)
        raise TypeError(f"{name}: expected dtype {expected}, got {_dtype_name(t.dtype)}")
    shape = t.shape
    if len(shape) != len(dims):
        raise ValueError(f"{name}: expected a {len(dims)}-D tensor {_shape_doc(dims)}, got shape {tuple(shape)}")
    for dim, actual in zip(dims, shape):
        if dim is None:
            continue
        if isinstance(dim, str):
            if sizes is None or dim not in sizes:
                if sizes is not None:
                    sizes[dim] = actual
                continue
            expected = sizes[dim]
        else:
            expected = dim
        if actual != expected:
            named = f" with {dim} = {expected}" if isinstance(dim, str) else ""
            raise ValueError(f"{name}: expected shape {_shape_doc(dims)}{named}, got {tuple(shape)}")
    return t


def check_accumulation_tensor(
    name: str,
    t: object,
    dims: Dims,
    activation_dtype: torch.dtype,
    sizes: dict[str, int] | None = None,
) -> torch.Tensor:
    """`check_tensor` for a tensor that is fp32 by contract: its dtype must be accumulation_dtype(activation_dtype).

    On a dtype mismatch the message says why that dtype is expected, e.g. "cos: expected dtype float32 (fp32 by
    contract for bfloat16 activations; float64 only with float64 activations), got float64".
    """
    expected = accumulation_dtype(activation_dtype)
    if isinstance(t, torch.Tensor) and t.dtype != expected:
        if expected == VERIFICATION_DTYPE:
            why = "float64 activations make every fp32-by-contract tensor float64"
        else:
            activations = _dtype_name(activation_dtype)
            why = f"fp32 by contract for {activations} activations; float64 only with float64 activations"
        fail(TypeError, f"{name}: expected dtype {_dtype_name(expected)} ({why}), got {_dtype_name(t.dtype)}")
    return check_tensor(name, t, dims, (expected,), sizes)


def check_optional_tensor(
    name: str, t: object, dims: Dims, dtypes: Sequence[torch.dtype], sizes: dict[str, int] | None = None
) -> torch.Tensor | None:
    return None if t is None else check_tensor(name, t, dims, dtypes, sizes)


def check_same_device(**tensors: torch.Tensor | None) -> torch.device:
    """All tensors on one device; returns it. The message lists every argument's device."""
    device = None
    for t in tensors.values():  # a loop, not a set of devices: this runs on every op call
        if t is None:
            continue
        if device is None:
            device = t.device
        elif t.device != device:
            present = ", ".join(f"{name} on {t.device}" for name, t in tensors.items() if t is not None)
            raise ValueError(f"tensors must be on one device, got {present}")
    if device is None:
        raise ValueError("check_same_device: expected at least one tensor")
    return device


def check_same_dtype(**tensors: torch.Tensor) -> torch.dtype:
    """All tensors of one dtype; returns it."""
    dtypes = {t.dtype for t in tensors.values()}
    check(
        len(dtypes) == 1,
        TypeError,
        lambda: (
            "expected one activation dtype, got "
            + ", ".join(f"{name} {_dtype_name(t.dtype)}" for name, t in tensors.items())
        ),
    )
    return next(iter(dtypes))


def check_positive_int(name: str, value: object, maximum: int | None = None) -> int:
    """A Python int (not a bool) in [1, maximum]; returns it."""
    bound = "" if maximum is None else f" <= {maximum}"
    check(
        isinstance(value, int) and not isinstance(value, bool),
        TypeError,
        lambda: f"{name}: expected a positive int{bound}, got {value!r}",
    )
    check(
        value > 0 and (maximum is None or value <= maximum),  # type: ignore[operator]
        ValueError,
        lambda: f"{name}: expected a positive int{bound}, got {value!r}",
    )
    return int(value)  # type: ignore[arg-type]


def check_finite_float(name: str, value: object, *, positive: bool = False) -> float:
    """A Python int or float (not a bool), finite, and > 0 if `positive`; returns it as a float."""
    what = "a positive float (finite, > 0)" if positive else "a finite float"
    check(
        isinstance(value, (int, float)) and not isinstance(value, bool),
        TypeError,
        lambda: f"{name}: expected {what}, got {value!r}",
    )
    # Comparisons rather than math.isfinite: under torch.compile(dynamic=True) a float argument is symbolic.
    check(
        -math.inf < value < math.inf and (not positive or value > 0),  # type: ignore[operator]
        ValueError,
        lambda: f"{name}: expected {what}, got {value!r}",
    )
    return value if isinstance(value, float) else float(value)  # type: ignore[arg-type]


def check_block_size(cache_name: str, cache: torch.Tensor) -> None:
    """A paged cache [num_blocks, block_size, D] has at least one slot per block (slot = block * block_size + offset
    divides by it)."""
    check(
        cache.shape[1] >= 1,
        ValueError,
        lambda: f"{cache_name}: expected block_size >= 1 in [num_blocks, block_size, D], got {tuple(cache.shape)}",
    )


def check_even(name: str, value: int, what: str) -> None:
    check(value % 2 == 0, ValueError, lambda: f"{name}: expected an even {what}, got {value}")


def value_checks_enabled(*tensors: torch.Tensor) -> bool:
    """Whether checks that read tensor values may run now (eager, not disabled, real tensors)."""
    if setting("GLM5_HAL_CHECK_VALUES", "1") == "0":
        return False
    if torch.compiler.is_compiling():
        return False
    if all(type(t) is torch.Tensor and t.device.type != "meta" for t in tensors):
        return True  # plain tensors (a fake one is a subclass): is_fake's walk costs more than most checks here
    from torch._subclasses.fake_tensor import is_fake

    return not any(is_fake(t) or t.device.type == "meta" for t in tensors)


# Up to this many values, a host tensor's range is read as a Python list: one call (~0.3 us for a decode step's
# slot_mapping) where torch's reductions cost a few microseconds each, on every op of every layer of every step.
HOST_LIST_LIMIT = 64


def value_range(t: torch.Tensor) -> tuple[int, int]:
    """(min, max) of a non-empty integer tensor, as Python ints (a host read)."""
    if t.numel() <= HOST_LIST_LIMIT and t.device.type == "cpu":
        values = t.flatten().tolist()
        return min(values), max(values)
    lo, hi = torch.aminmax(t)
    return int(lo), int(hi)


def check_index_range(name: str, t: torch.Tensor, low: int, high: int, meaning: Callable[[], str]) -> None:
    """Every value of `t` in [low, high) (value check). `meaning()` says what the values are, for the message."""
    if t.numel() == 0 or not value_checks_enabled(t):
        return
    lo, hi = value_range(t)
    check(
        low <= lo and hi < high,
        ValueError,
        lambda: f"{name}: expected values in [{low}, {high}) ({meaning()}), got values in [{lo}, {hi}]",
    )


def check_permutation(name: str, t: torch.Tensor, n: int) -> None:
    """`t` [n] holds every value of 0 .. n-1 exactly once (value check; one host read, after the range check)."""
    check_index_range(name, t, 0, n, lambda: f"a permutation of 0 .. {n - 1}")
    if t.numel() == 0 or not value_checks_enabled(t):
        return
    seen = torch.zeros(n, dtype=torch.int32, device=t.device).index_put_(
        (t.to(torch.int64),), torch.ones_like(t, dtype=torch.int32), accumulate=True
    )
    repeated = int((seen != 1).sum())
    check(
        repeated == 0,
        ValueError,
        lambda: f"{name}: expected a permutation of 0 .. {n - 1}, got {repeated} values missing or repeated",
    )


def check_ragged_layout(
    cu_seqlens_q: torch.Tensor,
    seq_lens_k: torch.Tensor,
    block_table: torch.Tensor,
    num_tokens: int,
    num_blocks: int,
    block_size: int,
) -> None:
    """Values of the token-major ragged batch and its paged KV layout (OPS.md "Conventions").

    cu_seqlens_q starts at 0, never decreases and ends at T; every sequence has at least as many keys as new
    queries (the queries are its last keys); seq_lens_k fits the block table; every block a sequence uses is a
    real block of the cache.
    """
    if not value_checks_enabled(cu_seqlens_q, seq_lens_k, block_table):
        return
    # Python ints for the [B + 1] / [B] values: a decode step's batch is a few requests, and each small torch op
    # here cost more than the check itself (these checks ran on every op of every step).
    cu = cu_seqlens_q.tolist()
    lens_k = seq_lens_k.tolist()
    check(cu[0] == 0, ValueError, lambda: f"cu_seqlens_q: expected cu_seqlens_q[0] == 0, got {cu[0]}")
    q_lens = [end - start for start, end in zip(cu, cu[1:])]
    check(
        all(q >= 0 for q in q_lens),
        ValueError,
        lambda: f"cu_seqlens_q: expected a non-decreasing prefix sum, got {cu}",
    )
    check(
        cu[-1] == num_tokens,
        ValueError,
        lambda: f"cu_seqlens_q: expected cu_seqlens_q[-1] == T = {num_tokens}, got {cu[-1]}",
    )
    capacity = block_table.shape[1] * block_size
    check(
        all(q <= k <= capacity for q, k in zip(q_lens, lens_k)),
        ValueError,
        lambda: (
            f"seq_lens_k: expected q_len[b] <= seq_lens_k[b] <= max_blocks * block_size = {capacity}, "
            f"got seq_lens_k = {lens_k} with q_len = {q_lens}"
        ),
    )
    # Only the blocks a sequence actually uses must be valid; the rest of its row is padding.
    blocks_used = [(k + block_size - 1) // block_size for k in lens_k]
    if len(blocks_used) == 1:  # one sequence (a decode step of one request): its row's first blocks, no mask
        used_ids = block_table[0, : blocks_used[0]]
    else:
        columns = torch.arange(block_table.shape[1], device=block_table.device)
        used = columns[None, :] < torch.tensor(blocks_used, device=block_table.device)[:, None]
        used_ids = block_table[used]
    if used_ids.numel():
        lo, hi = value_range(used_ids)
        check(
            lo >= 0 and hi < num_blocks,
            ValueError,
            lambda: (
                f"block_table: expected block ids in [0, {num_blocks}) for the blocks each sequence uses, "
                f"got ids in [{lo}, {hi}]"
            ),
        )
