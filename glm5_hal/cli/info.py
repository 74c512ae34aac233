"""`glm5-hal info`: the hardware torch sees, every backend (available or why not), who runs each op, and each
available backend's own report (Backend.report: the torch backend's GEMM routes and native kernels, a vendor's
kernel per op)."""

from __future__ import annotations

import argparse
import json
import os
import platform

import torch

from glm5_hal.environment import ENV_REPROBE
from glm5_hal.registry import ALL_OP_NAMES, OP_NAMES, registry
from glm5_hal.selection import BackendError, requested_backend, resolve


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("info", help="hardware, backends and per-op implementation")
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON instead of text")
    parser.add_argument(
        "--reprobe",
        action="store_true",
        help=f"measure again what backends keep across processes (the torch backend's routes; {ENV_REPROBE}=1)",
    )
    parser.set_defaults(func=run)


def hardware() -> dict[str, object]:
    """What torch itself reports; vendor devices are reported by their backends' probes, not here."""
    info: dict[str, object] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cpu_threads": torch.get_num_threads(),
        "cuda_available": torch.cuda.is_available(),
        "hip": torch.version.hip,
    }
    if torch.cuda.is_available():
        info["cuda_devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info


def op_table(name: str) -> dict[str, str]:
    """Per op: 'native', 'via <backend>' (a declared delegate) or 'fallback to torch'; empty if unavailable."""
    reg = registry()
    backend = reg.get(name)
    if backend is None or not reg.availability(name).available:
        return {}
    ops = reg.ops(name)
    table = {}
    for op in ALL_OP_NAMES:
        if op in backend.delegates:  # checked first: a delegating backend's table holds the delegate's function
            table[op] = f"via {backend.delegates[op]}"
        elif op in ops:
            table[op] = "native"
        else:
            table[op] = "fallback to torch"
    return table


def _report(name: str) -> dict[str, object] | None:
    """The backend's own section (Backend.report), asked only of an available backend; a report that raises is a
    bug of that backend, shown as such rather than stopping `info`."""
    reg = registry()
    backend = reg.get(name)
    if backend is None or backend.report is None or not reg.availability(name).available:
        return None
    try:
        report = backend.report()
    except Exception as exc:  # noqa: BLE001 (one backend's broken report must not hide the others)
        return {"lines": [f"{name}: its report failed: {type(exc).__name__}: {exc}"], "data": {}}
    return {"lines": list(report.lines), "data": dict(report.data)}


def report_data(info: dict[str, object], backend: str) -> dict[str, object]:
    """The JSON data of `backend`'s report in `info` (collect(), or `info --json` parsed); {} if it has none."""
    for entry in info["backends"]:
        if entry["name"] == backend:
            return (entry["report"] or {}).get("data", {})
    raise KeyError(f"backend: expected one of {[e['name'] for e in info['backends']]}, got {backend!r}")


def collect() -> dict[str, object]:
    reg = registry()
    backends = []
    for name in reg.names():
        backend = reg.get(name)
        avail = reg.availability(name)
        backends.append(
            {
                "name": name,
                "summary": backend.summary if backend else "",
                "available": avail.available,
                "reason": avail.reason,
                "device_types": list(avail.device_types),
                "auto_priority": backend.auto_priority if backend else None,
                "float64": backend.float64 if backend else False,
                "ops": op_table(name),
                "notes": list(backend.notes) if backend else [],
                "report": _report(name),
            }
        )
    selection = {}
    for op in ALL_OP_NAMES:
        try:
            res = resolve(op, "cpu")
            selection[op] = {"backend": res.backend, "reason": res.reason}
        except BackendError as exc:
            selection[op] = {"backend": None, "reason": str(exc)}
    requested, strict = requested_backend(OP_NAMES[0])
    return {
        "hardware": hardware(),
        "requested": requested,
        "strict": strict,
        "backends": backends,
        "cpu_selection": selection,
    }


def _collect_reprobed() -> dict[str, object]:
    """collect() with GLM5_HAL_REPROBE=1 while it runs: the backends measure again and replace what they keep (a
    backend that already answered in this process keeps that answer: the command runs in a fresh one)."""
    previous = os.environ.get(ENV_REPROBE)
    os.environ[ENV_REPROBE] = "1"
    try:
        return collect()
    finally:
        if previous is None:
            del os.environ[ENV_REPROBE]
        else:
            os.environ[ENV_REPROBE] = previous


def run(args: argparse.Namespace) -> int:
    data = _collect_reprobed() if args.reprobe else collect()
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    hw = data["hardware"]
    print("hardware")
    for key, value in hw.items():
        print(f"  {key}: {value}")
    print(f"\nselection: GLM5_HAL_BACKEND={data['requested']} strict={data['strict']}")
    print("\nbackends")
    for b in data["backends"]:
        state = "available" if b["available"] else "UNAVAILABLE"
        where = f" on {', '.join(b['device_types'])}" if b["available"] else ""
        print(f"  {b['name']:<10} {state}{where}: {b['reason']}")
        if b["summary"]:
            print(f"  {'':<10} {b['summary']}")
        if b["float64"]:
            print(f"  {'':<10} float64 verification mode: supported")
        for note in b["notes"]:
            print(f"  {'':<10} note: {note}")
        if b["ops"]:
            native = [op for op, how in b["ops"].items() if how == "native"]
            other = {op: how for op, how in b["ops"].items() if how != "native"}
            print(f"  {'':<10} native: {', '.join(native) or 'none'}")
            for op, how in other.items():
                print(f"  {'':<10} {op}: {how}")
    for b in data["backends"]:
        if b["report"]:
            print()
            for line in b["report"]["lines"]:
                print(line)
    print("\nwho runs each op on cpu tensors now")
    for op, sel in data["cpu_selection"].items():
        # The backends list above already says why the others were not considered; keep one line per op.
        why = sel["reason"].splitlines()[0].split("; not considered")[0]
        print(f"  {op:<24} {sel['backend'] or '-'}  ({why})")
    return 0
