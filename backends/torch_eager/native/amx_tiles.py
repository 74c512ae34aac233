"""The AMX tile state, asked of Linux before an AMX kernel runs (amx_tiles.h has the C side).

Linux gives a process the AMX register file only on request (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA),
Linux >= 5.16); a tile instruction before that kills the process with SIGILL. Every AMX library exports
glm5_amx_init, which asks (its portable build has nothing to ask and answers yes). `function` calls it once per
loaded library before handing out any of the library's kernels, and a refusal becomes build.NativeUnavailable with
the reason, never a crash: callers keep their other routes.

    kernel = function("amx_gemm", "amx", "glm5_amx_bf16_gemm_nt", argtypes, ctypes.c_int)
    ok, why = availability("amx_gemm", "amx")

An op with a vector kernel and an AMX one (sparse attention, the indexer's scores) picks its source by build with
source_for, and loads it with any_function / any_availability (the tile state asked only for an AMX source).
"""

from __future__ import annotations

import ctypes
import os
import threading
from errno import ENOSPC

from backends.torch_eager.native import build
from glm5_hal.checks import check

INIT = "glm5_amx_init"  # int glm5_amx_init(void): 0, or the errno of Linux's refusal
_granted: dict[str, str | None] = {}  # a loaded library's path -> None (tile state granted) or why not
_lock = threading.Lock()


def refusal(kernel: str, isa: str, errno: int) -> str:
    """Why the AMX build of `kernel` cannot run, from the errno glm5_amx_init returned."""
    why = os.strerror(errno) if errno > 0 else f"error {errno}"
    hint = "AMX kernels need Linux >= 5.16 and a CPU with amx_tile"
    if errno == ENOSPC:  # Linux checks every thread's alternate signal stack against the larger signal frame
        hint = "a thread's alternate signal stack (sigaltstack, as faulthandler's) is too small for the AMX state"
    return (
        f"{kernel}_{isa}: Linux refused the AMX tile state (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA):"
        f" {why}); {hint}"
    )


def tile_state(kernel: str, isa: str) -> None:
    """Ask Linux for the tile state for the library load(kernel, isa) gives (once per library and process);
    build.NativeUnavailable where it cannot be built or loaded, or Linux says no."""
    library = build.load(kernel, isa)
    found = _granted.get(library._name, "")  # once asked, no lock: a dict read is atomic
    if found == "":
        with _lock:
            if library._name not in _granted:
                errno = build.function(kernel, isa, INIT, [], ctypes.c_int)()
                _granted[library._name] = None if errno == 0 else refusal(kernel, isa, errno)
            found = _granted[library._name]
    if found is not None:
        raise build.NativeUnavailable(found)


def function(kernel: str, isa: str, name: str, argtypes: list, restype: object = None) -> ctypes._CFuncPtr:
    """build.function, once the process holds the tile state (tile_state)."""
    tile_state(kernel, isa)
    return build.function(kernel, isa, name, argtypes, restype)


def source_for(isa: str, vector: str, amx: str, kernel: str | None = None) -> str:
    """The C source that runs for `isa` where an op has a vector kernel (`vector`: built for the vector ISAs) and an
    AMX one (`amx`): `kernel` where given (one of the two; the tests run the AMX source's portable build), else `amx`
    for the AMX build and `vector` for the others."""
    chosen = kernel or (amx if isa == "amx" else vector)
    check(chosen in (vector, amx), ValueError, lambda: f"kernel: expected {vector!r} or {amx!r}, got {chosen!r}")
    return chosen


def _is_amx_source(kernel: str) -> bool:
    return INIT in build.SYMBOLS.get(kernel, ())  # an AMX source exports the tile-state request


def any_function(kernel: str, isa: str, name: str, argtypes: list, restype: object = None) -> ctypes._CFuncPtr:
    """build.function for any source: through the tile state (`function`) where `kernel` is an AMX source."""
    if _is_amx_source(kernel):
        return function(kernel, isa, name, argtypes, restype)
    return build.function(kernel, isa, name, argtypes, restype)


def any_availability(kernel: str, isa: str) -> tuple[bool, str]:
    """build.availability for any source, Linux's grant of the tile state included where `kernel` is an AMX one."""
    return availability(kernel, isa) if _is_amx_source(kernel) else build.availability(kernel, isa)


def availability(kernel: str, isa: str) -> tuple[bool, str]:
    """build.availability, and for a build that loads, whether Linux grants the tile state."""
    ok, why = build.availability(kernel, isa)
    if not ok:
        return ok, why
    try:
        tile_state(kernel, isa)
    except build.NativeUnavailable as exc:
        return False, str(exc)
    return ok, why
