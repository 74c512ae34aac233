"""`glm5-hal bench --quick` end to end: the table, the JSON, the Markdown and their structure (not the timings)."""

from __future__ import annotations

import json
import math

import pytest

from glm5_hal.cli import main
from perf.cli import Row, format_table
from perf.plot import context_series
from perf.scenarios import SCENARIOS, select

RATES = ("median_ms", "p10_ms", "p90_ms", "bytes", "gbps", "roofline_fraction")
ARITHMETIC = ("flops", "tflops")  # zero only for moe_dispatch, a pure permutation of rows


def test_quick_bench_writes_a_finite_positive_row_per_op_and_backend(tmp_path, capsys):
    out, md = tmp_path / "bench.json", tmp_path / "bench.md"
    argv = ["bench", "--quick", "--threads", "1", "--no-progress", "--backends", "torch,reference"]
    assert main([*argv, "--json", str(out), "--markdown", str(md)]) == 0
    data = json.loads(out.read_text())
    ops = {s.op for s in SCENARIOS["quick"]()}
    assert {(r["op"], r["backend"]) for r in data["rows"]} == {(op, b) for op in ops for b in ("torch", "reference")}
    for row in data["rows"]:
        for key in RATES:
            assert math.isfinite(row[key]) and row[key] > 0, (key, row)
        for key in ARITHMETIC:
            assert math.isfinite(row[key]) and (row[key] > 0 or row["op"] == "moe_dispatch"), (key, row)
        assert row["p10_ms"] <= row["median_ms"] <= row["p90_ms"]
        assert row["reps"] >= 3 and row["bound"] in ("compute", "memory")
        assert math.isfinite(row["speedup"]) and row["speedup"] > 0
    assert all(math.isfinite(data["peaks"][k]) and data["peaks"][k] > 0 for k in ("flops", "int8_ops", "bandwidth"))
    assert data["peaks"]["source"] == "measured"  # a CPU is never in the vendor table
    printed = capsys.readouterr().out
    assert "roofline" in printed and "speedup" in printed
    assert md.read_text().count("\n") == len(data["rows"]) + 2  # header, rule, one line per row


def test_usage_errors_name_the_argument(capsys):
    assert main(["bench", "--backends", "nope"]) == 2
    assert main(["bench", "--scenarios", "nope"]) == 2
    assert main(["bench", "--ops", "nope"]) == 2
    assert main(["bench", "--scenarios", "quant", "--plot", "x.png"]) == 2
    err = capsys.readouterr().err
    assert "--backends: unknown ['nope']" in err and "--scenarios: unknown ['nope']" in err
    assert "--ops: unknown ['nope']" in err and "--plot: needs scenarios with a context length" in err


def test_ops_filter_keeps_the_baselines_the_ops_are_compared_with():
    chosen = select(["context"], ["sparse_flash_attention"])
    assert {s.op for s in chosen} == {"sparse_flash_attention", "dense_mla_attention"}
    assert len(chosen) == 2 * len({s.context for s in chosen})
    with pytest.raises(ValueError, match="unknown"):
        select(["nope"])


def _row(op: str, context: int, ms: float, backend: str = "torch") -> Row:
    return Row("s", op, backend, context, ms, ms, ms, 3, 1.0, 1.0, 1.0, 1.0, 1.0, "compute")


def test_context_series_adds_the_sparse_path_sum():
    rows = [_row("sparse_flash_attention", 4096, 2.0), _row("lightning_indexer", 4096, 3.0)]
    rows += [_row("dense_mla_attention", 4096, 40.0, "baseline (torch)")]
    series = context_series(rows)
    assert series[("indexer+sparse", "torch")] == {4096: 5.0}
    assert series[("dense_mla_attention", "baseline (torch)")] == {4096: 40.0}


def test_markdown_table_has_a_comparison_column_only_when_there_is_one():
    plain = format_table([_row("fused_moe", 0, 1.0)], markdown=True)
    assert "speedup" not in plain and "vs baseline" not in plain
    compared = Row(**{**_row("quant_matmul", 0, 1.0).__dict__, "vs_baseline": 3.0})
    assert "| 3.00x |" in format_table([compared], markdown=True)


def test_fast_paths_run_side_by_side_and_the_choice_is_recorded(tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = ["bench", "--quick", "--ops", "quant_matmul", "--threads", "1", "--no-progress", "--fast-paths", "0,auto"]
    assert main([*argv, "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [r["backend"] for r in data["rows"]] == ["torch fast=0", "torch fast=auto"]
    assert data["rows"][0]["speedup"] == 1.0 and data["rows"][1]["speedup"] > 0
    assert set(data["fast_paths"]) == {"0", "auto"}
    assert data["fast_paths"]["0"]["int8"]["path"].startswith("chunked fp32")
    assert "int8 GEMM (W8A8 / W4A8)" in capsys.readouterr().out
    assert main(["bench", "--quick", "--fast-paths", "sometimes"]) == 2
    assert "--fast-paths: GLM5_HAL_FAST_PATHS: expected auto, 0" in capsys.readouterr().err
