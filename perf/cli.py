"""`glm5-hal bench`: per-op latency on the selected backends against each op's roofline.

    glm5-hal bench --quick                                    one mini case of every op (well under a minute)
    glm5-hal bench --scenarios decode,quant --backends torch,reference --json out.json --markdown out.md
    glm5-hal bench --scenarios context --plot context.png     latency against context length (4K..128K)
    glm5-hal bench --scenarios ep-decode,ep-prefill --ep-ranks 2   ep_dispatch / ep_combine on 2 local ranks
                                                              (or under torchrun: perf/ep_bench.py)
    glm5-hal bench --scenarios layer --reps 3                 a whole decoder layer vs transformers' (perf/layer.py)
    glm5-hal bench --scenarios decode --fast-paths 0,auto     conservative fp32 paths vs the probe's fast paths

For every (scenario, backend): warm-up calls, then timed calls over rotated input sets (perf/timing.py); the op's
FLOPs and minimum bytes (perf/costs.py) turn the median into TFLOP/s, GB/s and the fraction of the roofline
min(matmul peak, bandwidth x intensity) (perf/peaks.py: vendor figures for known accelerators, measured on the spot
elsewhere or with --measure-peaks). Several backends run side by side with a speedup against the first; baselines
(dense MLA attention, fp32 / bf16 matmul: perf/baselines.py) run once and give the `vs baseline` column. With
--fast-paths, every backend also runs once per GLM5_HAL_FAST_PATHS mode (backends.torch_eager.capabilities), labelled
`<backend> fast=<mode>`, and the probe's choices for the device are printed and recorded in the JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial

import torch

import glm5_hal
from backends.torch_eager.capabilities import capabilities, fast_paths, parse_mode
from glm5_hal.cli.progress import ProgressBar
from glm5_hal.registry import OP_NAMES, registry
from glm5_hal.selection import OpNotImplementedError, use_backend
from glm5_hal.text_table import render_table
from perf.baselines import BASELINES
from perf.costs import Cost, cost
from perf.ep_bench import EP_SCENARIOS
from perf.layer import LAYER_OPS, ScenarioSkipped
from perf.load import LoadMonitor
from perf.peaks import Peaks, measure_peaks, table_peaks
from perf.scenarios import SCENARIOS, Scenario, select
from perf.timing import time_calls

INT8_OPS = frozenset({"quant_matmul", "w4a8_matmul"})  # judged against the int8 GEMM peak
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
BASELINE_BACKEND = "baseline (torch)"
QUICK_REPS = 3
BUSY_WARNING = 0.1  # other processes' share of the CPU above which the run warns that it was contended


@dataclass(frozen=True)
class Row:
    """One timed (scenario, op, backend). Times in ms; rates from the op's cost model and the median."""

    scenario: str
    op: str
    backend: str
    context: int | None
    median_ms: float
    p10_ms: float
    p90_ms: float
    reps: int
    flops: float
    bytes: float
    tflops: float
    gbps: float
    roofline_fraction: float  # roofline time / median time
    bound: str  # "compute" or "memory": which side of the roofline limits this op here
    speedup: float | None = None  # the first backend's median / this one (several backends only)
    vs_baseline: float | None = None  # the scenario's baseline median / this one (e.g. dense attention / sparse)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `bench` to the glm5-hal command line (through the glm5_hal.commands entry point)."""
    parser = subparsers.add_parser(
        "bench",
        help="per-op latency, TFLOP/s, GB/s and fraction of the roofline",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--backends", default="torch", help="comma-separated backends, side by side (default torch)")
    parser.add_argument(
        "--scenarios",
        default="decode",
        help=f"comma-separated sets: {', '.join(SCENARIOS)}; expert parallel: {', '.join(EP_SCENARIOS)}",
    )
    parser.add_argument(
        "--ep-ranks", type=int, default=2, help="EP sets without torchrun: local CPU ranks over gloo (default 2)"
    )
    parser.add_argument("--quick", action="store_true", help="the quick set, 3 repetitions, measured peaks (< 1 min)")
    parser.add_argument("--ops", help="only these ops (comma-separated; their baselines stay)")
    parser.add_argument("--device", default=_default_device(), help="torch device (default: %(default)s)")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES), help="activation dtype")
    parser.add_argument("--reps", type=int, default=10, help="timed calls per op after warm-up (default 10)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls per op first (default 2)")
    parser.add_argument("--input-sets", type=int, default=2, help="input sets rotated between calls (default 2)")
    parser.add_argument("--max-seconds", type=float, default=30.0, help="stop timing one op after this long")
    parser.add_argument("--measure-peaks", action="store_true", help="measure GEMM and copy peaks even if tabled")
    parser.add_argument("--json", metavar="FILE", help="write the peaks and rows as JSON")
    parser.add_argument("--markdown", metavar="FILE", help="write the table as Markdown")
    parser.add_argument("--plot", metavar="PNG", help="latency against context length (needs the context set)")
    parser.add_argument(
        "--threads", type=int, help="CPU threads for torch (default: torch's choice); 1 avoids stalls on a busy CPU"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the first input set (set i uses seed + i)")
    parser.add_argument(
        "--fast-paths",
        metavar="MODES",
        help="comma-separated GLM5_HAL_FAST_PATHS modes to run side by side (e.g. 0,auto: the conservative fp32 "
        "paths, then the probe's choice); default: the environment's mode only",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(func=run)


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _split(value: str | None) -> list[str]:
    return [v.strip() for v in (value or "").split(",") if v.strip()]


def op_callable(op: str) -> Callable[..., object]:
    """The function a scenario of `op` times: the public glm5_hal op, the perf baseline of that name, or a whole
    decoder layer (perf/layer.py)."""
    if op in BASELINES:
        return BASELINES[op].run
    return LAYER_OPS[op].run if op in LAYER_OPS else getattr(glm5_hal, op)


def op_cost(op: str, inputs: dict) -> Cost:
    """FLOPs and minimum bytes of one call of `op` (an op, a baseline or a layer) on `inputs`."""
    if op in BASELINES:
        return BASELINES[op].cost(inputs)
    return LAYER_OPS[op].cost(inputs) if op in LAYER_OPS else cost(op, inputs)


def _call_with_keywords(fn: Callable[..., object], inputs: dict) -> object:
    return fn(**inputs)


def _to_device(value: object, device: torch.device) -> object:
    """Tensors, and objects with a `to_device` (the layer scenarios' inputs), on `device`; anything else as it is."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    return value.to_device(device) if hasattr(value, "to_device") else value


def _input_sets(scenario: Scenario, count: int, seed: int, device: torch.device, dtype: torch.dtype) -> list[dict]:
    sets = []
    for i in range(count):
        built = scenario.build(torch.Generator().manual_seed(seed + i), dtype)
        sets.append({k: _to_device(v, device) for k, v in built.items()})
    return sets


def _label(backend: str, mode: str | None) -> str:
    return backend if mode is None else f"{backend} fast={mode}"


def bench(
    scenarios: list[Scenario],
    backends: list[str],
    device: torch.device,
    dtype: torch.dtype,
    peaks: Peaks,
    *,
    reps: int = 10,
    warmup: int = 2,
    input_sets: int = 2,
    max_seconds: float = 30.0,
    seed: int = 0,
    fast_path_modes: list[str] | None = None,
    progress: Callable[[int, int, str], None] | None = None,
) -> list[Row]:
    """Time every scenario on every backend (baselines once) and judge it against `peaks`; rows in run order.
    fast_path_modes: GLM5_HAL_FAST_PATHS modes each backend runs in, rows labelled `_label(backend, mode)`; None =
    the environment's mode, rows labelled by the backend alone."""
    modes: list[str | None] = list(fast_path_modes) if fast_path_modes else [None]
    variants = [(b, m) for b in backends for m in modes]
    jobs = [(s, v) for s in scenarios for v in ([(BASELINE_BACKEND, None)] if s.op in BASELINES else variants)]
    rows: list[Row] = []
    for i, (scenario, (backend, mode)) in enumerate(jobs):
        label = _label(backend, mode)
        if progress is not None:
            progress(i, len(jobs), f"{label} {scenario.op} {scenario.name}")
        try:
            sets = _input_sets(scenario, input_sets, seed, device, dtype)
        except ScenarioSkipped as exc:
            print(f"bench: skipped {scenario.op} at {scenario.name}: {exc}", file=sys.stderr)
            continue
        call = partial(_call_with_keywords, op_callable(scenario.op))
        if backend == BASELINE_BACKEND:
            timing = time_calls(call, sets, device, warmup=warmup, reps=reps, max_seconds=max_seconds)
        else:
            try:
                # strict: a backend lacking the op must not time torch's instead
                with use_backend(backend, strict=True), fast_paths(mode) if mode else contextlib.nullcontext():
                    timing = time_calls(call, sets, device, warmup=warmup, reps=reps, max_seconds=max_seconds)
            except OpNotImplementedError as exc:
                print(f"bench: skipped {scenario.op} on {label}: {exc}", file=sys.stderr)
                continue
        c = op_cost(scenario.op, sets[0])
        compute_s = c.flops / (peaks.int8_ops if scenario.op in INT8_OPS else peaks.flops)
        memory_s = c.bytes / peaks.bandwidth
        rows.append(
            Row(
                scenario=scenario.name,
                op=scenario.op,
                backend=label,
                context=scenario.context,
                median_ms=timing.median_s * 1e3,
                p10_ms=timing.p10_s * 1e3,
                p90_ms=timing.p90_s * 1e3,
                reps=timing.reps,
                flops=c.flops,
                bytes=c.bytes,
                tflops=c.flops / timing.median_s / 1e12,
                gbps=c.bytes / timing.median_s / 1e9,
                roofline_fraction=max(compute_s, memory_s) / timing.median_s,
                bound="compute" if compute_s >= memory_s else "memory",
            )
        )
        del sets  # free this scenario's inputs before the next one is built
    if progress is not None:
        progress(len(jobs), len(jobs), "done")
    return _with_comparisons(rows, scenarios, [_label(b, m) for b, m in variants])


def _with_comparisons(rows: list[Row], scenarios: list[Scenario], backends: list[str]) -> list[Row]:
    """Fill `speedup` (vs the first backend, when there are several) and `vs_baseline` (vs the scenario's
    baseline row, when it ran)."""
    median = {(r.scenario, r.op, r.backend): r.median_ms for r in rows}
    baseline_of = {(s.name, s.op): s.baseline for s in scenarios if s.baseline}
    done = []
    for r in rows:
        first = median.get((r.scenario, r.op, backends[0])) if len(backends) > 1 else None
        base_op = baseline_of.get((r.scenario, r.op))
        base = median.get((r.scenario, base_op, BASELINE_BACKEND)) if base_op else None
        done.append(
            Row(
                **{
                    **asdict(r),
                    "speedup": first / r.median_ms if first and r.backend != BASELINE_BACKEND else None,
                    "vs_baseline": base / r.median_ms if base else None,
                }
            )
        )
    return done


def format_table(rows: list[Row], *, markdown: bool = False) -> str:
    """The rows as an aligned text table (or Markdown)."""
    head = ["op", "scenario", "backend", "median ms", "p10-p90 ms", "TFLOP/s", "GB/s", "roofline", "bound"]
    show_speedup = any(r.speedup is not None for r in rows)
    show_baseline = any(r.vs_baseline is not None for r in rows)
    head += ["speedup"] * show_speedup + ["vs baseline"] * show_baseline
    body = []
    for r in rows:
        line = [
            r.op,
            r.scenario,
            r.backend,
            f"{r.median_ms:.3f}",
            f"{r.p10_ms:.3f}-{r.p90_ms:.3f}",
            f"{r.tflops:.4f}",
            f"{r.gbps:.2f}",
            f"{100 * r.roofline_fraction:.1f}%",
            r.bound,
        ]
        line += [_ratio(r.speedup)] * show_speedup + [_ratio(r.vs_baseline)] * show_baseline
        body.append(line)
    return render_table(head, body, markdown=markdown)


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def describe_peaks(peaks: Peaks) -> str:
    text = (
        f"device {peaks.name}: matmul {peaks.flops / 1e12:.4f} TFLOP/s, int8 {peaks.int8_ops / 1e12:.4f} TOP/s, "
        f"bandwidth {peaks.bandwidth / 1e9:.1f} GB/s ({peaks.source})"
    )
    return text + (f"\n  {peaks.detail}" if peaks.detail else "")


def run(args: argparse.Namespace) -> int:
    """`glm5-hal bench`: 0 when every row has a positive, finite time; 2 on a usage error."""
    backends = _split(args.backends)
    known = registry().names()
    unknown = [b for b in backends if b not in known]
    if unknown or not backends:
        print(f"--backends: unknown {unknown or backends}; known: {known}", file=sys.stderr)
        return 2
    for b in backends:
        availability = registry().availability(b)
        if not availability.available:
            print(f"--backends: {b} is unavailable here: {availability.reason}", file=sys.stderr)
            return 2
    ep_sets = [name for name in _split(args.scenarios) if name in EP_SCENARIOS]
    if ep_sets:
        if len(ep_sets) != len(_split(args.scenarios)) or args.ep_ranks < 1:
            print("--scenarios: run the EP sets apart from the per-op sets (--ep-ranks >= 1)", file=sys.stderr)
            return 2
        if args.fast_paths:  # said, not ignored: every mode would time the same exchange
            print("--fast-paths: the EP sets time ep_dispatch / ep_combine, which have no GEMMs", file=sys.stderr)
            return 2
        from perf import ep_bench

        return ep_bench.run(args, ep_sets, DTYPES[args.dtype])
    ops = _split(args.ops) or None
    known_ops = [*OP_NAMES, *BASELINES, *LAYER_OPS]
    bad_ops = [op for op in ops or () if op not in known_ops]
    if bad_ops:
        print(f"--ops: unknown {bad_ops}; known: {known_ops}", file=sys.stderr)
        return 2
    try:
        scenarios = select(["quick"] if args.quick else _split(args.scenarios), ops)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    if not scenarios:
        print(f"--ops: none of {ops} occurs in the chosen scenarios", file=sys.stderr)
        return 2
    if args.plot and not any(s.context for s in scenarios):
        print("--plot: needs scenarios with a context length (--scenarios context)", file=sys.stderr)
        return 2
    if args.reps < 1 or args.input_sets < 1 or args.warmup < 0:
        print("--reps and --input-sets: expected >= 1, --warmup: expected >= 0", file=sys.stderr)
        return 2
    modes = _split(args.fast_paths)
    try:
        for mode in modes:
            parse_mode(mode)
    except ValueError as exc:
        print(f"--fast-paths: {exc}", file=sys.stderr)
        return 2

    if args.threads is not None:
        if args.threads < 1:
            print(f"--threads: expected >= 1, got {args.threads}", file=sys.stderr)
            return 2
        torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    monitor = LoadMonitor()
    peaks = None if args.measure_peaks else table_peaks(device)
    if peaks is None:
        peaks = measure_peaks(device, dtype, max_size=2048 if args.quick else 8192)
    print(describe_peaks(peaks))
    # The probe runs here, before any timing, once per mode (the environment's when --fast-paths is not given).
    choices = {mode or "environment": capabilities(device, mode) for mode in (modes or [None])}
    for mode, caps in choices.items():
        print(f"fast paths ({mode}): " + "\n".join(caps.describe()))
    rows = bench(
        scenarios,
        backends,
        device,
        dtype,
        peaks,
        reps=QUICK_REPS if args.quick else args.reps,
        warmup=1 if args.quick else args.warmup,
        input_sets=args.input_sets,
        max_seconds=args.max_seconds,
        seed=args.seed,
        fast_path_modes=modes or None,
        progress=ProgressBar(enabled=False if args.no_progress else None),
    )
    print(format_table(rows))
    others = monitor.others_share()
    if others is not None:
        print(f"other processes used {100 * others:.0f}% of the machine's CPU time during this run", end="")
        print(" (timings of CPU ops are contended: rerun on a quiet machine)" if others > BUSY_WARNING else "")
    if args.json:
        with open(args.json, "w") as f:
            meta = {"device": args.device, "dtype": args.dtype, "backends": backends, "torch": torch.__version__}
            meta |= {"threads": torch.get_num_threads(), "cpu_share_of_other_processes": others}
            meta |= {"fast_paths": {mode: caps.as_dict() for mode, caps in choices.items()}}
            json.dump({**meta, "peaks": asdict(peaks), "rows": [asdict(r) for r in rows]}, f, indent=2)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(format_table(rows, markdown=True) + "\n")
    if args.plot:
        from perf.plot import plot_context

        plot_context(rows, args.plot, title=f"GLM-5 decode, batch 4, {args.dtype}, on {peaks.name}")
    return 0 if all(math.isfinite(r.median_ms) and r.median_ms > 0 for r in rows) else 1
