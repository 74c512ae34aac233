"""Regression tests of the second hardening round (issue 31): each failed before its fix (test 2 where the CPU
runs the AVX-512 VNNI build; the portable build's scalar loop was right before).

1. block ids past the cache with value checks off or under torch.compile: IndexError on the fp32 path, SIGSEGV
   in the native sparse attention kernel, out-of-bounds reads on triton; the rule (docs/ops.md "Paged caches") is
   now that a key the block table cannot address is not a key, on every backend and the reference.
2. int8_gemm.c formed the W4A8 scale gather's index in 32 bits: scale rows 2^31 / 15 elements apart or more
   segfaulted (AVX-512 build).
3. a truncated or torn library in the build cache killed later processes with SIGBUS in dlopen; a library lacking
   a symbol raised AttributeError from the op;
4. a hanging compiler stalled each kernel's first call for the whole timeout and left its processes running;
5. with HOME unset and a uid without a passwd entry the cache went to a relative '~/.cache/glm5_hal';
6. a read-only cache dir reported "built but did not load"; top-k rows past 2^31 scores raised ValueError;
7. sparse attention copied a cache view with spare slots per block whole on every call (fp32 and native paths);
8. the test extra admitted transformers 5.23, where the layer benchmark's comparison fails.

Edge rules (docs/ops.md "Edge rules"), on the reference, torch, the native kernel, triton and the ascend fake: all
-inf scores are an empty softmax; the absolute floor 2^-110; the hi + lo split near FLT_MAX; and the judge's scales
for lse near 0, cancelling indexer sums and fp16 outputs among the subnormals (the long fuzz profile's failures).
"""

from __future__ import annotations

import math
import mmap
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fakes.ascend.fixture import fake_torch_npu_fixture, torch_npu_schemas_fixture  # noqa: F401 (fixtures)

REPO = Path(__file__).resolve().parents[1]


