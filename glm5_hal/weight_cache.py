"""What a backend derives from a weight for its kernels, made once per weight instead of on every call: a
oneDNN-prepacked copy, the native int8 kernels' panels, unpacked int4 codes (the torch backend), a transposed
FRACTAL_NZ copy or an int4pack repacking (Ascend).

The ops take raw weights on every call; a model passes the same weight tensors (parameters, buffers) each time.
Entries are keyed on the weight tensor itself, weakly (an entry dies with its weight), or on the tensor a view was
taken from, so that a fresh view of a stored weight (w[expert]) finds its entry. An entry is remade when the
weight's version counter moves (an in-place write), when the view covers other elements, or when the weight's data
moved (`weight.data = new`). A derived value must not reference the weight (that would keep the weight, and so the
entry, alive forever).

Not seen: an in-place write through `weight.data` (`weight.data.copy_(new)`), which bypasses the version counter by
design (torch's `.data` is how code hides writes from autograd), and an in-place write to an inference tensor inside
torch.inference_mode (inference tensors have no version counter). A process that writes weights either way calls
`clear()` afterwards; torch's own loading (`load_state_dict`, `copy_` under no_grad) moves the counter.

Threads: a lookup and an insertion are single dictionary operations (atomic under the GIL); two threads that miss at
once both make the value, and one of the two is kept.

Memory: an entry is as large as the int8 weight (a W4A8 weight's entry is twice its packed size) and lives as long
as the weight does. GLM5_HAL_FAST_PATHS=0 uses no cache on the torch backend.
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


def _version(weight: Tensor) -> int | None:
    try:
        return weight._version
    except RuntimeError:  # an inference tensor: no version counter (see the module docstring)
        return None


def derived(weight: Tensor, kind: Hashable, make: Callable[[Tensor], object]) -> object:
    """make(weight), remembered for this weight (and view of it), its current contents and `kind` (what is derived:
    different derivations of one weight live side by side)."""
    root = weight if weight._base is None else weight._base
    view = (weight.data_ptr(), tuple(weight.shape), tuple(weight.stride()), weight.dtype)
    per_root = _per_root(root)
    found = per_root.get((view, kind))
    version = _version(weight)
    if found is not None and found[0] == version:
        return found[1]
    value = make(weight)
    per_root[(view, kind)] = (version, value)
    return value


def cached_entries() -> int:
    """How many derived values are alive (tests, diagnostics)."""
    return sum(len(per_root) for _, per_root in _entries.values())


def clear() -> None:
    """Forget every derived value (after writing weights in place through `.data`: see the module docstring)."""
    _entries.clear()
