"""The MetaX fake's error and rule checks (the shared helpers live in fakes/schema_fake.py)."""

from __future__ import annotations

from fakes.schema_fake import rule_checks


class FakeMetaxError(RuntimeError):
    """A call MetaX's sources (a TORCH_CHECK, an interface docstring or assert) refuse, or that the fake does not
    model."""


require, not_modeled = rule_checks(FakeMetaxError, "strict MetaX fake")
