"""Which backend runs an op: environment variables, a per-op override, a context manager, `auto`, fallback.

Precedence for one call of op `op` on device type `dev` (first that applies):
  1. the innermost `use_backend(...)` context naming `op` (or naming no ops);
  2. `set_backend(name, op=op)` / `set_backend(name)` made in this process;
  3. `GLM5_HAL_OP_BACKENDS="op=name,op2=name2"` (bisecting a parity failure one op at a time);
  4. `GLM5_HAL_BACKEND=name`, default `auto`.
`auto` picks, among the available backends that run on `dev` and implement `op` natively, the one with the
highest `auto_priority`, and can say why (`explain`). A named backend that lacks `op` falls back to `torch`
with a one-time warning, or raises `OpNotImplementedError` in strict mode (`GLM5_HAL_STRICT=1` or
`use_backend(..., strict=True)`).
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from glm5_hal.environment import parsed_setting
from glm5_hal.registry import ALL_OP_NAMES, registry

ENV_BACKEND = "GLM5_HAL_BACKEND"
ENV_OP_BACKENDS = "GLM5_HAL_OP_BACKENDS"
ENV_STRICT = "GLM5_HAL_STRICT"
AUTO = "auto"
FALLBACK_BACKEND = "torch"


class BackendError(RuntimeError):
    """Base class of backend selection errors."""


class BackendNotFoundError(BackendError, ValueError):
    """A backend name that no installed package registers."""


class BackendUnavailableError(BackendError):
    """A known backend whose device or library is missing here."""


class OpNotImplementedError(BackendError, NotImplementedError):
    """The selected backend lacks the op and strict mode forbids the fallback."""


class Float64UnsupportedError(BackendError, TypeError):
    """float64 inputs (the verification mode) reached a backend whose descriptor lacks `float64=True`."""


@dataclass(frozen=True)
class _Override:
    backend: str
    ops: frozenset[str] | None  # None = every op
    strict: bool | None


@dataclass(frozen=True)
class Resolution:
    """The outcome of selection for one (op, device type): who runs it and why."""

    op: str
    device_type: str
    requested: str  # what the user asked for: a name or "auto"
    backend: str  # who runs it
    implementation: Callable
    reason: str
    fallback: bool = False  # the requested backend lacks the op, so torch runs it (with a one-time warning)


_context: contextvars.ContextVar[tuple[_Override, ...]] = contextvars.ContextVar("glm5_hal_backend", default=())
_process_default: str | None = None
_process_per_op: dict[str, str] = {}
_warned: set[tuple[str, str]] = set()
_warn_lock = threading.Lock()


def _check_op_names(ops: Iterable[str]) -> frozenset[str]:
    ops = frozenset(ops)
    unknown = sorted(ops - set(ALL_OP_NAMES))
    if unknown:
        raise ValueError(f"ops: expected op names from {list(ALL_OP_NAMES)}, got unknown {unknown}")
    return ops


def set_backend(name: str | None, *, op: str | None = None) -> None:
    """Select `name` for every op (or only for `op`) in this process; None clears that setting."""
    global _process_default
    if name is not None and name != AUTO:
        _require_known(name)
    if op is None:
        _process_default = name
    else:
        _check_op_names([op])
        if name is None:
            _process_per_op.pop(op, None)
        else:
            _process_per_op[op] = name


@contextlib.contextmanager
def use_backend(name: str, *, ops: Iterable[str] | None = None, strict: bool | None = None) -> Iterator[None]:
    """Run the body with `name` selected (for `ops` only, if given); `strict=True` forbids fallbacks.

    >>> with glm5_hal.use_backend("reference", ops=["sparse_flash_attention"]):
    ...     out, lse = glm5_hal.sparse_flash_attention(...)
    """
    if name != AUTO:
        _require_known(name)
    override = _Override(name, None if ops is None else _check_op_names(ops), strict)
    token = _context.set(_context.get() + (override,))
    try:
        yield
    finally:
        _context.reset(token)


def _parse_per_op(value: str) -> dict[str, str]:
    spec = value.strip()
    table: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        op, sep, name = item.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"{ENV_OP_BACKENDS}: expected 'op=backend[,op=backend]', got {spec!r}")
        _check_op_names([op.strip()])
        table[op.strip()] = name.strip()
    return table


def _env_per_op() -> dict[str, str]:
    return parsed_setting(ENV_OP_BACKENDS, _parse_per_op)


def _parse_flag(value: str) -> bool:
    return value.strip().lower() in ("1", "true", "yes", "on")


def _parse_backend(value: str) -> str:
    return value.strip() or AUTO


def requested_backend(op: str) -> tuple[str, bool]:
    """(backend name or "auto", strict) that applies to `op` now, before availability is considered."""
    overrides = _context.get()
    strict = next((o.strict for o in reversed(overrides) if o.strict is not None), None)
    if strict is None:
        strict = parsed_setting(ENV_STRICT, _parse_flag)
    for override in reversed(overrides):
        if override.ops is None or op in override.ops:
            return override.backend, strict
    if op in _process_per_op:
        return _process_per_op[op], strict
    if _process_default is not None:
        return _process_default, strict
    per_op = _env_per_op()
    if op in per_op:
        return per_op[op], strict
    return parsed_setting(ENV_BACKEND, _parse_backend), strict


def _describe_others(exclude: str) -> str:
    reg = registry()
    lines = []
    for name in reg.names():
        if name == exclude:
            continue
        avail = reg.availability(name)
        state = "available" if avail.available else "unavailable"
        lines.append(f"  {name}: {state} ({avail.reason})")
    return "\n".join(lines)


def _require_known(name: str) -> None:
    if name not in registry().names():
        raise BackendNotFoundError(
            f"{ENV_BACKEND}: unknown backend {name!r}; expected 'auto' or one of:\n{_describe_others(name)}"
        )


def _implementation(name: str, op: str) -> Callable | None:
    return registry().ops(name).get(op)


def _resolve_auto(op: str, device_type: str) -> Resolution:
    reg = registry()
    candidates = []
    skipped = []
    for name in reg.names():
        backend = reg.get(name)
        avail = reg.availability(name)
        if backend is None or not avail.available:
            skipped.append(f"{name}: {avail.reason}")
        elif backend.auto_priority is None:
            skipped.append(f"{name}: only when named explicitly")
        elif not avail.auto_eligible:
            skipped.append(f"{name}: only when named explicitly here ({avail.reason})")
        elif not avail.runs_on(device_type):
            skipped.append(f"{name}: does not run on {device_type} (runs on {', '.join(avail.device_types)})")
        elif _implementation(name, op) is None:
            skipped.append(f"{name}: does not implement {op}")
        else:
            candidates.append((backend.auto_priority, name))
    if not candidates:
        raise BackendUnavailableError(
            f"auto: no available backend runs {op} on device type {device_type!r}:\n  " + "\n  ".join(skipped)
        )
    _, best = max(candidates)
    others = [name for _, name in sorted(candidates, reverse=True) if name != best]
    reason = f"auto picked {best!r} for {op} on {device_type}"
    if others:
        reason += f" (ahead of {', '.join(others)})"
    if skipped:
        reason += "; not considered: " + "; ".join(skipped)
    return Resolution(op, device_type, AUTO, best, reg.ops(best)[op], reason)


def _resolve_named(op: str, device_type: str, name: str, strict: bool) -> Resolution:
    reg = registry()
    _require_known(name)
    avail = reg.availability(name)
    if not avail.available:
        raise BackendUnavailableError(
            f"{ENV_BACKEND}: backend {name!r} is unavailable here: {avail.reason}\nother backends:\n"
            + _describe_others(name)
        )
    if not avail.runs_on(device_type):
        raise BackendUnavailableError(
            f"backend {name!r} runs on device types {list(avail.device_types)}, but the inputs of {op} are on "
            f"{device_type!r}; move the tensors or select another backend"
        )
    impl = _implementation(name, op)
    if impl is not None:
        return Resolution(op, device_type, name, name, impl, f"{name!r} selected explicitly")
    backend = reg.get(name)
    delegate = backend.delegates.get(op) if backend is not None else None
    target = delegate or FALLBACK_BACKEND
    if delegate is None and strict:
        raise OpNotImplementedError(
            f"backend {name!r} does not implement {op} and strict mode ({ENV_STRICT}=1) forbids falling back "
            f"to {FALLBACK_BACKEND!r}"
        )
    fallback = _resolve_named(op, device_type, target, strict=True)
    if delegate is None:
        with _warn_lock:
            if (name, op) not in _warned:
                _warned.add((name, op))
                warnings.warn(
                    f"glm5_hal: backend {name!r} does not implement {op}; falling back to {target!r} "
                    f"(set {ENV_STRICT}=1 to make this an error)",
                    RuntimeWarning,
                    stacklevel=4,
                )
        reason = f"{name!r} lacks {op}: fell back to {target!r}"
    else:
        reason = f"{name!r} runs {op} through {target!r} on its device"
    return Resolution(op, device_type, name, fallback.backend, fallback.implementation, reason, delegate is None)


# Resolutions by (op, device type, requested backend, strict), with the registry and the generation they were made
# at: every op call resolves its backend, and building the answer (probing each backend's state, the reason string)
# cost ~30-40 us per call, as much as a whole small op. Availability is probed once per registry generation anyway,
# so the answer can only change when the generation does. A fallback to torch is not kept: its one-time warning is
# issued where it is built.
_resolutions: dict[tuple[str, str, str, bool], tuple[object, int, Resolution]] = {}


def resolve(op: str, device_type: str) -> Resolution:
    """Who runs `op` for inputs on `device_type` under the current settings, and why."""
    name, strict = requested_backend(op)
    reg = registry()
    key = (op, device_type, name, strict)
    cached = _resolutions.get(key)
    if cached is not None and cached[0] is reg and cached[1] == reg.generation:
        return cached[2]
    generation = reg.generation  # read before building: a change while building leaves a stale entry unused
    if name == AUTO:
        resolution = _resolve_auto(op, device_type)
    else:
        resolution = _resolve_named(op, device_type, name, strict)
    if not resolution.fallback:
        _resolutions[key] = (reg, generation, resolution)
    return resolution


def float64_backends() -> list[str]:
    """The registered backends that run the float64 verification mode (`Backend.float64`), loadable or not."""
    reg = registry()
    return [name for name in reg.names() if (backend := reg.get(name)) is not None and backend.float64]


def check_float64_support(resolution: Resolution) -> None:
    """Refuse float64 inputs unless the backend that runs `resolution.op` supports the float64 verification mode.

    Called by the public ops' shared dispatch path only when an argument is float64, so the bf16/fp16/fp32 path
    never pays for it. A backend without support would upcast to fp32 (or worse) and silently lose the precision
    the mode exists for, hence an error (TypeError: the dtype is what the backend cannot take).
    """
    backend = registry().get(resolution.backend)
    if backend is not None and backend.float64:
        return
    capable = float64_backends()
    if capable:
        supported_by = f"supported by the {', '.join(repr(name) for name in capable)} backend" + (
            "s" if len(capable) > 1 else ""
        )
        fix = f" (select one with {ENV_BACKEND}={capable[0]}, or glm5_hal.use_backend({capable[0]!r}))"
    else:
        supported_by, fix = "supported by no installed backend", ""
    how = resolution.reason.split("; not considered")[0]  # auto's list of skipped backends is noise here
    raise Float64UnsupportedError(
        f"{resolution.op}: float64 inputs are a verification mode {supported_by}; the backend selected for "
        f"{resolution.device_type} is {resolution.backend!r} ({how}){fix}"
    )


def explain(op: str, device_type: str = "cpu") -> str:
    """One line saying which backend runs `op` on `device_type` now, and why."""
    res = resolve(op, device_type)
    return f"{op} on {device_type}: {res.backend} ({res.reason})"


def prepare(device: object) -> list[str]:
    """Run now the one-time set-up (Backend.prepare) of every backend the ops would run on for tensors on `device`
    (a torch.device) under the current settings, so that the first op call does not pay for it. Returns the backends
    prepared. An op no backend runs here is left to fail when called, with its own message."""
    reg = registry()
    names: list[str] = []
    for op in ALL_OP_NAMES:
        try:
            res = resolve(op, device.type)
        except BackendError:
            continue
        chosen = reg.get(res.backend)
        delegate = chosen.delegates.get(op) if chosen is not None else None  # a vendor running the torch path
        for name in (res.backend, delegate):
            backend = reg.get(name) if name is not None else None
            if name not in names and backend is not None and backend.prepare is not None:
                names.append(name)
                backend.prepare(device)
    return names
