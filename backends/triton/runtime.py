"""Where the Triton kernels run in this process: natively on a GPU, or under Triton's CPU interpreter.

Triton decides at decoration time (`@triton.jit`, including the helpers inside `triton.language`) whether a
function is compiled or interpreted, from the `TRITON_INTERPRET` environment variable. So the choice has to be
made before `triton` is first imported: `use_interpreter_if_no_gpu()` does that for the backend, and the test
suite's conftest does it for the tests. Kernel modules read `DOT_UPCAST` once, at their import.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
from collections.abc import Callable

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


def unit_stride_arguments(*, written: tuple[str, ...] = ()) -> Callable[[Callable], Callable]:
    """Decorator of every kernel wrapper: its tensor arguments arrive with unit stride along the last dim.

    Validation accepts any view, so a 1-D bias, scale, slot map, offset or index vector may be every other element
    of a buffer; the kernels read vectors (and the last dim of every table) as plain arrays, and take every other
    stride as an argument. Views that lack a unit last stride are copied here, once per call (a no-op for the
    usual contiguous tensors). The `written` arguments (caches written in place) are never copied: the kernels
    that write them take all their strides.
    """

    def decorate(wrapper: Callable) -> Callable:
        signature = inspect.signature(wrapper)

        @functools.wraps(wrapper)
        def with_unit_strides(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            for name, value in bound.arguments.items():
                if name not in written and isinstance(value, torch.Tensor) and _needs_unit_stride(value):
                    bound.arguments[name] = value.contiguous()
            return wrapper(*bound.args, **bound.kwargs)

        return with_unit_strides

    return decorate


def _needs_unit_stride(t: torch.Tensor) -> bool:
    return t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1
