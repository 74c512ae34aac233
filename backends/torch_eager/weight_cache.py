"""What a fast int8 path derives from a quantized weight (a oneDNN-prepacked copy, unpacked int4 codes), made once
per weight instead of on every call.

The ops take raw weights on every call; a model passes the same weight tensors (parameters, buffers) each time.
Entries are keyed on the weight tensor itself, weakly (an entry dies with its weight), or on the tensor a view was
taken from, so that a fresh view of a stored weight (w[expert]) finds its entry. An entry is
remade when the weight's version counter moves (an in-place write) or the view covers other elements. A derived
value must not reference the weight (that would keep the weight, and so the entry, alive forever).

Memory: an entry is as large as the int8 weight (a W4A8 weight's entry is twice its packed size) and lives as long
as the weight does. GLM5_HAL_FAST_PATHS=0 uses no cache.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable

from torch import Tensor

# id(root tensor) -> (a weak reference to it, {(view, kind): (version, value)}). Not torch.utils.weak's
# WeakIdKeyDictionary: its lookup builds a reference and runs three Python methods, ~0.01 ms per call once a model's
# other layers have evicted the caches (every quantized GEMM looks up its weight).
_entries: dict[int, tuple[weakref.ref, dict]] = {}


def _forget(key: int, reference: weakref.ref) -> None:
    """The weight behind `reference` died: drop its entries (unless its id was already reused by a new weight)."""
    found = _entries.get(key)
    if found is not None and found[0] is reference:
        del _entries[key]


def _per_root(root: Tensor) -> dict:
    key = id(root)
    found = _entries.get(key)
    if found is not None and found[0]() is root:
        return found[1]
    per_root: dict = {}
    _entries[key] = (weakref.ref(root, lambda reference: _forget(key, reference)), per_root)
    return per_root


def derived(weight: Tensor, kind: Hashable, make: Callable[[Tensor], object]) -> object:
    """make(weight), remembered for this weight (and view of it), its current contents and `kind` (what is derived:
    different derivations of one weight live side by side)."""
    root = weight if weight._base is None else weight._base
    view = (weight.storage_offset(), tuple(weight.shape), tuple(weight.stride()), weight.dtype)
    per_root = _per_root(root)
    found = per_root.get((view, kind))
    if found is not None and found[0] == weight._version:
        return found[1]
    value = make(weight)
    per_root[(view, kind)] = (weight._version, value)
    return value


def cached_entries() -> int:
    """How many derived values are alive (tests, diagnostics)."""
    return sum(len(per_root) for _, per_root in _entries.values())
