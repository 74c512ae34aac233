"""Vendor wheels the strict fakes read their schemas from: downloaded once with `pip download --no-deps` into a
cache, checked to hold the file the fake reads, never installed.

The cache is ~/.cache/glm5-hal/wheels, or $GLM5_HAL_WHEEL_CACHE. A wheel whose archive is truncated or lacks the
file is deleted and fetched again. Used by fakes/ascend (torch-npu) and fakes/kunlun (vllm-kunlun).
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from collections.abc import Sequence
from pathlib import Path

CACHE_ENV = "GLM5_HAL_WHEEL_CACHE"
DOWNLOAD_TIMEOUT_S = 600


class WheelUnavailable(RuntimeError):
    """The wheel is neither cached nor downloadable (no network, PyPI unreachable, pip failure)."""


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "glm5-hal" / "wheels")


def _holds(wheel: Path, member: str) -> bool:
    try:
        with zipfile.ZipFile(wheel) as archive:
            return member in archive.namelist()
    except (OSError, zipfile.BadZipFile):
        return False


def cached_wheel(requirement: str, pattern: str, member: str, pip_args: Sequence[str] = ()) -> Path:
    """The cached wheel of `requirement` ("name==version") whose file name matches the glob `pattern` and whose
    archive holds `member`, downloading it on first use; WheelUnavailable otherwise. pip_args: extra arguments of
    `pip download` (a fixed platform, so that the download does not depend on the host)."""
    directory = cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    for wheel in directory.glob(pattern):
        if _holds(wheel, member):
            return wheel
        wheel.unlink()  # a truncated download: fetch it again
    command = [sys.executable, "-m", "pip", "download", "--no-deps", requirement, "-d", str(directory), *pip_args]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise WheelUnavailable(f"pip download {requirement} failed: {exc}") from exc
    wheels = [w for w in directory.glob(pattern) if _holds(w, member)]
    if done.returncode != 0 or not wheels:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise WheelUnavailable(f"pip download {requirement} failed (exit {done.returncode}): {' | '.join(tail)}")
    return wheels[0]


def read_member(wheel: Path, member: str) -> str:
    """The text of `member` inside the wheel."""
    with zipfile.ZipFile(wheel) as archive:
        return archive.read(member).decode()
