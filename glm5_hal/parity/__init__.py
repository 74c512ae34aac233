"""The numeric-parity machinery shared by the pytest suite (parity_tests/) and `glm5-hal parity`.

[cases] build fresh inputs -> [specs] run the public op on a backend and the float64 reference
-> [compare] judge by the tolerance policy -> [runner] op x backend table (text, JSON, Markdown).
"""

from glm5_hal.parity.cases import CASES, Case, cases_for
from glm5_hal.parity.compare import TOLERANCE, Verdict
from glm5_hal.parity.runner import (
    Result,
    format_table,
    parity_device,
    run_all,
    run_case,
    session_seed,
    summarise,
    write_report,
)

__all__ = [
    "CASES",
    "Case",
    "cases_for",
    "TOLERANCE",
    "Verdict",
    "Result",
    "run_case",
    "parity_device",
    "run_all",
    "summarise",
    "format_table",
    "write_report",
    "session_seed",
]
