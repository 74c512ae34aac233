"""glm5-hal's environment variables, read on every op call without os.environ's Python layers.

The settings (GLM5_HAL_BACKEND, GLM5_HAL_FAST_PATHS, GLM5_HAL_NATIVE, ...) are read when an op runs, so that a
change to os.environ applies to the next call. `os.environ.get` runs four Python frames (Mapping.get, __getitem__,
encodekey, decodevalue); once a decode step's weights have evicted them from the CPU caches, each read cost about
15 us on the CPU this was measured on, and one op call read six (about 0.09 ms, on a 0.15 ms int8 GEMM).
`setting` looks the name up in the bytes table that os.environ keeps (and updates on every assignment and
deletion) where CPython has one, and falls back to os.environ.get elsewhere; both give the same answers.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

# Backends that keep measured decisions across processes (the torch backend's probe store) measure again and replace
# them where this is set to 1; `glm5-hal info --reprobe` sets it for its own process.
ENV_REPROBE = "GLM5_HAL_REPROBE"

# os.environ's own table of encoded names -> encoded values on POSIX CPython (Windows keys it by upper-cased str).
_ENCODED: dict[bytes, bytes] | None = getattr(os.environ, "_data", None) if os.name == "posix" else None
if _ENCODED is not None and not isinstance(_ENCODED, dict):
    _ENCODED = None


def setting(name: str, default: str = "") -> str:
    """os.environ.get(name, default) (name: ASCII)."""
    if _ENCODED is None:
        return os.environ.get(name, default)
    value = _ENCODED.get(name.encode())
    return default if value is None else os.fsdecode(value)


def raw_setting(name: str) -> object:
    """A value that changes whenever os.environ[name] does (None while unset): a cache key for what a setting
    decides, cheaper than `setting` (no decoding)."""
    if _ENCODED is None:
        return os.environ.get(name)
    return _ENCODED.get(name.encode())


_parsed: dict[tuple[str, Callable, object], object] = {}
_UNPARSED = object()  # what _parsed.get answers for a value not parsed yet (None may be a parsed value)
_PARSED_LIMIT = 256  # distinct (setting, value) pairs kept; a process cycling through more starts over


def parsed_setting(name: str, parse: Callable[[str], T]) -> T:
    """parse(setting(name)), parsed once per value the variable takes (a parse that raises is not remembered, so
    a bad value raises on every call)."""
    key = (name, parse, raw_setting(name))
    found = _parsed.get(key, _UNPARSED)
    if found is _UNPARSED:
        found = parse(setting(name))
        if len(_parsed) >= _PARSED_LIMIT:
            _parsed.clear()
        _parsed[key] = found
    return found  # type: ignore[return-value]
