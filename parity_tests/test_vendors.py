"""The six portable vendor backends (glm5_hal.vendors): detection by environment, torch marker and SMI command,
NVIDIA never confused with a vendor that presents as cuda, a broken vendor install reported, selection by
`auto` and by name, and parity on the CPU stand-in device.

Fakes: an extension module in sys.modules carrying GLM5_HAL_STAND_IN_DEVICE = "cpu" (cambricon, mthreads,
enflame), a torch attribute (hygon), an SMI executable on PATH (kunlun, metax); the last three present as cuda,
so the environment variable GLM5_HAL_STAND_IN_DEVICE=cpu puts them on the CPU stand-in (docs/vendors.md). A
"real device" is faked by a usable torch device module (or a non-NVIDIA torch.cuda) and no stand-in.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import os
import stat
import sys
import types
from collections.abc import Iterator

import pytest
import torch

from glm5_hal.cli.info import op_table
from glm5_hal.parity import CASES, run_case
from glm5_hal.registry import ALL_OP_NAMES, OP_NAMES, Availability, Backend, registry
from glm5_hal.selection import resolve, use_backend
from glm5_hal.vendors import ENV_STAND_IN, ENV_VENDOR, STAND_IN_ATTR, VendorSpec, vendor_triton_usable

VENDORS = ("cambricon", "kunlun", "mthreads", "hygon", "metax", "enflame")


def _load_spec(name: str) -> VendorSpec:
    return importlib.import_module(f"backends.{name}").SPEC


@pytest.fixture
def fresh_registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    # These tests are about `auto` and detection: a GLM5_HAL_BACKEND chosen for the parity run must not leak in.
    for var in ("GLM5_HAL_BACKEND", "GLM5_HAL_OP_BACKENDS", "GLM5_HAL_VENDOR", "GLM5_HAL_STAND_IN_DEVICE"):
        monkeypatch.delenv(var, raising=False)
    registry().refresh()
    yield
    registry().refresh()


def _fake_module(monkeypatch: pytest.MonkeyPatch, name: str, stand_in: bool = True) -> None:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, loader=None)
    if stand_in:
        setattr(module, STAND_IN_ATTR, "cpu")
    monkeypatch.setitem(sys.modules, name, module)


def _fake_smi(monkeypatch: pytest.MonkeyPatch, tmp_path, command: str, exit_code: int = 0) -> None:
    script = tmp_path / command
    script.write_text(f"#!/bin/sh\necho fake {command}\nexit {exit_code}\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '')}")


def _fake_vendor(name: str, monkeypatch: pytest.MonkeyPatch, tmp_path) -> str:
    """Make `name` detectable the way its real device would be; returns the signal the reason must name."""
    spec = _load_spec(name)
    if spec.torch_module is not None:
        _fake_module(monkeypatch, spec.torch_module)
        return spec.torch_module
    monkeypatch.setenv(ENV_STAND_IN, "cpu")
    if spec.torch_attr is not None:
        monkeypatch.setattr(torch, spec.torch_attr, "fake-1.0", raising=False)
        return f"torch.{spec.torch_attr}"
    _fake_smi(monkeypatch, tmp_path, spec.smi)
    return spec.smi


@pytest.mark.parametrize("name", VENDORS)
def test_not_detected_without_any_signal(name, fresh_registry):
    avail = registry().availability(name)
    assert not avail.available
    assert "no " in avail.reason and "found" in avail.reason, avail.reason


@pytest.mark.parametrize("name", VENDORS)
def test_detected_by_its_own_signal_and_picked_by_auto(name, monkeypatch, tmp_path, fresh_registry):
    signal = _fake_vendor(name, monkeypatch, tmp_path)
    avail = registry().availability(name)
    assert avail.available, avail.reason
    assert signal in avail.reason and "CPU stand-in" in avail.reason
    assert _load_spec(name).device_type in avail.device_types
    for op in OP_NAMES:
        assert resolve(op, "cpu").backend == name  # auto prefers the vendor over plain torch on its device
    with use_backend(name):
        assert resolve("sparse_flash_attention", "cpu").requested == name


@pytest.mark.parametrize("name", VENDORS)
def test_environment_variable_names_the_vendor_and_rules_out_the_others(name, monkeypatch, fresh_registry):
    monkeypatch.setenv(ENV_VENDOR, name)
    monkeypatch.setenv(ENV_STAND_IN, "cpu")
    assert registry().availability(name).available
    assert f"{ENV_VENDOR}={name}" in registry().availability(name).reason
    for other in VENDORS:
        if other != name:
            assert not registry().availability(other).available
            assert "names another vendor" in registry().availability(other).reason


@pytest.mark.parametrize("name", ["kunlun", "hygon", "metax"])
def test_nvidia_is_not_taken_for_a_vendor_presenting_as_cuda(name, monkeypatch, tmp_path, fresh_registry):
    spec = _load_spec(name)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    if spec.torch_attr is not None:
        monkeypatch.setattr(torch, spec.torch_attr, "fake-1.0", raising=False)
        assert not registry().availability(name).available  # the marker alone does not override NVIDIA
        registry().refresh()
    _fake_smi(monkeypatch, tmp_path, spec.smi)
    avail = registry().availability(name)
    assert not avail.available and "NVIDIA" in avail.reason, avail.reason


def test_an_amd_rocm_build_is_not_taken_for_hygon(monkeypatch, fresh_registry):
    # torch.version.hip is set by every ROCm build; only DTK's torch.__hcu_version__ (or hy-smi) says Hygon.
    monkeypatch.setattr(torch.version, "hip", "6.2.41133", raising=False)
    monkeypatch.delattr(torch, "__hcu_version__", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "AMD Instinct MI300X")
    avail = registry().availability("hygon")
    assert not avail.available and "no Hygon DCU device found" in avail.reason, avail.reason


def test_a_vendor_smi_that_fails_is_not_a_detection(monkeypatch, tmp_path, fresh_registry):
    _fake_smi(monkeypatch, tmp_path, "mx-smi", exit_code=1)
    assert not registry().availability("metax").available


def test_a_broken_vendor_module_is_reported_not_fatal(monkeypatch, tmp_path, fresh_registry):
    (tmp_path / "torch_mlu.py").write_text("raise ImportError('libcnrt.so: cannot open shared object file')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "torch_mlu", raising=False)
    avail = registry().availability("cambricon")
    assert not avail.available
    assert "torch_mlu import failed" in avail.reason and "libcnrt.so" in avail.reason
    assert resolve("moe_gate", "cpu").backend == "torch"  # everything else still works


def test_without_the_stand_in_a_detected_vendor_needs_its_device(monkeypatch, fresh_registry):
    _fake_module(monkeypatch, "torch_musa", stand_in=False)
    avail = registry().availability("mthreads")
    assert not avail.available and "torch.musa.is_available() is False" in avail.reason


@pytest.mark.parametrize("name", VENDORS)
def test_info_shows_which_portable_backend_runs_each_op(name, monkeypatch, tmp_path, fresh_registry):
    _fake_vendor(name, monkeypatch, tmp_path)
    table = op_table(name)
    assert set(table) == set(ALL_OP_NAMES)
    assert set(table.values()) <= {"via torch", "via triton"}
    assert table["ep_dispatch"] == table["ep_combine"] == "via torch"  # the portable exchange
    triton_ok = vendor_triton_usable(_load_spec(name), stand_in=True)
    assert (table["moe_gate"] == "via triton") == (triton_ok and "moe_gate" in registry().ops("triton"))
    assert table["sparse_flash_attention"] == (
        "via triton" if triton_ok and "sparse_flash_attention" in registry().ops("triton") else "via torch"
    )


def _replace_triton(availability: Availability, ops: dict) -> None:
    """Swap the triton backend for one that reports `availability` and implements `ops` (fresh_registry undoes it)."""
    registry().unregister("triton")
    registry().register(Backend("triton", "stand-in triton", probe=lambda: availability, load_ops=lambda: ops))


def _on_a_real_device(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make `name` detected on its own (faked) device, without the CPU stand-in."""
    spec = _load_spec(name)
    if spec.torch_module is not None:
        _fake_module(monkeypatch, spec.torch_module, stand_in=False)
    else:
        monkeypatch.setattr(torch, spec.torch_attr, "fake-1.0", raising=False)
    device = types.SimpleNamespace(is_available=lambda: True)
    if spec.presents_as_cuda:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: f"{spec.vendor} fake device")
    else:
        monkeypatch.setattr(torch, spec.device_type, device, raising=False)


