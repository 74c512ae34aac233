"""Run parity cases on a backend and summarise them as an op x backend table (text, JSON, Markdown)."""

from __future__ import annotations

import inspect
import json
import os
import random
import zlib
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

import torch

import glm5_hal
from glm5_hal.parity.cases import Case
from glm5_hal.parity.compare import Verdict, compare_unchanged
from glm5_hal.parity.inputs import with_layout
from glm5_hal.parity.specs import SPECS
from glm5_hal.registry import ANY_DEVICE, OP_NAMES, registry
from glm5_hal.selection import OpNotImplementedError, use_backend

ENV_SEED = "GLM5_HAL_PARITY_SEED"
ENV_DEVICE = "GLM5_HAL_PARITY_DEVICE"


def _device_usable(device_type: str) -> bool:
    try:
        torch.empty(0, device=device_type)
    except Exception:  # RuntimeError (unknown type), AssertionError (torch built without it), vendor errors
        return False
    return True


def parity_device(backend: str) -> str:
    """The torch device a backend's parity cases run on: `GLM5_HAL_PARITY_DEVICE` if set; else the first device
    type the backend names that this process can allocate on (npu for ascend on an Ascend machine, cpu for a
    CPU stand-in); for a run-anywhere backend, cuda when present, else cpu."""
    if os.environ.get(ENV_DEVICE):
        return os.environ[ENV_DEVICE]
    device_types = registry().availability(backend).device_types
    for device_type in device_types:
        if device_type != ANY_DEVICE and _device_usable(device_type):
            return device_type
    return "cuda" if ANY_DEVICE in device_types and torch.cuda.is_available() else "cpu"


def session_seed() -> int:
    """The run's base seed: `GLM5_HAL_PARITY_SEED` if set (to reproduce a failure), else fresh each process."""
    value = os.environ.get(ENV_SEED)
    if value is None:
        value = str(random.SystemRandom().randrange(2**31))
        os.environ[ENV_SEED] = value  # the same seed for the rest of the process and its report
    return int(value)


@dataclass(frozen=True)
class Result:
    op: str
    case: str
    backend: str
    dtype: str
    status: str  # "pass", "fail", "error", "not implemented"
    rel_err: float
    detail: str = ""

    @property
    def passed(self) -> bool:
        return self.status == "pass"


def _clone(value: object, device: torch.device) -> object:
    return value.clone().to(device) if isinstance(value, torch.Tensor) else value


def custom_op_arguments(op: str, inputs: dict) -> tuple:
    """`inputs` (keyed by the public op's argument names) in the order of the custom op torch.ops.glm5_hal.<op>,
    with the public function's defaults for the arguments it leaves out (eps, kv_cache_dtype, ...): what the
    public wrapper passes, for opcheck."""
    public = inspect.signature(getattr(glm5_hal, op)).parameters
    schema = getattr(torch.ops.glm5_hal, op).default._schema
    return tuple(inputs[a.name] if a.name in inputs else public[a.name].default for a in schema.arguments)


def case_generator(case: Case, dtype: torch.dtype, seed: int) -> torch.Generator:
    """A generator seeded by the run seed and the case identity (stable across processes and backends)."""
    key = zlib.crc32(f"{case.id}/{dtype}".encode())
    return torch.Generator().manual_seed((seed * 1_000_003 + key) % 2**63)


def run_case(case: Case, backend: str, dtype: torch.dtype, *, device: str = "cpu", seed: int | None = None) -> Result:
    """Build the case's inputs, run the op on `backend` (strict: no silent fallback), judge against the reference."""
    seed = session_seed() if seed is None else seed
    inputs = case.build(case_generator(case, dtype, seed), dtype)
    return run_inputs(case.op, inputs, backend, dtype, device=device, name=case.name, exact=case.exact)


