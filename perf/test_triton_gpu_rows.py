"""perf/triton_gpu.py's tuning rows run and judge: sparse attention's key ranges, the indexer's tokens a program,
and its two top-k selects.

On a GPU they time the prefill and decode targets; here they run under the interpreter on a small batch (the times
mean nothing), so that a GPU session does not find them broken, and they must report a wrong answer as one.
"""

from __future__ import annotations

import pytest
import torch

from backends.triton.runtime import use_interpreter_if_no_gpu

use_interpreter_if_no_gpu()
pytest.importorskip("triton", reason="triton is not installed: pip install glm5-hal[triton]")

from backends.triton import indexer  # noqa: E402
from glm5_hal.config import GLM5_MINI  # noqa: E402
from glm5_hal.parity import cases as builders  # noqa: E402
from glm5_hal.parity.inputs import SeqSpec  # noqa: E402
from perf.triton_gpu import DTYPE, key_range_rows, tokens_per_program_rows, topk_share  # noqa: E402

CPU = torch.device("cpu")
BUILD = builders.indexer_inputs(GLM5_MINI, [SeqSpec(12, 40), SeqSpec(1, 20)], 16, 16)


def test_tokens_per_program_rows_agree_and_name_the_default():
    inputs = BUILD(torch.Generator().manual_seed(0), DTYPE)
    rows, differing = tokens_per_program_rows(inputs, CPU, reps=3, counts=(1, 2))
    assert differing == 0 and len(rows) == 3
    assert all(row.endswith("vs 1: ok") for row in rows) and "(default)" in rows[-1]


def test_tokens_per_program_rows_count_a_wrong_count(monkeypatch):
    inputs = BUILD(torch.Generator().manual_seed(0), DTYPE)
    right = indexer.indexer_logits

    def wrong_at_two(*args, tokens_per_program=None, **kwargs):
        logits = right(*args, tokens_per_program=tokens_per_program, **kwargs)
        return logits * 1.5 if tokens_per_program == 2 else logits

    monkeypatch.setattr(indexer, "indexer_logits", wrong_at_two)
    rows, differing = tokens_per_program_rows(inputs, CPU, reps=3, counts=(1, 2))
    assert differing == 1 and "vs 1: ok" not in rows[1]


def test_topk_share_compares_the_two_selects(monkeypatch):
    line, agree = topk_share("mini", BUILD, CPU, reps=3)
    assert agree and "kernel select" in line and "torch select" in line and line.endswith("selects agree")
    right = indexer.lightning_indexer

    def off_by_one(*args, topk_select=None, **kwargs):
        indices, scores = right(*args, topk_select=topk_select, **kwargs)
        return (indices.flip(-1), scores) if topk_select == "kernel" else (indices, scores)

    monkeypatch.setattr(indexer, "lightning_indexer", off_by_one)
    line, agree = topk_share("mini", BUILD, CPU, reps=3)
    assert not agree and line.endswith("SELECTS DIFFER")


def test_key_range_rows_agree_and_name_the_ranges_that_run():
    """topk 200 in ranges of a multiple of 64 keys: 1, 2 and 4 wanted run as 1, 2 and 4; the default (1 on a CPU)."""
    inputs = builders.sparse_attention_inputs(GLM5_MINI, [SeqSpec(2, 300)], 16, 200)(
        torch.Generator().manual_seed(0), DTYPE
    )
    rows, differing = key_range_rows(inputs, CPU, reps=3, counts=(1, 2, 4))
    assert differing == 0 and [row.split()[0] for row in rows] == ["1", "2", "4", "1"]
    assert all(row.endswith("vs 1: ok") for row in rows) and "(default)" in rows[-1]
