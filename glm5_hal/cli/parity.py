"""`glm5-hal parity`: run the parity cases on the selected backends and print the op x backend table."""

from __future__ import annotations

import argparse
import os
import sys

from glm5_hal.cli.progress import ProgressBar
from glm5_hal.registry import OP_NAMES, registry
from glm5_hal.selection import ENV_BACKEND


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "parity", help="check backends against the float64 NumPy reference; non-zero exit on any failure"
    )
    parser.add_argument(
        "--backends",
        help="comma-separated backends (default: GLM5_HAL_BACKEND if it names one, else every available backend)",
    )
    parser.add_argument("--ops", help=f"comma-separated ops (default: all): {', '.join(OP_NAMES)}")
    parser.add_argument(
        "--device",
        help="torch device the inputs live on (default: each backend's own device, e.g. npu for ascend, cuda for "
        "torch on a GPU machine, else cpu; or GLM5_HAL_PARITY_DEVICE)",
    )
    parser.add_argument("--quick", action="store_true", help="skip the cases at real GLM-5 / DeepSeek-V3.2 dims")
    parser.add_argument("--seed", type=int, help="base seed (default: fresh; printed so a failure can be rerun)")
    parser.add_argument("--json", metavar="FILE", help="write every result and the summary as JSON")
    parser.add_argument("--markdown", metavar="FILE", help="write the summary table as Markdown")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--distributed",
        action="store_true",
        help="check ep_dispatch / ep_combine and the model on N ranks (ops ep_dispatch, ep_combine, ep_model); "
        "start it with `torchrun --nproc-per-node N -m glm5_hal.cli parity --distributed`",
    )
    parser.add_argument(
        "--timeout", type=float, default=300.0, help="--distributed: seconds a collective may wait (default 300)"
    )
    parser.set_defaults(func=run)


def _split(value: str | None) -> list[str] | None:
    return None if not value else [v.strip() for v in value.split(",") if v.strip()]


def default_backends() -> list[str]:
    requested = os.environ.get(ENV_BACKEND, "auto").strip()
    reg = registry()
    if requested and requested != "auto":
        return [requested]
    return [name for name in reg.names() if reg.availability(name).available]


def run(args: argparse.Namespace) -> int:
    if args.seed is not None:
        os.environ["GLM5_HAL_PARITY_SEED"] = str(args.seed)
    from glm5_hal.parity import cases_for, format_table, parity_device, run_all, session_seed, summarise, write_report

    if args.distributed:
        from glm5_hal.cli.parity_distributed import run as run_distributed

        return run_distributed(args, _split(args.backends), _split(args.ops))
    reg = registry()
    backends = _split(args.backends) or default_backends()
    unknown = [b for b in backends if b not in reg.names()]
    if unknown:
        print(f"--backends: unknown {unknown}; known: {reg.names()}", file=sys.stderr)
        return 2
    for name in backends:
        avail = reg.availability(name)
        if not avail.available:
            print(f"backend {name}: unavailable ({avail.reason})", file=sys.stderr)
            return 2
    ops = _split(args.ops) or list(OP_NAMES)
    bad_ops = sorted(set(ops) - set(OP_NAMES))
    if bad_ops:
        print(f"--ops: unknown {bad_ops}; known: {list(OP_NAMES)}", file=sys.stderr)
        return 2
    cases = [c for c in cases_for(quick=args.quick) if c.op in ops]
    where = args.device or ", ".join(f"{b} on {parity_device(b)}" for b in backends)
    print(f"parity: {where}; {len(cases)} cases, seed {session_seed()}")
    bar = ProgressBar(enabled=False if args.no_progress else None)
    results = run_all(cases, backends, device=args.device, progress=bar)
    print(format_table(summarise(results)))
    failures = [r for r in results if r.status in ("fail", "error")]
    for r in failures:
        print(f"FAILED {r.backend} {r.op}/{r.case} {r.dtype}: {r.detail}")
    write_report(results, json_path=args.json, markdown_path=args.markdown)
    if failures:
        print(f"{len(failures)} of {len(results)} checks failed (rerun with --seed {session_seed()})")
    return 1 if failures else 0
