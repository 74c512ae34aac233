"""Build and load the native CPU kernels: C sources in this folder, compiled on first use with the machine's C
compiler into a per-user cache, loaded with ctypes.

Nothing here runs at import. `load(kernel, isa)` returns the loaded library or raises NativeUnavailable with the
reason (native kernels switched off, the CPU lacks the instruction set, no compiler, the compiler failed): callers
turn that into "keep the torch path" (glm5_hal.capabilities), never into a crash.

- GLM5_HAL_NATIVE=0 switches the native kernels off (the torch paths run; for bisecting numerics or speed).
- GLM5_HAL_CACHE_DIR: where built libraries go (default $XDG_CACHE_HOME/glm5_hal, else ~/.cache/glm5_hal). A
  library's file name is a hash of its source, compiler and flags, so an edit or another compiler builds anew;
  the file appears by an atomic rename, so processes building at once (test ranks) never load a partial one.
- CC: the compiler (default `cc`, else `gcc`).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from glm5_hal.cpu_flags import this_cpu
from glm5_hal.environment import parsed_setting

ENV_NATIVE = "GLM5_HAL_NATIVE"
ENV_CACHE_DIR = "GLM5_HAL_CACHE_DIR"
SOURCE_DIR = Path(__file__).resolve().parent
BUILD_TIMEOUT_S = 120
# -ffp-contract=off: scalar fp32 code rounds each multiply and add as written (gcc fuses them into FMAs by
# default), so a kernel that follows a torch path's order of operations gives its bits.
BASE_FLAGS = ("-O3", "-fPIC", "-shared", "-fno-math-errno", "-ffp-contract=off")


class NativeUnavailable(RuntimeError):
    """A native kernel cannot be used here; the message says why (for `glm5-hal info` and the probe's reason)."""


@dataclass(frozen=True)
class Isa:
    """One way to build a kernel: compiler flags, and the CPU flags (/proc/cpuinfo) the result needs to run."""

    name: str
    compile_flags: tuple[str, ...]
    cpu_flags: tuple[str, ...]


ISAS: dict[str, Isa] = {
    isa.name: isa
    for isa in (
        # VDPBF16PS on 512-bit registers, with AVX-512BW masked 16-bit loads for the edges.
        Isa(
            "avx512_bf16",
            ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16"),
            ("avx512f", "avx512bw", "avx512vl", "avx512_bf16"),
        ),
        # VPDPBUSD (u8 x s8 dot products into int32 lanes) on 512-bit registers, with masked byte loads for the edges.
        Isa(
            "avx512_vnni",
            ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"),
            ("avx512f", "avx512bw", "avx512vl", "avx512_vnni"),
        ),
        # The same loops around scalar arithmetic: runs on any CPU (the tests check the blocking with it everywhere).
        Isa("portable", ("-DGLM5_PORTABLE",), ()),
    )
}
KERNELS = ("bf16_gemm", "indexer_scores", "sparse_attention", "int8_gemm", "topk")  # <name>.c in this folder

_lock = threading.Lock()


def _parse_enabled(value: str) -> bool:
    return value.strip().lower() not in ("0", "off", "false", "no")  # unset ("") is enabled


def native_enabled() -> bool:
    return parsed_setting(ENV_NATIVE, _parse_enabled)


def cache_dir() -> Path:
    if os.environ.get(ENV_CACHE_DIR):
        return Path(os.environ[ENV_CACHE_DIR])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "glm5_hal"


def _compiler() -> str:
    for name in (os.environ.get("CC"), "cc", "gcc"):
        if name and shutil.which(name):
            return name
    raise NativeUnavailable("no C compiler (set CC, or install gcc / clang)")


def _build(kernel: str, isa: Isa) -> Path:
    compiler = _compiler()
    source = SOURCE_DIR / f"{kernel}.c"
    flags = (*BASE_FLAGS, *isa.compile_flags, f"-I{SOURCE_DIR}")
    headers = [h.read_bytes() for h in sorted(SOURCE_DIR.glob("*.h"))]
    key = hashlib.sha256(
        b"\0".join([source.read_bytes(), *headers, shutil.which(compiler).encode(), " ".join(flags).encode()])
    ).hexdigest()[:16]
    name = f"{kernel}_{isa.name}"
    directory = cache_dir()
    library = directory / f"{name}-{key}.so"
    if library.exists():
        return library
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise NativeUnavailable(f"cannot create the build cache {directory} ({exc}); set {ENV_CACHE_DIR}") from exc
    with tempfile.TemporaryDirectory(dir=directory) as scratch:
        partial = Path(scratch) / library.name
        try:
            done = subprocess.run(
                [compiler, *flags, "-o", str(partial), str(source)],
                capture_output=True,
                text=True,
                timeout=BUILD_TIMEOUT_S,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise NativeUnavailable(f"{compiler} could not build {name}: {exc}") from exc
        if done.returncode != 0:
            first_lines = " | ".join(done.stderr.strip().splitlines()[:3])
            failed = f"{compiler} failed to build {name} (exit {done.returncode})"
            raise NativeUnavailable(f"{failed}: {first_lines}")
        os.replace(partial, library)
    return library


def _load(kernel: str, isa: Isa) -> ctypes.CDLL:
    _model, flags = this_cpu()
    missing = [f for f in isa.cpu_flags if flags is None or f not in flags]
    if missing:
        raise NativeUnavailable(f"{kernel}_{isa.name} needs CPU flags {', '.join(missing)}, which this CPU lacks")
    try:
        return ctypes.CDLL(str(_build(kernel, isa)))
    except OSError as exc:  # a library that does not load (wrong architecture, a broken file in the cache)
        raise NativeUnavailable(f"{kernel}_{isa.name} built but did not load: {exc}") from exc


_loaded: dict[tuple[str, str], ctypes.CDLL | NativeUnavailable] = {}  # the library, or why there is none


def load(kernel: str, isa: str) -> ctypes.CDLL:
    """The library of `kernel` (KERNELS) built for `isa` (ISAS), built on first use; NativeUnavailable says why
    not. Either answer is kept for the process: a failing compiler runs once, not on every call."""
    if kernel not in KERNELS or isa not in ISAS:
        raise ValueError(f"native kernel: expected one of {KERNELS} x {tuple(ISAS)}, got {kernel!r}, {isa!r}")
    if not native_enabled():
        raise NativeUnavailable(f"{ENV_NATIVE}={os.environ[ENV_NATIVE]}")
    found = _loaded.get((kernel, isa))  # once loaded, no lock: a dict read is atomic, and this runs on every call
    if isinstance(found, ctypes.CDLL):
        return found
    with _lock:  # one build per process even if several threads ask at once
        if (kernel, isa) not in _loaded:
            try:
                _loaded[kernel, isa] = _load(kernel, ISAS[isa])
            except NativeUnavailable as exc:
                _loaded[kernel, isa] = exc
        found = _loaded[kernel, isa]
    if isinstance(found, NativeUnavailable):
        raise found
    return found


def forget() -> None:
    """Drop what load() remembered (tests that fake a CPU or a compiler)."""
    with _lock:
        _loaded.clear()


def function(kernel: str, isa: str, name: str, argtypes: list, restype: object = None) -> ctypes._CFuncPtr:
    """The C function `name` of load(kernel, isa), with its ctypes signature set (NativeUnavailable as load)."""
    found = getattr(load(kernel, isa), name)
    if found.argtypes is None:
        found.argtypes, found.restype = argtypes, restype
    return found


def availability(kernel: str, isa: str) -> tuple[bool, str]:
    """(True, what runs) or (False, why not) for `kernel` built for `isa` here (built on first use)."""
    try:
        load(kernel, isa)
    except NativeUnavailable as exc:
        return False, str(exc)
    return True, f"{kernel}_{isa} (glm5_hal/native/{kernel}.c)"
