"""Timing one op call: warm-up, device timing, many repetitions over rotated input sets, median and spread.

Caches must not flatter: consecutive calls take different input sets, and before every timed call a buffer larger
than the last-level cache is overwritten (as triton.testing.do_bench does), so each call starts with its inputs in
memory, as an op in a real model does after the other layers have run.

On a device whose torch module has events (`torch.cuda.Event`, `torch.npu.Event`, `torch.mlu.Event`, ...) each call
is bracketed by a start and an end event and the device's own clock gives its time; elsewhere (the CPU, or a
device module without events) the host clock is read around the call, with the device synchronised before and after
so queued work is neither missed nor counted twice.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType

import torch

from glm5_hal import cpu_flags


@dataclass(frozen=True)
class Timing:
    """Seconds per call over `reps` timed calls: the median and the 10th / 90th percentiles."""

    median_s: float
    p10_s: float
    p90_s: float
    reps: int
    clock: str  # "device events" or "host clock"

    @property
    def spread(self) -> float:
        """(p90 - p10) / median: how noisy the measurement was."""
        return (self.p90_s - self.p10_s) / self.median_s if self.median_s else 0.0


def device_module(device: torch.device) -> ModuleType | None:
    """torch.cuda / torch.npu / torch.mlu / ... for an accelerator, None for the CPU (or an unknown device type)."""
    if device.type == "cpu":
        return None
    return getattr(torch, device.type, None)


def synchronize(device: torch.device) -> None:
    """Wait until every kernel queued on `device` has finished (nothing to wait for on the CPU)."""
    module = device_module(device)
    if module is not None and hasattr(module, "synchronize"):
        module.synchronize()


# Accelerator last-level caches are at most ~100 MB today (H100 L2: 50 MB); CPUs report theirs in sysfs.
DEVICE_FLUSH_BYTES = 256 * 2**20


def cache_flush_bytes(device: torch.device) -> int:
    """Bytes to overwrite between calls to evict the last-level cache: twice the largest cache sysfs lists on a CPU
    (256 MiB where it lists none), 256 MiB on an accelerator."""
    if device.type != "cpu":
        return DEVICE_FLUSH_BYTES
    return cpu_flags.cache_flush_bytes()


def _event_timer(device: torch.device) -> Callable[[Callable[[], object]], float] | None:
    """A function timing one call with the device's events, or None where the device has none."""
    module = device_module(device)
    if module is None or not hasattr(module, "Event"):
        return None

    def timed(call: Callable[[], object]) -> float:
        start, end = module.Event(enable_timing=True), module.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3  # events report milliseconds

    return timed


def _host_timer(device: torch.device) -> Callable[[Callable[[], object]], float]:
    def timed(call: Callable[[], object]) -> float:
        synchronize(device)
        t0 = time.perf_counter()
        call()
        synchronize(device)
        return time.perf_counter() - t0

    return timed


def time_calls(
    fn: Callable[[dict], object],
    input_sets: Sequence[dict],
    device: torch.device,
    *,
    warmup: int = 2,
    reps: int = 10,
    max_seconds: float = 30.0,
    flush_bytes: int | None = None,
) -> Timing:
    """Time fn(inputs) with inputs cycling through `input_sets` (different data on consecutive calls, so a cache
    warmed by one call does not flatter the next), after `warmup` untimed calls.

    reps: timed calls wanted; stops early once `max_seconds` of timed calls have run (never below 3 calls, so a
    median and a spread exist). flush_bytes: size of the buffer overwritten (untimed) before each timed call;
    None: cache_flush_bytes(device); 0: no flush (for timing the flush-sized copies of peaks.py themselves).
    Returns the median and the 10th / 90th percentiles of the per-call times.
    """
    if not input_sets:
        raise ValueError("input_sets: expected at least one input set, got none")
    flush_bytes = cache_flush_bytes(device) if flush_bytes is None else flush_bytes
    flush = torch.empty(flush_bytes // 4, dtype=torch.float32, device=device) if flush_bytes else None
    for i in range(warmup):
        fn(input_sets[i % len(input_sets)])
    synchronize(device)
    event_timer = _event_timer(device)
    timer = event_timer or _host_timer(device)
    samples: list[float] = []
    spent = 0.0
    for i in range(max(reps, 3)):
        inputs = input_sets[(warmup + i) % len(input_sets)]
        if flush is not None:
            flush.zero_()
        samples.append(timer(lambda inputs=inputs: fn(inputs)))
        spent += samples[-1]
        if len(samples) >= 3 and spent > max_seconds:
            break
    if len(samples) > 1:
        deciles = statistics.quantiles(samples, n=10, method="inclusive")
        p10, p90 = deciles[0], deciles[-1]
    else:
        p10 = p90 = samples[0]
    return Timing(statistics.median(samples), p10, p90, len(samples), "device events" if event_timer else "host clock")