def _compiled_moe_gate(*args, **kwargs):
    raise AssertionError("only its identity matters here")


@pytest.mark.parametrize(
    ("name", "triton_where", "expected"),
    [
        ("hygon", Availability(True, "compiled on the DCU", ("cuda",)), "via triton"),
        ("mthreads", Availability(True, "compiled on a CUDA GPU", ("cuda",)), "via torch"),
        ("hygon", Availability(True, "CPU interpreter", ("cpu",), auto_eligible=False, emulated=True), "via torch"),
        ("hygon", Availability(False, "triton is not installed"), "via torch"),
    ],
    ids=["compiled-on-its-device", "compiled-elsewhere", "interpreter-only", "no-triton"],
)
def test_on_a_real_device_the_triton_path_needs_compiled_triton_there(
    name, triton_where, expected, monkeypatch, fresh_registry
):
    # Triton's CPU interpreter must never be given device tensors, nor switched on for a process that has them.
    _on_a_real_device(name, monkeypatch)
    _replace_triton(triton_where, {"moe_gate": _compiled_moe_gate})
    avail = registry().availability(name)
    assert avail.available and "CPU stand-in" not in avail.reason, avail.reason
    assert op_table(name)["moe_gate"] == expected
    assert (registry().ops(name)["moe_gate"] is _compiled_moe_gate) == (expected == "via triton")
    assert op_table(name)["sparse_flash_attention"] == "via torch"  # not in this triton table


# One case of every op, in both dtypes: the vendor backends run the same torch / triton functions that the full
# suite already checks case by case, so here the point is that they run, through the vendor, on its device.
_REPRESENTATIVE = {}
for _case in CASES:
    if not _case.slow:
        _REPRESENTATIVE.setdefault(_case.op, _case)


# And a quantized-cache writer and reader (glm5_hal.kv_formats): vendors take the formats their delegates take.
for _case in CASES:
    if _case.id in ("mla_prolog/mini_decode_int8_mla", "lightning_indexer/mini_decode_fp8_index"):
        _REPRESENTATIVE[_case.id] = _case


@pytest.mark.parametrize("name", VENDORS)
@pytest.mark.parametrize("case", list(_REPRESENTATIVE.values()), ids=lambda c: c.id)
def test_parity_on_the_cpu_stand_in(name, case, monkeypatch, tmp_path, fresh_registry, record_parity):
    _fake_vendor(name, monkeypatch, tmp_path)
    for dtype in case.dtypes:
        result = run_case(case, name, dtype, device="cpu")
        record_parity(result)
        assert result.passed, f"{result.status}: {result.detail}"
