"""pytest-benchmark over the bench scenarios, so results compare across commits with pytest-benchmark's own tools:

    pytest perf/test_bench_ops.py --benchmark-only --benchmark-enable [--benchmark-save NAME]
    GLM5_HAL_BENCH_SCENARIOS=decode,quant pytest perf/test_bench_ops.py --benchmark-only --benchmark-enable

Scenario sets come from GLM5_HAL_BENCH_SCENARIOS (default `quick`: mini dims), ops run on the selected backend
(GLM5_HAL_BACKEND, default auto), on GLM5_HAL_BENCH_DEVICE (default cpu), with GLM5_HAL_BENCH_THREADS CPU threads
(default: torch's choice; 1 avoids stalls on a busy CPU). Each round takes the next of
INPUT_SETS input sets and a buffer larger than the last-level cache is overwritten first (untimed), as in
`glm5-hal bench`, so caches do not flatter. In the normal test run (--benchmark-disable, the project's
addopts) each body runs once, which checks that every scenario builds and runs.
"""

from __future__ import annotations

import itertools
import os

import pytest
import torch

from perf.cli import op_callable, op_cost
from perf.scenarios import select
from perf.timing import cache_flush_bytes, synchronize

INPUT_SETS = 2
DEVICE = torch.device(os.environ.get("GLM5_HAL_BENCH_DEVICE", "cpu"))
if os.environ.get("GLM5_HAL_BENCH_THREADS"):
    torch.set_num_threads(int(os.environ["GLM5_HAL_BENCH_THREADS"]))
SETS = [s.strip() for s in os.environ.get("GLM5_HAL_BENCH_SCENARIOS", "quick").split(",") if s.strip()]


@pytest.mark.parametrize("scenario", select(SETS), ids=lambda s: f"{s.op}[{s.name}]")
def test_op_latency(benchmark, scenario):
    sets = []
    for i in range(INPUT_SETS):
        built = scenario.build(torch.Generator().manual_seed(i), torch.bfloat16)
        sets.append({k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in built.items()})
    run = op_callable(scenario.op)
    rotation = itertools.cycle(sets)
    flush = torch.empty(cache_flush_bytes(DEVICE) // 4, device=DEVICE)

    def next_inputs() -> tuple[tuple[dict], dict]:
        flush.zero_()  # evict the previous round's data (pedantic's setup is not timed)
        synchronize(DEVICE)
        return (next(rotation),), {}

    def timed_call(inputs: dict) -> object:
        out = run(**inputs)
        synchronize(DEVICE)
        return out

    c = op_cost(scenario.op, sets[0])
    benchmark.extra_info.update(op=scenario.op, flops=c.flops, bytes=c.bytes)
    benchmark.pedantic(timed_call, setup=next_inputs, rounds=5, warmup_rounds=1)
