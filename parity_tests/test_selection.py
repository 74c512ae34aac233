"""Backend discovery and selection: env vars, per-op override, context manager, auto, fallback, strict, plugins."""

from __future__ import annotations

import importlib.metadata
import os
import sys
import types
import warnings

import pytest
import torch

import glm5_hal
from glm5_hal import selection
from glm5_hal.registry import ANY_DEVICE, OP_NAMES, Availability, Backend, Registry, registry


def _x() -> torch.Tensor:
    return torch.randn(3, 128)


@pytest.fixture
def partial_backend():
    """A backend implementing only hadamard_transform (it tags its result so tests can see who ran)."""
    calls: list[str] = []

    def hadamard(x, *, scale=None):
        calls.append("hadamard_transform")
        return torch.full_like(x, 7.0)

    backend = Backend(
        name="partial",
        summary="test backend with one op",
        probe=lambda: Availability(True, "always", (ANY_DEVICE,)),
        load_ops=lambda: {"hadamard_transform": hadamard},
    )
    registry().register(backend)
    yield calls
    registry().unregister("partial")


@pytest.fixture(autouse=True)
def _clean_selection(monkeypatch):
    for var in (selection.ENV_BACKEND, selection.ENV_OP_BACKENDS, selection.ENV_STRICT):
        monkeypatch.delenv(var, raising=False)
    selection.set_backend(None)
    for op in OP_NAMES:
        selection.set_backend(None, op=op)
    selection._warned.clear()
    yield
    selection.set_backend(None)


def test_auto_picks_torch_on_cpu_and_says_why():
    res = glm5_hal.resolve("sparse_flash_attention", "cpu")
    assert res.backend == "torch"
    assert "auto picked 'torch'" in res.reason
    # The reference is never picked automatically, and says so.
    assert "reference: only when named explicitly" in res.reason


def test_auto_resolution_is_reused_until_the_registry_changes():
    """auto's answer is cached per (op, device type); registering, unregistering or refreshing invalidates it."""
    first = glm5_hal.resolve("hadamard_transform", "cpu")
    assert glm5_hal.resolve("hadamard_transform", "cpu") is first  # built once, not on every op call
    eager = Backend(
        name="eager_winner",
        summary="test backend auto prefers",
        probe=lambda: Availability(True, "always", (ANY_DEVICE,)),
        load_ops=lambda: {"hadamard_transform": lambda x, *, scale=None: torch.full_like(x, 3.0)},
        auto_priority=10_000,
    )
    registry().register(eager)
    try:
        assert glm5_hal.resolve("hadamard_transform", "cpu").backend == "eager_winner"
        assert (glm5_hal.hadamard_transform(_x()) == 3.0).all()
    finally:
        registry().unregister("eager_winner")
    assert glm5_hal.resolve("hadamard_transform", "cpu").backend == first.backend
    registry().refresh()
    assert glm5_hal.resolve("hadamard_transform", "cpu") is not first  # re-probed, rebuilt
    assert glm5_hal.resolve("hadamard_transform", "cpu").backend == first.backend


def test_env_var_selects_backend(monkeypatch, partial_backend):
    monkeypatch.setenv(selection.ENV_BACKEND, "partial")
    out = glm5_hal.hadamard_transform(_x())
    assert partial_backend == ["hadamard_transform"]
    assert torch.all(out == 7.0)


def test_unknown_backend_lists_available_and_why_not(monkeypatch):
    monkeypatch.setenv(selection.ENV_BACKEND, "nosuch")
    with pytest.raises(glm5_hal.BackendNotFoundError) as err:
        glm5_hal.hadamard_transform(_x())
    msg = str(err.value)
    assert "unknown backend 'nosuch'" in msg
    assert "torch: available" in msg and "reference: available" in msg
    assert "ascend: unavailable" in msg  # the others are listed with their reason


def test_unavailable_backend_gives_its_reason(monkeypatch):
    registry().register(
        Backend(
            "ghost",
            "no device",
            probe=lambda: Availability(False, "libghost.so not found; is GhostSDK installed?"),
            load_ops=dict,
        )
    )
    try:
        monkeypatch.setenv(selection.ENV_BACKEND, "ghost")
        with pytest.raises(glm5_hal.BackendUnavailableError, match="libghost.so not found"):
            glm5_hal.hadamard_transform(_x())
    finally:
        registry().unregister("ghost")


def test_missing_op_falls_back_to_torch_with_one_warning(monkeypatch, partial_backend):
    monkeypatch.setenv(selection.ENV_BACKEND, "partial")
    with pytest.warns(RuntimeWarning, match="does not implement dynamic_quant; falling back to 'torch'"):
        q, _ = glm5_hal.dynamic_quant(_x())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second call must not warn again
        glm5_hal.dynamic_quant(_x())
    assert q.dtype == torch.int8