def _run_python(code: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter at the repository root (parity_tests importable): a crash there (SIGSEGV,
    SIGBUS) is a return code this test reads, not the end of the test run."""
    path = os.pathsep.join([str(REPO), str(REPO / "parity_tests"), os.environ.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": path, **(env or {})},
    )


def _assert_survived(done: subprocess.CompletedProcess) -> None:
    if done.returncode != 0 or "survived" not in done.stdout:
        pytest.fail(f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}", pytrace=False)


# --------------------------------------------------------------------------------- 1: block ids past the cache
# Three sequences over a 3-block cache (block size 16): sequence 0's second block id is 1000 (past the cache),
# sequence 1's first is -3, and sequence 2 has 40 keys where its two-block table addresses 32 (positions 32 .. 39
# are past the table). With value checks on each is a ValueError; with them off (or under torch.compile) the
# contract says such keys are not keys. The expected results are computed here in float64 from that rule alone.
_PAST_THE_CACHE = r'''
import functools, math, sys
import torch
import glm5_hal

PATH = sys.argv[1]
BS, BLOCKS, TOPK = 16, 3, 24
# Ids far outside the cache, then a table whose only such id is BLOCKS itself (the first past the cache: an off-by-one
# in a bounds test, or a shortcut that checks the table's range as a whole, would take it for a block).
TABLES = (
    torch.tensor([[0, 1000], [-3, 2], [1, 2]], dtype=torch.int32),
    torch.tensor([[0, 1], [0, 2], [1, 3]], dtype=torch.int32),
)
SEQ_LENS = torch.tensor([32, 20, 40], dtype=torch.int32)
CU = torch.tensor([0, 2, 4, 6], dtype=torch.int32)
SEQS = [0, 0, 1, 1, 2, 2]
POSITIONS = [30, 31, 18, 19, 38, 39]


def addressable(b, p):
    if p < 0 or p >= TABLE.shape[1] * BS:
        return False
    return 0 <= int(TABLE[b, p // BS]) < BLOCKS


def row(cache, b, p):
    return cache[int(TABLE[b, p // BS]), p % BS].double()


def attention_inputs(dtype):
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(BLOCKS, BS, 576, generator=gen).to(dtype)
    q = torch.randn(6, 2, 576, generator=gen).to(dtype)
    # Every token selects positions across all its blocks (some addressable, some not), then -1.
    indices = torch.full((6, TOPK), -1, dtype=torch.int32)
    for t, b in enumerate(SEQS):
        picks = torch.randperm(int(SEQ_LENS[b]), generator=gen)[: TOPK - 2]
        indices[t, : picks.numel()] = picks
    return dict(q=q, kv_cache=cache, indices=indices, block_table=TABLE, seq_lens_k=SEQ_LENS, cu_seqlens_q=CU,
                sm_scale=0.05, d_v=512)


def expected_attention(inputs):
    q, cache = inputs["q"].double(), inputs["kv_cache"]
    out, lse = torch.zeros(6, 2, 512, dtype=torch.float64), torch.full((6, 2), -math.inf, dtype=torch.float64)
    for t, b in enumerate(SEQS):
        keys = [p for p in inputs["indices"][t].tolist() if 0 <= p < int(SEQ_LENS[b]) and addressable(b, p)]
        if keys:
            k = torch.stack([row(cache, b, p) for p in keys])
            s = 0.05 * q[t] @ k.T
            out[t], lse[t] = torch.softmax(s, -1) @ k[:, :512], torch.logsumexp(s, -1)
    return out, lse


def indexer_inputs(dtype):
    gen = torch.Generator().manual_seed(1)
    return dict(q_idx=torch.randn(6, 2, 128, generator=gen).to(dtype), weights=torch.randn(6, 2, generator=gen),
                index_k_cache=torch.randn(BLOCKS, BS, 128, generator=gen).to(dtype), block_table=TABLE,
                seq_lens_k=SEQ_LENS, cu_seqlens_q=CU)


def expected_logits(inputs):
    q, w, cache = inputs["q_idx"].double(), inputs["weights"].double(), inputs["index_k_cache"]
    logits = torch.full((6, TABLE.shape[1] * BS), -math.inf, dtype=torch.float64)
    for t, b in enumerate(SEQS):
        for p in range(min(POSITIONS[t] + 1, logits.shape[1])):
            if addressable(b, p):
                logits[t, p] = w[t] @ torch.relu(q[t] @ row(cache, b, p))
    return logits


def close(got, want, dtype, what):
    tol = {torch.float32: 1e-4, torch.bfloat16: 3e-2}[dtype]
    want = want.to(torch.float64)
    got = got.to(torch.float64)
    assert torch.equal(got.isinf(), want.isinf()), (what, got, want)
    finite = want.isfinite()
    err = (got[finite] - want[finite]).abs().max() if finite.any() else 0.0
    assert err <= tol * max(1.0, float(want[finite].abs().max())), (what, float(err))


def check_attention(backend, dtype, run=None):
    inputs = attention_inputs(dtype)
    with glm5_hal.use_backend(backend, strict=True):
        out, lse = (run or glm5_hal.sparse_flash_attention)(**inputs)
    want_out, want_lse = expected_attention(inputs)
    close(out, want_out, dtype, f"{backend} {dtype} out")
    close(lse, want_lse, dtype, f"{backend} {dtype} lse")


def check_indexer(backend, dtype):
    inputs = indexer_inputs(dtype)
    want = expected_logits(inputs)
    with glm5_hal.use_backend(backend, strict=True):
        logits = glm5_hal.indexer_logits(**inputs)
        indices = glm5_hal.lightning_indexer(**inputs, topk=32)  # every visible key: no tie to break
    close(logits, want, dtype, f"{backend} {dtype} logits")
    for t in range(6):
        picked = sorted(p for p in indices[t].tolist() if p >= 0)
        assert picked == [p for p in range(32) if want[t, p] > -math.inf], (backend, t, picked)


def force_native_portable():
    """Route the torch backend's bf16 attention and indexer through backends.torch_eager.native's portable build, as a
    CPU with AVX-512 BF16 routes them through the fast one (this machine may lack it; the kernels' loops are the
    same)."""
    import backends.torch_eager.indexer as indexer
    import backends.torch_eager.sparse_attention as attention
    from backends.torch_eager.gemm import Gemm
    from backends.torch_eager.native import sparse_attention

    assert sparse_attention.availability("portable")[0], sparse_attention.availability("portable")
    native = Gemm(torch.bfloat16, True, math.inf, True, "portable")
    # Every family's bf16 products on the native route, for the rest of this process.
    attention.gemm_for = indexer.gemm_for = lambda dtype, device, family: native if dtype == torch.bfloat16 else None


if PATH == "native":
    force_native_portable()
elif PATH == "compile":
    torch._dynamo.reset()
    compiled = torch.compile(glm5_hal.sparse_flash_attention, fullgraph=True, backend="aot_eager")
elif PATH == "ascend":
    from fakes.ascend.fixture import install_in_process
    from fakes.ascend.wheel import torch_npu_wheel
    install_in_process(torch_npu_wheel())
for TABLE in TABLES:  # the functions above read the global TABLE
    if PATH == "native":
        check_attention("torch", torch.bfloat16)
        check_indexer("torch", torch.bfloat16)
    elif PATH == "compile":
        check_attention("torch", torch.float32, compiled)
    else:
        for dtype in (torch.float32, torch.bfloat16):
            check_attention(PATH, dtype)
            check_indexer(PATH, dtype)
print("survived")
'''


@pytest.mark.parametrize("path", ["reference", "torch", "native", "triton", "ascend", "compile"])
def test_defect1_keys_the_block_table_cannot_address_are_not_keys(path: str) -> None:
    if path == "ascend":
        pytest.importorskip("fakes.ascend.wheel").torch_npu_wheel()  # skips with the reason where it is missing
    env = {"GLM5_HAL_CHECK_VALUES": "0" if path != "compile" else "1", "TRITON_INTERPRET": "1"}
    _assert_survived(_run_python(_PAST_THE_CACHE.replace("sys.argv[1]", repr(path)), env))


_KERNEL_SLOTS_PAST_THE_ROWS = r"""
import torch
from backends.torch_eager.native import sparse_attention

gen = torch.Generator().manual_seed(0)
rows = torch.randn(8, 64, generator=gen).bfloat16()
q = torch.randn(2, 3, 64, generator=gen).bfloat16()
slots = torch.tensor([[0, 8, 3, 1 << 40], [-5, 2, 7, -1]])  # 8 and 2^40 are past the rows, -5 before them
fair = torch.where((slots >= 0) & (slots < 8), slots, -1)
got = sparse_attention.attention(q, rows, slots, 0.1, 32, out_dtype=torch.float32, isa="portable", threads=1)
want = sparse_attention.attention(q, rows, fair, 0.1, 32, out_dtype=torch.float32, isa="portable", threads=1)
assert all(torch.equal(g, w) for g, w in zip(got, want)), (got, want)
print("survived")
"""


def test_defect1_the_native_attention_kernel_reads_no_slot_past_its_rows() -> None:
    # The kernel is the last line: whatever slot a caller computes, it reads only rows it was given.
    _assert_survived(_run_python(_KERNEL_SLOTS_PAST_THE_ROWS))


# ----------------------------------------------------------------------------- 2: int8_gemm's scale row stride
_LINUX_MAP_NORESERVE = 0x4000 if sys.platform == "linux" else 0  # the mmap module names it from Python 3.13


def _rows_far_apart(values: torch.Tensor, row_stride: int) -> tuple[torch.Tensor, mmap.mmap]:
    """values [N, G] fp32 as a view whose rows lie row_stride elements apart, over a private anonymous mapping
    reserved without backing (MAP_NORESERVE): only the pages that hold the values are ever touched, so a view
    spanning gigabytes costs a few pages. Keep the mapping alive as long as the view."""
    n, g = values.shape
    span = (n - 1) * row_stride + g
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", _LINUX_MAP_NORESERVE)
    mapping = mmap.mmap(-1, span * values.element_size(), flags=flags)
    view = torch.frombuffer(mapping, dtype=values.dtype).as_strided((n, g), (row_stride, 1))
    view.copy_(values)
    return view, mapping


@pytest.mark.parametrize("isa", ["avx512_vnni", "portable"])
@pytest.mark.parametrize("row_stride", [2**31 // 15 + 1, 2**31 + 3])
def test_defect2_w4a8_scales_with_rows_2_to_the_31_apart(isa: str, row_stride: int) -> None:
    """The AVX-512 epilogue formed the scale gather's index j * row_stride in 32 bits: a row stride >= 2^31 / 15
    read outside the scales (SIGSEGV). The scales of a panel are now gathered with 64-bit indices in the code both
    builds share; this checks that path against the same scales stored contiguously."""
    from backends.torch_eager.native import int8_gemm

    ok, why = int8_gemm.availability(isa)
    if not ok:
        pytest.skip(f"{isa} build does not run here: {why}")
    gen = torch.Generator().manual_seed(2)
    rows, cols, depth, group = 3, 40, 64, 16  # 40 columns: two 16-wide vectors and a tail of 8
    x_q = torch.randint(-128, 128, (rows, depth), generator=gen, dtype=torch.int8)
    w_packed = torch.randint(0, 256, (cols, depth // 2), generator=gen, dtype=torch.uint8)
    scales = torch.rand(cols, depth // group, generator=gen) + 0.5
    far, _mapping = _rows_far_apart(scales, row_stride)
    want = int8_gemm.w4a8_mm(x_q, w_packed, scales, group, isa=isa, threads=1)
    got = int8_gemm.w4a8_mm(x_q, w_packed, far, group, isa=isa, threads=1)
    assert torch.equal(got, want)


# ------------------------------------------------------------------------------- 3-6: the native kernels' builder
@pytest.fixture
def fresh_builds(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """Builds into an empty cache, with what build.load() remembered cleared before and after."""
    from backends.torch_eager.native import build

    cache = tmp_path / "cache"
    monkeypatch.setenv(build.ENV_CACHE_DIR, str(cache))
    build.forget()
    yield cache
    build.forget()


def _topk_library(cache: Path) -> Path:
    from backends.torch_eager.native import topk

    ok, why = topk.availability()
    if not ok:
        pytest.skip(f"no native top-k here: {why}")
    (library,) = cache.glob("topk_portable-*.so")
    return library


_TOPK_IN_A_NEW_PROCESS = r"""
import torch
from backends.torch_eager.native import topk

assert topk.availability()[0], topk.availability()
scores = torch.tensor([[0.5, 2.0, -1.0, 2.0]])
values, columns = topk.topk(scores, 2, threads=1)
assert columns.tolist() == [[1, 3]], columns
print("survived")
"""


@pytest.mark.parametrize("damage", ["truncated", "torn"])
def test_defect3_a_damaged_library_in_the_cache_is_rebuilt(fresh_builds: Path, damage: str) -> None:
    """A crash mid-write leaves a short file (or one with a stretch of zeros where the page cache was not flushed)
    under the final name. dlopen of a short one killed every later process with SIGBUS; now the build's recorded
    size and checksum are verified first, and a library that does not match is built again."""
    library = _topk_library(fresh_builds)
    good = library.read_bytes()
    middle = len(good) // 2
    damaged = good[:middle] if damage == "truncated" else good[:middle] + bytes(4096) + good[middle + 4096 :]
    # A new file under the library's name, not the old one rewritten: this process has the old one mapped
    # (_topk_library loaded it), and a mapped library cut short under a running process is this defect's SIGBUS
    # in pytest itself (it killed CI at exit).
    library.unlink()
    library.write_bytes(damaged)
    done = _run_python(_TOPK_IN_A_NEW_PROCESS, {"GLM5_HAL_CACHE_DIR": str(fresh_builds)})
    _assert_survived(done)
    assert library.read_bytes() == good  # rebuilt, the same bytes as the first build


def test_defect3_a_library_lacking_a_symbol_turns_the_route_off(fresh_builds: Path, tmp_path: Path) -> None:
    """A library that loads but lacks the kernel's function (here: one built from another source, with a record
    that matches it) raised AttributeError from the op; now it is a reason, and the op takes the torch route."""
    from backends.torch_eager.native import build, topk
    from backends.torch_eager.topk import topk as eager_topk
    from glm5_hal.cli.info import collect, report_data

    # Built by another process: this one must not have loaded the library's path already (dlopen would hand back
    # the library it has under that name).
    _assert_survived(_run_python(_TOPK_IN_A_NEW_PROCESS, {"GLM5_HAL_CACHE_DIR": str(fresh_builds)}))
    (library,) = fresh_builds.glob("topk_portable-*.so")
    empty = tmp_path / "empty.c"
    empty.write_text("int glm5_something_else(void) { return 0; }\n")
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(library), str(empty)], check=True)
    build.record_library(library)  # a matching record: only the symbol check can tell
    build.forget()
    ok, why = topk.availability()
    assert not ok and "glm5_topk" in why, why
    scores = torch.tensor([[0.5, 2.0, -1.0, 2.0], [3.0, 1.0, 1.0, 0.0]])
    values, columns = eager_topk(scores, 2)  # the torch route, not an AttributeError
    assert columns.tolist() == [[1, 3], [0, 1]] and values.tolist() == [[2.0, 2.0], [3.0, 1.0]]
    kernels = report_data(collect(), "torch")["native_kernels"]["kernels"]
    assert "glm5_topk" in kernels["topk_portable"], kernels


_HANGING_COMPILER = """#!/bin/sh
sleep 300 &
echo $! >> "{pids}"
echo $$ >> "{pids}"
wait
"""


def test_defect4_a_hanging_compiler_costs_one_bounded_attempt(fresh_builds: Path, tmp_path: Path, monkeypatch) -> None:
    """A compiler that never returns stalled the first call of every kernel for the whole timeout, and the
    processes it started were left running. Now the whole process group is killed at the timeout, and the compiler
    is not tried again in this process."""
    from backends.torch_eager.native import bf16_gemm, build, indexer_scores, topk

    pids = tmp_path / "pids"
    compiler = tmp_path / "hanging-cc"
    compiler.write_text(_HANGING_COMPILER.format(pids=pids))
    compiler.chmod(0o755)
    monkeypatch.setenv("CC", str(compiler))
    monkeypatch.setattr(build, "BUILD_TIMEOUT_S", 1.0)
    started = time.monotonic()
    ok, why = topk.availability()
    assert not ok and "timed out" in why, why
    for module in (bf16_gemm, indexer_scores):
        ok, again = module.availability("portable")
        assert not ok and "timed out" in again, again
    assert time.monotonic() - started < 10  # one timeout, not three
    spawned = [int(line) for line in pids.read_text().split()]
    assert len(spawned) == 2  # the compiler ran once: one shell and its sleep
    deadline = time.monotonic() + 5
    while any(_alive(pid) for pid in spawned) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(pid) for pid in spawned), "the compiler's processes outlived the timeout"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its parent) counts as gone.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def test_defect5_no_home_and_no_passwd_entry_never_caches_under_a_relative_tilde(
    fresh_builds: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """expanduser('~') returns '~' itself when HOME is unset and the uid has no passwd entry (common in containers):
    the cache went to a folder literally named '~' in the working directory. Now the cache falls back to a private
    folder under the temporary directory, and `glm5-hal info` says why."""
    import pwd
    import tempfile

    from backends.torch_eager.native import build, topk
    from glm5_hal.cli.info import collect, report_data

    def no_entry(uid: int) -> pwd.struct_passwd:
        raise KeyError(f"getpwuid(): uid not found: {uid}")

    work, temp = tmp_path / "work", tmp_path / "tmp"
    work.mkdir()
    temp.mkdir()
    for name in ("HOME", "XDG_CACHE_HOME", build.ENV_CACHE_DIR):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(pwd, "getpwuid", no_entry)
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    monkeypatch.chdir(work)
    assert os.path.expanduser("~") == "~"  # the situation of the report

    ok, why = topk.availability()
    assert not (work / "~").exists(), "a folder named '~' was created in the working directory"
    assert ok, why  # the private temporary cache builds and loads
    where = build.cache_location()
    assert where.path is not None and where.path.is_absolute() and where.path.parent == temp, where
    assert "HOME" in where.note, where
    assert (where.path.stat().st_mode & 0o777) == 0o700  # nobody else may plant a library there
    info = report_data(collect(), "torch")["native_kernels"]
    assert info["cache_dir"] == str(where.path) and "HOME" in info["cache_note"], info


def test_defect5_a_temporary_cache_someone_else_can_write_is_refused(
    fresh_builds: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fallback folder has a predictable name in a shared directory: if it exists and others can write it (or it
    is not ours), loading a library from it would run their code. Then there are no native kernels, and a reason."""
    import tempfile

    from backends.torch_eager.native import build, topk

    for name in ("HOME", "XDG_CACHE_HOME", build.ENV_CACHE_DIR):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(os.path, "expanduser", lambda path: path)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    planted = tmp_path / f"glm5_hal-{os.getuid()}"
    planted.mkdir()
    planted.chmod(0o777)
    where = build.cache_location()
    assert where.path is None and "writable by others" in where.note, where
    ok, why = topk.availability()
    assert not ok and "writable by others" in why, why


