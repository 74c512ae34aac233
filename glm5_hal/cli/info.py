"""`glm5-hal info`: the hardware torch sees, every backend (available or why not), who runs each op, and which fast
GEMM paths the portable backends use on each device and why (glm5_hal.capabilities)."""

from __future__ import annotations

import argparse
import json
import platform

import torch

from glm5_hal.capabilities import capabilities
from glm5_hal.native import bf16_gemm, build, indexer_scores, int8_gemm, sparse_attention
from glm5_hal.native import topk as native_topk
from glm5_hal.registry import ALL_OP_NAMES, OP_NAMES, registry
from glm5_hal.selection import BackendError, requested_backend, resolve


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("info", help="hardware, backends and per-op implementation")
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON instead of text")
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


def fast_paths() -> dict[str, dict[str, object]]:
    """Per device torch can use here (the CPU, every CUDA device): the probe's choices, or the error that stopped
    it (a bad GLM5_HAL_FAST_PATHS value)."""
    found: dict[str, dict[str, object]] = {}
    for device in ["cpu"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]:
        try:
            found[device] = capabilities(device).as_dict()
        except ValueError as exc:
            found[device] = {"error": str(exc)}
    return found


def native_kernels() -> dict[str, object]:
    """glm5_hal.native's state: on or off, the build cache (and why it is where it is, or why there is none), and
    each kernel build the routes use on this CPU, asked for here (built on first use): loaded, or why not."""
    for module in (bf16_gemm, indexer_scores, sparse_attention, int8_gemm, native_topk):
        module.availability()  # the build each route takes; the answer lands in build.status()
    return build.status()


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
        "fast_paths": fast_paths(),
        "requested": requested,
        "strict": strict,
        "backends": backends,
        "cpu_selection": selection,
        "native_kernels": native_kernels(),
    }


def run(args: argparse.Namespace) -> int:
    data = collect()
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
    print("\nfast GEMM paths of the portable backends (GLM5_HAL_FAST_PATHS: auto, 0 = conservative fp32, 1 = all)")
    for device, choice in data["fast_paths"].items():
        for line in choice.get("summary", [f"{device}: {choice.get('error')}"]):
            print(f"  {line}")
    native = data["native_kernels"]
    state = "on" if native["enabled"] else "off (GLM5_HAL_NATIVE)"
    print(f"\nnative CPU kernels (glm5_hal/native): {state}; build cache {native['cache_dir'] or 'none'}")
    if native["cache_note"]:
        print(f"  cache: {native['cache_note']}")
    for kernel, how in native["kernels"].items():
        print(f"  {kernel:<28} {how}")
    print("\nwho runs each op on cpu tensors now")
    for op, sel in data["cpu_selection"].items():
        # The backends list above already says why the others were not considered; keep one line per op.
        why = sel["reason"].splitlines()[0].split("; not considered")[0]
        print(f"  {op:<24} {sel['backend'] or '-'}  ({why})")
    return 0
