"""Hypothesis profiles of the fuzz suite, and the count of configs each op ran on each backend.

GLM5_HAL_FUZZ_PROFILE=ci (default): derandomized (the same examples every run, so CI is reproducible and its time
is fixed), a fixed deadline per example, no example database written.
GLM5_HAL_FUZZ_PROFILE=long: 10x the examples, fresh ones every run, no deadline; failures are saved in
.hypothesis/ and replayed first next time.
"""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch
from hypothesis import HealthCheck, settings

from fuzz.strategies import FUZZ_CLASSES, FUZZ_COUNTS, PROFILE

_SLOW_IS_FINE = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture]

settings.register_profile(
    "ci",
    derandomize=True,
    database=None,
    # Per example: generous for a 2-core CI machine shared with other jobs (the slowest examples, triton's
    # interpreter over a fused MoE, take ~1 s alone); it catches a hang, not a slow run.
    deadline=timedelta(seconds=30),
    print_blob=True,
    suppress_health_check=_SLOW_IS_FINE,
)
settings.register_profile("long", deadline=None, print_blob=True, suppress_health_check=_SLOW_IS_FINE)
settings.load_profile(PROFILE)
assert PROFILE in ("ci", "long"), (
    f"GLM5_HAL_FUZZ_PROFILE: expected 'ci' or 'long', got {os.environ.get('GLM5_HAL_FUZZ_PROFILE')!r}"
)


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:  # noqa: ARG001
    if not FUZZ_COUNTS:
        return
    terminalreporter.section(f"glm5-hal fuzz: configs run per op and backend (profile {PROFILE})")
    kinds = sorted({kind for kind, _, _ in FUZZ_COUNTS})
    for kind in kinds:
        rows = sorted((op, backend, n) for (k, op, backend), n in FUZZ_COUNTS.items() if k == kind)
        terminalreporter.write_line(f"{kind}:")
        for op, backend, n in rows:
            classes = f"  ({len(FUZZ_CLASSES[op])} classes)" if kind == "bad inputs" and op in FUZZ_CLASSES else ""
            terminalreporter.write_line(f"  {op:<34} {backend:<12} {n}{classes}")


@pytest.fixture(autouse=True, scope="package")
def one_intra_op_thread():
    """The fuzz shapes are tiny: intra-op threads cost more than they save there, and on a machine shared with
    other jobs their wake-ups cost milliseconds per op. Restored for the rest of the session."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
