"""One parity case: an op, a name, a builder of fresh inputs and the dtypes it runs in (the list is cases.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

FP32_BF16 = (torch.float32, torch.bfloat16)
FP32_ONLY = (torch.float32,)
Build = Callable[[torch.Generator, torch.dtype], dict]


@dataclass(frozen=True)
class Case:
    """One parity case of one op. `exact`: every output must match the reference exactly (integer results)."""

    op: str
    name: str
    group: str
    build: Build
    dtypes: tuple[torch.dtype, ...] = FP32_BF16
    exact: bool = False
    slow: bool = False  # real model dims: skipped by `--quick`

    @property
    def id(self) -> str:
        return f"{self.op}/{self.name}"