def test_strict_mode_forbids_fallback(monkeypatch, partial_backend):
    monkeypatch.setenv(selection.ENV_BACKEND, "partial")
    monkeypatch.setenv(selection.ENV_STRICT, "1")
    with pytest.raises(glm5_hal.OpNotImplementedError, match="strict mode"):
        glm5_hal.dynamic_quant(_x())


def test_per_op_env_override(monkeypatch, partial_backend):
    monkeypatch.setenv(selection.ENV_OP_BACKENDS, "hadamard_transform=partial")
    glm5_hal.hadamard_transform(_x())
    assert glm5_hal.resolve("dynamic_quant", "cpu").backend == "torch"
    assert partial_backend == ["hadamard_transform"]


def test_per_op_env_override_rejects_bad_spec(monkeypatch):
    monkeypatch.setenv(selection.ENV_OP_BACKENDS, "no_such_op=torch")
    with pytest.raises(ValueError, match="unknown"):
        glm5_hal.resolve("dynamic_quant", "cpu")


def test_context_manager_nests_and_restores(partial_backend):
    with glm5_hal.use_backend("reference"):
        assert glm5_hal.resolve("hadamard_transform", "cpu").backend == "reference"
        with glm5_hal.use_backend("partial", ops=["hadamard_transform"]):
            assert glm5_hal.resolve("hadamard_transform", "cpu").backend == "partial"
            assert glm5_hal.resolve("moe_gate", "cpu").backend == "reference"
        assert glm5_hal.resolve("hadamard_transform", "cpu").backend == "reference"
    assert glm5_hal.resolve("hadamard_transform", "cpu").backend == "torch"


def test_context_manager_strict(partial_backend):
    with glm5_hal.use_backend("partial", strict=True), pytest.raises(glm5_hal.OpNotImplementedError):
        glm5_hal.resolve("moe_gate", "cpu")


def test_set_backend_per_op_and_unknown_name():
    glm5_hal.set_backend("reference", op="moe_gate")
    assert glm5_hal.resolve("moe_gate", "cpu").backend == "reference"
    assert glm5_hal.resolve("moe_dispatch", "cpu").backend == "torch"
    with pytest.raises(glm5_hal.BackendNotFoundError):
        glm5_hal.set_backend("nosuch")
    with pytest.raises(ValueError, match="unknown"):
        glm5_hal.use_backend("torch", ops=["not_an_op"]).__enter__()


def test_backend_must_run_on_the_inputs_device(partial_backend):
    registry().register(Backend("npu_only", "npu", probe=lambda: Availability(True, "fake", ("npu",)), load_ops=dict))
    try:
        with glm5_hal.use_backend("npu_only"), pytest.raises(glm5_hal.BackendUnavailableError, match="'cpu'"):
            glm5_hal.hadamard_transform(_x())
    finally:
        registry().unregister("npu_only")


def test_registry_knows_every_planned_backend():
    names = set(registry().names())
    assert {
        "reference",
        "torch",
        "triton",
        "ascend",
        "cambricon",
        "kunlun",
        "mthreads",
        "hygon",
        "metax",
        "enflame",
    } <= names


# ------------------------------------------------------------------------------------------- entry-point plugins
class _FakeEntryPoint:
    def __init__(self, name: str, value: str) -> None:
        self.name, self.value = name, value

    def load(self):
        module, _, attr = self.value.partition(":")
        return getattr(importlib.import_module(module), attr)


def _plugin_module(monkeypatch) -> None:
    module = types.ModuleType("fake_vendor_plugin")
    module.BACKEND = Backend(
        "fakevendor",
        "out-of-tree plugin",
        probe=lambda: Availability(True, "fake device found", ("cpu",)),
        load_ops=lambda: {"hadamard_transform": lambda x, *, scale=None: torch.zeros_like(x)},
        auto_priority=50,
    )
    module.BROKEN = property  # not a Backend
    monkeypatch.setitem(sys.modules, "fake_vendor_plugin", module)


def test_out_of_tree_plugin_is_discovered_and_picked_by_auto(monkeypatch):
    _plugin_module(monkeypatch)
    eps = [
        _FakeEntryPoint("fakevendor", "fake_vendor_plugin:BACKEND"),
        _FakeEntryPoint("torch", "backends.torch_eager.descriptor:BACKEND"),
    ]
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: eps)
    reg = Registry()
    assert reg.names() == ["fakevendor", "torch"]
    assert reg.availability("fakevendor").available
    assert "hadamard_transform" in reg.ops("fakevendor")


