"""The `torch` backend on both GEMM paths, whatever this machine's probe picks (backends.torch_eager.capabilities).

- Parity of every parity case (real-dims ones excepted: the main suite runs those on the probe's own choice) with
  GLM5_HAL_FAST_PATHS=1 (every correct fast path) and =0 (the conservative fp32 path), at the usual tolerances.
- Wiring: which dtypes the GEMMs actually receive on each path (an aten-level spy): on the fast path every GEMM
  operand is in the activation dtype (fp32 intermediates and rows decoded from a quantized cache enter as hi + lo
  parts), on the conservative path every one is fp32.
- Precision of the fast path's GEMMs: fp32 operands and results are not rounded to bf16 (backends/torch_eager/gemm.py),
  on inputs built to cancel, where one bf16 rounding would be amplified past the bf16 tolerance.
- The per-weight cache of the int8 paths: made once, remade after an in-place write, shared by views, released
  with the weight.
"""

from __future__ import annotations

import dataclasses
import gc
import math

import pytest
import torch
from test_native_kernels import _same_bits
from torch.utils._python_dispatch import TorchDispatchMode

import glm5_hal
import ops_reference as ref
from backends.torch_eager import OPS, int8_gemms
from backends.torch_eager import quant as quant_backend
from backends.torch_eager.capabilities import (
    ATTENTION,
    INDEXER,
    QUANTIZED_INDEXER,
    WEIGHTS,
    DeviceProbe,
    Route,
    capabilities,
    fast_paths,
)
from backends.torch_eager.gemm import FP32, Gemm, RoutedGemm, forced_route, from_route, gemm_for
from backends.torch_eager.indexer import scoring_kernel
from backends.torch_eager.native import bf16_gemm, build, indexer_scores, int8_gemm, quantized_index_scores
from backends.torch_eager.native import sparse_attention as native_attention
from backends.torch_eager.sparse_attention import native_kernel_runs
from conftest import parity_backends
from glm5_hal import weight_cache
from glm5_hal.kv_formats import FORMATS
from glm5_hal.parity import CASES, run_case
from glm5_hal.parity.compare import compare_float, to_numpy
from glm5_hal.parity.inputs import SeqSpec, paged_batch, randn, random_topk_indices
from glm5_hal.parity.quantized_cache import encode_cache

MODES = {"1": "fast paths forced", "0": "conservative fp32 paths"}
# Parity runs the forced fast paths with and without backends.torch_eager.native's kernels (where they run,
# GLM5_HAL_NATIVE=0 is the only way to reach the residual GEMM path on this machine).
NATIVE = {"native": "1", "no-native": "0"}
GEMM_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.baddbmm.default,
    torch.ops.glm5_hal.native_bf16_bmm_nt.default,  # backends.torch_eager.native's bf16 GEMM with fp32 results (CPU)
    torch.ops.glm5_hal.native_indexer_scores.default,  # its fused indexer scores (products, ReLU, head sum)
    torch.ops.glm5_hal.native_paged_sparse_attention.default,  # its sparse attention (both products), rows in place
    torch.ops.glm5_hal.native_quantized_index_scores.default,  # its indexer scores over quantized rows (decoded in it)
    torch.ops.glm5_hal.native_quantized_index_scores_paged.default,  # the same over the op's paged batch
    torch.ops.glm5_hal.native_indexer_prolog.default,  # its decode-sized indexer prolog (three projections in it)
}


def _params():
    for case in CASES:
        if case.slow:
            continue
        for dtype in case.dtypes:
            for mode, native in (("1", "native"), ("1", "no-native"), ("0", "native")):
                name = f"{case.id}-{str(dtype).removeprefix('torch.')}-fast{mode}" + (
                    "-no-native" * (native != "native")
                )
                yield pytest.param(case, dtype, mode, native, id=name)


