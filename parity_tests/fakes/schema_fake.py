"""What every strict vendor fake shares: ops defined from the vendor's real schema strings with torch.library (so
PyTorch itself refuses a call the real schema would refuse: a misspelt keyword, a missing argument, a wrong type),
a CPU kernel per op written from the documented semantics, calls counted per op, the rule checks that refuse what
the vendor's sources rule out (`rule_checks`), and the host helpers those kernels compute with (float64 NumPy,
poison for what the documentation leaves undefined).

Used by parity_tests/fakes/ascend (schemas from the torch-npu wheel), parity_tests/fakes/kunlun (schemas rebuilt
from the vllm-kunlun wheel) and parity_tests/fakes/metax (schemas written into the project from MetaX's
repositories).
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable, Mapping

import numpy as np
import torch
from torch import Tensor

INT8_POISON = -128  # outside the symmetric [-127, 127] range every documented quantizer produces


def rule_checks(
    error: type[Exception], fake: str, unmodeled: str = "is not modeled by this fake"
) -> tuple[Callable[[bool, str, str], None], Callable[[bool, str, str], None]]:
    """(require, not_modeled) for one fake, both raising `error` naming the op and the rule, tagged [`fake`].

    require(condition, op, rule): a call the vendor's sources refuse (a TORCH_CHECK, a docstring, an assert).
    not_modeled(condition, op, what): a feature the glm5-hal backend does not use, refused rather than guessed
    ("<op>: <what> <unmodeled>; the glm5-hal backend must not use it").
    """

    def require(condition: bool, op: str, rule: str) -> None:
        if not condition:
            raise error(f"{op}: {rule} [{fake}]")

    def not_modeled(condition: bool, op: str, what: str) -> None:
        if not condition:
            raise error(f"{op}: {what} {unmodeled}; the glm5-hal backend must not use it")

    return require, not_modeled


def host(t: Tensor) -> np.ndarray:
    """A float64 (floating tensors) or int64 (integer tensors) NumPy copy."""
    t = t.detach().cpu()
    return (t.to(torch.float64) if t.is_floating_point() else t.to(torch.int64)).numpy()


def device_tensor(a: np.ndarray, dtype: torch.dtype, like: Tensor) -> Tensor:
    return torch.from_numpy(np.ascontiguousarray(a)).to(device=like.device, dtype=dtype)


def poison(shape: tuple[int, ...], dtype: torch.dtype, like: Tensor) -> Tensor:
    """An output the documentation leaves undefined: NaN for floats, INT8_POISON / -1 for integers."""
    fill = float("nan") if dtype.is_floating_point else (INT8_POISON if dtype == torch.int8 else -1)
    return torch.full(shape, fill, dtype=dtype, device=like.device)


class CallCounter:
    """Calls per op (tests assert the vendor kernels really ran) and nothing else; reset between tests."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()

    def reset(self) -> None:
        self.calls.clear()

    def counted(self, name: str, kernel: Callable) -> Callable:
        @functools.wraps(kernel)
        def run(*args, **kwargs):
            self.calls[name] += 1
            return kernel(*args, **kwargs)

        return run


def define_ops(
    namespace: str, schemas: Mapping[str, str], kernels: Mapping[str, Callable], counter: CallCounter
) -> torch.library.Library:
    """Define `torch.ops.<namespace>.<name>` for each schema (a full "name(args) -> returns" string) with its CPU
    kernel, counted. The returned Library owns the definitions: keep it alive for as long as they are used."""
    missing = sorted(set(schemas) ^ set(kernels))
    if missing:
        raise ValueError(f"schemas and kernels: expected the same op names, got {missing} in only one of them")
    library = torch.library.Library(namespace, "DEF")
    for name, schema in schemas.items():
        if not schema.startswith(f"{name}("):
            raise ValueError(f"schemas[{name!r}]: expected a schema of {name}(...), got {schema[:40]!r}")
        library.define(schema)
        library.impl(name, counter.counted(name, kernels[name]), "CPU")
    return library