def test_broken_plugins_are_reported_not_fatal(monkeypatch):
    _plugin_module(monkeypatch)
    eps = [
        _FakeEntryPoint("crashes", "no_such_module_xyz:BACKEND"),
        _FakeEntryPoint("wrongtype", "fake_vendor_plugin:BROKEN"),
        _FakeEntryPoint("torch", "backends.torch_eager.descriptor:BACKEND"),
    ]
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: eps)
    reg = Registry()
    assert reg.names() == ["crashes", "torch", "wrongtype"]
    assert "ModuleNotFoundError" in reg.availability("crashes").reason
    assert "is not a glm5_hal.registry.Backend" in reg.availability("wrongtype").reason
    assert reg.availability("torch").available


def test_a_raising_probe_is_reported_as_unavailable():
    def probe():
        raise OSError("driver exploded")

    reg = Registry()
    reg._backends = {"bad": Backend("bad", "", probe=probe, load_ops=dict)}
    avail = reg.availability("bad")
    assert not avail.available and "driver exploded" in avail.reason


def test_importing_glm5_hal_imports_no_vendor_library():
    vendor_modules = ("torch_npu", "torch_mlu", "torch_musa", "torch_gcu", "triton")
    code = (
        f"import sys, glm5_hal; glm5_hal.registry().names();print([m for m in {vendor_modules!r} if m in sys.modules])"
    )
    import subprocess

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# --- glm5_hal.environment: the settings reader the ops call on every call ---


@pytest.mark.parametrize("value", ["torch", " reference ", "", "é-non-ascii"])
def test_setting_reads_what_os_environ_holds_after_every_change(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    from glm5_hal.environment import setting

    name = "GLM5_HAL_TEST_SETTING"
    monkeypatch.delenv(name, raising=False)
    assert setting(name) == "" and setting(name, "auto") == "auto"
    monkeypatch.setenv(name, value)
    assert setting(name, "auto") == os.environ.get(name, "auto") == value
    monkeypatch.delenv(name)
    assert setting(name, "auto") == "auto"


def test_a_backend_set_in_the_environment_applies_to_the_next_call(monkeypatch: pytest.MonkeyPatch) -> None:
    # The ops read GLM5_HAL_BACKEND through glm5_hal.environment: a change between two calls must show.
    monkeypatch.setenv("GLM5_HAL_BACKEND", "reference")
    assert selection.resolve("moe_gate", "cpu").backend == "reference"
    monkeypatch.setenv("GLM5_HAL_BACKEND", "torch")
    assert selection.resolve("moe_gate", "cpu").backend == "torch"


def test_parsed_setting_parses_each_value_once_and_follows_every_change(monkeypatch: pytest.MonkeyPatch) -> None:
    from glm5_hal.environment import parsed_setting, raw_setting

    name = "GLM5_HAL_TEST_PARSED"
    parsed = []

    def parse(value: str) -> int:
        parsed.append(value)
        if value == "bad":
            raise ValueError("bad value")
        return len(value)

    monkeypatch.delenv(name, raising=False)
    assert raw_setting(name) is None
    assert parsed_setting(name, parse) == 0 and parsed_setting(name, parse) == 0 and parsed == [""]
    monkeypatch.setenv(name, "abc")
    assert raw_setting(name) is not None
    assert parsed_setting(name, parse) == 3 and parsed_setting(name, parse) == 3 and parsed == ["", "abc"]
    monkeypatch.setenv(name, "bad")
    for _ in range(2):  # a value that does not parse raises on every call, not once
        with pytest.raises(ValueError, match="bad value"):
            parsed_setting(name, parse)
    assert parsed == ["", "abc", "bad", "bad"]
    monkeypatch.delenv(name)
    assert parsed_setting(name, parse) == 0 and parsed == ["", "abc", "bad", "bad"]  # "" was parsed before


def test_strict_and_per_op_settings_apply_to_the_next_call(monkeypatch, partial_backend) -> None:
    # resolve() remembers its answers per (op, device, request, strict): each setting must still show on the next
    # call, and a fallback must still warn in every test that clears the warnings (it is not remembered).
    monkeypatch.setenv(selection.ENV_BACKEND, "partial")
    for _ in range(2):
        selection._warned.clear()  # as the next test's fixture does
        with pytest.warns(RuntimeWarning, match="falling back"):
            assert selection.resolve("sparse_flash_attention", "cpu").fallback
    monkeypatch.setenv(selection.ENV_STRICT, "1")
    with pytest.raises(selection.OpNotImplementedError):
        selection.resolve("sparse_flash_attention", "cpu")
    monkeypatch.delenv(selection.ENV_STRICT)
    monkeypatch.delenv(selection.ENV_BACKEND)
    assert selection.resolve("hadamard_transform", "cpu").backend == "torch"
    monkeypatch.setenv(selection.ENV_OP_BACKENDS, "hadamard_transform=partial")
    assert selection.resolve("hadamard_transform", "cpu").backend == "partial"
    registry().unregister("partial")  # a registry change invalidates what was remembered
    with pytest.raises(selection.BackendNotFoundError):
        selection.resolve("hadamard_transform", "cpu")
