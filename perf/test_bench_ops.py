"""pytest-benchmark over the quick scenarios: `pytest perf/ --benchmark-only --benchmark-enable` times every op
on the selected backend (GLM5_HAL_BACKEND, default auto) and can be compared across commits with
pytest-benchmark's own tools. In the normal test run (--benchmark-disable) each body runs once."""

from __future__ import annotations

import pytest
import torch

import glm5_hal
from perf.scenarios import SCENARIOS


@pytest.mark.parametrize("scenario", SCENARIOS["quick"](), ids=lambda s: f"{s.op}-{s.name}")
def test_op_latency(benchmark, scenario):
    inputs = scenario.build(torch.Generator().manual_seed(0), torch.bfloat16)
    fn = getattr(glm5_hal, scenario.op)
    benchmark.extra_info["op"] = scenario.op
    benchmark(lambda: fn(**inputs))
