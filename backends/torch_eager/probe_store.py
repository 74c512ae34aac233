"""The probe's decisions kept on disk beside the built native kernels, so that a process pays for the measurements
once per machine, not once per process (capabilities.capabilities reads and writes them).

One JSON file per key: the device (CPU model and ISA flags, or the accelerator's name), torch's version, the thread
count, glm5-hal's version, the probe's own source and the native kernels' (a change to what is measured, how it is
decided or what a kernel does measures again), the mode and GLM5_HAL_NATIVE. A file that is missing, unreadable,
damaged or for another key is measured again and replaced; GLM5_HAL_REPROBE=1 (`glm5-hal info --reprobe`) measures
again whatever is there. Where the build cache has no usable folder (backends/torch_eager/native/build.py), nothing
is kept.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from importlib import metadata
from pathlib import Path

import torch

from backends.torch_eager.native import build
from glm5_hal.cpu_flags import this_cpu
from glm5_hal.environment import ENV_REPROBE, parsed_setting

FORMAT = 1  # of the files: a reader of another format measures again
# The sources whose code decides: capabilities.py (the decisions), route_workloads.py (what is timed), int8_gemms.py
# and gemm.py (the routes), and the native kernels (which builds exist, and how fast and exact they are).
_SOURCES = ("capabilities.py", "route_workloads.py", "int8_gemms.py", "gemm.py")
_NATIVE_SOURCES = ("*.c", "*.h", "*.py")


def reprobe_requested() -> bool:
    return parsed_setting(ENV_REPROBE, lambda v: v.strip().lower() in ("1", "on", "true", "yes"))


def _glm5_hal_version() -> str:
    try:
        return metadata.version("glm5-hal")
    except metadata.PackageNotFoundError:
        return "unknown"


def _source_digest() -> str:
    digest = hashlib.sha256()
    here = Path(__file__).resolve().parent
    native = sorted(path for pattern in _NATIVE_SOURCES for path in (here / "native").glob(pattern))
    for path in [here / name for name in _SOURCES] + native:
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def key(device: torch.device, mode: str) -> dict[str, object]:
    """Everything the stored decisions depend on, for `device` in `mode`."""
    if device.type == "cpu":
        model, flags = this_cpu()
        what = {"cpu": model, "flags": sorted(flags) if flags is not None else None}
    elif device.type == "cuda":
        what = {"gpu": torch.cuda.get_device_name(device), "capability": list(torch.cuda.get_device_capability(device))}
    else:
        what = {"device_type": device.type}
    return {
        "format": FORMAT,
        "device": str(device),
        **what,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "glm5_hal": _glm5_hal_version(),
        "probe_source": _source_digest(),
        "mode": mode,
        "native": build.native_mode(),
    }


def path_for(found_key: dict[str, object]) -> Path | None:
    """The file for `found_key` in the build cache, or None where there is no usable cache folder."""
    folder = build.cache_location().path
    if folder is None:
        return None
    name = hashlib.sha256(json.dumps(found_key, sort_keys=True).encode()).hexdigest()[:16]
    return folder / f"routes-{name}.json"


def load(found_key: dict[str, object]) -> dict[str, object] | None:
    """The stored decisions for `found_key` (as `save` wrote them), or None: none kept, another key, or damaged."""
    path = path_for(found_key)
    if path is None or reprobe_requested():
        return None
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(stored, dict) or stored.get("key") != found_key or not isinstance(stored.get("value"), dict):
        return None
    return stored["value"]


def save(found_key: dict[str, object], value: dict[str, object]) -> Path | None:
    """Write `value` for `found_key` (atomically: a reader sees the old file or the new one, never half of one).
    Returns the file, or None where nothing could be kept (the next process measures again; never an error)."""
    path = path_for(found_key)
    if path is None:
        return None
    scratch = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, scratch = tempfile.mkstemp(dir=path.parent, prefix=".routes-", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump({"key": found_key, "value": value}, f, indent=1, allow_nan=True)
        os.replace(scratch, path)
    except OSError:
        if scratch is not None:  # a full disk mid-write: no half-written scratch file left behind
            Path(scratch).unlink(missing_ok=True)
        return None
    return path
