"""Build and load the native CPU kernels: C sources in this folder, compiled on first use with the machine's C
compiler into a per-user cache, loaded with ctypes.

Nothing here runs at import. `load(kernel, isa)` returns the loaded library or raises NativeUnavailable with the
reason (native kernels switched off, the CPU lacks the instruction set, no compiler, the compiler failed or hung, no
writable cache, a library without the kernel's functions): callers turn that into "keep the torch path"
(backends.torch_eager.capabilities), never into a crash. `glm5-hal info` shows the cache and each kernel's state
(`status`).

- GLM5_HAL_NATIVE=0 switches the native kernels off (the torch paths run; for bisecting numerics or speed).
  GLM5_HAL_NATIVE=portable runs every kernel's portable build (the same blocking in scalar C) in place of its
  instruction-set build, on any CPU: slow, for testing the native routes where the CPU lacks their instructions.
- GLM5_HAL_CACHE_DIR: where built libraries go (default $XDG_CACHE_HOME/glm5_hal, else ~/.cache/glm5_hal; where
  neither names an absolute folder, as with HOME unset and a uid without a passwd entry, a private folder of this
  user in the temporary directory, with the reason in `glm5-hal info`). A library's file name is a hash of its
  source, compiler and flags, so an edit or another compiler builds anew.
- A library is written whole before it gets its name (compiled in a scratch folder, flushed to disk, renamed), and
  its size and SHA-256 go to a record beside it the same way; a library is loaded only if it matches its record,
  and built again otherwise. So processes building at once (test ranks) never load a partial one, and a file torn
  by a crash mid-write is rebuilt instead of killing every later process with SIGBUS inside dlopen.
- The compiler runs in a process group of its own, at most BUILD_TIMEOUT_S; one that times out is killed with its
  whole group and not tried again in this process (a hanging compiler costs one timeout, not one per kernel).
- CC: the compiler (default `cc`, else `gcc`).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import re
import shutil
import signal
import stat
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
        # AMX tiles: TDPBF16PS / TDPBSSD on 16 x 64-byte tiles (amx_tiles.h). AVX-512 (every CPU with AMX has F, BW,
        # VL and BF16) for the code around the tiles: the staging and packing loops, and the decode and fp32 route of
        # amx_quantized_index_scores.c. The process must also ask Linux for the tile state before the first tile
        # instruction: amx_tiles.py does that once per library.
        Isa(
            "amx",
            ("-mamx-tile", "-mamx-bf16", "-mamx-int8", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16"),
            ("amx_tile", "amx_bf16", "amx_int8", "avx512f", "avx512bw", "avx512vl", "avx512_bf16"),
        ),
        # Tests only: the AMX sources with the tile instructions emulated in scalar C (amx_tiles.h) and everything else
        # built for AVX-512 as in the AMX build, so that code (the AMX kernels' packing, softmax, decode) runs on any
        # AVX-512 BF16 CPU. No route takes it (capabilities.NATIVE_ISAS).
        Isa(
            "amx_emulated",
            ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-DGLM5_EMULATE_TILES"),
            ("avx512f", "avx512bw", "avx512vl", "avx512_bf16"),
        ),
        # 256-bit FMA on fp32 lanes, bf16 widened exactly (the 16 bits moved to the top of an fp32): the float kernels
        # for CPUs without AVX-512 (AVX2 EPYCs). No masked 16-bit loads: edges are copied or handled in scalar code.
        # F16C (every AVX2 CPU has it) widens e4m3 codes through fp16 in quantized_index_scores.c.
        Isa("avx2", ("-mavx2", "-mfma", "-mf16c", "-DGLM5_AVX2"), ("avx2", "fma", "f16c")),
        # The same loops around scalar arithmetic: runs on any CPU (the tests check the blocking with it everywhere).
        Isa("portable", ("-DGLM5_PORTABLE",), ()),
    )
}
# <name>.c in this folder -> the functions its library must export (a library without one turns the route off).
SYMBOLS: dict[str, tuple[str, ...]] = {
    "bf16_gemm": ("glm5_bf16_gemm_nt",),
    "indexer_scores": ("glm5_indexer_scores",),
    "quantized_index_scores": ("glm5_quantized_index_scores", "glm5_quantized_index_scores_paged"),
    "indexer_prolog": ("glm5_indexer_prolog_project", "glm5_indexer_prolog_finish", "glm5_encode_index_rows"),
    "sparse_attention": ("glm5_sparse_attention",),
    "int8_gemm": ("glm5_w8a8_gemm_nt", "glm5_w4a8_gemm_nt"),
    "topk": ("glm5_topk",),
    "amx_gemm": ("glm5_amx_init", "glm5_amx_bf16_gemm_nt", "glm5_amx_s8_gemm_nt"),
    "amx_attention": ("glm5_amx_init", "glm5_sparse_attention", "glm5_sparse_attention_paged"),
    "amx_index_scores": ("glm5_amx_init", "glm5_indexer_scores"),
    "amx_quantized_index_scores": (
        "glm5_amx_init",
        "glm5_quantized_index_scores",
        "glm5_quantized_index_scores_paged",
    ),
}
KERNELS = tuple(SYMBOLS)
INCLUDED_SOURCE = re.compile(rb'^#include "([A-Za-z0-9_]+\.c)"', re.MULTILINE)  # a source another source builds
RECORD_SUFFIX = ".record"  # <library>.record: {"size": bytes, "sha256": hex} of the library as built

_lock = threading.Lock()


ON, OFF, PORTABLE_ONLY = "on", "off", "portable"


def _parse_mode(value: str) -> str:
    value = value.strip().lower()
    if value in ("0", "off", "false", "no"):
        return OFF
    return PORTABLE_ONLY if value == PORTABLE_ONLY else ON  # unset ("") is on


def native_mode() -> str:
    """ON, OFF or PORTABLE_ONLY, from GLM5_HAL_NATIVE."""
    return parsed_setting(ENV_NATIVE, _parse_mode)


def native_enabled() -> bool:
    return native_mode() != OFF


@dataclass(frozen=True)
class CacheLocation:
    """Where built libraries go. path None: nowhere usable (no native kernels). note: why the cache is not the
    configured one (a temporary fallback, or none), else empty."""

    path: Path | None
    note: str = ""


def cache_location() -> CacheLocation:
    """The build cache folder (see the module docstring). Never a relative path: expanduser('~') stays '~' when HOME
    is unset and the uid has no passwd entry, which would put the cache in a folder named '~' wherever the process
    happens to run."""
    explicit = os.environ.get(ENV_CACHE_DIR)
    if explicit:
        return CacheLocation(Path(os.path.abspath(os.path.expanduser(explicit))))
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg and os.path.isabs(xdg):  # the XDG spec: a relative value is invalid and ignored
        return CacheLocation(Path(xdg) / "glm5_hal")
    home = os.path.expanduser("~")
    if os.path.isabs(home):
        return CacheLocation(Path(home) / ".cache" / "glm5_hal")
    if os.environ.get("HOME"):
        return _private_temporary_cache(f"HOME={os.environ['HOME']!r} is not an absolute path")
    return _private_temporary_cache("HOME is unset and this uid has no passwd entry (no home folder to cache in)")


def _private_temporary_cache(why: str) -> CacheLocation:
    """A folder of this user's own in the temporary directory. Its name is predictable in a shared directory, so it is
    used only if it is a real folder, ours, and writable by nobody else: a library planted there would be loaded
    and run."""
    folder = Path(tempfile.gettempdir()) / f"glm5_hal-{os.getuid()}"
    advice = f"set {ENV_CACHE_DIR} to keep builds"
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
        found = os.lstat(folder)
    except OSError as exc:
        return CacheLocation(None, f"{why}, and the temporary cache {folder} cannot be made ({exc}); {advice}")
    if not stat.S_ISDIR(found.st_mode) or found.st_uid != os.getuid() or found.st_mode & 0o022:
        return CacheLocation(
            None,
            f"{why}, and the temporary cache {folder} is not a private folder of this user (a link, another owner,"
            f" or writable by others): no native kernels; {advice}",
        )
    return CacheLocation(folder, f"{why}: building in {folder}; {advice}")


def cache_dir() -> Path:
    """The build cache folder (cache_location), NativeUnavailable where there is none."""
    where = cache_location()
    if where.path is None:
        raise NativeUnavailable(where.note)
    return where.path


def _compiler() -> str:
    for name in (os.environ.get("CC"), "cc", "gcc"):
        if name and shutil.which(name):
            return name
    raise NativeUnavailable("no C compiler (set CC, or install gcc / clang)")


def _digest(data: bytes) -> dict[str, object]:
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _record_path(library: Path) -> Path:
    return library.with_name(library.name + RECORD_SUFFIX)


def _fsync_folder(folder: Path) -> None:
    """Make renames in `folder` durable (a crash after a rename must not lose it); best effort where a folder cannot
    be opened for that."""
    try:
        handle = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(handle)
    except OSError:
        pass
    finally:
        os.close(handle)


def _write_durably(path: Path, data: bytes) -> None:
    """`data` under `path`, all or nothing: written to a scratch file in the same folder, flushed, then renamed."""
    handle, scratch = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(handle, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(scratch, path)
    except BaseException:
        Path(scratch).unlink(missing_ok=True)
        raise
    _fsync_folder(path.parent)


def record_library(library: Path) -> None:
    """Write the record of `library` as it is now (size and SHA-256), durably. The build does this after the
    library's own rename, so a record never describes a library that is not complete on disk."""
    _write_durably(_record_path(library), json.dumps(_digest(library.read_bytes())).encode())


