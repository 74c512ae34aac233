"""Portable backends for accelerators that run the `torch` (and, where the vendor ships one, `triton`) paths.

Each vendor folder under backends/ holds one `VendorSpec` and calls `vendor_backend(spec)`; everything else,
detection included, lives here once (the FlagGems `runtime/backend/_<vendor>/` and vLLM platform-plugin
pattern). Detection, in FlagGems' order:

1. environment: `GLM5_HAL_VENDOR=<backend name>` says which vendor this machine is (and rules the others out);
2. torch: the vendor's extension module imported (lazily, here, never at `import glm5_hal`) and its attribute
   on `torch` (`torch.mlu`, `torch.musa`, ...), or the build marker of a torch that presents as `cuda`
   (`torch.__hcu_version__` for Hygon DTK; `torch.version.hip` alone is any ROCm build, AMD's too, so it is not
   a Hygon signal); a CUDA device whose name says NVIDIA is never taken for a vendor presenting as `cuda`;
3. the vendor's SMI command (`cnmon`, `xpu-smi`, `mthreads-gmi`, `hy-smi`, `mx-smi`) found on PATH and exiting 0.
Every import and command is bounded in time and never raises (glm5_hal.probing): the SMI commands of all
vendors run concurrently the first time one is needed, so a machine where they hang pays one short bound.

A detected vendor is available when torch can use its device. Testing without the hardware: a fake extension
module carrying `GLM5_HAL_STAND_IN_DEVICE = "cpu"`, or the environment variable `GLM5_HAL_STAND_IN_DEVICE=cpu`
next to a detection signal, makes the backend accept CPU tensors and says so in its reason.

A portable vendor (`vendor_backend`: Cambricon, Moore Threads, Hygon, Enflame) has no vendor-tuned kernels: every
op runs the portable `torch` implementation on the vendor's device, or the `triton` one where the vendor's Triton
toolchain imports and glm5-hal's triton backend runs compiled kernels on that device (never Triton's CPU
interpreter on a real device). A vendor with kernels of its own (`tuned_vendor_backend`: Kunlunxin, MetaX; Ascend
has its own backend) runs them for the ops and inputs they fit, over that portable table. `glm5-hal info` shows
which, per op.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

from glm5_hal.kv_formats import FORMATS
from glm5_hal.probing import call_bounded, import_bounded, is_installed, run_commands
from glm5_hal.registry import ALL_OP_NAMES, Availability, Backend, BackendReport, registry

ENV_VENDOR = "GLM5_HAL_VENDOR"
ENV_STAND_IN = "GLM5_HAL_STAND_IN_DEVICE"
STAND_IN_ATTR = "GLM5_HAL_STAND_IN_DEVICE"


@dataclass(frozen=True)
class VendorSpec:
    """What glm5-hal needs to know about one vendor.

    name: the backend name (`GLM5_HAL_BACKEND=<name>`). vendor: who makes the device, for messages.
    device_type: the torch device type its tensors live on ("mlu", "musa", "gcu", or "cuda" for devices that
        present as CUDA). torch_module: the PyTorch extension to import, or None when the vendor ships a whole
        torch build instead. torch_attr: the attribute that extension (or build) adds to `torch`, or None.
    smi: the device-query command, or None where no command is known to work.
    triton_module: the import name of the vendor's Triton toolchain, or None.
    presents_as_cuda: its tensors are on "cuda", so an NVIDIA device name rules it out.
    """

    name: str
    vendor: str
    device_type: str
    torch_module: str | None
    torch_attr: str | None
    smi: str | None
    triton_module: str | None = None
    presents_as_cuda: bool = False

    @property
    def summary(self) -> str:
        return f"{self.vendor} ({self.device_type}): portable torch/triton paths on the device; no tuned kernels yet"


@dataclass(frozen=True)
class Detection:
    found: bool
    how: str  # what said so (or why not), for the availability reason
    stand_in: bool = False  # a fake on the CPU stand-in device


# Every vendor's spec, registered by vendor_backend(): the device-query commands of all of them run at once.
_SPECS: list[VendorSpec] = []


def _import_extension(spec: VendorSpec) -> tuple[object | None, str | None]:
    """(module, None) or (None, why not). A broken vendor install (an import that raises anything, sys.exit()
    included, or hangs) is a reason, never an exception or a freeze."""
    if spec.torch_module is None:
        return None, None
    installed, why_not = is_installed(spec.torch_module)
    if not installed:
        return None, why_not
    imported = import_bounded(spec.torch_module)
    return imported.value, (imported.reason or None)


def _is_nvidia() -> bool:
    try:
        return torch.cuda.is_available() and "NVIDIA" in torch.cuda.get_device_name().upper()
    except Exception:
        return False


def _torch_marker(spec: VendorSpec) -> bool:
    if spec.torch_attr is None:
        return False
    if spec.presents_as_cuda and _is_nvidia():
        return False
    return hasattr(torch, spec.torch_attr)


def _smi_outcome(spec: VendorSpec) -> tuple[bool, str]:
    """(whether spec's SMI command ran and exited 0, what happened). The first call runs every vendor's command
    concurrently (each bounded); later calls reuse those outcomes."""
    if spec.smi is None:
        return False, "no device-query command known"
    outcomes = run_commands([s.smi for s in (*_SPECS, spec) if s.smi is not None])
    return outcomes[spec.smi].ok, outcomes[spec.smi].reason


def detect(spec: VendorSpec) -> Detection:
    """Is this machine's accelerator `spec`'s? Environment first, then torch, then the SMI command."""
    named = os.environ.get(ENV_VENDOR, "").strip().lower()
    if named and named != spec.name:
        return Detection(False, f"{ENV_VENDOR}={named} names another vendor")
    module, import_error = _import_extension(spec)
    stand_in = getattr(module, STAND_IN_ATTR, None) == "cpu" or os.environ.get(ENV_STAND_IN, "") == "cpu"
    if named == spec.name:
        return Detection(True, f"{ENV_VENDOR}={named}", stand_in)
    if import_error and spec.torch_attr is None:
        return Detection(False, import_error)
    if module is not None or _torch_marker(spec):
        marker = spec.torch_module if module is not None else f"torch.{spec.torch_attr}"
        return Detection(True, f"{marker} found", stand_in)
    smi_ok, smi = _smi_outcome(spec)
    if smi_ok:
        return Detection(True, f"{spec.smi} found on PATH", stand_in)
    why = import_error or (f"no torch.{spec.torch_attr}" if spec.torch_attr else "nothing in torch tells it apart")
    return Detection(False, f"no {spec.vendor} device found ({why}; {smi})")


def _device_usable(device_type: str) -> tuple[bool, str]:
    """(whether torch.<device_type>.is_available(), the reason if not); a raising or hanging driver is a reason."""
    module = getattr(torch, device_type, None)
    if module is None or not hasattr(module, "is_available"):
        return False, f"no torch.{device_type} module, so torch.{device_type}.is_available() is False"
    what = f"torch.{device_type}.is_available()"
    outcome = call_bounded(module.is_available, what)
    if outcome.reason:
        return False, outcome.reason
    return bool(outcome.value), f"{what} is False"


def probe(spec: VendorSpec, found: Detection | None = None) -> Availability:
    """Availability of `spec` here, from `found` (detected now when not given)."""
    found = found if found is not None else detect(spec)
    if not found.found:
        return Availability(False, found.how)
    if found.stand_in:
        return Availability(
            True,
            f"{found.how}; a fake for testing: runs on the CPU stand-in device, not on {spec.vendor} hardware",
            (spec.device_type, "cpu"),
            auto_eligible=True,
        )
    if spec.presents_as_cuda and _is_nvidia():
        return Availability(False, f"{found.how}, but the CUDA device is NVIDIA's: use the triton or torch backend")
    usable, why_not = _device_usable(spec.device_type)
    if not usable:
        return Availability(False, f"{found.how}, but {why_not}")
    return Availability(True, f"{found.how}; {spec.device_type} device available", (spec.device_type,))


def vendor_triton_usable(spec: VendorSpec, stand_in: bool) -> bool:
    """Whether `spec`'s ops take the `triton` path here (call after the vendor's probe said available).

    The vendor's Triton toolchain must import, and glm5-hal's triton backend must run on the device the vendor's
    tensors are on: compiled there on a real device. Triton's CPU interpreter would otherwise be switched on for
    the whole process and fed device tensors. On the CPU stand-in the device is the CPU, so the interpreter is
    the stand-in's Triton, and the parity tests exercise the triton path of the vendor backends through it.
    """
    if spec.triton_module is None or not is_installed(spec.triton_module)[0]:
        return False
    triton = registry().availability("triton")
    if stand_in:
        return triton.runs_on("cpu")
    return triton.runs_on(spec.device_type) and not triton.emulated


def vendor_backend(spec: VendorSpec) -> Backend:
    """The Backend of a portable vendor: every op runs `triton` where the vendor's Triton works, else `torch`.

    The delegate of each op is decided when the ops load (it depends on what imports on this machine), so the
    `delegates` mapping is filled then; `glm5-hal info` shows it per op.
    """
    _SPECS.append(spec)
    delegates: dict[str, str] = {}
    detected: list[Detection] = []  # the last probe's detection: load_ops runs right after a successful probe

    def run_probe() -> Availability:
        detected[:] = [detect(spec)]
        return probe(spec, detected[0])

    def load_ops() -> Mapping[str, Callable]:
        reg = registry()
        stand_in = bool(detected) and detected[0].stand_in
        triton_ops = reg.ops("triton") if vendor_triton_usable(spec, stand_in) else {}
        torch_ops = reg.ops("torch")
        delegates.clear()
        delegates.update({op: "triton" if op in triton_ops else "torch" for op in ALL_OP_NAMES})
        return {op: (triton_ops.get(op) or torch_ops[op]) for op in ALL_OP_NAMES}

    return Backend(
        name=spec.name,
        summary=spec.summary,
        probe=run_probe,
        load_ops=load_ops,
        # Above the plain torch backend (the same code, but this one knows the device), below tuned backends.
        auto_priority=10,
        delegates=delegates,
        notes=(
            f"no {spec.vendor}-tuned kernels yet: ops run on {spec.device_type} through the portable torch path"
            + (
                f", or the triton backend where the vendor's Triton (`{spec.triton_module}`) imports and the triton "
                f"backend compiles for {spec.device_type}"
                if spec.triton_module
                else ""
            ),
        ),
    )


class KernelTable(Protocol):
    """A vendor's op table (backends/<vendor>/ops.py): the adapters of the ops its kernels serve, and their routes.

    vendor_ops(portable_ops): {op: adapter}, given the portable ops {op: implementation}. Imports the vendor library
        (bounded), never at `import glm5_hal`; with the library missing it maps nothing (or adapters that run the
        portable op) and `routes` says why. An adapter runs the portable op itself for inputs its kernel's
        documented range does not cover.
    routes(): {op: {"kernel": what runs where inputs fit ("" if nothing), "why": why not, or its limits}}, the
        per-op section of `glm5-hal info`.
    """

    def vendor_ops(self, portable_ops: Mapping[str, Callable]) -> Mapping[str, Callable]: ...

    def routes(self) -> Mapping[str, Mapping[str, str]]: ...


@dataclass(frozen=True)
class VendorKernels:
    """A vendor's own kernels over its portable table (tuned_vendor_backend).

    summary: the backend's line in `glm5-hal info`. notes: its extra lines there.
    table: () -> the vendor's KernelTable (its ops module), called when the ops load or the report is made, so that
        importing the vendor's backend package imports none of its adapters.
    """

    summary: str
    notes: tuple[str, ...]
    table: Callable[[], KernelTable]


def tuned_vendor_backend(spec: VendorSpec, kernels: VendorKernels) -> Backend:
    """The Backend of a vendor with kernels of its own: detection and the portable table as vendor_backend, the
    ops `kernels.load` maps replaced by its adapters (shown "native" by `glm5-hal info`, the rest "via torch" /
    "via triton"), and a report listing each op's kernel or why the portable path runs."""
    portable = vendor_backend(spec)
    delegates: dict[str, str] = {}

    def load_ops() -> Mapping[str, Callable]:
        ops = dict(portable.load_ops())
        mapped = kernels.table().vendor_ops(ops)
        delegates.clear()
        delegates.update({op: how for op, how in portable.delegates.items() if op not in mapped})
        return {**ops, **mapped}

    def report() -> BackendReport:
        table = {op: dict(route) for op, route in kernels.table().routes().items()}
        lines = [f"{spec.name} kernels (per op: the vendor kernel that runs where inputs fit, or why not)"]
        for op, route in table.items():
            kernel, why = route.get("kernel", ""), route.get("why", "")
            lines.append(f"  {op}: {kernel}" + (f" ({why})" if why else "") if kernel else f"  {op}: portable ({why})")
        return BackendReport(tuple(lines), {"kernels": table})

    return Backend(
        name=spec.name,
        summary=kernels.summary,
        probe=portable.probe,
        load_ops=load_ops,
        auto_priority=portable.auto_priority,
        delegates=delegates,
        notes=kernels.notes,
        # The quantized cache formats: adapters read them with a kernel where one takes them, portably otherwise.
        kv_cache_dtypes=tuple(FORMATS),
        report=report,
    )
