"""Canaries around the paged caches, on random valid configs and every backend.

Writers (mla_prolog, indexer_prolog): the cache sits inside a guard buffer (a guard block before and after it,
a spare slot in every block, a spare element in every row) holding a sentinel; every slot of the cache starts as
NaN. After the op: the guard is bit-for-bit the sentinel, exactly the slots of slot_mapping's non-negative entries
changed (a -1 slot writes nothing), the written rows are the reference's (so the op read none of the NaN), and the
outputs are the reference's.

Readers (indexer_logits, lightning_indexer, sparse_flash_attention): every cache slot the op must not read holds
NaN (positions past a sequence's keys, blocks no sequence uses, spare blocks, and for sparse attention every key
no valid index selects), the cache sits in a NaN guard buffer, and unused block-table entries hold garbage. The
outputs must be the reference's: NaN in an unread slot never reaches an output. Every other argument must come
back unchanged (the parity judge checks that).

Quantized caches (kv_cache_dtype, every format): the same rules on uint8 rows. Every slot a writer does not write,
and every slot a reader must not read, holds garbage bytes whose scales are all NaN (so any value decoded from
them is NaN); the guard is GUARD_BYTE for a writer and 0xFF (NaN scales and NaN e4m3 codes) for a reader, with a
spare 1 or 4 bytes per row (4 keeps the rows aligned, so the triton kernels work in place, not on a copy).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fuzz.strategies import FUZZ_COUNTS, VALID_CASES, FuzzCase, examples, quantized_cache_cases
from fuzz.test_fuzz_parity import fuzz_backends
from glm5_hal.kv_formats import FORMATS, KVCacheFormat, decode_rows
from glm5_hal.parity import cases as C
from glm5_hal.parity.quantized_cache import quantized_build
from glm5_hal.parity.specs import SPECS
from glm5_hal.registry import Availability, Backend, registry
from glm5_hal.selection import use_backend

GUARD = -7777.0  # finite, so the guard compares bit for bit
GUARD_BYTE = 0xA5  # a quantized cache's guard
CANARY_CONFIGS_PER_OP = 50
QUANTIZED_CANARY_CONFIGS_PER_OP = 25
WRITERS = {"mla_prolog": "kv_cache", "indexer_prolog": "index_k_cache"}
READERS = {
    "indexer_logits": "index_k_cache",
    "lightning_indexer": "index_k_cache",
    "sparse_flash_attention": "kv_cache",
}


def guarded(cache: torch.Tensor, fill: float, row_pad: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(buffer, view, inside): `cache`'s values in a view of a larger buffer filled with `fill` (a guard block on
    both sides, a spare slot per block, `row_pad` spare elements per row); `inside` marks the view's elements."""
    blocks, block_size, width = cache.shape
    buffer = torch.full((blocks + 2, block_size + 1, width + row_pad), fill, dtype=cache.dtype)
    view = buffer[1 : blocks + 1, :block_size, :width]
    view.copy_(cache)
    inside = torch.zeros(buffer.shape, dtype=torch.bool)
    inside[1 : blocks + 1, :block_size, :width] = True
    return buffer, view, inside


def _judge(op: str, inputs: dict, outputs: dict, dtype: torch.dtype) -> None:
    verdicts = SPECS[op].judge(inputs, outputs, dtype)
    failed = [f"{v.output}: {v.detail}" for v in verdicts if not v.passed]
    assert not failed, failed


def _run(op: str, inputs: dict, backend: str) -> dict:
    with use_backend(backend, ops=[op], strict=True):
        return {k: v.cpu() for k, v in SPECS[op].run(inputs).items()}


def _clone(inputs: dict) -> dict:
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}


def check_writer(case: FuzzCase, backend: str) -> None:
    cache_arg = WRITERS[case.op]
    inputs = _clone(case.inputs)
    inputs[cache_arg] = torch.full_like(inputs[cache_arg], float("nan"))  # the prologs must never read the cache
    reference_inputs = _clone(inputs)
    buffer, view, inside = guarded(inputs[cache_arg], GUARD)
    outputs = _run(case.op, {**inputs, cache_arg: view}, backend)
    assert bool((buffer[~inside] == GUARD).all()), "a write landed outside the cache"
    slots = inputs["slot_mapping"]
    written = torch.zeros(view.shape[0] * view.shape[1], dtype=torch.bool)
    written[slots[slots >= 0]] = True
    rows_after = view.reshape(-1, view.shape[-1])
    assert bool(rows_after[~written].isnan().all()), "a slot outside slot_mapping (or of a -1 token) changed"
    assert bool(torch.isfinite(rows_after[written]).all()), "a written row holds a NaN it could only have read"
    _judge(case.op, reference_inputs, outputs, case.dtype)


