"""`glm5-hal bench --scenarios ep-quick --ep-ranks N`: the rows, their structure and the byte accounting (not the
timings)."""

from __future__ import annotations

import json
import math

import pytest

from glm5_hal.cli import main


@pytest.mark.parametrize("ranks", [2, 4])
def test_ep_bench_reports_latency_and_bytes_per_rank(tmp_path, capsys, ranks: int) -> None:
    out = tmp_path / "ep.json"
    argv = ["bench", "--scenarios", "ep-quick", "--ep-ranks", str(ranks), "--reps", "3", "--warmup", "1"]
    assert main([*argv, "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert {(r["op"], r["transport"]) for r in data["rows"]} == {
        (op, t) for op in ("ep_dispatch", "ep_combine") for t in ("bfloat16", "int8")
    }
    for row in data["rows"]:
        assert row["ranks"] == ranks and row["reps"] == 3
        assert math.isfinite(row["median_ms"]) and row["median_ms"] > 0
        assert row["p10_ms"] <= row["median_ms"] <= row["p90_ms"]
        # Every row a rank sends to another is received by it: the means over ranks agree.
        assert row["sent_bytes_mean"] == pytest.approx(row["received_bytes_mean"])
        assert 0 < row["sent_bytes_mean"] <= row["sent_bytes_max"]
    by = {(r["op"], r["transport"]): r for r in data["rows"]}
    # glm5-mini: hidden 256, bf16 rows of 512 bytes; the int8 transport sends 256 + 4 bytes per row.
    ratio = by["ep_dispatch", "int8"]["sent_bytes_mean"] / by["ep_dispatch", "bfloat16"]["sent_bytes_mean"]
    assert ratio == pytest.approx(260 / 512)
    assert by["ep_combine", "int8"]["sent_bytes_mean"] == by["ep_combine", "bfloat16"]["sent_bytes_mean"]
    assert "sent/rank MB" in capsys.readouterr().out


def test_ep_sets_do_not_mix_with_per_op_sets(capsys) -> None:
    assert main(["bench", "--scenarios", "ep-quick,decode"]) == 2
    assert "run the EP sets apart" in capsys.readouterr().err


def test_ep_sets_refuse_fast_path_modes(capsys) -> None:
    assert main(["bench", "--scenarios", "ep-quick", "--fast-paths", "0,auto"]) == 2
    assert "--fast-paths: the EP sets time ep_dispatch / ep_combine, which have no GEMMs" in capsys.readouterr().err