_READ_ONLY_CACHE = r"""
import os
# imported before dropping root: the interpreter may live where others cannot read
from backends.torch_eager.native import topk

if os.geteuid() == 0:  # root writes anywhere: drop to a plain uid for the read-only folder to be read-only
    os.setgid(54321)
    os.setuid(54321)
ok, why = topk.availability()
print(why)
assert not ok
assert "did not load" not in why and "built but" not in why, why
assert "cannot write" in why and "nothing was built" in why, why
print("survived")
"""


def test_defect6_a_read_only_cache_says_nothing_was_built() -> None:
    """A cache folder that exists but may not be written: the build never ran, yet the reason said "built but did not
    load: Permission denied". (Outside pytest's own temporary folders, which only their owner may enter.)"""
    import shutil
    import tempfile

    parent = Path(tempfile.mkdtemp(prefix="glm5-hal-read-only-"))
    try:
        parent.chmod(0o755)
        cache = parent / "cache"
        cache.mkdir(mode=0o555)
        cache.chmod(0o555)
        _assert_survived(_run_python(_READ_ONLY_CACHE, {"GLM5_HAL_CACHE_DIR": str(cache)}))
    finally:
        shutil.rmtree(parent)


def test_defect6_rows_past_the_native_top_k_width_take_the_torch_route(monkeypatch: pytest.MonkeyPatch) -> None:
    """topk.c keeps columns in 32 bits: a row of 2^31 or more scores raised ValueError from the native wrapper. Such
    rows now take the torch route. A row of 2^31 fp32 scores is 8 GiB, so the limit is lowered here to 64; the
    route decision reads the same constant."""
    from backends.torch_eager import topk as topk_module
    from backends.torch_eager.native import topk as native_topk

    if not native_topk.availability()[0]:
        pytest.skip(f"no native top-k here: {native_topk.availability()[1]}")
    calls: list[int] = []
    real = native_topk.topk
    monkeypatch.setattr(native_topk, "topk", lambda scores, k, **kw: calls.append(scores.shape[1]) or real(scores, k))
    monkeypatch.setattr(native_topk, "MAX_WIDTH", 64)
    gen = torch.Generator().manual_seed(6)
    for width in (64, 65, 200):
        scores = torch.randn(3, width, generator=gen)
        scores[:, 7] = scores[:, 3]  # a tie: the lower column first
        values, columns = topk_module.topk(scores, 16)
        order = sorted(range(width), key=lambda c: (-scores[0, c].item(), c))[:16]
        assert columns[0].tolist() == order and torch.equal(values[0], scores[0, order])
    assert calls == [64], calls  # the native kernel took the row it can hold, torch the wider ones