def _matches_record(library: Path) -> bool:
    """Whether `library` exists and is the file its record describes (no record: not trusted, built again)."""
    try:
        recorded = json.loads(_record_path(library).read_text())
        data = library.read_bytes()
    except (OSError, ValueError):
        return False
    return isinstance(recorded, dict) and recorded == _digest(data)


_hung: dict[str, str] = {}  # compiler -> why it is not run again in this process (it timed out once)


def _run_compiler(compiler: str, command: list[str], name: str) -> None:
    """Run one compile in a process group of its own, at most BUILD_TIMEOUT_S. On a timeout the whole group is
    killed (a compiler driver's children too) and the compiler is not tried again in this process."""
    if compiler in _hung:
        raise NativeUnavailable(_hung[compiler])
    try:
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
        )
    except OSError as exc:
        raise NativeUnavailable(f"{compiler} could not build {name}: {exc}") from exc
    try:
        _, stderr = process.communicate(timeout=BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except OSError:  # the group is gone already
            pass
        process.communicate()  # reap it; its pipes close once the whole group is dead
        _hung[compiler] = (
            f"{compiler} timed out after {BUILD_TIMEOUT_S:g} s building {name} (its process group was killed; it is"
            " not tried again in this process)"
        )
        raise NativeUnavailable(_hung[compiler]) from None
    if process.returncode != 0:
        first_lines = " | ".join(stderr.strip().splitlines()[:3])
        raise NativeUnavailable(f"{compiler} failed to build {name} (exit {process.returncode}): {first_lines}")


def _build(kernel: str, isa: Isa) -> Path:
    compiler = _compiler()
    source = SOURCE_DIR / f"{kernel}.c"
    flags = (*BASE_FLAGS, *isa.compile_flags, f"-I{SOURCE_DIR}")
    text = source.read_bytes()
    # What the library is built from: the source, every header, and any source it includes (a build of another
    # kernel's source with a switch, as amx_quantized_index_scores.c is): an edit to any of them builds anew.
    included = [(SOURCE_DIR / name.decode()).read_bytes() for name in INCLUDED_SOURCE.findall(text)]
    headers = [h.read_bytes() for h in sorted(SOURCE_DIR.glob("*.h"))]
    key = hashlib.sha256(
        b"\0".join([text, *included, *headers, shutil.which(compiler).encode(), " ".join(flags).encode()])
    ).hexdigest()[:16]
    name = f"{kernel}_{isa.name}"
    directory = cache_dir()
    library = directory / f"{name}-{key}.so"
    if _matches_record(library):
        return library
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise NativeUnavailable(f"cannot create the build cache {directory} ({exc}); set {ENV_CACHE_DIR}") from exc
    unwritable = f"cannot write the build cache {directory}, so nothing was built; set {ENV_CACHE_DIR}"
    try:
        scratch_folder = tempfile.TemporaryDirectory(dir=directory)
    except OSError as exc:
        raise NativeUnavailable(f"{unwritable} ({exc})") from exc
    with scratch_folder as scratch:
        partial = Path(scratch) / library.name
        _run_compiler(compiler, [compiler, *flags, "-o", str(partial), str(source)], name)
        try:
            with open(partial, "rb+") as built:  # on disk before it has its name
                os.fsync(built.fileno())
            os.replace(partial, library)
            _fsync_folder(directory)
            record_library(library)
        except OSError as exc:
            raise NativeUnavailable(f"{unwritable} ({exc})") from exc
    return library


def _load(kernel: str, isa: Isa) -> ctypes.CDLL:
    _model, flags = this_cpu()
    missing = [f for f in isa.cpu_flags if flags is None or f not in flags]
    if missing:
        raise NativeUnavailable(f"{kernel}_{isa.name} needs CPU flags {', '.join(missing)}, which this CPU lacks")
    library = _build(kernel, isa)
    try:
        loaded = ctypes.CDLL(str(library))
    except OSError as exc:  # a library that does not load (wrong architecture, a missing runtime library)
        raise NativeUnavailable(f"{kernel}_{isa.name} was built but does not load: {exc}") from exc
    absent = [symbol for symbol in SYMBOLS[kernel] if not hasattr(loaded, symbol)]
    if absent:
        lacks = ", ".join(absent)
        raise NativeUnavailable(f"{kernel}_{isa.name} ({library}) lacks {lacks}: the native route stays off")
    return loaded


_loaded: dict[tuple[str, str], ctypes.CDLL | NativeUnavailable] = {}  # the library, or why there is none


def load(kernel: str, isa: str) -> ctypes.CDLL:
    """The library of `kernel` (KERNELS) built for `isa` (ISAS), built on first use; NativeUnavailable says why
    not. Either answer is kept for the process: a failing compiler runs once, not on every call."""
    if kernel not in KERNELS or isa not in ISAS:
        raise ValueError(f"native kernel: expected one of {KERNELS} x {tuple(ISAS)}, got {kernel!r}, {isa!r}")
    mode = native_mode()
    if mode == OFF:
        raise NativeUnavailable(f"{ENV_NATIVE}={os.environ[ENV_NATIVE]}")
    if mode == PORTABLE_ONLY:
        isa = "portable"
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
    """Drop what load() remembered, hung compilers included (tests that fake a CPU or a compiler)."""
    with _lock:
        _loaded.clear()
        _hung.clear()


def function(kernel: str, isa: str, name: str, argtypes: list, restype: object = None) -> ctypes._CFuncPtr:
    """The C function `name` of load(kernel, isa), with its ctypes signature set (NativeUnavailable as load, and for
    a function the library does not export)."""
    try:
        found = getattr(load(kernel, isa), name)
    except AttributeError as exc:
        raise NativeUnavailable(f"{kernel}_{isa} lacks {name}") from exc
    if found.argtypes is None:
        found.argtypes, found.restype = argtypes, restype
    return found


def availability(kernel: str, isa: str) -> tuple[bool, str]:
    """(True, what runs) or (False, why not) for `kernel` built for `isa` here (built on first use)."""
    try:
        load(kernel, isa)
    except NativeUnavailable as exc:
        return False, str(exc)
    mode = native_mode()
    answer = _available.get((kernel, isa, mode))  # asked by every op call that may take a kernel: made once
    if answer is None:
        if mode == PORTABLE_ONLY:
            answer = True, f"{kernel}_portable in place of {kernel}_{isa} ({ENV_NATIVE}=portable)"
        else:
            answer = True, f"{kernel}_{isa} (backends/torch_eager/native/{kernel}.c)"
        _available[kernel, isa, mode] = answer
    return answer


_available: dict[tuple[str, str, str], tuple[bool, str]] = {}  # availability's answers where the kernel loaded


def status() -> dict[str, object]:
    """What `glm5-hal info` shows: whether native kernels are on, the cache folder and why it is there (or why there
    is none), and each kernel build this process has tried: where it was loaded from, or why not."""
    where = cache_location()
    kernels: dict[str, str] = {}
    with _lock:
        for (kernel, isa), found in sorted(_loaded.items()):
            kernels[f"{kernel}_{isa}"] = str(found) if isinstance(found, NativeUnavailable) else f"loaded {found._name}"
    return {
        "enabled": native_enabled(),
        "mode": native_mode(),
        "cache_dir": str(where.path) if where.path is not None else None,
        "cache_note": where.note,
        "kernels": kernels,
    }
