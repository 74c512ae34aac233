"""perf/decode_calls.py: its "kernels alone" side computes what the public calls compute (else the difference it
reports would not be the calls' Python), and the command prints its table."""

from __future__ import annotations

import pytest
import torch

from backends.torch_eager.native import quantized_index_scores as native_scores
from backends.torch_eager.native import sparse_attention as native_attention
from perf import decode_calls


@pytest.fixture(autouse=True)
def _native() -> None:
    for module, isa in ((native_scores, "avx2"), (native_attention, "avx2")):
        ok, why = module.availability(isa)
        if not ok:
            pytest.skip(f"the native kernels do not run here: {why}")


@pytest.mark.parametrize("context", [64, 300, 2500])
def test_the_kernels_alone_compute_what_the_calls_do(context: int) -> None:
    try:
        calls, kernels = decode_calls._layer(context)
    except decode_calls.NoNativeRoute as why:
        pytest.skip(str(why))
    q_idx, weights = calls["indexer_prolog"]()
    topk = calls["lightning_indexer"]()
    out, lse = calls["sparse_flash_attention"]()
    kernels["indexer_prolog"]()  # writes the same key row again, and its q / weights into buffers of its own
    _, (scores, positions) = kernels["lightning_indexer"]()
    assert torch.equal(positions, topk[:, : positions.shape[1]])
    assert (topk[:, positions.shape[1] :] == -1).all()  # fewer keys than topk: the rest is padding
    kernel_out, kernel_lse = kernels["sparse_flash_attention"]()
    assert torch.equal(kernel_out.view(torch.int16), out.view(torch.int16))
    assert torch.equal(kernel_lse, lse)
    assert q_idx.shape == (1, 4, 128) and weights.shape == (1, 4)


def test_the_command_prints_one_row_per_call(capsys: pytest.CaptureFixture[str]) -> None:
    try:
        decode_calls._layer(128)
    except decode_calls.NoNativeRoute as why:
        pytest.skip(str(why))
    decode_calls.main(["--context", "128", "--reps", "5"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "---" not in line]
    assert [row.split(" | ")[0].removeprefix("| ") for row in rows[1:]] == [
        "indexer_prolog",
        "lightning_indexer",
        "cache write",
        "sparse_flash_attention",
        "the layer",
    ]
