"""Docs do not drift: every public op documents each of its arguments, and docs/ops.md lists every op."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

import glm5_hal
from glm5_hal.registry import ALL_OP_NAMES

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("op", ALL_OP_NAMES)
def test_docstring_names_every_argument(op: str) -> None:
    fn = getattr(glm5_hal, op)
    doc = inspect.getdoc(fn) or ""
    for name in inspect.signature(fn).parameters:
        assert f"{name}:" in doc or f"{name}," in doc, f"{op}: argument {name!r} is not documented"
    assert "Reference: ops_reference/" in doc


@pytest.mark.parametrize("op", ALL_OP_NAMES)
def test_ops_doc_and_reference_exist(op: str) -> None:
    import ops_reference

    assert callable(getattr(ops_reference, op)), f"ops_reference has no {op}"
    assert f"`{op}(" in (ROOT / "docs" / "ops.md").read_text(), f"docs/ops.md does not document {op}"
