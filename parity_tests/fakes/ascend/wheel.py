"""The torch-npu 2.14.0 wheel from PyPI: downloaded once into a cache, read (never installed) for its op schemas.

The wheel pins torch 2.14.0 and needs CANN, so it cannot be installed here; its
torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml still carries the exact PyTorch schema of every fused op.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

VERSION = "2.14.0"
# The schemas are the same in every build; one fixed build makes the download independent of the host.
PLATFORM, PYTHON, ABI = "manylinux_2_28_x86_64", "3.11", "cp311"
SCHEMA_FILE = "torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml"
CACHE_ENV = "GLM5_HAL_WHEEL_CACHE"
DOWNLOAD_TIMEOUT_S = 600


class WheelUnavailable(RuntimeError):
    """The wheel is neither cached nor downloadable (no network, PyPI unreachable, pip failure)."""


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "glm5-hal" / "wheels")


def _readable(wheel: Path) -> bool:
    try:
        with zipfile.ZipFile(wheel) as archive:
            return SCHEMA_FILE in archive.namelist()
    except (OSError, zipfile.BadZipFile):
        return False


def torch_npu_wheel() -> Path:
    """The cached wheel, downloading it with `pip download --no-deps` on first use; WheelUnavailable otherwise."""
    directory = cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    pattern = f"torch_npu-{VERSION}-{ABI}-{ABI}-{PLATFORM}.whl"
    for wheel in directory.glob(pattern):
        if _readable(wheel):
            return wheel
        wheel.unlink()  # a truncated download: fetch it again
    command = [sys.executable, "-m", "pip", "download", "--no-deps", f"torch-npu=={VERSION}", "-d", str(directory)]
    command += ["--only-binary=:all:", "--platform", PLATFORM, "--python-version", PYTHON, "--abi", ABI]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise WheelUnavailable(f"pip download torch-npu=={VERSION} failed: {exc}") from exc
    wheels = [w for w in directory.glob(pattern) if _readable(w)]
    if done.returncode != 0 or not wheels:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise WheelUnavailable(f"pip download torch-npu=={VERSION} failed (exit {done.returncode}): {' | '.join(tail)}")
    return wheels[0]


_FUNC = re.compile(r"^\s*(?:-\s*)?func:\s*(?P<schema>(?P<name>[\w.]+)\(.*)$")


def schemas(wheel: Path, names: list[str]) -> dict[str, str]:
    """{op name: its schema string} for `names`, read from the wheel's codegen yaml (overloads excluded)."""
    with zipfile.ZipFile(wheel) as archive:
        text = archive.read(SCHEMA_FILE).decode()
    found: dict[str, str] = {}
    for line in text.splitlines():
        match = _FUNC.match(line)
        if match and match.group("name") in names:
            found[match.group("name")] = match.group("schema").strip().strip("'\"")
    missing = sorted(set(names) - set(found))
    if missing:
        raise WheelUnavailable(f"{wheel.name} has no schema for {missing}")
    return found