# --------------------------------------------------------------------------- 7: a cache view is read in place
def _route_torch_attention_through_the_portable_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch backend's bf16 sparse attention on backends.torch_eager.native's portable build, as a CPU with
    AVX-512 BF16 runs it on the fast one (the same loops and the same Python side; this machine may lack the
    instructions)."""
    import backends.torch_eager.sparse_attention as attention
    from backends.torch_eager.gemm import FP32, Gemm
    from backends.torch_eager.native import sparse_attention as kernel

    ok, why = kernel.availability("portable")
    if not ok:
        pytest.skip(f"no portable sparse attention kernel here: {why}")
    native = Gemm(torch.bfloat16, True, math.inf, True, "portable")
    monkeypatch.setattr(attention, "gemm_for", lambda dtype, device, _: native if dtype == torch.bfloat16 else FP32)


class _LargeResults(torch.utils._python_dispatch.TorchDispatchMode):
    """Records every aten op whose result holds at least `elements` elements (a copy of the cache would)."""

    def __init__(self, elements: int) -> None:
        super().__init__()
        self.elements, self.seen = elements, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        inputs = torch.utils._pytree.tree_leaves((args, kwargs))
        storages = {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, torch.Tensor)}
        for t in torch.utils._pytree.tree_leaves(result):
            # Views of an input (its storage) are no copy; a new result that large is.
            new = isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in storages
            if new and t.numel() >= self.elements:
                self.seen.append((str(func), tuple(t.shape)))
        return result


def _cache_view(layout: str, blocks: int, block_size: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    if layout == "spare_slots":  # [blocks, block_size, width] out of [blocks, block_size + 4, width]
        return torch.randn(blocks, block_size + 4, width, generator=gen).to(dtype)[:, 2 : block_size + 2]
    # Blocks an odd number of elements apart: no row stride divides the block stride.
    block_stride = block_size * width + 5
    storage = torch.randn(blocks * block_stride, generator=gen).to(dtype)
    return storage.as_strided((blocks, block_size, width), (block_stride, width, 1))


@pytest.mark.parametrize("layout", ["spare_slots", "odd_block_stride"])
@pytest.mark.parametrize("path", ["fp32", "native"])
def test_defect7_a_cache_view_is_read_in_place(path: str, layout: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache view whose slots are not one flat run of rows was copied whole (flatten) on every call: 0.6 GB more
    and 6x the time for a 0.6 GB cache. No op result may now be as large as the cache, and the results are the
    contiguous cache's, bit for bit."""
    import backends.torch_eager.sparse_attention as torch_backend
    import glm5_hal
    from glm5_hal.parity.cases import SeqSpec
    from glm5_hal.parity.inputs import paged_batch, random_topk_indices

    dtype = torch.float32 if path == "fp32" else torch.bfloat16
    if path == "native":
        _route_torch_attention_through_the_portable_kernel(monkeypatch)
    gen = torch.Generator().manual_seed(0)
    batch = paged_batch([SeqSpec(2, 300), SeqSpec(1, 180)], 16, gen)
    cache = _cache_view(layout, batch.num_blocks, 16, 576, dtype)
    q = torch.randn(batch.num_tokens, 4, 576, generator=gen).to(dtype)
    indices = random_topk_indices(batch, 32, gen)
    args = (indices, batch.block_table, batch.seq_lens_k, batch.cu_seqlens_q, 0.05, 512)
    with glm5_hal.use_backend("torch", strict=True):
        want = glm5_hal.sparse_flash_attention(q, cache.contiguous(), *args)
        got = glm5_hal.sparse_flash_attention(q, cache, *args)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    # The backend's body itself under the spy: a dispatch mode does not see inside the custom op it intercepts.
    with _LargeResults(cache.numel() // 2) as spy:
        torch_backend.sparse_flash_attention(q, cache, *args)
    assert not spy.seen, f"results as large as the cache: {spy.seen}"


# ---------------------------------------------------------------------- 8: the transformers bound the tests need
def test_defect8_the_test_extra_allows_no_transformers_the_layer_test_fails_on() -> None:
    """perf/test_layer_bench.py::test_both_layers_compute_the_same_layer fails on transformers 5.23 (its DSA indexer's
    attention-mask shape) and passes on 5.24: a bound that admits 5.23 promises an environment that fails."""
    import tomllib
    from packaging.requirements import Requirement

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (spec,) = [Requirement(line).specifier for line in extras["test"] if Requirement(line).name == "transformers"]
    assert "5.23.0" not in spec and "5.23.9" not in spec, spec
    assert "5.24.0" in spec, spec


# ------------------------------------------------------------------------------------------------ edge rules
# docs/ops.md "Edge rules": decided for the contract, followed by the reference and every backend.
_EDGE_BACKENDS = ["reference", "torch", "native", "triton", "ascend"]


@pytest.fixture
def edge_backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The backend to run on: 'native' is the torch backend on backends.torch_eager.native's portable kernel (bf16
    only); 'ascend' the strict torch_npu fake (skipped with the reason where its wheel is missing)."""
    name = request.param
    if name == "native":
        _route_torch_attention_through_the_portable_kernel(monkeypatch)
        return "torch"
    if name == "ascend":
        request.getfixturevalue("fake_torch_npu")
    return name


def _copy(value: object) -> object:
    return value.clone() if isinstance(value, torch.Tensor) else value


def _all_minus_inf_inputs(dtype: torch.dtype) -> dict:
    """Token 0 head 0 scores -inf against every key (its q holds -inf where every row holds 1); the rest finite."""
    gen = torch.Generator().manual_seed(31)
    cache = torch.randn(2, 16, 576, generator=gen) * 0.1
    cache[..., 0] = 1.0
    q = torch.randn(2, 2, 576, generator=gen)
    q[0, 0, 0] = float("-inf")
    indices = torch.tensor([[0, 3, 17, 20, -1], [1, 2, 18, 30, 5]], dtype=torch.int32)
    return {
        "q": q.to(dtype),
        "kv_cache": cache.to(dtype),
        "indices": indices,
        "block_table": torch.tensor([[1, 0]], dtype=torch.int32),
        "seq_lens_k": torch.tensor([32], dtype=torch.int32),
        "cu_seqlens_q": torch.tensor([0, 2], dtype=torch.int32),
        "sm_scale": 0.05,
        "d_v": 512,
    }


@pytest.mark.parametrize("edge_backend", _EDGE_BACKENDS, indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_edge_all_minus_inf_scores_are_an_empty_softmax(edge_backend: str, dtype: torch.dtype) -> None:
    """Valid keys whose scores are all -inf (infinite inputs): the reference gave NaN, the torch backend out 0 and
    lse -inf. The contract now says: every probability is 0 (the softmax of an empty sum), so out = 0 and lse = -inf,
    as for a row without keys; the other heads and tokens are untouched."""
    import glm5_hal
    from glm5_hal.parity.runner import run_inputs

    inputs = _all_minus_inf_inputs(dtype)
    with glm5_hal.use_backend(edge_backend, strict=True):
        out, lse = glm5_hal.sparse_flash_attention(**{k: _copy(v) for k, v in inputs.items()})
    empty = bool((out[0, 0] == 0).all()) and float(lse[0, 0]) == float("-inf")
    assert empty, f"all -inf scores gave out {out[0, 0, :3].tolist()}..., lse {float(lse[0, 0])}"
    assert torch.isfinite(out[1]).all() and torch.isfinite(lse[1]).all() and torch.isfinite(lse[0, 1])
    result = run_inputs("sparse_flash_attention", inputs, edge_backend, dtype)
    assert result.passed, f"{result.status}: {result.detail}"
    # out = 0 whatever V holds: an inf in a selected row's V (0 * inf would be NaN in a plain product).
    # V is part of K: with q's dim 5 negative, that row's score stays -inf for head 0.
    inputs["kv_cache"][1, 0, 5] = float("inf")  # key position 0 (block table [1, 0])
    inputs["q"][0, 0, 5] = -1.0
    with glm5_hal.use_backend(edge_backend, strict=True):
        out, lse = glm5_hal.sparse_flash_attention(**inputs)
    empty = bool((out[0, 0] == 0).all()) and float(lse[0, 0]) == float("-inf")
    assert empty, f"with inf in V: out {out[0, 0, :6].tolist()}..., lse {float(lse[0, 0])}"


def _near_float_max_moe(dtype: torch.dtype = torch.bfloat16) -> dict:
    """fused_moe whose SwiGLU activation of token 0 is 2^127 * 1.99957 (0.02% below FLT_MAX, finite in fp32) and
    whose second GEMM weighs it by 0 and by 1e-30: the true outputs are 0 and ~3.4e8. A bf16 high part rounded to
    nearest is 2^128 = inf there: inf, and NaN through the zero weight."""
    experts, inter, hidden = 2, 2, 2
    w13 = torch.zeros(experts, 2 * inter, hidden)
    w13[:, 0, 0] = 2.0**63 * 1.4140625  # gate of unit 0 (181 / 128: exact in bf16)
    w13[:, inter, 0] = 2.0**64 * 1.4140625  # up of unit 0: gate * up = 2^127 * 32761 / 16384, past bf16's max
    w13[:, 1, 1] = w13[:, inter + 1, 1] = 1.0  # unit 1: an ordinary value
    w2 = torch.zeros(experts, hidden, inter)
    w2[:, 1, 0] = 1e-30
    w2[:, :, 1] = 0.5
    return {
        "x": torch.tensor([[1.0, 0.25], [0.5, 1.0]]).to(dtype),
        "topk_weights": torch.tensor([[1.0], [1.0]]),
        "topk_ids": torch.tensor([[0], [1]], dtype=torch.int32),
        "w13": w13.to(dtype),
        "w2": w2.to(dtype),
    }


@pytest.mark.parametrize("backend", ["reference", "torch", "triton", "ascend"])
def test_edge_fp32_operands_near_float_max_split_without_overflow(backend: str, request: pytest.FixtureRequest) -> None:
    """An fp32 operand of a half-precision GEMM enters as hi + lo parts; hi rounded to nearest overflowed for values
    within 0.4% of FLT_MAX (past bf16's largest finite number). hi is now that largest number there, lo the rest,
    so the product is the finite one (torch backend with every fast path on, triton's split in registers)."""
    import glm5_hal
    from backends.torch_eager.capabilities import fast_paths
    from glm5_hal.parity.runner import run_inputs

    if backend == "ascend":
        request.getfixturevalue("fake_torch_npu")
    inputs = _near_float_max_moe()
    with fast_paths("1"):
        result = run_inputs("fused_moe", inputs, backend, torch.bfloat16)
        with glm5_hal.use_backend(backend, strict=True):
            out = glm5_hal.fused_moe(**{k: _copy(v) for k, v in inputs.items()})
    assert torch.isfinite(out).all(), out
    assert result.passed, f"{result.status}: {result.detail}"


_TOP_OF_FP32 = [3.3895314e38, 3.3961e38, 3.4021e38, 3.4028235e38, -3.4028235e38, 1.0, float("inf"), float("nan")]


def _check_parts(hi: torch.Tensor, lo: torch.Tensor) -> None:
    """hi + lo of _TOP_OF_FP32: finite parts summing to each finite value (to the split's 2^-16), the infinity as
    a finite hi plus an infinite lo, NaN as NaN."""
    top = torch.tensor(_TOP_OF_FP32, dtype=torch.float64)
    total = hi.double() + lo.double()
    finite = top.isfinite()
    assert hi.isfinite()[finite].all() and lo.isfinite()[finite].all(), (hi, lo)
    assert ((total - top).abs()[finite] <= 2.0**-16 * top.abs()[finite]).all(), (total, top)
    assert total[6] == float("inf") and total[7].isnan()


def test_edge_the_torch_split_keeps_every_finite_fp32_value() -> None:
    """_stacked_parts (the torch backend's hi + lo split) over the top of the fp32 range."""
    from backends.torch_eager.gemm import _stacked_parts

    parts, count = _stacked_parts(torch.tensor(_TOP_OF_FP32)[None, :], torch.bfloat16, 0)
    assert count == 2
    _check_parts(parts[0], parts[1])


try:  # a module-level kernel: triton resolves the names a kernel uses among its module's globals
    import triton
    import triton.language as tl

    from backends.triton.matmul import split_hi_lo

    @triton.jit
    def _split_kernel(x_ptr, hi_ptr, lo_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        hi, lo = split_hi_lo(tl.load(x_ptr + i), tl.bfloat16)
        tl.store(hi_ptr + i, hi)
        tl.store(lo_ptr + i, lo)
except ImportError:  # no triton: its test is skipped
    _split_kernel = None


def test_edge_the_triton_split_keeps_every_finite_fp32_value() -> None:
    """split_hi_lo (triton's split in registers) over the top of the fp32 range, in a one-program kernel."""
    if _split_kernel is None:
        pytest.skip("triton is not installed")
    x = torch.tensor(_TOP_OF_FP32)
    hi, lo = torch.empty(8, dtype=torch.bfloat16), torch.empty(8, dtype=torch.bfloat16)
    _split_kernel[(1,)](x, hi, lo, 8)
    _check_parts(hi, lo)


def _tiny_cache_inputs(dtype: torch.dtype) -> dict:
    """Sparse attention over a cache whose rows are ~1e-36 (normal fp32 / bf16 numbers), 96 keys a token: each
    product P_j * V_j is ~1e-38, below fp32's smallest normal number, where fast paths flush to zero."""
    from glm5_hal.parity.cases import SeqSpec
    from glm5_hal.parity.inputs import paged_batch, random_topk_indices

    gen = torch.Generator().manual_seed(36)
    batch = paged_batch([SeqSpec(2, 128)], 16, gen)
    return {
        "q": torch.randn(batch.num_tokens, 2, 576, generator=gen).to(dtype),
        "kv_cache": (torch.rand(batch.num_blocks, 16, 576, generator=gen) * 1e-36 + 1e-36).to(dtype),
        "indices": random_topk_indices(batch, 96, gen),
        "block_table": batch.block_table,
        "seq_lens_k": batch.seq_lens_k,
        "cu_seqlens_q": batch.cu_seqlens_q,
        "sm_scale": 0.05,
        "d_v": 512,
    }


def test_edge_the_absolute_floor_is_what_the_judge_allows() -> None:
    """docs/ops.md "Edge rules": beyond the relative tolerances an output may miss the reference by ABSOLUTE_FLOOR
    (2^-110), no more: 1e-36 read as 0 passes, 1e-30 read as 0 or 1e-36 read as 1e-33 does not."""
    import numpy as np

    from glm5_hal.parity.compare import ABSOLUTE_FLOOR, TOLERANCE, compare_float

    assert ABSOLUTE_FLOOR == 2.0**-110
    tiny = np.full((4, 8), 1e-36)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert compare_float("out", torch.zeros(4, 8), tiny, dtype).passed
        assert not compare_float("out", torch.zeros(4, 8), tiny * 1e6, dtype).passed
        assert not compare_float("out", torch.full((4, 8), 1e-33), tiny, dtype).passed
        assert compare_float("out", torch.from_numpy(tiny * (1 + 0.1 * TOLERANCE[dtype])), tiny, dtype).passed


def test_edge_a_flushing_fast_path_meets_the_floor() -> None:
    """What a bf16 unit does (VDPBF16PS, AMX and tensor cores flush subnormal products): the native kernel's
    portable build under FTZ / DAZ reads the 1e-36 rows as out = 0, a relative error of 1. The contract's absolute
    floor admits it; the same kernel without the flush is exact."""
    import numpy as np

    from backends.torch_eager.native import sparse_attention as kernel
    from glm5_hal.parity.compare import compare_float

    if not kernel.availability("portable")[0]:
        pytest.skip(f"no portable sparse attention kernel here: {kernel.availability('portable')[1]}")
    gen = torch.Generator().manual_seed(2)
    # 256 keys of 0.5e-36 .. 1e-36: every product P_j * V_j (P ~ 1 / 256) is below 2^-126, all flushed.
    rows = (torch.rand(300, 64, generator=gen) * 0.5e-36 + 0.5e-36).bfloat16()
    q = torch.randn(2, 3, 64, generator=gen).bfloat16()
    slots = torch.stack([torch.randperm(300, generator=gen)[:256] for _ in range(2)])
    keys = rows.double()[slots]  # [T, k, D]
    probs = torch.softmax(0.1 * torch.einsum("thd,tkd->thk", q.double(), keys), dim=-1)
    want = torch.einsum("thk,tkd->thd", probs, keys[..., :32]).numpy()

    exact, _ = kernel.attention(q, rows, slots, 0.1, 32, out_dtype=torch.float32, isa="portable", threads=1)
    verdict = compare_float("out", exact, want, torch.bfloat16)  # the dtype of the op this kernel serves
    assert bool(exact.all()) and verdict.passed, verdict
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush subnormals (no FTZ / DAZ)")
    try:
        flushed, _ = kernel.attention(q, rows, slots, 0.1, 32, out_dtype=torch.float32, isa="portable", threads=1)
    finally:
        torch.set_flush_denormal(False)
    assert not bool(flushed.any()) and np.abs(want).min() > 0  # every output flushed to 0: relative error 1
    assert compare_float("out", flushed, want, torch.bfloat16).passed


@pytest.mark.parametrize("edge_backend", _EDGE_BACKENDS, indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_edge_tiny_cache_rows_on_every_backend(edge_backend: str, dtype: torch.dtype) -> None:
    """A cache of ~1e-36 rows on every backend: within the contract (the judge's floor), and not flushed where the
    path is fp32 (torch's fp32 path, the reference): there the result keeps its relative accuracy."""
    import glm5_hal
    from glm5_hal.parity.runner import run_inputs

    inputs = _tiny_cache_inputs(dtype)
    result = run_inputs("sparse_flash_attention", inputs, edge_backend, dtype)
    assert result.passed, f"{result.status}: {result.detail}"
    if dtype == torch.float32:
        with glm5_hal.use_backend(edge_backend, strict=True):
            out, _ = glm5_hal.sparse_flash_attention(**{k: _copy(v) for k, v in inputs.items()})
        assert bool((out != 0).all()), "an fp32 path flushed a normal fp32 result"


# ------------------------------------------------------------- the long fuzz profile's comparisons (edge rules)
def _one_block_attention_inputs(q: torch.Tensor, cache: torch.Tensor, indices: list, sm_scale: float) -> dict:
    """sparse_flash_attention's inputs for q's tokens as one sequence over the 16 keys of cache's one block."""
    return {
        "q": q,
        "kv_cache": cache,
        "indices": torch.tensor(indices, dtype=torch.int32),
        "block_table": torch.tensor([[0]], dtype=torch.int32),
        "seq_lens_k": torch.tensor([16], dtype=torch.int32),
        "cu_seqlens_q": torch.tensor([0, q.shape[0]], dtype=torch.int32),
        "sm_scale": sm_scale,
        "d_v": 512,
    }


def _lse_near_zero_inputs() -> dict:
    """Sparse attention whose every lse is ~0: two keys per token, each scoring ~log(1/2) (q's first dim against
    rows whose first dim is 1, the rest 0), so sum exp ~ 1. An fp32 sum's rounding is absolute in lse (~1e-7)."""
    cache = torch.zeros(1, 16, 576)
    cache[..., 0] = 1.0
    q = torch.zeros(3, 4, 576)
    q[..., 0] = math.log(0.5) / 0.05 + torch.linspace(-1e-3, 1e-3, 12).view(3, 4)
    return _one_block_attention_inputs(q, cache, [[0, 1], [2, 3], [4, 5]], 0.05)


@pytest.mark.parametrize("edge_backend", ["reference", "torch", "triton", "ascend"], indirect=True)
def test_fuzz_comparison_lse_is_judged_absolutely_near_zero(edge_backend: str) -> None:
    """lse near 0 was judged by its relative error: an fp32 sum's rounding (absolute in the log) failed it. lse is
    now judged against max(1, |lse|); a real error (1e-4) still fails."""
    import numpy as np

    from glm5_hal.parity.compare import compare_float
    from glm5_hal.parity.runner import run_inputs
    from glm5_hal.parity.specs import SPECS

    inputs = _lse_near_zero_inputs()
    result = run_inputs("sparse_flash_attention", inputs, edge_backend, torch.float32)
    assert result.passed, f"{result.status}: {result.detail}"
    want = SPECS["sparse_flash_attention"].reference(inputs)["lse"]
    assert np.abs(want).max() < 1e-3  # the case: every lse near 0
    off = torch.from_numpy(want + 1e-4).float()
    verdicts = SPECS["sparse_flash_attention"].judge(inputs, {"out": torch.zeros(3, 4, 512), "lse": off}, torch.float32)
    assert not next(v for v in verdicts if v.output == "lse").passed
    assert compare_float(
        "lse", torch.from_numpy(want + 5e-6), want, torch.float32, scale=np.maximum(1, abs(want))
    ).passed


def _cancelling_attention_inputs() -> dict:
    """One token, 4 heads with the same query, over 3 keys whose value rows cancel: q is 0 on the value dims, so the
    scores come from the last 64 dims alone, and the third row's values are minus the other two's p-weighted sum
    over its p (float64, then rounded to fp32): every output is rounding noise, ~1e-7 of its terms."""
    gen = torch.Generator().manual_seed(47)
    rows = torch.randn(1, 16, 576, generator=gen, dtype=torch.float64)
    q = torch.zeros(1, 4, 576, dtype=torch.float64)
    q[..., 512:] = torch.randn(64, generator=gen, dtype=torch.float64)
    p = torch.softmax(0.1 * rows[0, :3] @ q[0, 0], dim=0)
    rows[0, 2, :512] = -(p[0] * rows[0, 0, :512] + p[1] * rows[0, 1, :512]) / p[2]
    return _one_block_attention_inputs(q.float(), rows.float(), [[0, 1, 2]], 0.1)


@pytest.mark.parametrize("edge_backend", ["reference", "torch", "triton", "ascend"], indirect=True)
def test_fuzz_comparison_attention_values_that_cancel_are_judged_against_their_terms(edge_backend: str) -> None:
    """out = sum_i p_i v_i sums value rows of both signs: an fp32 output that cancels is as accurate as its terms'
    rounding, not as itself (the torch and triton backends failed this case at 1.1x and 2.8x its own size under a
    judge of out against itself). The judge now scales out by max(|out|, sqrt(sum_i p_i^2 v_i^2)); an error of 1e-4
    of the terms still fails."""
    import numpy as np

    from glm5_hal.parity.runner import run_inputs
    from glm5_hal.parity.specs import SPECS

    inputs = _cancelling_attention_inputs()
    spec = SPECS["sparse_flash_attention"]
    want = spec.reference(inputs)
    terms = spec.reference({**inputs, "indices": torch.tensor([[0, 1]], dtype=torch.int32)})["out"]  # two of three
    assert np.abs(want["out"]).max() < 1e-5 * np.abs(terms).max()  # the case: outputs that cancel
    result = run_inputs("sparse_flash_attention", inputs, edge_backend, torch.float32)
    assert result.passed, f"{result.status}: {result.detail}"
    off = torch.from_numpy(want["out"] + 1e-4 * np.abs(terms)).float()
    verdicts = spec.judge(inputs, {"out": off, "lse": torch.from_numpy(want["lse"]).float()}, torch.float32)
    assert not next(v for v in verdicts if v.output == "out").passed


def _cancelling_indexer_inputs(dtype: torch.dtype = torch.float32) -> dict:
    """Two indexer heads of opposite weight and nearly equal queries: each score is a difference of two ReLU'd dot
    products ~1000x its size, so its fp32 rounding is ~1e-4 of it (against the sum of magnitudes: ~1e-7)."""
    gen = torch.Generator().manual_seed(44)
    keys = torch.rand(2, 16, 128, generator=gen)
    base = torch.rand(6, 1, 128, generator=gen)
    q = torch.cat([base, base + 1e-3 * torch.randn(6, 1, 128, generator=gen)], dim=1)
    return {
        "q_idx": q.to(dtype),
        "weights": torch.tensor([[1.0, -1.0]]).repeat(6, 1),
        "index_k_cache": keys.to(dtype),
        "block_table": torch.tensor([[1, 0]], dtype=torch.int32),
        "seq_lens_k": torch.tensor([32], dtype=torch.int32),
        "cu_seqlens_q": torch.tensor([0, 6], dtype=torch.int32),
    }


@pytest.mark.parametrize("op", ["indexer_logits", "lightning_indexer"])
@pytest.mark.parametrize("edge_backend", ["reference", "torch", "triton", "ascend"], indirect=True)
def test_fuzz_comparison_indexer_scores_are_judged_against_their_magnitudes(op: str, edge_backend: str) -> None:
    """A weighted sum over heads cancels: its fp32 error is relative to its terms, not to itself (the long profile
    failed fp32 lightning_indexer at 1.33e-5 against 1e-5). The judge now scales errors by the terms' root-sum-square
    (test_fuzz_comparison_sums_are_judged_against_their_terms_root_sum_square); a score off by 1e-3 of the sum of
    the terms' magnitudes still fails."""
    from glm5_hal.parity.runner import run_inputs
    from glm5_hal.parity.specs import SPECS

    inputs = _cancelling_indexer_inputs()
    extra = {"topk": 8} if op == "lightning_indexer" else {}
    result = run_inputs(op, {**inputs, **extra}, edge_backend, torch.float32)
    assert result.passed, f"{result.status}: {result.detail}"
    if op == "indexer_logits":
        want = torch.from_numpy(SPECS[op].reference(inputs)["logits"])
        off = torch.where(want.isfinite(), want + 1e-3 * want.abs().max() * 1000, want).float()
        assert not SPECS[op].judge(inputs, {"logits": off}, torch.float32)[0].passed


def _cancelling_combine_inputs() -> dict:
    """fp16 expert outputs of both signs near 1 whose weighted sums cancel to ~1e-2, with fp32 weights that fp16
    cannot hold: rounding the weights to fp16 moves each term by up to 2^-11 of itself, ~0.05 of the output."""
    gen = torch.Generator().manual_seed(45)
    tokens, k, width = 64, 2, 16
    y = (torch.rand(tokens, k, width, generator=gen) + 0.5) * torch.tensor([1.0, -1.0])[None, :, None]
    w = torch.rand(tokens, k, generator=gen) * 0.5 + 0.25
    y[:, 1] = -(w[:, :1] / w[:, 1:]) * y[:, 0] * (1 + 1e-2 * torch.randn(tokens, width, generator=gen))
    src_index = torch.randperm(tokens * k, generator=gen)
    y_sorted = torch.empty(tokens * k, width)
    y_sorted[torch.argsort(src_index)] = y.reshape(tokens * k, width)  # row r holds assignment src_index[r]
    return {"y_sorted": y_sorted.half(), "src_index": src_index, "topk_weights": w}


@pytest.mark.parametrize("edge_backend", ["reference", "torch", "triton", "ascend"], indirect=True)
def test_fuzz_comparison_moe_combine_is_judged_against_its_terms(edge_backend: str) -> None:
    """moe_combine sums expert outputs of both signs: its error is relative to sum_j |w_j| |y_j|, not to the output
    (the long profile failed an fp16 case on ascend at 1.04x the bound relative to the output: the kernel takes the
    weights in the tokens' dtype). The judge now scales by the terms; an error of 2e-3 of them still fails."""
    import numpy as np

    from glm5_hal.parity.runner import run_inputs
    from glm5_hal.parity.specs import SPECS

    inputs = _cancelling_combine_inputs()
    want = SPECS["moe_combine"].reference(inputs)["out"]
    terms = SPECS["moe_combine"].reference(
        {**inputs, "y_sorted": inputs["y_sorted"].abs(), "topk_weights": inputs["topk_weights"].abs()}
    )["out"]
    assert np.median(np.abs(want) / terms) < 0.05  # the case: sums that cancel
    result = run_inputs("moe_combine", inputs, edge_backend, torch.float16)
    assert result.passed, f"{result.status}: {result.detail}"
    off = torch.from_numpy(want + 2e-3 * terms).half()
    assert not SPECS["moe_combine"].judge(inputs, {"out": off}, torch.float16)[0].passed


def _projection_case(op: str, width: int, *, positive: bool = False) -> dict:
    """A regular case of an op whose sums run over `width` terms (grouped_matmul's K, fused_moe's hidden and
    intermediate sizes, the prologs' hidden and q_lora sizes, indexer_logits' heads x head_dim); positive: every
    operand's magnitude instead, so no sum cancels and each is sqrt(width) times its terms' root-sum-square."""
    from glm5_hal.parity import cases as C

    gen = torch.Generator().manual_seed(46)
    if op == "grouped_matmul":
        inputs = C.grouped_matmul_inputs([3, 0, 4], 24, width)(gen, torch.float32)
    elif op == "fused_moe":
        inputs = C.fused_moe_inputs(5, width, width, 2, 3)(gen, torch.float32)
    elif op in ("indexer_prolog", "mla_prolog"):
        cfg = C.GLM5_MINI.with_overrides(hidden_size=width, q_lora_rank=width)
        build = C.indexer_prolog_inputs if op == "indexer_prolog" else C.mla_prolog_inputs
        inputs = build(cfg, [C.SeqSpec(2, 6)], 8)(gen, torch.float32)
    else:  # indexer_logits: heads x head_dim terms
        cfg = C.GLM5_MINI.with_overrides(index_n_heads=width // 128, index_head_dim=128)
        inputs = C.indexer_inputs(cfg, [C.SeqSpec(3, 40)], 16)(gen, torch.float32)
    if positive:
        inputs = {k: v.abs() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in inputs.items()}
    return inputs


_PROJECTION_OUTPUTS = {
    "grouped_matmul": ("y",),
    "fused_moe": ("out",),
    "indexer_prolog": ("q_idx", "weights"),
    "indexer_logits": ("logits",),
    "mla_prolog": ("q_lat", "q_pe", "q_norm"),
}


@pytest.mark.parametrize("op", sorted(_PROJECTION_OUTPUTS))
def test_fuzz_comparison_sums_are_judged_against_their_terms_root_sum_square(op: str) -> None:
    """Projections (grouped_matmul's y, fused_moe's out, the prologs' queries and head weights) and indexer scores
    sum products of both signs: an fp32 output that cancels is as accurate as its terms' rounding, not as itself (the
    long profile failed fp32 grouped_matmul at 1.1e-4 and indexer_prolog at 3.0e-4 of themselves; the parity cases
    `products_cancel`, `decode_projections_cancel` and `decode_latent_queries_cancel`). The judge scales by
    max(|out|, the terms' root-sum-square): random sums of 2048 terms are judged against about their own size (the
    sum of the terms' magnitudes, judged against before, let a bf16 output 8% off pass there), and aligned sums,
    sqrt(width) times their root-sum-square, keep their own size."""
    import numpy as np

    from glm5_hal.parity.specs import SPECS

    spec, names = SPECS[op], _PROJECTION_OUTPUTS[op]

    def judged(inputs: dict, outputs: dict[str, np.ndarray], dtype: torch.dtype) -> bool:
        got = {name: torch.from_numpy(outputs[name]).to(dtype) for name in names}
        return all(v.passed for v in spec.judge(inputs, got, dtype))

    inputs = _projection_case(op, 2048)
    want = spec.reference(inputs)
    assert judged(inputs, want, torch.bfloat16)  # bf16's own rounding of every output
    assert not judged(inputs, {name: want[name] * (1 + 5 * 1.6e-2) for name in names}, torch.bfloat16)
    assert not judged(inputs, {name: want[name] * (1 + 5e-5) for name in names}, torch.float32)

    aligned = _projection_case(op, 2048, positive=True)
    want = spec.reference(aligned)
    assert judged(aligned, want, torch.bfloat16)
    assert judged(aligned, {name: want[name] * (1 + 0.5 * 1.6e-2) for name in names}, torch.bfloat16)
    assert not judged(aligned, {name: want[name] * (1 + 2 * 1.6e-2) for name in names}, torch.bfloat16)


def test_fuzz_comparison_fp16_outputs_among_the_subnormals(request: pytest.FixtureRequest) -> None:
    """An fp16 output of ~1e-6 sits among fp16's subnormals, 2^-24 apart: rounding it is an error of up to 3%, which
    the 1e-3 tolerance failed on every backend, the reference's own fp16 result included. The judge now allows the
    output format's rounding there (2^-25); an error of 2^-20 still fails."""
    import numpy as np

    from glm5_hal.parity import cases as C
    from glm5_hal.parity.compare import compare_float
    from glm5_hal.parity.runner import run_inputs

    inputs = C.fused_moe_inputs(6, 8, 4, 2, 4)(torch.Generator().manual_seed(0), torch.float16)
    inputs["w2"] = inputs["w2"] * 1e-6
    for backend in ("reference", "torch", "triton", "ascend"):
        if backend == "ascend":
            request.getfixturevalue("fake_torch_npu")
        result = run_inputs("fused_moe", inputs, backend, torch.float16)
        assert result.passed, f"{backend}: {result.status}: {result.detail}"
    want = np.full((2, 3), 1e-6)
    assert not compare_float("out", torch.from_numpy(want + 2.0**-20).half(), want, torch.float16).passed


@pytest.mark.parametrize("edge_backend", _EDGE_BACKENDS, indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("mixed", [False, True], ids=["all_plus_inf", "plus_and_minus_inf"])
def test_edge_a_plus_inf_score_makes_the_head_nan(edge_backend: str, dtype: torch.dtype, mixed: bool) -> None:
    """Token 0 head 0 scores +inf against every key, or +inf against one and -inf against the others (its q holds
    +inf where the rows hold +1 or -1): the softmax's shift by its max leaves inf - inf = NaN, so out and lse are NaN
    as in the reference (docs/ops.md "Edge rules"). The torch backend shifted by 0 where the max was not finite and
    gave lse +inf (found by sprinkling infinities into the fuzz suite's inputs, 2026-11-30). The other heads and
    tokens are untouched."""
    import glm5_hal
    from glm5_hal.parity.runner import run_inputs

    inputs = _all_minus_inf_inputs(dtype)
    inputs["q"][0, 0, 0] = float("inf")
    if mixed:  # key position 0 (block table [1, 0]: block 1, slot 0) keeps +1, the token's other keys -1
        inputs["kv_cache"][..., 0] = -1.0
        inputs["kv_cache"][1, 0, 0] = 1.0
    with glm5_hal.use_backend(edge_backend, strict=True):
        out, lse = glm5_hal.sparse_flash_attention(**{k: _copy(v) for k, v in inputs.items()})
    assert torch.isnan(lse[0, 0]) and torch.isnan(out[0, 0]).all(), f"lse {float(lse[0, 0])}, out {out[0, 0, :3]}"
    assert torch.isfinite(out[1]).all() and torch.isfinite(lse[1]).all() and torch.isfinite(lse[0, 1])
    result = run_inputs("sparse_flash_attention", inputs, edge_backend, dtype)
    assert result.passed, f"{result.status}: {result.detail}"


def test_the_exact_judge_takes_nan_carried_to_its_place_and_nothing_else() -> None:
    """compare_exact judges outputs that are copies of inputs (moe_dispatch's x_sorted): a NaN input carried to its
    place is right, and the judge said "differ" for it (NaN != NaN; found by sprinkling NaN into the fuzz suite's
    inputs, 2026-11-30). A NaN where the reference has a number, or a number where it has NaN, still differs."""
    import numpy as np

    from glm5_hal.parity.compare import compare_exact

    want = np.array([[1.0, np.nan], [np.inf, -0.0]])
    assert compare_exact("x", torch.tensor([[1.0, float("nan")], [float("inf"), 0.0]]), want).passed
    assert not compare_exact("x", torch.tensor([[float("nan"), float("nan")], [float("inf"), 0.0]]), want).passed
    assert not compare_exact("x", torch.tensor([[1.0, 2.0], [float("inf"), 0.0]]), want).passed
    assert compare_exact("ids", torch.tensor([3, 1]), np.array([3, 1])).passed  # integers as before
    assert not compare_exact("ids", torch.tensor([3, 2]), np.array([3, 1])).passed
