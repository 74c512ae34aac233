"""Running a native kernel on torch's intra-op thread count: the kernels take a share of the work as index ranges,
and Python threads run the shares (a ctypes call releases the GIL, so they run at once)."""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

# Below ~2 MFLOP per thread, handing a share to the pool (tens of microseconds) costs more than it saves.
MIN_FLOPS_PER_THREAD = 1 << 21

_pool: tuple[ThreadPoolExecutor, int, int] | None = None  # the pool, its size, the process that made it
_pool_lock = threading.Lock()


def _executor(threads: int) -> ThreadPoolExecutor:
    """A pool of at least `threads` workers (grown, never shrunk: torch's thread count can change at run time). A
    forked child makes its own: the parent's pool object survives a fork, its threads do not, and work handed to it
    would never run."""
    global _pool
    with _pool_lock:
        if _pool is None or _pool[1] < threads or _pool[2] != os.getpid():
            _pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="glm5_hal-native"), threads, os.getpid()
        return _pool[0]


def thread_count(flops: int, threads: int | None) -> int:
    """How many threads a call of `flops` uses: torch's count (or `threads`), fewer where shares would be tiny."""
    threads = torch.get_num_threads() if threads is None else threads
    return max(1, min(threads, flops // MIN_FLOPS_PER_THREAD))


def split(extent: int, parts: int, align: int = 1) -> list[tuple[int, int]]:
    """[begin, end) ranges covering range(extent) in `parts` near-equal pieces whose edges are multiples of `align`
    (the last one ends at extent); empty pieces are left out."""
    units = math.ceil(extent / align)
    edges = [min(extent, align * (units * i // parts)) for i in range(parts + 1)]
    return [(edges[i], edges[i + 1]) for i in range(parts) if edges[i] < edges[i + 1]]


def run_shares(kernel: Callable[..., None], args: Sequence[object], shares: Sequence[tuple[int, ...]]) -> None:
    """kernel(*args, *share) for every share: the first on the calling thread, the others on the pool. The caller
    keeps the tensors behind `args` alive until this returns (it waits for every share, even when one raises)."""
    first, *rest = shares
    # The calling thread runs the first share itself: one hand-off fewer, and one thread fewer competing for the
    # cores with torch's own workers.
    pending = [_executor(len(rest)).submit(kernel, *args, *share) for share in rest] if rest else []
    try:
        kernel(*args, *first)
    finally:
        for done in pending:
            done.result()


def failed_shares(kernel: Callable[..., int], args: Sequence[object], shares: Sequence[tuple[int, ...]]) -> list:
    """run_shares for a kernel that returns 0 when it succeeds (and, say, -1 where its scratch could not be
    allocated): the shares whose call returned anything else, for the caller's error."""
    failed = []

    def run(*share: int) -> None:
        if kernel(*args, *share) != 0:
            failed.append(share)

    run_shares(run, (), shares)
    return failed
