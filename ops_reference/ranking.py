"""How the top-k selections rank scores (docs/ops.md "NaN"): largest first, NaN above every number, ties to the
lower index. moe_gate ranks experts and groups this way, lightning_indexer key positions."""

from __future__ import annotations

import numpy as np


def descending_nan_first(values: np.ndarray) -> np.ndarray:
    """The order of each row of `values` (last axis) from largest to smallest, NaN first, stable (ties, NaN with
    NaN included, keep the lower index first)."""
    values = np.asarray(values, np.float64)
    nan = np.isnan(values)
    # np.lexsort sorts by its last key first: NaN before numbers, then the numbers descending, then the index.
    return np.lexsort((-np.where(nan, 0.0, values), ~nan), axis=-1)
