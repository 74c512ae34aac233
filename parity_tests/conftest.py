"""pytest plumbing of the parity suite: backend parametrisation, the --quick switch and the summary table.

pytest                                   every op x every available backend x dtype x case
pytest --quick                           skip the cases at real model dims
GLM5_HAL_BACKEND=torch pytest            parity of that backend only (and the model tests on it alone)
pytest --parity-json r.json --parity-markdown r.md
"""

from __future__ import annotations

import os

# numpy's BLAS runs the Triton interpreter's dots (tl.dot is np.matmul on one tile of at most 512 x 512): too small
# for BLAS threads to pay off, and on a CPU shared with other jobs their spin-waits made the interpreted GEMMs at
# real model dims 3-5x slower (measured on a busy 2-core machine). OpenBLAS reads this when numpy loads: set it
# before anything imports numpy; an explicit setting wins.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import pytest

from backends.triton.runtime import use_interpreter_if_no_gpu
from glm5_hal.parity.runner import Result, format_table, session_seed, summarise, write_report
from glm5_hal.registry import registry
from glm5_hal.selection import ENV_BACKEND, use_backend

# Without a GPU the triton backend runs under Triton's CPU interpreter, which must be chosen before anything
# imports triton (torch.compile does, in test_custom_ops.py).
use_interpreter_if_no_gpu()

_RESULTS: list[Result] = []


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("glm5-hal parity")
    group.addoption("--quick", action="store_true", help="skip parity cases at real GLM-5 / DeepSeek-V3.2 dims")
    group.addoption("--parity-json", metavar="FILE", help="write the parity results as JSON")
    group.addoption("--parity-markdown", metavar="FILE", help="write the parity summary table as Markdown")


def parity_backends() -> list[str]:
    """GLM5_HAL_BACKEND if it names a backend, else every registered backend (unavailable ones are skipped)."""
    requested = os.environ.get(ENV_BACKEND, "auto").strip()
    if requested and requested != "auto":
        return [requested]
    return registry().names()


@pytest.fixture
def available_backend(request: pytest.FixtureRequest) -> str:
    name = request.param
    avail = registry().availability(name)
    if not avail.available:
        pytest.skip(f"backend {name} unavailable: {avail.reason}")
    return name


# The model and quantization tests run on these when GLM5_HAL_BACKEND names none: auto's pick on a CPU (torch)
# and the float64 NumPy reference, the two backends the model's contract is checked on in CI.
MODEL_TEST_BACKENDS = ("torch", "reference")


def model_backends() -> list[str]:
    """GLM5_HAL_BACKEND if it names a backend, else MODEL_TEST_BACKENDS."""
    requested = os.environ.get(ENV_BACKEND, "auto").strip()
    return [requested] if requested and requested != "auto" else list(MODEL_TEST_BACKENDS)


@pytest.fixture(params=model_backends())
def model_backend(request: pytest.FixtureRequest):
    """Runs the test with the backend of this parametrisation selected (for modules that build whole models:
    `pytestmark = pytest.mark.usefixtures("model_backend")`); yields its name."""
    name = request.param
    avail = registry().availability(name)
    if not avail.available:
        pytest.skip(f"backend {name} unavailable: {avail.reason}")
    with use_backend(name):
        yield name


@pytest.fixture
def record_parity():
    return _RESULTS.append


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:  # noqa: ARG001
    if not _RESULTS:
        return
    terminalreporter.section(f"glm5-hal parity (seed {session_seed()}; rerun with GLM5_HAL_PARITY_SEED)")
    terminalreporter.write_line(format_table(summarise(_RESULTS)))
    write_report(
        _RESULTS,
        json_path=config.getoption("--parity-json"),
        markdown_path=config.getoption("--parity-markdown"),
    )
