"""pytest fixture that puts the strict MetaX fake in front of the `metax` backend.

    from fakes.metax.fixture import fake_metax_fixture  # noqa: F401

`fake_metax` (per test): the fake modules in sys.modules, the machine declared a MetaX one on the CPU stand-in
(GLM5_HAL_VENDOR=metax, GLM5_HAL_STAND_IN_DEVICE=cpu: MetaX presents as `cuda`, so no module can carry the
stand-in attribute), a fresh registry, all undone after. Yields the call counter.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

from fakes.metax import CALLS, MODULES, build
from glm5_hal.registry import registry
from glm5_hal.vendors import ENV_STAND_IN, ENV_VENDOR


@pytest.fixture(name="fake_metax")
def fake_metax_fixture(monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    for name in MODULES:
        loaded = sys.modules.get(name)
        if loaded is not None and not hasattr(sys.modules.get("mcoplib"), "GLM5_HAL_OP_NAMESPACES"):
            pytest.skip(f"a real {name} is loaded: run the parity suite on the MetaX machine (docs/vendors.md)")
    for var in ("GLM5_HAL_BACKEND", "GLM5_HAL_OP_BACKENDS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv(ENV_VENDOR, "metax")
    monkeypatch.setenv(ENV_STAND_IN, "cpu")
    for name, module in build().items():
        monkeypatch.setitem(sys.modules, name, module)
    CALLS.reset()
    registry().refresh()
    yield CALLS
    registry().refresh()
