"""Where the Triton kernels run in this process: natively on a GPU, or under Triton's CPU interpreter.

Triton decides at decoration time (`@triton.jit`, including the helpers inside `triton.language`) whether a
function is compiled or interpreted, from the `TRITON_INTERPRET` environment variable. So the choice has to be
made before `triton` is first imported: `use_interpreter_if_no_gpu()` does that for the backend, and the test
suite's conftest does it for the tests. Kernel modules read `DOT_UPCAST` once, at their import.
"""

from __future__ import annotations

import os
import sys

import torch

ENV_INTERPRET = "TRITON_INTERPRET"


def interpreting() -> bool:
    """Whether Triton kernels in this process run under the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get(ENV_INTERPRET, "0").strip().lower() in ("1", "true", "on", "yes")


def has_gpu() -> bool:
    """A CUDA or ROCm (HIP) device torch can use: where compiled Triton kernels run."""
    return torch.cuda.is_available()


def use_interpreter_if_no_gpu() -> None:
    """Turn the interpreter on when there is no GPU, before triton is imported; refuse if it is too late."""
    if has_gpu() or interpreting():
        return
    if "triton" in sys.modules:
        raise RuntimeError(
            "triton was imported before glm5-hal could switch on its CPU interpreter, and there is no GPU; "
            "set TRITON_INTERPRET=1 before starting Python to run the triton backend on this machine"
        )
    os.environ[ENV_INTERPRET] = "1"
    global DOT_UPCAST
    DOT_UPCAST = True


# Under the interpreter (triton 3.9), tl.dot on bf16 operands returns wrong values while fp16/fp32/int8 dots are
# right; kernels take this as a constexpr and upcast bf16 operands to fp32 before tl.dot. Compiled kernels keep
# the native bf16 tensor-core dot. Kept in step with the interpreter switch by use_interpreter_if_no_gpu().
DOT_UPCAST: bool = interpreting()
