"""Parity of the exported graphs: each parity case's op exported at the case's dims, run by onnxruntime on the
CPU, and judged against ops_reference by glm5_hal.parity (same inputs, same compare policy as any backend).

The graphs compute in fp32, so cases run in fp32 (the fp32 tolerance of glm5_hal.parity.compare applies).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from glm5_hal.parity.cases import Case
from glm5_hal.parity.compare import Verdict
from glm5_hal.parity.runner import Result, case_generator, session_seed
from glm5_hal.parity.specs import SPECS

BACKEND_NAME = "onnxruntime"
DTYPE = torch.float32


def run_case(case: Case, *, seed: int | None = None, custom_ops: Iterable[str] = ()) -> Result:
    """Export `case.op` like the case's inputs, check it, run it with onnxruntime, judge it (fp32)."""
    from glm5_hal.onnx_export.export import check, contract_outputs, export_like
    from glm5_hal.onnx_export.runtime import run, session

    spec = SPECS[case.op]
    seed = session_seed() if seed is None else seed
    inputs = case.build(case_generator(case, DTYPE, seed), DTYPE)
    try:
        model = export_like(case.op, inputs, custom_ops=custom_ops)
        check(model)
        produced = contract_outputs(run(session(model), inputs))
    except Exception as exc:  # reported as a failed case, with its message, like a crashing backend
        return Result(
            case.op, case.name, BACKEND_NAME, "float32", "error", float("inf"), f"{type(exc).__name__}: {exc}"
        )
    outputs = {name: torch.from_numpy(produced[name]) for name in spec.output_names + spec.mutated}
    return _result(case, spec.judge(inputs, outputs, DTYPE))


def _result(case: Case, verdicts: list[Verdict]) -> Result:
    if case.exact:  # integer results must match exactly, not within a tolerance
        verdicts = [
            v if v.rel_err == 0.0 else Verdict(v.output, False, v.rel_err, "exact case: " + v.detail) for v in verdicts
        ]
    failed = [v for v in verdicts if not v.passed]
    detail = "; ".join(f"{v.output}: {v.detail}" for v in failed)
    worst = max((v.rel_err for v in verdicts), default=0.0)
    return Result(case.op, case.name, BACKEND_NAME, "float32", "fail" if failed else "pass", worst, detail)
