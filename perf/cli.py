"""`glm5-hal bench`: per-op latency on the selected backends against each op's roofline.

glm5-hal bench --quick                                  one mini case of every op (under a minute)
glm5-hal bench --scenarios decode,context --backends torch,reference --json out.json --plot ctx.png
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass

import torch

import glm5_hal
from glm5_hal.cli.progress import ProgressBar
from glm5_hal.registry import registry
from glm5_hal.selection import use_backend
from perf.costs import cost, dense_mla_attention, visible_keys
from perf.dense import dense_mla_attention as dense_baseline
from perf.peaks import Peaks, measure_peaks, table_peaks
from perf.scenarios import DENSE_MLA, SCENARIOS, Scenario
from perf.timing import time_calls

INT8_OPS = {"quant_matmul", "w4a8_matmul"}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Row:
    scenario: str
    op: str
    backend: str
    context: int | None
    median_ms: float
    p10_ms: float
    p90_ms: float
    reps: int
    tflops: float
    gbps: float
    roofline_fraction: float
    speedup: float | None = None  # vs the first backend of the run


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("bench", help="per-op latency, TFLOP/s, GB/s and fraction of the roofline")
    parser.add_argument("--backends", default="torch", help="comma-separated backends, side by side (default torch)")
    parser.add_argument("--scenarios", default="decode", help=f"comma-separated: {', '.join(SCENARIOS)}")
    parser.add_argument("--quick", action="store_true", help="the quick scenario, few repetitions (< 1 minute)")
    parser.add_argument("--ops", help="only these ops (comma-separated)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--reps", type=int, default=10, help="timed repetitions per op (after warm-up)")
    parser.add_argument("--input-sets", type=int, default=2, help="input sets rotated between repetitions")
    parser.add_argument("--measure-peaks", action="store_true", help="time a large GEMM and copy for the roofline")
    parser.add_argument("--json", metavar="FILE", help="write the rows and the peaks as JSON")
    parser.add_argument("--markdown", metavar="FILE", help="write the table as Markdown")
    parser.add_argument("--plot", metavar="PNG", help="latency against context length (context scenario)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true")
    parser.set_defaults(func=run)


def _split(value: str | None) -> list[str]:
    return [v.strip() for v in (value or "").split(",") if v.strip()]


def _call(scenario: Scenario, inputs: dict) -> object:
    if scenario.op == DENSE_MLA:
        return dense_baseline(**{k: v for k, v in inputs.items() if k != "indices"})
    return getattr(glm5_hal, scenario.op)(**inputs)


def _cost(scenario: Scenario, inputs: dict):
    if scenario.op != DENSE_MLA:
        return cost(scenario.op, inputs)
    q = inputs["q"]
    visible = visible_keys(inputs["seq_lens_k"], inputs["cu_seqlens_q"])
    context = int(inputs["seq_lens_k"].long().sum())
    return dense_mla_attention(q.shape[0], q.shape[1], visible, context, q.element_size(), inputs.get("d_v", 512))


def bench(
    scenarios: list[Scenario],
    backends: list[str],
    device: torch.device,
    dtype: torch.dtype,
    peaks: Peaks,
    *,
    reps: int,
    input_sets: int,
    seed: int,
    warmup: int = 2,
    progress=None,
) -> list[Row]:
    rows: list[Row] = []
    jobs = [(s, b) for s in scenarios for b in (backends if s.op != DENSE_MLA else backends[:1])]
    for i, (scenario, backend) in enumerate(jobs):
        if progress is not None:
            progress(i, len(jobs), f"{backend} {scenario.op} {scenario.name}")
        sets = []
        for j in range(input_sets):
            gen = torch.Generator().manual_seed(seed + j)
            built = scenario.build(gen, dtype)
            sets.append({k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in built.items()})
        with use_backend(backend, strict=False):
            timing = time_calls(lambda a, s=scenario: _call(s, a), sets, device, reps=reps, warmup=warmup)
        c = _cost(scenario, sets[0])
        bound = peaks.bound_s(c.flops, c.bytes, int8=scenario.op in INT8_OPS)
        rows.append(
            Row(
                scenario.name,
                scenario.op,
                backend if scenario.op != DENSE_MLA else "torch (baseline)",
                scenario.context,
                timing.median_s * 1e3,
                timing.p10_s * 1e3,
                timing.p90_s * 1e3,
                timing.reps,
                c.flops / timing.median_s / 1e12,
                c.bytes / timing.median_s / 1e9,
                bound / timing.median_s,
            )
        )
    if progress is not None:
        progress(len(jobs), len(jobs), "done")
    return _with_speedups(rows, backends)


def _with_speedups(rows: list[Row], backends: list[str]) -> list[Row]:
    if len(backends) < 2:
        return rows
    base = {(r.scenario, r.op): r.median_ms for r in rows if r.backend == backends[0]}
    return [
        Row(**{**asdict(r), "speedup": base[(r.scenario, r.op)] / r.median_ms if (r.scenario, r.op) in base else None})
        for r in rows
    ]


def format_table(rows: list[Row], *, markdown: bool = False) -> str:
    head = ["op", "scenario", "backend", "median ms", "p10-p90 ms", "TFLOP/s", "GB/s", "roofline", "speedup"]
    body = [
        [
            r.op,
            r.scenario,
            r.backend,
            f"{r.median_ms:.3f}",
            f"{r.p10_ms:.3f}-{r.p90_ms:.3f}",
            f"{r.tflops:.4f}",
            f"{r.gbps:.2f}",
            f"{100 * r.roofline_fraction:.1f}%",
            "-" if r.speedup is None else f"{r.speedup:.2f}x",
        ]
        for r in rows
    ]
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        return "\n".join(lines + ["| " + " | ".join(b) + " |" for b in body])
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*head), fmt.format(*("-" * w for w in widths))] + [fmt.format(*b) for b in body])


def plot(rows: list[Row], path: str) -> None:
    """Latency against context: sparse attention, the indexer, both together, and dense MLA attention."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise SystemExit(f"--plot needs matplotlib: pip install 'glm5-hal[perf]' ({exc})") from exc
    series: dict[str, dict[int, float]] = {}
    for r in rows:
        if r.context is not None:
            series.setdefault(r.op if r.op != DENSE_MLA else "dense MLA attention (full context)", {})[r.context] = (
                r.median_ms
            )
    sparse, indexer = series.get("sparse_flash_attention", {}), series.get("lightning_indexer", {})
    both = {c: sparse[c] + indexer[c] for c in sparse if c in indexer}
    if both:
        series["indexer + sparse attention"] = both
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, points in series.items():
        xs = sorted(points)
        ax.plot([x / 1024 for x in xs], [points[x] for x in xs], marker="o", label=name)
    ax.set(xscale="log", yscale="log", xlabel="context (K keys)", ylabel="latency (ms)")
    ax.set_title("GLM-5 decode attention: sparse (topk 2048) vs dense MLA")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run(args: argparse.Namespace) -> int:
    backends = _split(args.backends)
    unknown = [b for b in backends if b not in registry().names()]
    if unknown or not backends:
        print(f"--backends: unknown {unknown}; known: {registry().names()}", file=sys.stderr)
        return 2
    for b in backends:
        if not registry().availability(b).available:
            print(f"--backends: {b} is unavailable here: {registry().availability(b).reason}", file=sys.stderr)
            return 2
    names = ["quick"] if args.quick else _split(args.scenarios)
    bad = [n for n in names if n not in SCENARIOS]
    if bad:
        print(f"--scenarios: unknown {bad}; known: {list(SCENARIOS)}", file=sys.stderr)
        return 2
    scenarios = [s for n in names for s in SCENARIOS[n]()]
    if args.ops:
        scenarios = [s for s in scenarios if s.op in _split(args.ops)]
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    peaks = table_peaks(device)
    if peaks is None or args.measure_peaks:
        peaks = measure_peaks(
            device, torch.float32 if device.type == "cpu" else dtype, size=1024 if args.quick else 2048
        )
    print(
        f"device {peaks.name}: matmul {peaks.flops / 1e12:.3f} TFLOP/s, int8 {peaks.int8_ops / 1e12:.3f} TOP/s, "
        f"bandwidth {peaks.bandwidth / 1e9:.1f} GB/s ({peaks.source})"
    )
    reps = 3 if args.quick else args.reps
    bar = ProgressBar(enabled=False if args.no_progress else None)
    rows = bench(
        scenarios,
        backends,
        device,
        dtype,
        peaks,
        reps=reps,
        input_sets=1 if args.quick else args.input_sets,
        seed=args.seed,
        warmup=1 if args.quick else 2,
        progress=bar,
    )
    print(format_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"peaks": asdict(peaks), "dtype": args.dtype, "rows": [asdict(r) for r in rows]}, f, indent=2)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(format_table(rows, markdown=True) + "\n")
    if args.plot:
        plot(rows, args.plot)
    bad_rows = [r for r in rows if not (math.isfinite(r.median_ms) and r.median_ms > 0)]
    return 1 if bad_rows else 0
