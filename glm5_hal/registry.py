"""Backend descriptors and their discovery.

[entry points `glm5_hal.backends`] -> Backend descriptors -> probe() (is it usable here, and why not)
                                                          -> load_ops() (op name -> implementation, lazily)

A backend is one `Backend` object. Built-in backends and out-of-tree ones register the same way: an entry point
in the `glm5_hal.backends` group whose value is a `Backend` (see the `[project.entry-points]` table of
pyproject.toml). Nothing here imports a vendor library: a backend's `probe` does that, lazily, and reports a
failure as a reason instead of raising. A plugin that fails to load is recorded and shown by `glm5-hal info`,
never swallowed and never fatal to `import glm5_hal`.
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

log = logging.getLogger("glm5_hal")

ENTRY_POINT_GROUP = "glm5_hal.backends"

# Every op of the operator contract (OPS.md), in contract order.
OP_NAMES: tuple[str, ...] = (
    "mla_prolog",
    "indexer_prolog",
    "indexer_logits",
    "lightning_indexer",
    "sparse_flash_attention",
    "moe_gate",
    "moe_dispatch",
    "grouped_matmul",
    "moe_combine",
    "fused_moe",
    "dynamic_quant",
    "quant_matmul",
    "w4a8_matmul",
    "hadamard_transform",
)
# The collective ops of the contract (OPS.md section 6, expert parallelism). Selected per backend like the ops above
# (a backend's op table names them, GLM5_HAL_BACKEND / GLM5_HAL_OP_BACKENDS / use_backend pick them), but they run on
# every rank of a process group, return an opaque handle and have data-dependent output sizes, so they are not
# torch.library custom ops, have no ONNX form and no single-device parity case (glm5_hal/ops/expert_parallel.py).
EP_OP_NAMES: tuple[str, ...] = ("ep_dispatch", "ep_combine")
# Every op a backend may implement.
ALL_OP_NAMES: tuple[str, ...] = OP_NAMES + EP_OP_NAMES

ANY_DEVICE = "*"


@dataclass(frozen=True)
class Availability:
    """Result of probing a backend on this machine.

    available: whether its ops can run here. reason: why (or why not), in words a user can act on, e.g.
    "torch_npu import failed: libhccl.so not found; is CANN installed?". device_types: the torch device types
    it runs on here ("*" = any device torch has). auto_eligible: whether `auto` may pick it here. emulated: the
    kernels run under an emulator (Triton's CPU interpreter): right, but slow, and not for another device.
    """

    available: bool
    reason: str
    device_types: tuple[str, ...] = ()
    auto_eligible: bool = True  # False: runs when named, but `auto` never picks it here (Triton's CPU interpreter)
    emulated: bool = False

    def runs_on(self, device_type: str) -> bool:
        return self.available and (ANY_DEVICE in self.device_types or device_type in self.device_types)


@dataclass(frozen=True)
class Backend:
    """Descriptor of one backend.

    name: what `GLM5_HAL_BACKEND` calls it. summary: one line for `glm5-hal info`.
    probe: () -> Availability; must not raise for a missing or broken library (return the reason instead).
    load_ops: () -> {op name: implementation}; called only once the backend is available. Implementations take
        the public op's arguments, already validated, and return what the public op returns.
    auto_priority: rank among backends `auto` may pick (higher wins); None = only when named explicitly.
    delegates: {op name: backend name} for ops this backend runs through another backend (e.g. a vendor backend
        running the portable `torch` path on its device); shown by `glm5-hal info`, resolved through the registry.
    notes: extra lines for `glm5-hal info` (what is validated, what is missing).
    float64: runs the float64 verification mode (docs/ops.md): float ops given float64 activations compute in
        float64 and return float64 (fp32-by-contract tensors included). A backend that would upcast to fp32 or
        below must leave it False; the public ops then refuse float64 inputs for it instead of losing precision.
    kv_cache_dtypes: the quantized cache formats (glm5_hal.kv_formats) its cache-reading and -writing ops take as
        `kv_cache_dtype=`; the public ops refuse the others for it. Float caches ("auto") need no entry.
    prepare: (device) -> None: the backend's one-time set-up for a torch device (probes, kernel builds), run by
        selection.prepare so that `generate` and benchmarks report it apart from the first op call.
    report: () -> BackendReport, called by `glm5-hal info` once the backend is available: what the backend chose
        on this machine that its ops' table cannot say (per-op kernels and why, the CPU routes and their probe).
        It may run kernels or measure; it must not raise for a missing library (say so in the report instead).
    """

    name: str
    summary: str
    probe: Callable[[], Availability]
    load_ops: Callable[[], Mapping[str, Callable]]
    auto_priority: int | None = None
    delegates: Mapping[str, str] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    float64: bool = False
    kv_cache_dtypes: tuple[str, ...] = ()
    prepare: Callable[[object], None] | None = None
    report: Callable[[], BackendReport] | None = None


@dataclass(frozen=True)
class BackendReport:
    """A backend's own section of `glm5-hal info`: `lines` for the text output (a heading line first), `data` the
    same facts JSON-ready for `info --json`."""

    lines: tuple[str, ...]
    data: Mapping[str, object] = field(default_factory=dict)


def unavailable_backend(name: str, summary: str, reason: str) -> Backend:
    """A descriptor for a backend that is known but not usable in this build (e.g. not implemented yet)."""

    def load_ops() -> Mapping[str, Callable]:
        raise RuntimeError(f"backend {name!r} is unavailable: {reason}")

    return Backend(name=name, summary=summary, probe=lambda: Availability(False, reason), load_ops=load_ops)


class Registry:
    """The discovered backends, their cached availability and their loaded ops. Thread-safe, lazy."""

    def __init__(self, group: str = ENTRY_POINT_GROUP) -> None:
        self._group = group
        self._lock = threading.RLock()
        self._backends: dict[str, Backend] | None = None
        self._load_errors: dict[str, str] = {}
        self._availability: dict[str, Availability] = {}
        self._ops: dict[str, Mapping[str, Callable]] = {}
        # Bumped whenever the set of backends or what is known about them may change, so that callers can cache
        # answers derived from the registry (selection's auto resolutions) and notice when they go stale.
        self.generation = 0

    def _discover(self) -> dict[str, Backend]:
        with self._lock:
            if self._backends is not None:
                return self._backends
            backends: dict[str, Backend] = {}
            for ep in sorted(importlib.metadata.entry_points(group=self._group), key=lambda e: e.name):
                if ep.name in backends or ep.name in self._load_errors:
                    self._load_errors[ep.name] = (
                        f"two installed packages register a backend named {ep.name!r} ({ep.value}); uninstall one"
                    )
                    backends.pop(ep.name, None)
                    continue
                try:
                    backend = ep.load()
                except Exception as exc:  # a broken plugin is reported by `info`, not fatal
                    self._load_errors[ep.name] = f"loading {ep.value} failed: {type(exc).__name__}: {exc}"
                    log.warning("glm5_hal: backend plugin %s could not be loaded: %s", ep.name, exc)
                    continue
                if not isinstance(backend, Backend) or backend.name != ep.name:
                    self._load_errors[ep.name] = (
                        f"{ep.value} is not a glm5_hal.registry.Backend named {ep.name!r} (got {backend!r:.80})"
                    )
                    continue
                backends[ep.name] = backend
            self._backends = backends
            return backends

    def register(self, backend: Backend) -> None:
        """Add a backend at run time (tests, notebooks); an existing name is an error."""
        with self._lock:
            backends = self._discover()
            if backend.name in backends:
                raise ValueError(f"backend: a backend named {backend.name!r} is already registered")
            backends[backend.name] = backend
            self.generation += 1

    def unregister(self, name: str) -> None:
        with self._lock:
            self._discover().pop(name, None)
            self._availability.pop(name, None)
            self._ops.pop(name, None)
            self.generation += 1

    def names(self) -> list[str]:
        """Every known backend name, loadable or not."""
        return sorted(set(self._discover()) | set(self._load_errors))

    def get(self, name: str) -> Backend | None:
        return self._discover().get(name)

    def availability(self, name: str) -> Availability:
        """Probe `name` once and remember the answer (a probe never raises; a raising probe is a bug we report)."""
        with self._lock:
            if name in self._availability:
                return self._availability[name]
            backend = self._discover().get(name)
            if backend is None:
                result = Availability(False, self._load_errors.get(name, "no such backend is registered"))
            else:
                try:
                    result = backend.probe()
                except Exception as exc:
                    result = Availability(False, f"probe raised {type(exc).__name__}: {exc} (a bug in the probe)")
                if result.available:
                    # A backend whose implementations cannot be imported is not available either.
                    try:
                        self._load(name, backend)
                    except Exception as exc:
                        result = Availability(False, f"loading its ops failed: {type(exc).__name__}: {exc}")
            self._availability[name] = result
            return result

    def _load(self, name: str, backend: Backend) -> Mapping[str, Callable]:
        if name not in self._ops:
            table = dict(backend.load_ops())
            unknown = sorted(set(table) - set(ALL_OP_NAMES))
            if unknown:
                raise RuntimeError(f"backend {name!r} implements unknown ops {unknown}; known: {ALL_OP_NAMES}")
            self._ops[name] = table
        return self._ops[name]

    def ops(self, name: str) -> Mapping[str, Callable]:
        """The op table of an available backend (loaded once; call `availability` first)."""
        with self._lock:
            if not self.availability(name).available:
                raise RuntimeError(f"backend {name!r} is unavailable: {self.availability(name).reason}")
            return self._load(name, self._discover()[name])

    def refresh(self) -> None:
        """Forget discovery and probe results (after installing a plugin or changing the environment)."""
        with self._lock:
            self._backends = None
            self._load_errors = {}
            self._availability = {}
            self._ops = {}
            self.generation += 1


@functools.cache
def registry() -> Registry:
    """The process-wide registry."""
    return Registry()
