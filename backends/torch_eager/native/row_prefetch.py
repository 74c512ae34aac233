"""How a native kernel asks for the cache rows it reads next (row_prefetch.h): into L2, into L1 or non-temporally.

Sparse attention's selected rows and the quantized indexer's next chunk of keys are scattered over a paged cache,
so those kernels ask for them ahead of use, with a hint their entry points take. The results are the same bits
whatever the hint; which one is fastest with the rows coming from memory is the CPU's (into L2 was the fastest on
a Zen 4 and the slowest on a Zen 5), so the torch backend's probe measures them (capabilities._with_row_prefetch).
"""

from __future__ import annotations

from glm5_hal.checks import check

# name -> the kernels' code (PREFETCH_L2, PREFETCH_L1, PREFETCH_NTA in row_prefetch.h)
ROW_PREFETCHES: dict[str, int] = {"l2": 0, "l1": 1, "nta": 2}


def check_prefetch(kernel: str, prefetch: str) -> None:
    """A clear error, naming `kernel`, for a hint that is not one of ROW_PREFETCHES."""
    check(
        prefetch in ROW_PREFETCHES,
        ValueError,
        lambda: f"{kernel}: prefetch: expected one of {tuple(ROW_PREFETCHES)}, got {prefetch!r}",
    )
