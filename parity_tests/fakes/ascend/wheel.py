"""The torch-npu 2.14.0 wheel from PyPI: downloaded once into a cache, read (never installed) for its op schemas.

The wheel pins torch 2.14.0 and needs CANN, so it cannot be installed here; its
torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml still carries the exact PyTorch schema of every fused op.
"""

from __future__ import annotations

import re
from pathlib import Path

from fakes.wheels import WheelUnavailable, cache_dir, cached_wheel, read_member  # noqa: F401 (re-exported)

VERSION = "2.14.0"
# The schemas are the same in every build; one fixed build makes the download independent of the host.
PLATFORM, PYTHON, ABI = "manylinux_2_28_x86_64", "3.11", "cp311"
SCHEMA_FILE = "torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml"


def torch_npu_wheel() -> Path:
    """The cached wheel, downloading it with `pip download --no-deps` on first use; WheelUnavailable otherwise."""
    return cached_wheel(
        f"torch-npu=={VERSION}",
        f"torch_npu-{VERSION}-{ABI}-{ABI}-{PLATFORM}.whl",
        SCHEMA_FILE,
        ["--only-binary=:all:", "--platform", PLATFORM, "--python-version", PYTHON, "--abi", ABI],
    )


_FUNC = re.compile(r"^\s*(?:-\s*)?func:\s*(?P<schema>(?P<name>[\w.]+)\(.*)$")


def schemas(wheel: Path, names: list[str]) -> dict[str, str]:
    """{op name: its schema string} for `names`, read from the wheel's codegen yaml (overloads excluded)."""
    text = read_member(wheel, SCHEMA_FILE)
    found: dict[str, str] = {}
    for line in text.splitlines():
        match = _FUNC.match(line)
        if match and match.group("name") in names:
            found[match.group("name")] = match.group("schema").strip().strip("'\"")
    missing = sorted(set(names) - set(found))
    if missing:
        raise WheelUnavailable(f"{wheel.name} has no schema for {missing}")
    return found
