"""`glm5-hal export-onnx`: one ONNX model per op at a preset's dims, checked, and optionally verified.

glm5-hal export-onnx --preset glm5 --out onnx/                      every op -> onnx/<op>.onnx
glm5-hal export-onnx --preset glm5-mini --out onnx/ --ops moe_gate,fused_moe --verify
glm5-hal export-onnx --preset glm5 --out onnx/ --custom-ops grouped_matmul
glm5-hal export-onnx --preset glm5 --out onnx-fp8/ --kv-cache fp8             quantized caches (fp8_ds_mla, fp8_index)
"""

from __future__ import annotations

import argparse
import sys

from glm5_hal.config import PRESETS, get_preset
from glm5_hal.registry import OP_NAMES


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "export-onnx", help="write one ONNX model (standard opset, symbolic token/cache dims) per op"
    )
    parser.add_argument("--preset", required=True, help=f"model preset: {', '.join(sorted(PRESETS))}")
    parser.add_argument("--out", required=True, metavar="DIR", help="directory for <op>.onnx (created if missing)")
    parser.add_argument("--ops", help=f"comma-separated ops (default: all): {', '.join(OP_NAMES)}")
    parser.add_argument(
        "--custom-ops",
        default="",
        help="comma-separated ops to emit as one glm5_hal-domain node wherever they occur (docs/onnx.md)",
    )
    parser.add_argument(
        "--kv-cache",
        default="auto",
        choices=("auto", "fp8", "int8"),
        help="cache format of the cache ops: float (auto), fp8 (fp8_ds_mla + fp8_index), int8 (int8_mla + int8_index)",
    )
    parser.add_argument(
        "--verify",
        action="store_true",
        help="also run each op's parity cases through onnxruntime against the float64 reference (fp32)",
    )
    parser.set_defaults(func=run)


def _split(value: str | None) -> list[str]:
    return [v.strip() for v in (value or "").split(",") if v.strip()]


def run(args: argparse.Namespace) -> int:
    try:
        cfg = get_preset(args.preset)
    except ValueError as exc:
        print(f"--preset: {exc}", file=sys.stderr)
        return 2
    ops, custom_ops = _split(args.ops) or list(OP_NAMES), _split(args.custom_ops)
    for flag, names in (("--ops", ops), ("--custom-ops", custom_ops)):
        unknown = sorted(set(names) - set(OP_NAMES))
        if unknown:
            print(f"{flag}: unknown {unknown}; known: {list(OP_NAMES)}", file=sys.stderr)
            return 2
    from glm5_hal.onnx_export import write_preset

    try:
        paths = write_preset(cfg, args.out, ops, custom_ops=custom_ops, kv_cache=args.kv_cache)
    except ImportError as exc:
        print(f"export-onnx: {exc}", file=sys.stderr)
        return 2
    print(f"export-onnx: preset {cfg.name}, {len(paths)} models checked (onnx.checker, full shape inference)")
    for path in paths:
        print(f"  {path}  ({path.stat().st_size / 1024:.1f} KiB)")
    return _verify(ops, custom_ops) if args.verify else 0


def _verify(ops: list[str], custom_ops: list[str]) -> int:
    from glm5_hal.onnx_export.verify import run_case
    from glm5_hal.parity import cases_for, format_table, session_seed, summarise

    if custom_ops:
        print("--verify: graphs with glm5_hal custom nodes cannot run in onnxruntime; verifying the standard form")
    cases = [c for c in cases_for(quick=True) if c.op in ops]
    print(f"verify: {len(cases)} parity cases through onnxruntime (fp32), seed {session_seed()}")
    results = [run_case(c) for c in cases]
    print(format_table(summarise(results)))
    failures = [r for r in results if not r.passed]
    for r in failures:
        print(f"FAILED {r.op}/{r.case}: {r.detail}")
    return 1 if failures else 0
