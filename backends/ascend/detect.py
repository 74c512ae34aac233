"""Is torch_npu importable, and is an NPU visible? Answered lazily, as a reason a user can act on.

Nothing here runs when glm5_hal or backends.ascend is imported: the registry calls `probe()` the first time
someone asks about the `ascend` backend. A broken CANN install (torch_npu's import fails because libhccl.so or
libascendcl.so is missing) becomes a reason string, never an exception.

torch_npu registers itself as a PyTorch device-backend autoload plugin, so with a working install `import torch`
has already imported it. `TORCH_DEVICE_BACKEND_AUTOLOAD=0` is how a user says "do not load device backends
behind my back"; the probe respects that and then only uses a torch_npu the user imported explicitly.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import sys
from types import ModuleType

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
    message = str(exc)
    missing = _MISSING_LIBRARY.search(message)
    if missing:
        return f"torch_npu import failed: {missing.group(1)} not found; {CANN_HINT}"
    first_line = message.strip().splitlines()[0] if message.strip() else ""
    return f"torch_npu import failed: {type(exc).__name__}: {first_line}"


def autoload_disabled() -> bool:
    return os.environ.get(ENV_AUTOLOAD, "1").strip().lower() in ("0", "false", "no", "off")


def import_torch_npu() -> tuple[ModuleType | None, str]:
    """(the torch_npu module, "") or (None, why not). Never raises."""
    if MODULE in sys.modules:
        module = sys.modules[MODULE]
        if module is None:
            return None, "torch_npu import is blocked (sys.modules['torch_npu'] is None)"
        return module, ""
    try:
        spec = importlib.util.find_spec(MODULE)
    except Exception as exc:  # a broken finder or a half-installed package
        return None, describe_import_failure(exc)
    if spec is None:
        return None, "torch_npu is not installed (pip install torch-npu, the build matching your torch and CANN)"
    if autoload_disabled():
        return None, (
            f"torch_npu is installed but not imported, and {ENV_AUTOLOAD}=0 forbids loading it implicitly; "
            f"`import torch_npu` before using glm5_hal, or unset {ENV_AUTOLOAD}"
        )
    try:
        return importlib.import_module(MODULE), ""
    except Exception as exc:  # CANN missing: ImportError/OSError from loading torch_npu._C
        return None, describe_import_failure(exc)


def _visible_npus(module: ModuleType) -> tuple[int, str]:
    """(number of visible NPUs, "") or (0, why none)."""
    npu = getattr(module, "npu", None)
    if npu is None or not hasattr(npu, "is_available"):
        return 0, "torch_npu has no torch_npu.npu.is_available(); is this a real torch_npu?"
    try:
        if not npu.is_available():
            return 0, ""
        return int(npu.device_count()), ""
    except Exception as exc:  # the driver is present but unusable
        return 0, f"torch_npu.npu.is_available() raised {type(exc).__name__}: {exc}"


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
