"""Run a function on N local ranks of a gloo process group: bounded wall time, and the first failure fails it all.

    values = run_ranks(fn, 4, args=(...), timeout_s=60)    # fn(rank, world_size, *args) on each of 4 ranks

For the tests of the collective ops and for `glm5-hal bench --ep-ranks N` on a machine without a launcher; real
deployments start their ranks with torchrun (docs/expert_parallel.md). Each rank is a process, started from a
forkserver that imported torch once (so a run costs a fork, not an interpreter start), with the caller's environment
and sys.path. The ranks join a gloo group through a file store; its collectives time out after
`collective_timeout_s`.

- fail_fast=True (default): returns every rank's return value, in rank order. The first rank that raises, or that
  dies, fails the run at once: the others are terminated and RankFailed carries that rank's traceback. A run still
  going at `timeout_s` is terminated and raises RankTimeout naming the ranks that had not finished.
- fail_fast=False: waits for every rank (or the deadline) and returns a RankOutcome per rank, errors included, so a
  test can check what the surviving ranks saw when one failed.
Return values travel pickled by value (tensors included); keep them small.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import queue as queue_module
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

PRELOAD = ["torch", "torch.distributed", "glm5_hal"]
POLL_S = 0.05
EXIT_GRACE_S = 1.0  # a dead rank's last message may still be in the queue: wait this long for it


@dataclass(frozen=True)
class RankOutcome:
    """What one rank did: ok with its return value, or the exception it raised (type name, message, traceback);
    error_type "died" (exit code in message) or "timeout" when it never reported."""

    rank: int
    ok: bool
    value: object = None
    error_type: str = ""
    message: str = ""
    traceback: str = ""
    seconds: float = 0.0


class RankFailed(RuntimeError):
    """A rank raised or died; the message carries its traceback."""

    def __init__(self, outcome: RankOutcome) -> None:
        self.outcome = outcome
        super().__init__(
            f"rank {outcome.rank} failed after {outcome.seconds:.1f} s: {outcome.error_type}: {outcome.message}\n"
            f"{outcome.traceback}"
        )


class RankTimeout(TimeoutError):
    """The run did not finish within its wall-time bound."""


def _context() -> multiprocessing.context.BaseContext:
    if "forkserver" in multiprocessing.get_all_start_methods():
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)  # no effect once the server runs; it then has them already
        return ctx
    return multiprocessing.get_context("spawn")


def _rank_main(
    fn: Callable[..., object],
    rank: int,
    world_size: int,
    args: Sequence[object],
    store: str,
    collective_timeout_s: float,
    threads: int,
    environ: dict[str, str],
    results: multiprocessing.Queue,
) -> None:
    import torch
    import torch.distributed as dist

    os.environ.clear()
    os.environ.update(environ)  # the forkserver's environment is the one it started with, not the caller's now
    torch.set_num_threads(threads)
    start = time.monotonic()
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=collective_timeout_s),
        )
        value = fn(rank, world_size, *args)
        results.put((rank, True, pickle.dumps(value), "", "", "", time.monotonic() - start))
        dist.destroy_process_group()
    except BaseException as exc:  # everything, SystemExit and KeyboardInterrupt included, is reported
        results.put((rank, False, None, type(exc).__name__, str(exc), traceback.format_exc(), time.monotonic() - start))
    finally:
        results.close()
        results.join_thread()  # the message is in the pipe before the process goes
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # no interpreter teardown: a process group broken by a peer's failure may abort in it


def _stop(processes: Sequence[multiprocessing.process.BaseProcess]) -> None:
    for p in processes:
        if p.is_alive():
            p.terminate()
    for p in processes:
        p.join(timeout=2.0)
        if p.is_alive():
            p.kill()
            p.join(timeout=2.0)


def run_ranks(
    fn: Callable[..., object],
    world_size: int,
    args: Sequence[object] = (),
    *,
    timeout_s: float = 120.0,
    collective_timeout_s: float = 60.0,
    fail_fast: bool = True,
    threads: int = 1,
) -> list[object] | list[RankOutcome]:
    """fn(rank, world_size, *args) on `world_size` local ranks of a gloo group (see the module docstring).

    fn must be importable by name (a module-level function) and its return value picklable. threads: torch CPU
    threads per rank (1: N ranks share the cores without oversubscribing them).
    """
    if world_size < 1:
        raise ValueError(f"world_size: expected >= 1, got {world_size}")
    ctx = _context()
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="glm5-hal-ranks-") as tmp:
        store = str(Path(tmp) / "store")
        environ = dict(os.environ)
        processes = [
            ctx.Process(
                target=_rank_main,
                args=(fn, rank, world_size, tuple(args), store, collective_timeout_s, threads, environ, results),
                name=f"glm5-hal-rank-{rank}",
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for p in processes:
            p.start()
        try:
            outcomes = _collect(processes, results, timeout_s, fail_fast)
        finally:
            _stop(processes)
    if not fail_fast:
        return outcomes
    return [o.value for o in outcomes]


def _collect(
    processes: Sequence[multiprocessing.process.BaseProcess],
    results: multiprocessing.Queue,
    timeout_s: float,
    fail_fast: bool,
) -> list[RankOutcome]:
    start = time.monotonic()
    deadline = start + timeout_s
    outcomes: dict[int, RankOutcome] = {}
    dead_since: dict[int, float] = {}
    while len(outcomes) < len(processes):
        try:
            rank, ok, value, kind, message, trace, seconds = results.get(timeout=POLL_S)
            outcome = RankOutcome(rank, ok, pickle.loads(value) if ok else None, kind, message, trace, seconds)
            outcomes[rank] = outcome
            if not ok and fail_fast:
                raise RankFailed(outcome)
            continue
        except queue_module.Empty:
            pass
        now = time.monotonic()
        for rank, p in enumerate(processes):
            if rank in outcomes or p.is_alive():
                continue
            dead_since.setdefault(rank, now)
            if now - dead_since[rank] > EXIT_GRACE_S:  # gone without a word: killed, or crashed in C++
                died = f"exit code {p.exitcode}"
                outcome = RankOutcome(rank, False, error_type="died", message=died, seconds=now - start)
                outcomes[rank] = outcome
                if fail_fast:
                    raise RankFailed(outcome)
        if now > deadline:
            missing = [r for r in range(len(processes)) if r not in outcomes]
            if fail_fast:
                raise RankTimeout(
                    f"ranks {missing} of {len(processes)} had not finished after {timeout_s:.0f} s; terminated "
                    f"(finished: {sorted(outcomes)})"
                )
            for rank in missing:
                outcomes[rank] = RankOutcome(
                    rank, False, error_type="timeout", message=f"no result after {timeout_s:.0f} s", seconds=now - start
                )
    return [outcomes[r] for r in range(len(processes))]
