"""pytest fixtures that put the strict vllm-kunlun fake in front of the `kunlun` backend.

    from fakes.kunlun.fixture import fake_kunlun_fixture, vllm_kunlun_wheel_fixture  # noqa: F401

`vllm_kunlun_wheel` (session): the vllm-kunlun 0.11.1 wheel, downloaded once into ~/.cache/glm5-hal/wheels (or
$GLM5_HAL_WHEEL_CACHE); without network the tests that need it are skipped with the reason, never passed.
`fake_kunlun` (per test): the fake modules in sys.modules, the machine declared a Kunlunxin one on the CPU stand-in
(GLM5_HAL_VENDOR=kunlun, GLM5_HAL_STAND_IN_DEVICE=cpu: Kunlunxin presents as `cuda`, so no module can carry the
stand-in attribute), a fresh registry, all undone after. Yields the call counter.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from fakes.kunlun import build
from fakes.kunlun.common import CALLS
from fakes.kunlun.wheel import vllm_kunlun_wheel
from fakes.schema_fake import CallCounter
from fakes.wheels import WheelUnavailable
from glm5_hal import weight_cache
from glm5_hal.registry import registry
from glm5_hal.vendors import ENV_STAND_IN, ENV_VENDOR


@pytest.fixture(scope="session", name="vllm_kunlun_wheel")
def vllm_kunlun_wheel_fixture() -> Path:
    """The vllm-kunlun wheel whose wrapper source the fake's schemas are rebuilt from."""
    try:
        return vllm_kunlun_wheel()
    except WheelUnavailable as exc:
        pytest.skip(f"strict vllm-kunlun fake unavailable: {exc}")


@pytest.fixture(name="fake_kunlun")
def fake_kunlun_fixture(vllm_kunlun_wheel: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[CallCounter]:
    loaded = sys.modules.get("vllm_kunlun")
    if loaded is not None and not hasattr(loaded, "GLM5_HAL_OP_NAMESPACES"):
        pytest.skip("a real vllm_kunlun is loaded: run the parity suite on the Kunlunxin machine (docs/vendors.md)")
    for var in ("GLM5_HAL_BACKEND", "GLM5_HAL_OP_BACKENDS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv(ENV_VENDOR, "kunlun")
    monkeypatch.setenv(ENV_STAND_IN, "cpu")
    for name, module in build(vllm_kunlun_wheel).items():
        monkeypatch.setitem(sys.modules, name, module)
    CALLS.reset()
    weight_cache.clear()
    registry().refresh()
    yield CALLS
    weight_cache.clear()
    registry().refresh()