@pytest.mark.skipif("torch" not in parity_backends(), reason="GLM5_HAL_BACKEND selects another backend")
@pytest.mark.parametrize(("case", "dtype", "mode", "native"), list(_params()))
def test_torch_backend_parity_on_both_paths(
    case, dtype: torch.dtype, mode: str, native: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GLM5_HAL_NATIVE", NATIVE[native])
    with fast_paths(mode):
        result = run_case(case, "torch", dtype)
    status = f"{MODES[mode]}, {native}: {result.status}: {result.detail}"
    assert result.passed, f"{status} (worst rel err {result.rel_err:.3g})"


# ------------------------------------------------------------------------------------------------ wiring


class _GemmSpy(TorchDispatchMode):
    """Records the operand dtypes of every GEMM (aten's, and backends.torch_eager.native's custom op)."""

    def __init__(self) -> None:
        super().__init__()
        self.operands: list[tuple[torch.dtype, ...]] = []
        self.functions: list[object] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in GEMM_OPS:
            self.operands.append(tuple(a.dtype for a in args if isinstance(a, torch.Tensor)))
            self.functions.append(func)
        return func(*args, **(kwargs or {}))


def _operand_dtypes(spy: _GemmSpy) -> set[torch.dtype]:
    return {d for dtypes in spy.operands for d in dtypes}


def _sparse_attention_inputs(dtype: torch.dtype) -> tuple:
    gen = torch.Generator().manual_seed(0)
    batch = paged_batch([SeqSpec(3, 40)], 16, gen)
    q = randn((batch.num_tokens, 4, 576), gen, dtype=dtype)
    cache = randn((batch.num_blocks, 16, 576), gen, dtype=dtype)
    indices = random_topk_indices(batch, 8, gen)
    return q, cache, indices, batch.block_table, batch.seq_lens_k, batch.cu_seqlens_q, 0.1, 512


def _bf16_gemm(mode: str, family: str = WEIGHTS) -> Gemm:
    """The GEMM path of `family`'s bf16 products on the CPU in `mode`, whatever GLM5_HAL_FAST_PATHS says; asked before
    a spy is installed, so that a first probe's own GEMMs are not recorded as the op's."""
    with fast_paths(mode):
        return gemm_for(torch.bfloat16, torch.device("cpu"), family)


def test_gemm_path_follows_the_mode_and_the_activation_dtype() -> None:
    cpu = torch.device("cpu")
    with fast_paths("0"):
        assert gemm_for(torch.bfloat16, cpu) is FP32
    with fast_paths("1"):
        assert gemm_for(torch.float32, cpu) is FP32  # fp32 activations always keep fp32 products
        fast = gemm_for(torch.bfloat16, cpu)
        assert fast.operand == torch.bfloat16
        choice = capabilities(cpu).half_choice(torch.bfloat16)
        assert fast.fp32_output == choice.large.fp32_output
        # Logits take the same path: its results are fp32-accurate whether or not the GEMM returns fp32.
        assert fast.logits is fast


@pytest.mark.parametrize("mode", MODES)
def test_sparse_attention_gemm_operands(mode: str) -> None:
    inputs = _sparse_attention_inputs(torch.bfloat16)
    fast = _bf16_gemm(mode, ATTENTION).at(inputs[0].shape[1])  # the route for the call's head count
    with fast_paths(mode), _GemmSpy() as spy:
        OPS["sparse_flash_attention"](*inputs)
    if native_kernel_runs(fast):
        # The native kernel over the paged batch: bf16 q and cache, then the int32 indices, block table, seq_lens_k
        # and cu_seqlens_q (the probabilities are split into bf16 parts inside).
        assert spy.operands == [(torch.bfloat16, torch.bfloat16, *[torch.int32] * 4)]
    else:
        assert _operand_dtypes(spy) == {fast.operand}
    with fast_paths(mode), _GemmSpy() as fp32_spy:
        OPS["sparse_flash_attention"](*_sparse_attention_inputs(torch.float32))
    assert all(dtypes == (torch.float32, torch.float32) for dtypes in fp32_spy.operands)


@pytest.mark.parametrize("mode", MODES)
def test_projections_and_experts_gemm_operands(mode: str) -> None:
    gen = torch.Generator().manual_seed(1)
    x = randn((5, 64), gen, dtype=torch.bfloat16)
    w13, w2 = randn((3, 32, 64), gen, dtype=torch.bfloat16), randn((3, 64, 16), gen, dtype=torch.bfloat16)
    topk_ids = torch.tensor([[0, 1], [1, 2], [0, 2], [2, 1], [0, 1]], dtype=torch.int32)
    weights = torch.rand(5, 2, generator=gen)
    with fast_paths(mode), _GemmSpy() as spy:
        OPS["fused_moe"](x, weights, topk_ids, w13, w2)
    expert_gemms = spy.operands[:-1]  # the last GEMM is the fp32 combine with the routing weights
    want = _bf16_gemm(mode).operand
    assert expert_gemms and all(set(dtypes) == {want} for dtypes in expert_gemms)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kv_cache_dtype", ["fp8_ds_mla", "int8_mla"])
def test_quantized_latent_rows_feed_the_same_gemms(mode: str, kv_cache_dtype: str) -> None:
    """Rows decoded from a quantized cache reach sparse attention's GEMMs in the operand dtype of the path (as hi + lo
    parts on the fast path: decoded values are fp32). Where torch's half GEMM is emulated (a CPU without bf16 units,
    on a native route), products the native kernel does not take (fp32 rows) run in fp32 instead."""
    q, cache, *rest = _sparse_attention_inputs(torch.bfloat16)
    quantized = encode_cache(cache.float(), FORMATS[kv_cache_dtype], reference=False)
    fast = _bf16_gemm(mode, ATTENTION)
    with fast_paths(mode), _GemmSpy() as spy:
        OPS["sparse_flash_attention"](q, quantized, *rest, kv_cache_dtype=kv_cache_dtype)
    assert _operand_dtypes(spy) == {fast.operand if fast.torch_half else torch.float32}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_index", "int8_index"])
def test_indexer_keys_feed_the_path_gemm_and_the_head_reduction_stays_fp32(mode: str, kv_cache_dtype: str) -> None:
    gen = torch.Generator().manual_seed(3)
    batch = paged_batch([SeqSpec(2, 40)], 16, gen)
    keys = randn((batch.num_blocks, 16, 128), gen)
    cache = (
        keys.bfloat16() if kv_cache_dtype == "auto" else encode_cache(keys, FORMATS[kv_cache_dtype], reference=False)
    )
    q = randn((batch.num_tokens, 4, 128), gen, dtype=torch.bfloat16)
    weights = torch.rand(batch.num_tokens, 4, generator=gen)
    fast = _bf16_gemm(mode, INDEXER if kv_cache_dtype == "auto" else QUANTIZED_INDEXER)
    with fast_paths(mode), _GemmSpy() as spy:
        OPS["indexer_logits"](
            q, weights, cache, batch.block_table, batch.seq_lens_k, batch.cu_seqlens_q, kv_cache_dtype=kv_cache_dtype
        )
    if scoring_kernel(fast, kv_cache_dtype) is not None:
        (fused,) = spy.operands  # one native call: q, the fp32 head weights, the cache read in place, ...
        assert fused[:3] == (torch.bfloat16, torch.float32, cache.dtype)
        return
    *dots, head_reduction = spy.operands  # one key chunk: the q . k GEMMs, then the fp32 sum over heads
    # Decoded keys are fp32: where torch's half GEMM is emulated, the native route runs their products in fp32.
    decoded_in_fp32 = kv_cache_dtype != "auto" and not fast.torch_half
    assert dots and {d for dtypes in dots for d in dtypes} == {torch.float32 if decoded_in_fp32 else fast.operand}
    assert head_reduction == (torch.float32, torch.float32)


# ------------------------------------------------------------------------------------------------ precision


def _half_gemms() -> list[Gemm]:
    """The half-precision paths this device can run: fp32 results (out_dtype, or backends.torch_eager.native's kernel
    where it runs), and rounded results with the residual GEMM where addmm adds in fp32 (the probe's check; where it
    fails the backend never takes that path)."""
    cpu, probe = torch.device("cpu"), DeviceProbe(torch.device("cpu"))
    paths = [Gemm(torch.bfloat16, fp32_output=False)] if probe.residual_exact(torch.bfloat16) else []
    if probe.fp32_output(torch.bfloat16):
        paths.append(Gemm(torch.bfloat16, fp32_output=True))
    if bf16_gemm.availability()[0]:
        paths.append(Gemm(torch.bfloat16, fp32_output=True, native=True))
    assert paths or not capabilities(cpu).half_choice(torch.bfloat16).use
    return paths


def _cancelling(gen: torch.Generator, rows: int, depth: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 activations a [rows, depth] and bf16 weights w [cols, depth] whose products a @ w^T cancel to ~0.2% of the
    magnitudes they sum (each weight row nearly orthogonal to every activation row)."""
    a = torch.randn(rows, depth, generator=gen, dtype=torch.float64)
    w = torch.randn(cols, depth, generator=gen, dtype=torch.float64)
    basis, _ = torch.linalg.qr(a.T)  # [depth, rows]
    w = w - (w @ basis) @ basis.T + 0.002 * w.norm(dim=1, keepdim=True) * basis.sum(1) / basis.sum(1).norm()
    return a.float(), w.bfloat16()


@pytest.mark.parametrize("output", [False, True])
def test_half_gemm_keeps_fp32_operands_and_results(output: bool) -> None:
    """On fresh inputs built to cancel, a bf16 rounding of the fp32 operand would be ~100x larger than its share of
    the result (past the bf16 tolerance). The fast path's hi + lo operand carries ~16 bits, so its product must be
    at least 2^6 times closer than that rounding (2^9 in theory), and, as the op's output (`output=True`), within
    one more rounding of the result (2^-8)."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    a, w = _cancelling(gen, 4, 64, 48)
    want = a.double() @ w.double().T
    rounded_operand = (a.bfloat16().double() @ w.double().T - want).norm() / want.norm()
    assert rounded_operand > 2e-2, "the inputs do not cancel: the test would be void"
    bound = float(rounded_operand) * 2.0**-6 + (2.0**-8 if output else 0.0)
    for gemm in _half_gemms():
        for got in (
            gemm.linear(a, w, output=output),
            gemm.bmm(a[None], w.T[None], output=output)[0],
            gemm.bmm(w[None], a.T[None], output=output)[0].T,  # the fp32 operand second
        ):
            assert got.dtype == torch.float32
            rel = float((got.double() - want).norm() / want.norm())
            assert rel <= bound, f"{gemm}: relative error {rel:.3g} > {bound:g}"


def test_a_routed_gemm_takes_each_products_route_by_its_rows() -> None:
    """The weight family split by rows (capabilities.HalfChoice.split_rows): a product of fewer rows than the split on
    the small route, the others on the large one, in linear (rows = all leading dims) and bmm alike; an fp32 `a`
    counts its rows twice (it enters as two stacked parts). Both orders: half at decode (a native kernel reading the
    weight once), and fp32 at decode (the residual's second pass costing more than bf16 saves)."""
    w = torch.randn(16, 32).bfloat16()
    half = Gemm(torch.bfloat16, fp32_output=False)
    for routed, small, large in (
        (RoutedGemm(half, FP32, 6), torch.bfloat16, torch.float32),
        (RoutedGemm(FP32, half, 6), torch.float32, torch.bfloat16),
    ):
        for shape, dtype, want in (
            ((5, 32), torch.bfloat16, small),
            ((2, 3, 32), torch.bfloat16, large),
            ((6, 32), torch.bfloat16, large),
            ((3, 32), torch.float32, large),  # 3 rows in two parts: 6
            ((2, 32), torch.float32, small),
        ):
            with _GemmSpy() as spy:
                got = routed.linear(torch.randn(shape).to(dtype), w)
            assert _operand_dtypes(spy) == {want} and got.shape == (*shape[:-1], 16), (shape, dtype)
        for rows, want in ((5, small), (6, large)):
            with _GemmSpy() as spy:
                routed.bmm(torch.randn(2, rows, 32).bfloat16(), w.T.expand(2, 32, 16))
            assert _operand_dtypes(spy) == {want}, rows


def test_sparse_attention_takes_the_route_for_its_head_count() -> None:
    """Sparse attention split by heads (capabilities.MEASURED_COUNTS): a call of fewer heads than the split runs the
    native kernel (its portable build, which runs anywhere), a call of more runs torch's fp32 GEMMs."""
    _runs_native = native_attention.availability("portable")
    if not _runs_native[0]:
        pytest.skip(f"no native build here: {_runs_native[1]}")
    native = from_route(torch.bfloat16, Route("native", fp32_output=True, isa="portable", torch_half=False))
    q, cache, *rest = _sparse_attention_inputs(torch.bfloat16)  # 4 heads
    with forced_route(ATTENTION, RoutedGemm(native, FP32, 5)):
        for heads, want in (
            (4, torch.ops.glm5_hal.native_paged_sparse_attention.default),
            (5, torch.ops.aten.bmm.default),
        ):
            q_h = q[:, :1].expand(-1, heads, -1).contiguous()
            with _GemmSpy() as spy:
                OPS["sparse_flash_attention"](q_h, cache, *rest)
            assert set(spy.functions) == {want}, heads


def test_sparse_attention_hands_its_kernel_the_row_prefetch_of_its_route(monkeypatch: pytest.MonkeyPatch) -> None:
    """The row prefetch the probe measured fastest here (capabilities._with_row_prefetch) is what the kernel is told
    ("": the kernel's default, into L2); every hint gives the same bits."""
    ok, why = native_attention.availability("portable")
    if not ok:
        pytest.skip(f"no native build here: {why}")
    told = []
    real = native_attention.paged_attention

    def spy(*args: object, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        told.append(kwargs.get("prefetch"))
        return real(*args, **kwargs)

    monkeypatch.setattr(native_attention, "paged_attention", spy)
    inputs = _sparse_attention_inputs(torch.bfloat16)
    results = []
    for hint in ("", "l2", "l1", "nta"):
        route = Route("native", fp32_output=True, isa="portable", torch_half=False, prefetch=hint)
        with forced_route(ATTENTION, from_route(torch.bfloat16, route)):
            results.append(OPS["sparse_flash_attention"](*inputs))
    assert told == ["l2", "l2", "l1", "nta"]
    assert all(torch.equal(out, results[0][0]) and _same_bits(lse, results[0][1]) for out, lse in results)


def test_the_quantized_indexer_hands_its_kernel_the_row_prefetch_of_its_route(monkeypatch: pytest.MonkeyPatch) -> None:
    """The quantized indexer's scorer is told the row prefetch its route carries (capabilities._with_row_prefetch
    measured it; "": the kernel's default, non-temporal); every hint gives the same bits, on a decode step (one
    token alone with its keys: the route that prefetches) and on a prefill. On the first vector build that runs here
    (the portable one, the fallback, asks for nothing whatever the hint)."""
    isa = next((i for i in ("avx512_bf16", "avx2", "portable") if quantized_index_scores.availability(i)[0]), None)
    if isa is None:
        pytest.skip(f"no native build here: {quantized_index_scores.availability('portable')[1]}")
    told = []
    real = quantized_index_scores.paged_scores

    def spy(*args: object, **kwargs: object) -> torch.Tensor:
        told.append(kwargs.get("prefetch"))
        return real(*args, **kwargs)

    monkeypatch.setattr(quantized_index_scores, "paged_scores", spy)
    gen = torch.Generator().manual_seed(5)
    for seqs in ([SeqSpec(1, 700)], [SeqSpec(3, 300), SeqSpec(1, 40)]):
        batch = paged_batch(seqs, 16, gen, shuffle_blocks=True)
        cache = encode_cache(randn((batch.num_blocks, 16, 128), gen), FORMATS["fp8_index"], reference=False)
        q = randn((batch.num_tokens, 4, 128), gen, dtype=torch.bfloat16)
        weights = torch.rand(batch.num_tokens, 4, generator=gen)
        args = (q, weights, cache, batch.block_table, batch.seq_lens_k, batch.cu_seqlens_q)
        results, told = [], []
        for hint in ("", "l2", "l1", "nta"):
            route = Route("native", fp32_output=True, isa=isa, torch_half=False, prefetch=hint)
            with forced_route(QUANTIZED_INDEXER, from_route(torch.bfloat16, route)):
                results.append(OPS["indexer_logits"](*args, kv_cache_dtype="fp8_index"))
        assert told == ["nta", "l2", "l1", "nta"]
        assert all(_same_bits(got, results[0]) for got in results[1:])


def test_the_amx_attention_route_runs_amx_attention_c_and_passes_every_parity_case(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On AMX's route (native:amx) sparse attention runs its own kernel (amx_attention.c: both products on tiles), not
    sparse_attention.c nor the torch code over AMX's GEMM. GLM5_HAL_NATIVE=portable stands the AMX kernel's portable
    build (the tile blocking in scalar C) in for the AMX one, so this runs on any CPU: the op's bits are that
    kernel's (which differ from sparse_attention.c's in the order of the sums), and every bf16 parity case of the op
    passes on the route."""
    monkeypatch.setenv("GLM5_HAL_NATIVE", "portable")
    ok, why = native_attention.availability(native_attention.AMX)
    if not ok:
        pytest.skip(f"no AMX attention build here: {why}")
    amx = from_route(torch.bfloat16, Route("native", fp32_output=True, isa=native_attention.AMX, torch_half=False))
    inputs = _sparse_attention_inputs(torch.bfloat16)
    with forced_route(ATTENTION, amx), _GemmSpy() as spy:
        out, lse = OPS["sparse_flash_attention"](*inputs)
    assert spy.functions == [torch.ops.glm5_hal.native_paged_sparse_attention.default]
    tiles = native_attention.paged_attention(*inputs, kernel=native_attention.AMX_KERNEL, isa="portable", threads=1)
    vectors = native_attention.paged_attention(*inputs, isa="portable", threads=1)
    assert torch.equal(out, tiles[0]) and _same_bits(lse, tiles[1])
    assert not _same_bits(lse, vectors[1])  # so the bits above say which kernel ran
    op_args = (*inputs, native_attention.AMX, native_attention.AMX_KERNEL, "nta")
    torch.library.opcheck(torch.ops.glm5_hal.native_paged_sparse_attention, op_args)  # its schema and fake
    cases = [case for case in CASES if case.op == "sparse_flash_attention" and torch.bfloat16 in case.dtypes]
    assert cases
    with forced_route(ATTENTION, amx):
        for case in cases:
            result = run_case(case, "torch", torch.bfloat16)
            assert result.passed, f"{case.name}: {result.status}: {result.detail}"


def test_the_amx_indexer_route_runs_amx_index_scores_c_and_passes_every_parity_case(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On AMX's route the indexer's scores run its AMX kernels (the products on tiles): amx_index_scores.c over bf16
    rows, amx_quantized_index_scores.c over quantized index rows (the route of their own family, forced too), the
    portable builds standing in as above; every bf16 parity case of indexer_logits and lightning_indexer passes on
    the route."""
    monkeypatch.setenv("GLM5_HAL_NATIVE", "portable")
    ok, why = indexer_scores.availability(indexer_scores.AMX)
    if not ok:
        pytest.skip(f"no AMX indexer build here: {why}")
    loaded: set[str] = set()
    real_function = build.function
    monkeypatch.setattr(
        build, "function", lambda kernel, *a, **kw: loaded.add(kernel) or real_function(kernel, *a, **kw)
    )
    amx = from_route(torch.bfloat16, Route("native", fp32_output=True, isa=indexer_scores.AMX, torch_half=False))
    gen = torch.Generator().manual_seed(3)
    batch = paged_batch([SeqSpec(2, 40)], 16, gen)
    cache = randn((batch.num_blocks, 16, 128), gen, dtype=torch.bfloat16)
    q = randn((batch.num_tokens, 4, 128), gen, dtype=torch.bfloat16)
    weights = torch.rand(batch.num_tokens, 4, generator=gen)
    with forced_route(INDEXER, amx), _GemmSpy() as spy:
        OPS["indexer_logits"](q, weights, cache, batch.block_table, batch.seq_lens_k, batch.cu_seqlens_q)
    assert spy.functions == [torch.ops.glm5_hal.native_indexer_scores.default]
    assert indexer_scores.AMX_KERNEL in loaded and indexer_scores.KERNEL not in loaded, loaded
    loaded.clear()
    fp8 = encode_cache(cache.float(), FORMATS["fp8_index"], reference=False)
    with forced_route(QUANTIZED_INDEXER, amx), _GemmSpy() as spy:
        batch_args = (batch.block_table, batch.seq_lens_k, batch.cu_seqlens_q)
        OPS["indexer_logits"](q, weights, fp8, *batch_args, kv_cache_dtype="fp8_index")
    assert spy.functions == [torch.ops.glm5_hal.native_quantized_index_scores_paged.default]
    assert loaded == {quantized_index_scores.AMX_KERNEL}, loaded
    ops = ("indexer_logits", "lightning_indexer")
    cases = [case for case in CASES if case.op in ops and torch.bfloat16 in case.dtypes]
    assert cases
    with forced_route(INDEXER, amx), forced_route(QUANTIZED_INDEXER, amx):
        for case in cases:
            result = run_case(case, "torch", torch.bfloat16)
            assert result.passed, f"{case.name}: {result.status}: {result.detail}"


def test_products_past_max_work_take_the_fp32_gemm() -> None:
    """max_work 3 (a measured 3.75x over the 1.25x margin): bf16 x bf16 with the residual (2x) and an fp32 operand as
    the op's output (2 parts, no residual: 2x) stay half; an fp32 operand with the residual (4x) takes fp32."""
    w = torch.randn(16, 32).bfloat16()
    gemm = Gemm(torch.bfloat16, fp32_output=False, max_work=3.0)
    for x, output, want in (
        (torch.randn(4, 32).bfloat16(), False, {torch.bfloat16}),
        (torch.randn(4, 32), True, {torch.bfloat16}),
        (torch.randn(4, 32), False, {torch.float32}),
    ):
        with _GemmSpy() as spy:
            gemm.linear(x, w, output=output)
            gemm.bmm(x[None], w.T[None], output=output)
        assert _operand_dtypes(spy) == want, (x.dtype, output)
    assert Gemm(torch.bfloat16, fp32_output=True, max_work=3.0).takes_half(x, w, 4, output=False)  # 2 parts, 1 pass


def test_the_native_gemm_takes_bf16_column_operands_and_fp32_rows_only() -> None:
    """On the native path (max_work 2.75, as measured here): bf16 x bf16 and an fp32 `a` (few rows, split cheaply)
    take the native kernel; an fp32 `b` (cache rows, split at a cost above the kernel's) takes the residual rule, so
    here the fp32 GEMM (2 parts x 2 passes); an op's output takes torch's bf16 GEMM. On the fastest build that runs
    here (the portable one at least: the routing is the same for every build)."""
    isa = next(isa for isa in (bf16_gemm.FAST, bf16_gemm.AVX2, bf16_gemm.PORTABLE) if bf16_gemm.availability(isa)[0])
    gemm = Gemm(torch.bfloat16, fp32_output=True, max_work=2.75, native=True, native_isa=isa)
    native = torch.ops.glm5_hal.native_bf16_bmm_nt.default
    w = torch.randn(16, 32).bfloat16()
    for a, b, output, want in (
        (torch.randn(2, 4, 32).bfloat16(), w.T.expand(2, 32, 16), False, native),
        (torch.randn(2, 4, 32), w.T.expand(2, 32, 16), False, native),
        (torch.randn(2, 4, 32).bfloat16(), torch.randn(2, 32, 16), False, torch.ops.aten.bmm.default),
        (torch.randn(2, 4, 32).bfloat16(), w.T.expand(2, 32, 16), True, torch.ops.aten.bmm.default),
    ):
        with _GemmSpy() as spy:
            got = gemm.bmm(a, b, output=output)
        assert spy.functions == [want], (a.dtype, b.dtype, output)
        fp32_b = b.dtype == torch.float32
        assert (spy.operands[0] == (torch.float32, torch.float32)) == fp32_b  # the fp32 GEMM, as before native
        want_product = a.double() @ b.double()
        rel = float((got.double() - want_product).norm() / want_product.norm())
        assert rel <= (2.0**-8 if output else 2.0**-14), rel  # hi + lo carries ~2^-16 of an fp32 operand


def test_the_native_gemm_takes_the_outputs_of_few_rows_where_the_probe_measured_it_faster() -> None:
    """outputs_below (the probe's crossing with one pass of torch's half GEMM): an op's output of fewer rows of work
    takes the native kernel, if its weight is read in place (K-contiguous); more rows (an fp32 operand's two parts
    count twice), or a weight that would be copied on every call, take torch's bf16 GEMM as before."""
    isa = next(isa for isa in (bf16_gemm.FAST, bf16_gemm.AVX2, bf16_gemm.PORTABLE) if bf16_gemm.availability(isa)[0])
    gemm = Gemm(torch.bfloat16, True, math.inf, True, isa, torch_half=True, outputs_below=8)
    native, torch_bmm = torch.ops.glm5_hal.native_bf16_bmm_nt.default, torch.ops.aten.bmm.default
    w = torch.randn(16, 32).bfloat16()
    for a, b, want in (
        (torch.randn(2, 7, 32).bfloat16(), w.T.expand(2, 32, 16), native),
        (torch.randn(2, 8, 32).bfloat16(), w.T.expand(2, 32, 16), torch_bmm),
        (torch.randn(2, 4, 32), w.T.expand(2, 32, 16), torch_bmm),  # 4 fp32 rows: 8 rows of work
        (torch.randn(2, 3, 32), w.T.expand(2, 32, 16), native),
        (torch.randn(2, 4, 32).bfloat16(), torch.randn(2, 32, 16).bfloat16(), torch_bmm),  # N-contiguous b
    ):
        with _GemmSpy() as spy:
            got = gemm.bmm(a, b, output=True)
        assert want in spy.functions and (native in spy.functions) == (want == native), (a.shape, a.dtype, b.stride())
        rel = float((got.double() - a.double() @ b.double()).norm() / (a.double() @ b.double()).norm())
        assert rel <= 2.0**-8, rel  # an output: rounded right after anyway


def test_without_fast_torch_half_gemms_the_native_kernel_takes_the_outputs_too() -> None:
    """On a CPU without bf16 units (torch_half False: torch emulates its bf16 GEMM there), the native route sends the
    op's outputs to the native kernel as well, and a product it cannot take (an fp32 column operand) to fp32 GEMMs:
    never to torch's emulated bf16 GEMM."""
    gemm = Gemm(torch.bfloat16, True, math.inf, True, "portable", torch_half=False)
    native = torch.ops.glm5_hal.native_bf16_bmm_nt.default
    w = torch.randn(16, 32).bfloat16()
    for a, b, output, want in (
        (torch.randn(2, 4, 32).bfloat16(), w.T.expand(2, 32, 16), True, [native]),
        (torch.randn(2, 4, 32).bfloat16(), w.T.expand(2, 32, 16), False, [native]),
        (torch.randn(2, 4, 32).bfloat16(), torch.randn(2, 32, 16), False, [torch.ops.aten.bmm.default]),
    ):
        with _GemmSpy() as spy:
            got = gemm.bmm(a, b, output=output)
        assert spy.functions == want, (b.dtype, output)
        assert all(d != torch.bfloat16 for d in spy.operands[0]) or want == [native]
        rel = float((got.double() - a.double() @ b.double()).norm() / (a.double() @ b.double()).norm())
        assert rel <= 2.0**-14, rel


def test_half_gemm_passes_nan_and_inf_through() -> None:
    """inf in an fp32 operand gives the reference's +-inf / NaN, not NaN from the residual's inf - inf."""
    a = torch.tensor([[1.0, 2.0], [float("inf"), 1.0], [float("nan"), 0.0]])
    w = torch.tensor([[1.0, 0.5], [2.0, -1.0]], dtype=torch.bfloat16)
    want = a.double() @ w.double().T
    for gemm in _half_gemms():
        got = gemm.linear(a, w).double()
        assert torch.equal(torch.isnan(got), torch.isnan(want)), gemm
        finite = torch.isfinite(want)
        assert torch.equal(got[~finite & ~torch.isnan(want)], want[~finite & ~torch.isnan(want)]), gemm
        assert torch.allclose(got[finite], want[finite], rtol=1e-5), gemm


# ------------------------------------------------------------------------------------------------ int8 weight cache


def _quant(m: int, n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    x_q = torch.randint(-128, 128, (m, k), generator=gen, dtype=torch.int8)
    w_q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    return x_q, torch.rand(m, generator=gen) + 0.5, w_q, torch.rand(n, generator=gen) * 0.01


def _check_quant(got: torch.Tensor, x_q, x_scale, w_q, w_scale) -> None:
    want = ref.quant_matmul(*(to_numpy(t) for t in (x_q, x_scale, w_q, w_scale)))
    verdict = compare_float("y", got, want, torch.float32)
    assert verdict.passed, verdict.detail


def test_derived_values_are_made_once_per_weight_and_remade_after_a_write() -> None:
    made = []

    def make(w: torch.Tensor) -> torch.Tensor:
        made.append(w.shape)
        return w.sum(dim=-1)  # a fresh tensor, as the real derivations are

    weight = torch.arange(24.0).reshape(4, 6)
    first = weight_cache.derived(weight, "sum", make)
    assert weight_cache.derived(weight, "sum", make) is first and len(made) == 1
    assert weight_cache.derived(weight[1:3], "sum", make).tolist() == [51.0, 87.0] and len(made) == 2
    assert weight_cache.derived(weight[1:3], "sum", make).tolist() == [51.0, 87.0] and len(made) == 2  # a fresh view
    weight.mul_(2)  # an in-place write moves the version counter shared by every view
    assert weight_cache.derived(weight, "sum", make).tolist() == [30.0, 102.0, 174.0, 246.0] and len(made) == 3
    before = weight_cache.cached_entries()
    del weight, first
    gc.collect()
    assert weight_cache.cached_entries() == before - 2  # both entries went with their weight


def test_new_data_is_seen_and_a_write_through_data_after_clear() -> None:
    weight = torch.arange(24.0).reshape(4, 6)
    assert weight_cache.derived(weight, "sum", lambda w: w.sum(dim=-1)).tolist() == [15.0, 51.0, 87.0, 123.0]
    weight.data = torch.ones(4, 6)  # new data, same shape and version counter: the data pointer tells
    assert weight_cache.derived(weight, "sum", lambda w: w.sum(dim=-1)).tolist() == [6.0] * 4
    weight.data.mul_(3)  # hidden from the version counter (documented): seen once the cache is cleared
    assert weight_cache.derived(weight, "sum", lambda w: w.sum(dim=-1)).tolist() == [6.0] * 4
    weight_cache.clear()
    assert weight_cache.derived(weight, "sum", lambda w: w.sum(dim=-1)).tolist() == [18.0] * 4


@pytest.mark.parametrize("mode", MODES)
def test_int8_ops_take_weights_made_under_inference_mode(mode: str) -> None:
    # Inference tensors have no version counter: the cache keys them without one instead of failing.
    gen = torch.Generator().manual_seed(3)
    with torch.inference_mode():
        x_q, x_scale, w_q, w_scale = _quant(3, 40, 128, gen)
        codes = torch.randint(-8, 8, (40, 128), generator=gen)
        w_packed = torch.from_numpy(ref.pack_int4(codes.numpy())).clone()
        with fast_paths(mode):
            for _ in range(2):  # the second call finds what the first one made
                y = glm5_hal.quant_matmul(x_q, x_scale, w_q, w_scale, out_dtype=torch.float32)
                y4 = glm5_hal.w4a8_matmul(x_q, x_scale, w_packed, w_scale, out_dtype=torch.float32)
    _check_quant(y, x_q, x_scale, w_q, w_scale)
    want = ref.w4a8_matmul(*(to_numpy(t) for t in (x_q, x_scale, w_packed, w_scale)))
    verdict = compare_float("y", y4, want, torch.float32)
    assert verdict.passed, verdict.detail


def test_a_new_weight_never_finds_a_dead_weights_entry() -> None:
    # Entries are keyed on id(weight); CPython reuses the id of a freed object at once, so a fresh weight often has a
    # dead one's id: it must get its own value, and the dead one's entry must be gone.
    before = weight_cache.cached_entries()
    ids = set()
    for value in range(50):
        weight = torch.full((3,), float(value))
        ids.add(id(weight))
        assert weight_cache.derived(weight, "sum", lambda w: float(w.sum())) == 3.0 * value
        del weight
    assert len(ids) < 50  # ids were reused, so the case was exercised
    gc.collect()
    assert weight_cache.cached_entries() == before


@pytest.mark.parametrize("op", ["quant_matmul", "w4a8_matmul"])
def test_int8_fast_path_prepares_each_weight_once_and_sees_in_place_writes(op: str) -> None:
    gen = torch.Generator().manual_seed(2)
    x_q, x_scale, w_q, w_scale = _quant(5, 24, 256, gen)
    with fast_paths("1"):
        route = capabilities("cpu").int8_route()
        if route is None or not route.caches_weights:
            pytest.skip(f"no int8 route that prepares weights runs here ({capabilities('cpu').int8.reason})")
        if op == "quant_matmul":
            weight, args = w_q, (x_q, x_scale, w_q, w_scale, None, torch.float32)
        else:
            codes = torch.randint(-8, 8, (24, 256), generator=gen)
            weight = torch.from_numpy(ref.pack_int4(codes.numpy()))
            args = (x_q, x_scale, weight, w_scale, None, torch.float32)
        before = weight_cache.cached_entries()
        first = OPS[op](*args)
        assert weight_cache.cached_entries() == before + 1
        assert torch.equal(OPS[op](*args), first) and weight_cache.cached_entries() == before + 1
        weight.copy_(torch.flip(weight, dims=[0]))  # new contents, same tensor: the cache must notice
        got = OPS[op](*args)
    with fast_paths("0"):
        want = OPS[op](*args)  # the conservative path on the new contents, exact accumulators
    assert torch.equal(got, want)
    if op == "quant_matmul":
        _check_quant(got, x_q, x_scale, w_q, w_scale)


@pytest.mark.parametrize(("op", "group_size"), [("quant_matmul", None), ("w4a8_matmul", None), ("w4a8_matmul", 128)])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_native_int8_kernel_takes_the_rows_the_probe_chose_with_the_routes_results(
    op: str, group_size: int | None, out_dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not int8_gemm.availability()[0]:
        pytest.skip(f"the native int8 kernel does not run here: {int8_gemm.availability()[1]}")
    with fast_paths("1"):
        chosen = capabilities("cpu")
    if chosen.int8.route is None:
        pytest.skip(f"no exact int8 route here ({chosen.int8.reason})")
    # Native up to 4 rows beside a general route, whatever this machine's probe measured (forced, the native kernel
    # is the route itself where no AMX kernel comes first: oneDNN's is the general one then).
    general = chosen.int8.route
    if general == int8_gemms.NATIVE_VNNI.name:
        general = int8_gemms.ONEDNN_U8S8.name
    with_native = dataclasses.replace(chosen, int8=dataclasses.replace(chosen.int8, route=general, native_rows=4))
    monkeypatch.setattr(quant_backend, "capabilities", lambda device: with_native)
    ran = []
    for name in ("_w8a8", "_w4a8"):
        real = getattr(int8_gemm, name)
        monkeypatch.setattr(int8_gemm, name, lambda *a, real=real, name=name: ran.append(name) or real(*a))
    gen = torch.Generator().manual_seed(4)
    for rows in (1, 4, 5):
        x_q, x_scale, w_q, w_scale = _quant(rows, 21, 512, gen)
        bias = torch.randn(21, generator=gen)
        if op == "quant_matmul":
            args = (x_q, x_scale, w_q, w_scale, bias, out_dtype)
        else:
            weight = torch.from_numpy(ref.pack_int4(torch.randint(-8, 8, (21, 512), generator=gen).numpy()))
            scales = w_scale if group_size is None else torch.rand(21, 512 // group_size, generator=gen) * 0.01
            args = (x_q, x_scale, weight, scales, group_size, out_dtype)
        ran.clear()
        got = OPS[op](*args)
        assert ran == ([f"_w{4 if op == 'w4a8_matmul' else 8}a8"] if rows <= 4 else [])
        with fast_paths("0"):
            want = OPS[op](*args)  # the conservative path: exact accumulators, its own order of the group sums
        if op == "quant_matmul":  # one order of operations on both paths: the same bits
            assert torch.equal(got, want)
        else:
            verdict = compare_float("y", got, want.double().numpy(), out_dtype)
            assert verdict.passed, verdict.detail


@pytest.mark.parametrize("mode", MODES)
def test_sparse_attention_values_that_cancel_keep_the_probabilities_exact(mode: str) -> None:
    """Two keys whose value rows cancel in every output element to ~0.3% of the terms they sum: the output must still
    match float64 within the bf16 tolerance, which a value product over probabilities rounded to bf16 (2^-9 of each
    term) misses (relative error 5.3e-2 against 1.6e-2, checked by hand). Sparse attention's value product takes
    the normalised probabilities as hi + lo parts."""
    gen = torch.Generator().manual_seed(11)
    heads, width, d_v, block = 4, 576, 512, 16
    q = torch.zeros(1, heads, width)
    q[..., d_v:] = torch.randn(width - d_v, generator=gen)  # the same query in every head, on the rope dims only
    rows = torch.zeros(2, width)
    rows[:, d_v:] = torch.randn(2, width - d_v, generator=gen)  # the logits (and so p1 / p2) come from these
    q, rows = q.bfloat16(), rows.bfloat16()
    logits = (q[0, 0].double() @ rows.double().T) * 0.1
    p = torch.softmax(logits, dim=0)  # [2], the same in every head
    v1 = torch.randn(d_v, generator=gen, dtype=torch.float64) * 8
    rows[0, :d_v] = v1.bfloat16()
    rows[1, :d_v] = (-rows[0, :d_v].double() * p[0] / p[1] * 1.003).bfloat16()  # p1 v1 + p2 v2 ~ 0.3% of p1 v1
    values = rows[:, :d_v].double()
    want = (p[:, None] * values).sum(0)  # [d_v]
    assert (p[0] * values[0].abs() > 100 * want.abs()).all(), "the values do not cancel: the test would be void"
    cache = torch.zeros(1, block, width, dtype=torch.bfloat16)
    cache[0, :2] = rows
    indices = torch.tensor([[0, 1]], dtype=torch.int32)
    block_table, seq_lens_k = torch.zeros(1, 1, dtype=torch.int32), torch.tensor([2], dtype=torch.int32)
    cu_seqlens_q = torch.tensor([0, 1], dtype=torch.int32)
    with fast_paths(mode):
        out, _ = OPS["sparse_flash_attention"](q, cache, indices, block_table, seq_lens_k, cu_seqlens_q, 0.1, d_v)
    reference = want[None, None, :].expand(1, heads, d_v).numpy()
    verdict = compare_float("out", out, reference, torch.bfloat16)
    assert verdict.passed, verdict.detail