def run_inputs(
    op: str,
    inputs: dict,
    backend: str,
    dtype: torch.dtype,
    *,
    device: str = "cpu",
    name: str = "",
    exact: bool = False,
    layouts: dict[str, str] | None = None,
) -> Result:
    """Run `op` on `backend` (strict) with a copy of `inputs` on `device`, judged against the reference on `inputs`.

    layouts: {argument: a layout of glm5_hal.parity.inputs.LAYOUTS}; those arguments reach the op as views with
    the same values in that layout (a written cache is judged through its view). exact: every output must match
    the reference exactly. Every argument the op does not write must come back unchanged. `inputs` is left as
    it was.
    """
    spec = SPECS[op]
    dtype_name = str(dtype).removeprefix("torch.")
    device_inputs = {k: _clone(v, torch.device(device)) for k, v in inputs.items()}
    for arg, layout in (layouts or {}).items():
        if isinstance(device_inputs.get(arg), torch.Tensor):
            device_inputs[arg] = with_layout(device_inputs[arg], layout)
    try:
        with use_backend(backend, ops=[op], strict=True):
            outputs = spec.run(device_inputs)
    except OpNotImplementedError as exc:
        return Result(op, name, backend, dtype_name, "not implemented", 0.0, str(exc))
    except Exception as exc:  # the table reports a crashing backend as a failure, with its message
        return Result(op, name, backend, dtype_name, "error", float("inf"), f"{type(exc).__name__}: {exc}")
    outputs = {k: v.cpu() for k, v in outputs.items()}
    verdicts = spec.judge(inputs, outputs, dtype)
    verdicts += [
        compare_unchanged(f"{arg} (input)", value.cpu(), inputs[arg])
        for arg, value in device_inputs.items()
        if isinstance(value, torch.Tensor) and arg not in spec.mutated
    ]
    if exact:
        verdicts = [
            v if v.rel_err == 0.0 else Verdict(v.output, False, v.rel_err, "exact case: " + v.detail) for v in verdicts
        ]
    failed = [v for v in verdicts if not v.passed]
    worst = max((v.rel_err for v in verdicts), default=0.0)
    detail = "; ".join(f"{v.output}: {v.detail}" for v in failed)
    return Result(op, name, backend, dtype_name, "fail" if failed else "pass", worst, detail)


def run_all(
    cases: Iterable[Case],
    backends: Iterable[str],
    *,
    device: str | None = None,
    progress: Callable[[int, int, str], None] | None = None,
) -> list[Result]:
    """Every case x dtype on every backend; device None = each backend's parity_device."""
    jobs = [(c, b, d) for b in backends for c in cases for d in c.dtypes]
    results = []
    for i, (case, backend, dtype) in enumerate(jobs):
        if progress is not None:
            progress(i, len(jobs), f"{backend} {case.id} {str(dtype).removeprefix('torch.')}")
        results.append(run_case(case, backend, dtype, device=device or parity_device(backend)))
    if progress is not None:
        progress(len(jobs), len(jobs), "done")
    return results


def summarise(results: Iterable[Result]) -> list[dict]:
    """One row per (op, backend): status over all its cases and dtypes, and the worst relative error per dtype."""
    rows: dict[tuple[str, str], dict] = {}
    for r in results:
        row = rows.setdefault(
            (r.op, r.backend), {"op": r.op, "backend": r.backend, "cases": 0, "failed": 0, "skipped": 0, "worst": {}}
        )
        row["cases"] += 1
        if r.status == "not implemented":
            row["skipped"] += 1
            continue
        row["failed"] += 0 if r.passed else 1
        row["worst"][r.dtype] = max(row["worst"].get(r.dtype, 0.0), r.rel_err)
    order = {op: i for i, op in enumerate(OP_NAMES)}
    out = sorted(rows.values(), key=lambda row: (order.get(row["op"], 99), row["backend"]))
    for row in out:
        row["status"] = "FAIL" if row["failed"] else ("not implemented" if row["skipped"] == row["cases"] else "pass")
    return out


def _fmt_err(value: float | None) -> str:
    return "-" if value is None else ("exact" if value == 0.0 else f"{value:.2e}")


def format_table(rows: list[dict], *, markdown: bool = False) -> str:
    """The op x backend table: status, cases run, worst relative error in fp32 and bf16 (and fp16 if any)."""
    dtypes = sorted({d for row in rows for d in row["worst"]}, key=["float32", "bfloat16", "float16", "float64"].index)
    header = ["op", "backend", "status", "cases", *(f"worst rel err {d}" for d in dtypes)]
    body = [
        [
            row["op"],
            row["backend"],
            row["status"],
            f"{row['cases'] - row['skipped']}/{row['cases']}",
            *(_fmt_err(row["worst"].get(d)) for d in dtypes),
        ]
        for row in rows
    ]
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(r) + " |" for r in body]
        return "\n".join(lines)
    widths = [max(len(str(x)) for x in col) for col in zip(header, *body)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*header), fmt.format(*("-" * w for w in widths)), *(fmt.format(*r) for r in body)])


def write_report(results: list[Result], *, json_path: str | None = None, markdown_path: str | None = None) -> None:
    rows = summarise(results)
    if json_path:
        payload = {
            "seed": session_seed(),
            "torch": torch.__version__,
            "summary": rows,
            "results": [asdict(r) for r in results],
        }
        with open(json_path, "w") as fh:
            json.dump(payload, fh, indent=2, default=str)
    if markdown_path:
        with open(markdown_path, "w") as fh:
            fh.write(f"Parity against the float64 reference (seed {session_seed()}, torch {torch.__version__})\n\n")
            fh.write(format_table(rows, markdown=True) + "\n")
