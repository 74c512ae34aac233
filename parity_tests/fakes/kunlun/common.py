"""What every kernel of the strict vllm-kunlun fake shares: its error, its rule checks and its call counter.

A fake kernel (1) refuses what vllm-kunlun 0.11.1's wrappers, docstrings and callers rule out with a
FakeKunlunError naming the op and the rule, and refuses features the backend does not use rather than guess them
(`not_modeled`); (2) computes the documented result in float64 with ops_reference; (3) writes its results into the
output arguments the caller passed (the kernels' real behaviour, which the wrappers' mutates_args=() hides), and
fills what the documentation leaves undefined with poison (fakes/schema_fake.poison).
"""

from __future__ import annotations

import torch
from torch import Tensor

from fakes.schema_fake import CallCounter, rule_checks

CALLS = CallCounter()
ACTIVATION_DTYPES = (torch.bfloat16, torch.float16)


class FakeKunlunError(RuntimeError):
    """A call vllm-kunlun 0.11.1's sources rule out, or that this fake does not model."""


require, not_modeled = rule_checks(FakeKunlunError, "strict vllm-kunlun 0.11.1 fake")


def require_output(op: str, name: str, t: Tensor, shapes: tuple[tuple[int, ...], ...], dtype: torch.dtype) -> None:
    """An output argument the kernel writes: one of `shapes`, `dtype`, contiguous (written in place)."""
    require(tuple(t.shape) in shapes, op, f"{name} must be one of {list(shapes)}, got {tuple(t.shape)}")
    require(t.dtype == dtype, op, f"{name} must be {dtype}, got {t.dtype}")
    require(t.is_contiguous(), op, f"{name} is written in place and must be contiguous")


def require_lengths(op: str, name: str, t: Tensor, shape: tuple[int, ...], device: str | None = None) -> None:
    """A length / lod argument: int32 of `shape` (on `device` where the name says _cpu)."""
    require(
        t.dtype == torch.int32 and tuple(t.shape) == shape,
        op,
        f"{name} must be int32 {shape}, got {t.dtype} {tuple(t.shape)}",
    )
    if device is not None:
        require(t.device.type == device, op, f"{name} must be on the {device}, got {t.device}")
