"""`glm5-hal bench --quick` end to end: the table, the JSON and their structure (not the timings)."""

from __future__ import annotations

import json
import math

from glm5_hal.cli import main
from perf.scenarios import SCENARIOS


def test_quick_bench_writes_a_finite_positive_row_per_op(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", "--quick", "--no-progress", "--backends", "torch,reference", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    ops = {s.op for s in SCENARIOS["quick"]()}
    assert {(r["op"], r["backend"]) for r in data["rows"]} == {(op, b) for op in ops for b in ("torch", "reference")}
    for row in data["rows"]:
        for key in ("median_ms", "p10_ms", "p90_ms", "tflops", "gbps", "roofline_fraction"):
            assert math.isfinite(row[key]) and row[key] >= 0, (key, row)
        assert row["median_ms"] > 0 and row["reps"] >= 3
        if row["backend"] == "reference":
            assert row["speedup"] > 0
    assert all(data["peaks"][k] > 0 for k in ("flops", "int8_ops", "bandwidth"))
    assert "roofline" in capsys.readouterr().out


def test_unknown_backend_and_scenario_are_errors(capsys):
    assert main(["bench", "--backends", "nope"]) == 2
    assert main(["bench", "--scenarios", "nope"]) == 2
    err = capsys.readouterr().err
    assert "--backends: unknown ['nope']" in err and "--scenarios: unknown ['nope']" in err
