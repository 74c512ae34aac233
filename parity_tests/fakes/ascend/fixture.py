"""pytest fixtures that put the strict fake torch_npu in front of the `ascend` backend.

    from fakes.ascend.fixture import fake_torch_npu_fixture, torch_npu_schemas_fixture  # noqa: F401

`torch_npu_schemas` (session): the torch-npu 2.14.0 wheel, downloaded once into ~/.cache/glm5-hal/wheels (or
$GLM5_HAL_WHEEL_CACHE); without network the tests that need it are skipped with the reason, never passed.
`fake_torch_npu` (per test): the fake module in sys.modules['torch_npu'] and a fresh registry, both undone after.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from backends.ascend.detect import STAND_IN_ATTR
from fakes.ascend import build
from fakes.ascend.common import STATE
from fakes.ascend.wheel import WheelUnavailable, torch_npu_wheel
from glm5_hal import weight_cache
from glm5_hal.registry import registry


@pytest.fixture(scope="session", name="torch_npu_schemas")
def torch_npu_schemas_fixture() -> Path:
    """The torch-npu wheel whose schemas the fake is built from."""
    try:
        return torch_npu_wheel()
    except WheelUnavailable as exc:
        pytest.skip(f"strict torch_npu fake unavailable: {exc}")


@pytest.fixture(name="fake_torch_npu")
def fake_torch_npu_fixture(torch_npu_schemas: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """The fake torch_npu, importable as `torch_npu`, with the glm5_hal registry re-probed against it."""
    loaded = sys.modules.get("torch_npu")
    if loaded is not None and not getattr(loaded, STAND_IN_ATTR, None):
        # The real one owns the `npu` op namespace; there, run `glm5-hal parity --backends ascend --device npu`.
        pytest.skip("a real torch_npu is loaded: the strict fake would shadow it (see docs/ascend.md)")
    module = build(torch_npu_schemas)
    monkeypatch.setitem(sys.modules, "torch_npu", module)
    STATE.reset()
    weight_cache.clear()
    registry().refresh()
    yield module
    weight_cache.clear()
    registry().refresh()  # re-probed lazily once monkeypatch has removed the fake


def install_in_process(wheel: Path) -> ModuleType:
    """The fake torch_npu as `torch_npu` for the rest of this process, gloo groups answering get_hccl_comm_name, and
    a fresh registry: for the ranks the distributed tests spawn (a process of its own, where no fixture runs)."""
    from fakes.ascend.mc2 import install_hccl_comm_names

    module = build(wheel)
    sys.modules["torch_npu"] = module
    install_hccl_comm_names()
    STATE.reset()
    weight_cache.clear()
    registry().refresh()
    return module
