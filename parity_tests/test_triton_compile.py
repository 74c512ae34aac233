"""The Triton kernels compile for sm_90 (H100 / H200) with the installed Triton, on a CPU (triton/compile_check.py).

The interpreter CI runs the kernels under accepted two kernels that Triton 3.6's GPU compiler rejected on an H200;
these tests compile them for the GPU instead. Each runs in a fresh process: the pytest process has the interpreter
switched on (conftest.py), and a compile needs it off from the moment triton is imported.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="the triton extra is not installed (pip install 'glm5-hal[triton]')")

ROOT = Path(__file__).resolve().parents[1]


def _python(
    code: str, directory: Path, timeout: float, extra_path: list[str] | None = None
) -> subprocess.CompletedProcess:
    """Run `code` as a script file (Triton reads a kernel's source from its file) with the interpreter off;
    extra_path goes first on the module path (a second Triton)."""
    script = directory / "compile_check_script.py"
    script.write_text(textwrap.dedent(code))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [*(extra_path or []), str(ROOT), env.get("PYTHONPATH", "")]))
    return subprocess.run(
        [sys.executable, str(script)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# A second Triton to compile with: .ci/run installs 3.6.0, the version on the project's GPU machine (which the
# kernels must keep working with, beside the newest), with `pip install --no-deps --target <folder>`.
ENV_SECOND_TRITON = "GLM5_HAL_TRITON_SITE"


@pytest.mark.parametrize("triton_site", ["installed", ENV_SECOND_TRITON])
def test_every_triton_kernel_compiles_for_sm90(triton_site: str, tmp_path: Path) -> None:
    """Every @triton.jit kernel of the backend is launched by the check's case set, and each compiles for sm_90."""
    extra = []
    if triton_site == ENV_SECOND_TRITON:
        site = os.environ.get(ENV_SECOND_TRITON, "")
        if not site or not (Path(site) / "triton").is_dir():
            pytest.skip(f"{ENV_SECOND_TRITON} names no folder holding a second Triton (.ci/run installs 3.6.0 there)")
        extra = [site]
    proc = _python(
        """
        import importlib, pkgutil
        import triton
        from triton.runtime.jit import JITFunction
        import backends.triton as package
        from backends.triton.compile_check import check

        report = check(90, "quick")
        for line in report.lines():
            print(line)
        kernels = set()
        for module in pkgutil.iter_modules(package.__path__):
            namespace = vars(importlib.import_module(f"backends.triton.{module.name}"))
            jitted = {name for name, obj in namespace.items() if isinstance(obj, JITFunction)}
            kernels |= {name for name in jitted if name.endswith("_kernel")}
        print("TRITON", triton.__version__, triton.__file__)
        print("NOT COMPILED", sorted(kernels - set(report.shared)))
        """,
        tmp_path,
        timeout=1200,
        extra_path=extra,
    )
    out = proc.stdout + proc.stderr[-3000:]
    assert proc.returncode == 0, out
    assert "\n0 errors" in proc.stdout, out
    assert "NOT COMPILED []" in proc.stdout, out
    if extra:
        assert f"TRITON 3.6.0 {extra[0]}" in proc.stdout, out


def test_the_check_reports_what_the_gpu_compiler_rejects_and_what_does_not_fit(tmp_path: Path) -> None:
    """Calling a plain Python function from a kernel: the interpreter runs it, the compiler refuses it. A bf16 dot of
    [128, 1024] x [1024, 128] tiles compiles but wants 512 KiB of shared memory, over an sm_90 block's 227 KiB: the
    check reports it launched as it is, and as an autotuner's only configuration."""
    proc = _python(
        """
        import torch, triton, triton.language as tl
        from backends.triton.compile_check import Report, compile_only

        def doubled(t):  # not @triton.jit
            return t * 2

        @triton.jit
        def tile_copy(x_ptr, y_ptr, B: tl.constexpr):
            i = tl.arange(0, B)
            tl.store(y_ptr + i, tl.load(x_ptr + i))

        @triton.jit
        def tile_double(x_ptr, y_ptr, B: tl.constexpr):
            i = tl.arange(0, B)
            tl.store(y_ptr + i, doubled(tl.load(x_ptr + i)))

        @triton.jit
        def big_dot(x_ptr, y_ptr, M: tl.constexpr, K: tl.constexpr):
            i, k = tl.arange(0, M), tl.arange(0, K)
            a = tl.load(x_ptr + i[:, None] * K + k[None, :])
            b = tl.load(x_ptr + k[:, None] * M + i[None, :])
            tl.store(y_ptr + i[:, None] * M + i[None, :], tl.dot(a, b))

        big_dot_tuned = triton.autotune([triton.Config({"M": 128, "K": 1024})], key=[])(big_dot)

        report = Report(90)
        x, y = torch.zeros(128 * 1024, dtype=torch.bfloat16), torch.zeros(128 * 128)
        with compile_only(90, report):
            tile_copy[(1,)](y, y, B=64)
            print("compiled", sorted(report.shared["tile_copy"]))
            launches = (
                lambda: tile_double[(1,)](y, y, B=64),
                lambda: big_dot[(1,)](x, y, M=128, K=1024),
                lambda: big_dot_tuned[(1,)](x, y),
            )
            for launch in launches:
                try:
                    launch()
                    print("no error")
                except Exception as exc:
                    print("rejected:", type(exc).__name__, str(exc).splitlines()[0][:120])
        """,
        tmp_path,
        timeout=300,
    )
    out = proc.stdout + proc.stderr[-3000:]
    assert proc.returncode == 0, out
    assert "compiled [" in proc.stdout, out
    assert "Unsupported function referenced" in proc.stdout or "rejected: CompilationError" in proc.stdout, out
    assert "rejected: RuntimeError big_dot: needs 524288 bytes of shared memory, over 232448" in proc.stdout, out
    assert "rejected: RuntimeError big_dot: no autotuning config fits 232448 bytes" in proc.stdout, out
