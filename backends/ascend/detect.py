"""Is torch_npu importable, and is an NPU visible? Answered lazily, as a reason a user can act on.

Nothing here runs when glm5_hal or backends.ascend is imported: the registry calls `probe()` the first time
someone asks about the `ascend` backend. A broken CANN install (torch_npu's import fails because libhccl.so or
libascendcl.so is missing) becomes a reason string, never an exception.

torch_npu registers itself as a PyTorch device-backend autoload plugin, so with a working install `import torch`
has already imported it. `TORCH_DEVICE_BACKEND_AUTOLOAD=0` is how a user says "do not load device backends
behind my back"; the probe respects that and then only uses a torch_npu the user imported explicitly.
"""

from __future__ import annotations

import os
import re
import sys
from types import ModuleType

from glm5_hal.probing import call_bounded, describe_exception, import_bounded, is_installed
from glm5_hal.registry import Availability

MODULE = "torch_npu"
DEVICE_TYPE = "npu"
ENV_AUTOLOAD = "TORCH_DEVICE_BACKEND_AUTOLOAD"
# Agreed across glm5-hal's vendor backends: a test double of a vendor module sets this to the torch device type
# it really runs on ("cpu"). The real torch_npu never has it.
STAND_IN_ATTR = "GLM5_HAL_STAND_IN_DEVICE"
CANN_HINT = "is CANN installed? (source set_env.sh from the CANN toolkit, e.g. /usr/local/Ascend/ascend-toolkit)"

_MISSING_LIBRARY = re.compile(r"(lib[\w+.-]*?\.so(?:\.\d+)*)\s*:\s*cannot open shared object file")


def describe_import_failure(exc: BaseException) -> str:
    """The reason shown by `glm5-hal info` when `import torch_npu` raised `exc`."""
    missing = _MISSING_LIBRARY.search(str(exc))
    if missing:
        return f"torch_npu import failed: {missing.group(1)} not found; {CANN_HINT}"
    return f"torch_npu import failed: {describe_exception(exc)}"


def autoload_disabled() -> bool:
    return os.environ.get(ENV_AUTOLOAD, "1").strip().lower() in ("0", "false", "no", "off")


def import_torch_npu() -> tuple[ModuleType | None, str]:
    """(the torch_npu module, "") or (None, why not). Never raises, and never waits longer than the probe bound
    (glm5_hal.probing): a torch_npu whose import hangs on the driver is a "timed out" reason."""
    if MODULE in sys.modules:
        module = sys.modules[MODULE]
        if module is None:
            return None, "torch_npu import is blocked (sys.modules['torch_npu'] is None)"
        return module, ""
    installed, why_not = is_installed(MODULE)
    if not installed:
        if why_not.endswith("is not installed"):
            return None, "torch_npu is not installed (pip install torch-npu, the build matching your torch and CANN)"
        return None, why_not
    if autoload_disabled():
        return None, (
            f"torch_npu is installed but not imported, and {ENV_AUTOLOAD}=0 forbids loading it implicitly; "
            f"`import torch_npu` before using glm5_hal, or unset {ENV_AUTOLOAD}"
        )
    imported = import_bounded(MODULE)  # CANN missing: ImportError/OSError from loading torch_npu._C
    if imported.error is not None:
        return None, describe_import_failure(imported.error)
    return imported.value, imported.reason


def _visible_npus(module: ModuleType) -> tuple[int, str]:
    """(number of visible NPUs, "") or (0, why none)."""
    npu = getattr(module, "npu", None)
    if npu is None or not hasattr(npu, "is_available"):
        return 0, "torch_npu has no torch_npu.npu.is_available(); is this a real torch_npu?"
    # Bounded and never raising: a present but unusable driver may raise, or hang.
    outcome = call_bounded(lambda: int(npu.device_count()) if npu.is_available() else 0, "torch_npu.npu.is_available()")
    return (0, outcome.reason) if outcome.reason else (int(outcome.value), "")


def probe() -> Availability:
    """Availability of the `ascend` backend here; device_types ("npu",), plus the stand-in device of a fake."""
    module, reason = import_torch_npu()
    if module is None:
        return Availability(False, reason)
    version = getattr(module, "__version__", "(unknown version)")
    stand_in = getattr(module, STAND_IN_ATTR, None)
    if stand_in:
        return Availability(
            True,
            f"torch_npu {version} is a test fake running on the {stand_in!r} stand-in device, not on an NPU",
            (DEVICE_TYPE, str(stand_in)),
        )
    count, problem = _visible_npus(module)
    if problem:
        return Availability(False, problem)
    if count == 0:
        return Availability(
            False,
            f"torch_npu {version} imported but no NPU is visible (torch.npu.is_available() is False); "
            "check `npu-smi info` and ASCEND_RT_VISIBLE_DEVICES",
        )
    return Availability(True, f"torch_npu {version}: {count} NPU(s) visible", (DEVICE_TYPE,))
