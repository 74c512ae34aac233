"""pytest-benchmark: the deterministic top-k (glm5_hal.topk, ties to the lower position) against plain torch.topk,
at the indexer's shapes: topk 2048 of 16K..128K scores per row, 4 rows (decode, batch 4) and 64 rows (a prefill
tile).

    pytest perf/test_bench_topk.py --benchmark-only --benchmark-enable [--benchmark-group-by=param:keys]

Device and threads as perf/test_bench_ops.py (GLM5_HAL_BENCH_DEVICE, GLM5_HAL_BENCH_THREADS). In the normal test
run each body runs once, and the deterministic result is checked against the sorted-order definition.
"""

from __future__ import annotations

import os

import pytest
import torch

from glm5_hal.topk import topk_lower_position_ties
from perf.timing import synchronize

DEVICE = torch.device(os.environ.get("GLM5_HAL_BENCH_DEVICE", "cpu"))
if os.environ.get("GLM5_HAL_BENCH_THREADS"):
    torch.set_num_threads(int(os.environ["GLM5_HAL_BENCH_THREADS"]))
TOPK = 2048


def _plain(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.topk(scores, k, dim=-1, sorted=True)


@pytest.mark.parametrize("rows", [4, 64])
@pytest.mark.parametrize("keys", [16384, 65536, 131072])
@pytest.mark.parametrize("select", [_plain, topk_lower_position_ties], ids=["torch.topk", "lower-position-ties"])
def test_topk_latency(benchmark, select, keys, rows):
    scores = torch.randn(rows, keys, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    scores[:, keys // 2 :] = float("-inf")  # causal rows: half the keys not visible yet

    def timed() -> tuple[torch.Tensor, torch.Tensor]:
        out = select(scores, TOPK)
        synchronize(DEVICE)
        return out

    values, columns = benchmark.pedantic(timed, rounds=5, warmup_rounds=1)
    assert torch.equal(values, torch.topk(scores, TOPK, dim=-1).values)  # the same scores either way
    assert columns.shape == (rows, TOPK)