def _read_slots(op: str, inputs: dict, cache: torch.Tensor) -> torch.Tensor:
    """[num_slots] bool: the cache slots the op may read."""
    block_size = cache.shape[1]
    table = inputs["block_table"].long()
    lens, cu = inputs["seq_lens_k"].long(), inputs["cu_seqlens_q"].long()
    read = torch.zeros(cache.shape[0] * block_size, dtype=torch.bool)

    def mark(b: int, positions: torch.Tensor) -> None:
        read[table[b, positions // block_size] * block_size + positions % block_size] = True

    for b in range(table.shape[0]):
        first, last = int(cu[b]), int(cu[b + 1])
        if op == "sparse_flash_attention":
            picked = inputs["indices"][first:last].long().flatten()
            mark(b, picked[(picked >= 0) & (picked < lens[b])])
        elif last > first:  # the indexer reads every key its tokens see: positions < seq_lens_k[b]
            mark(b, torch.arange(int(lens[b])))
    return read


def _assert_no_nan(outputs: dict) -> None:
    for name, out in outputs.items():
        if out.is_floating_point():
            assert not bool(out.isnan().any()), f"{name}: NaN from an unread slot reached the output"


def check_reader(case: FuzzCase, backend: str) -> None:
    cache_arg = READERS[case.op]
    inputs = _clone(case.inputs)
    cache = inputs[cache_arg]
    read = _read_slots(case.op, inputs, cache)
    rows = cache.view(-1, cache.shape[-1])
    rows[~read] = float("nan")
    _, view, _ = guarded(cache, float("nan"))
    outputs = _run(case.op, {**inputs, cache_arg: view}, backend)
    _assert_no_nan(outputs)
    _judge(case.op, inputs, outputs, case.dtype)
    assert torch.equal(view.isnan(), cache.isnan()) and torch.equal(view.nan_to_num(), cache.nan_to_num()), (
        f"{cache_arg}: a reader wrote its cache"
    )


@pytest.mark.parametrize("op", [*WRITERS, *READERS])
def test_caches_only_change_where_written_and_unread_nan_never_leaks(op: str) -> None:
    backends = fuzz_backends()
    if not backends:
        pytest.skip("no fuzz backend is available here")
    check = check_writer if op in WRITERS else check_reader

    @settings(max_examples=examples(CANARY_CONFIGS_PER_OP))
    @given(case=VALID_CASES[op])
    def holds(case: FuzzCase) -> None:
        for backend in backends:
            check(case, backend)
            FUZZ_COUNTS[("canaries", op, backend)] += 1

    holds()


# ---------------------------------------------------------------------------------------------- quantized caches
def garbage_rows(num_rows: int, fmt: KVCacheFormat, seed: int) -> torch.Tensor:
    """uint8 [num_rows, row_bytes]: random bytes (codes, RoPE values: any bit pattern, NaN and inf included) with
    every scale NaN, so every value decoded from such a row is NaN."""
    rows = torch.randint(0, 256, (num_rows, fmt.row_bytes), generator=torch.Generator().manual_seed(seed))
    rows = rows.to(torch.uint8)
    rows[:, fmt.scales_offset : fmt.rope_offset] = torch.full((num_rows, fmt.num_scales), float("nan")).view(
        torch.uint8
    )
    return rows


def check_quantized_writer(case: FuzzCase, backend: str, row_pad: int = 4) -> None:
    cache_arg = WRITERS[case.op]
    fmt = FORMATS[case.inputs["kv_cache_dtype"]]
    inputs = _clone(case.inputs)
    cache = inputs[cache_arg]
    cache.view(-1, fmt.row_bytes)[:] = garbage_rows(cache.shape[0] * cache.shape[1], fmt, case.params["seed"])
    reference_inputs = _clone(inputs)
    buffer, view, inside = guarded(cache, GUARD_BYTE, row_pad)
    outputs = _run(case.op, {**inputs, cache_arg: view}, backend)
    assert bool((buffer[~inside] == GUARD_BYTE).all()), "a write landed outside the cache"
    # The judge: rows no token writes keep their bytes bit for bit, written rows are the reference's (within half
    # a quantization step); and written rows decode to finite values (no NaN scale read from the garbage).
    _judge(case.op, reference_inputs, outputs, case.dtype)
    slots = inputs["slot_mapping"]
    written = view.reshape(-1, fmt.row_bytes)[slots[slots >= 0]]
    assert bool(torch.isfinite(decode_rows(written, fmt)).all()), "a written row holds a NaN it could only have read"


def check_quantized_reader(case: FuzzCase, backend: str, row_pad: int = 4) -> None:
    cache_arg = READERS[case.op]
    fmt = FORMATS[case.inputs["kv_cache_dtype"]]
    inputs = _clone(case.inputs)
    cache = inputs[cache_arg]
    read = _read_slots(case.op, inputs, cache)
    rows = cache.view(-1, fmt.row_bytes)
    rows[~read] = garbage_rows(int((~read).sum()), fmt, case.params["seed"])
    _, view, _ = guarded(cache, 0xFF, row_pad)  # all-ones bytes: NaN scales, NaN e4m3 codes
    outputs = _run(case.op, {**inputs, cache_arg: view}, backend)
    _assert_no_nan(outputs)
    _judge(case.op, inputs, outputs, case.dtype)
    assert torch.equal(view, cache), f"{cache_arg}: a reader wrote its cache"


@pytest.mark.parametrize("op", [*WRITERS, *READERS])
def test_quantized_caches_only_change_where_written_and_unread_garbage_never_leaks(op: str) -> None:
    backends = fuzz_backends()
    if not backends:
        pytest.skip("no fuzz backend is available here")
    check = check_quantized_writer if op in WRITERS else check_quantized_reader

    @settings(max_examples=examples(QUANTIZED_CANARY_CONFIGS_PER_OP))
    @given(case=quantized_cache_cases(op, nonfinite_tiles=False), row_pad=st.sampled_from([1, 4]))
    def holds(case: FuzzCase, row_pad: int) -> None:
        for backend in backends:
            check(case, backend, row_pad)
            FUZZ_COUNTS[("canaries", f"{op} {case.inputs['kv_cache_dtype']}", backend)] += 1

    holds()


@pytest.fixture
def broken_backend():
    """A backend whose cache ops break the canaries' rules: a writer that also writes an unmapped slot, a reader
    whose output depends on every slot (every value decoded, for a quantized cache). The canary checks must fail on
    it (they can fail)."""
    torch_ops = registry().ops("torch")

    def stray_writer(*args, **kwargs):
        out = torch_ops["mla_prolog"](*args, **kwargs)
        kv_cache, slots = args[9], args[10]
        unmapped = sorted(set(range(kv_cache.shape[0] * kv_cache.shape[1])) - set(slots.tolist()))
        kv_cache[unmapped[0] // kv_cache.shape[1], unmapped[0] % kv_cache.shape[1]] = 0.0
        return out

    def leaky_reader(*args, **kwargs):
        out, lse = torch_ops["sparse_flash_attention"](*args, **kwargs)
        cache = args[1] if "kv_cache_dtype" not in kwargs else decode_rows(args[1], FORMATS[kwargs["kv_cache_dtype"]])
        return out + 0.0 * cache.sum(), lse

    ops = {"mla_prolog": stray_writer, "sparse_flash_attention": leaky_reader}
    registry().register(
        Backend(
            "canary-broken",
            "broken on purpose",
            lambda: Availability(True, "test", ("cpu",)),
            lambda: ops,
            kv_cache_dtypes=tuple(FORMATS),
        )
    )
    yield "canary-broken"
    registry().unregister("canary-broken")


def test_the_canaries_catch_stray_writes_and_leaky_reads(broken_backend: str) -> None:
    gen = torch.Generator().manual_seed(0)
    writer = C.mla_prolog_inputs(C.MINI, [C.SeqSpec(2, 5)], 4, spare_blocks=2)(gen, torch.float32)
    with pytest.raises(AssertionError, match="a slot outside slot_mapping"):
        check_writer(FuzzCase("mla_prolog", writer, torch.float32), broken_backend)
    reader = C.sparse_attention_inputs(C.MINI, [C.SeqSpec(2, 9)], 4, topk=3)(gen, torch.float32)
    with pytest.raises(AssertionError, match="NaN from an unread slot"):
        check_reader(FuzzCase("sparse_flash_attention", reader, torch.float32), broken_backend)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_ds_mla", "int8_mla"])
def test_the_quantized_canaries_catch_stray_writes_and_leaky_reads(broken_backend: str, kv_cache_dtype: str) -> None:
    gen = torch.Generator().manual_seed(0)
    params = {"seed": 1}
    build = quantized_build(C.mla_prolog_inputs(C.MINI, [C.SeqSpec(2, 5)], 4, spare_blocks=2), kv_cache_dtype)
    writer = FuzzCase("mla_prolog", build(gen, torch.float32), torch.float32, params=params)
    with pytest.raises(AssertionError, match="rows that no token writes were changed"):
        check_quantized_writer(writer, broken_backend)
    build = quantized_build(C.sparse_attention_inputs(C.MINI, [C.SeqSpec(2, 9)], 4, topk=3), kv_cache_dtype)
    reader = FuzzCase("sparse_flash_attention", build(gen, torch.float32), torch.float32, params=params)
    with pytest.raises(AssertionError, match="NaN from an unread slot"):
        check_quantized_reader(reader, broken_backend)
