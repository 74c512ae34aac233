"""The MetaX fake's error and rule checks (the shared helpers live in fakes/schema_fake.py)."""

from __future__ import annotations


class FakeMetaxError(RuntimeError):
    """A call MetaX's sources (a TORCH_CHECK, an interface docstring or assert) refuse, or that the fake does not
    model."""


def require(condition: bool, op: str, rule: str) -> None:
    if not condition:
        raise FakeMetaxError(f"{op}: {rule} [strict MetaX fake]")


def not_modeled(condition: bool, op: str, what: str) -> None:
    """For features the glm5-hal backend does not use: refuse rather than guess their semantics."""
    if not condition:
        raise FakeMetaxError(f"{op}: {what} is not modeled by this fake; the glm5-hal backend must not use it")
