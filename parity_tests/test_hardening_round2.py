"""Regression tests of the second hardening round (issue 31): each failed before its fix.

1. block ids past the cache with value checks off or under torch.compile: IndexError on the fp32 path, SIGSEGV
   in the native sparse attention kernel, out-of-bounds reads on triton; the rule (docs/ops.md "Paged caches") is
   now that a key the block table cannot address is not a key, on every backend and the reference.
2. int8_gemm.c formed the W4A8 scale gather's index in 32 bits: scale rows 2^31 / 15 elements apart or more
   segfaulted (AVX-512 build).
"""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

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
TABLE = torch.tensor([[0, 1000], [-3, 2], [1, 2]], dtype=torch.int32)
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
    """Route the torch backend's bf16 attention and indexer through glm5_hal.native's portable build, as a CPU with
    AVX-512 BF16 routes them through the fast one (this machine may lack it; the kernels' loops are the same)."""
    import backends.torch_eager.indexer as indexer
    import backends.torch_eager.sparse_attention as attention
    from backends.torch_eager.gemm import Gemm
    from glm5_hal.native import indexer_scores, sparse_attention

    assert sparse_attention.availability("portable")[0], sparse_attention.availability("portable")
    native = Gemm(torch.bfloat16, True, 1, math.inf, True)
    attention.gemm_for = indexer.gemm_for = lambda dtype, device: native if dtype == torch.bfloat16 else None

    class Portable:
        def __init__(self, module, name):
            self.module, self.name = module, name

        def availability(self, isa="portable"):
            return self.module.availability("portable")

        def __getattr__(self, attr):
            return functools.partial(getattr(self.module, attr), isa="portable")

    attention.native_attention = Portable(sparse_attention, "attention")
    indexer.native_scores = Portable(indexer_scores, "scores")


if PATH == "native":
    force_native_portable()
    check_attention("torch", torch.bfloat16)
    check_indexer("torch", torch.bfloat16)
elif PATH == "compile":
    torch._dynamo.reset()
    compiled = torch.compile(glm5_hal.sparse_flash_attention, fullgraph=True, backend="aot_eager")
    check_attention("torch", torch.float32, compiled)
elif PATH == "ascend":
    from fakes.ascend.fixture import install_in_process
    from fakes.ascend.wheel import torch_npu_wheel
    install_in_process(torch_npu_wheel())
    for dtype in (torch.bfloat16, torch.float32):
        check_attention("ascend", dtype)
        check_indexer("ascend", dtype)
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
from glm5_hal.native import sparse_attention

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
    from glm5_hal.native import int8_gemm

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
