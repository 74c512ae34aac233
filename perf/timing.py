"""Timing one op call: warm-up, device synchronisation, many repetitions over rotated input sets, median/spread."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Timing:
    median_s: float
    p10_s: float
    p90_s: float
    reps: int

    @property
    def spread(self) -> float:
        """(p90 - p10) / median: how noisy the measurement was."""
        return (self.p90_s - self.p10_s) / self.median_s if self.median_s else 0.0


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type != "cpu" and hasattr(torch, device.type):
        getattr(torch, device.type).synchronize()  # npu, mlu, musa, ... expose the same call


def time_calls(
    fn: Callable[[dict], object],
    input_sets: Sequence[dict],
    device: torch.device,
    *,
    warmup: int = 2,
    reps: int = 10,
    max_seconds: float = 10.0,
) -> Timing:
    """Median wall time of fn(inputs) with inputs cycling through `input_sets` (fresh data each call, so caches
    do not flatter), after `warmup` calls, synchronising the device around each call; stops early after
    `max_seconds` (at least 3 repetitions)."""
    for i in range(warmup):
        fn(input_sets[i % len(input_sets)])
    synchronize(device)
    samples: list[float] = []
    start = time.perf_counter()
    for i in range(reps):
        inputs = input_sets[i % len(input_sets)]
        synchronize(device)
        t0 = time.perf_counter()
        fn(inputs)
        synchronize(device)
        samples.append(time.perf_counter() - t0)
        if len(samples) >= 3 and time.perf_counter() - start > max_seconds:
            break
    deciles = statistics.quantiles(samples, n=10, method="inclusive") if len(samples) > 1 else samples * 9
    return Timing(statistics.median(samples), deciles[0], deciles[-1], len(samples))
