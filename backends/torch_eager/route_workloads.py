"""What the probe times to choose a route per op family (capabilities.FAMILIES): each family's own products, at
GLM-5 widths, run by this backend's ops on each candidate route (gemm.forced_route).

    weights    a projection [rows, 2048] @ [2048, 2048]^T (8 MiB of bf16) at capabilities.DECODE_ROWS and
               PREFILL_ROWS rows, the last-level cache overwritten before each timed call: a real weight comes from
               memory (8 MiB fits the 32 MiB L3 of the project's EPYCs: on a Zen 4 the native kernel's 4-row
               product ran 2.3-3.2x faster warm than from memory, fp32's 1.2x)
    attention  sparse_flash_attention: 4 tokens over 2048 selected keys of 576 (d_v 512), bf16 cache, at
               capabilities.FEW_HEADS and ALL_HEADS heads
    attention_from_memory  (capabilities.ATTENTION_FROM_MEMORY: the native kernel's row prefetch) the same at one
               decode token over 2048 of 32768 keys (a 36 MiB cache), the last-level cache overwritten before each
               timed call: its selected rows come from memory, scattered as at a long context (4 tokens would share
               rows the first brought in; over 8192 keys a quarter of the rows is selected, close enough together
               that the hardware's own prefetch hid the difference between hints on a Zen 5)
    indexer    indexer_logits: 4 tokens x 32 heads of 128 over 4096 keys, bf16 cache
    quantized_indexer  the same over the keys as fp8_index rows (as vLLM stores them)
    quantized_indexer_from_memory  (capabilities.QUANTIZED_INDEXER_FROM_MEMORY: the native scorer's row prefetch) one
               decode token at capabilities.FEW_HEADS heads over 32768 fp8_index keys in shuffled blocks (4.3 MB of
               rows), the last-level cache overwritten before each timed call

GLM-5's own head counts: a kernel's speed depends on them (a native attention kernel that won at 16 heads lost 2.4x
at 64 on an AVX2 Zen 3, where torch's GEMM makes better use of 64 rows), so attention is timed at a tensor-parallel
share of them and at all of them, and a call takes the route for its own head count; four tokens are a batched decode
step.
Attention's and the indexer's per-token work is the same at prefill, so one shape decides for both. Each call takes
milliseconds to tens of them: the whole probe stays within its budget (docs/perf.md). The routes are timed
alternately, best of `reps` each (other processes only ever add time; the from-memory workloads: the median, see
time_routes).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable

import torch

from backends.torch_eager import capabilities as caps
from backends.torch_eager.gemm import forced_route, from_route, gemm_for
from backends.torch_eager.indexer import indexer_logits
from backends.torch_eager.sparse_attention import sparse_flash_attention
from glm5_hal.cpu_flags import cache_flush_bytes
from glm5_hal.kv_formats import AUTO, FORMATS, encode_rows
from glm5_hal.parity.inputs import SeqSpec, paged_batch, randn, random_topk_indices

WIDTH = 2048  # the weight family's K and N
ATTENTION_SHAPE = {"tokens": 4, "keys": 4096, "topk": 2048, "width": 576, "d_v": 512}
INDEXER_SHAPE = {"tokens": 4, "heads": 32, "keys": 4096, "head_dim": 128}
BLOCK_SIZE = 64


def _weights(
    device: torch.device, dtype: torch.dtype, rows: int, gen: torch.Generator, output: bool = False
) -> Callable[[], object]:
    x = randn((rows, WIDTH), gen, dtype=dtype).to(device)
    w = randn((WIDTH, WIDTH), gen, dtype=dtype).to(device)
    return lambda: gemm_for(dtype, device).linear(x, w, output=output)


def _attention(
    device: torch.device, dtype: torch.dtype, gen: torch.Generator, heads: int, **changes: int
) -> Callable[[], object]:
    shape = ATTENTION_SHAPE | changes
    batch = paged_batch([SeqSpec(shape["tokens"], shape["keys"])], BLOCK_SIZE, gen, shuffle_blocks=True)
    q = randn((shape["tokens"], heads, shape["width"]), gen, dtype=dtype)
    cache = randn((batch.num_blocks, BLOCK_SIZE, shape["width"]), gen, dtype=dtype)
    indices = random_topk_indices(batch, shape["topk"], gen)
    args = [t.to(device) for t in (q, cache, indices, batch.block_table, batch.seq_lens_k, batch.cu_seqlens_q)]
    return lambda: sparse_flash_attention(*args, 0.07, shape["d_v"])


def _indexer(
    device: torch.device,
    dtype: torch.dtype,
    gen: torch.Generator,
    kv_cache_dtype: str,
    shuffle_blocks: bool = False,
    **changes: int,
) -> Callable[[], object]:
    shape = INDEXER_SHAPE | changes
    batch = paged_batch([SeqSpec(shape["tokens"], shape["keys"])], BLOCK_SIZE, gen, shuffle_blocks=shuffle_blocks)
    q = randn((shape["tokens"], shape["heads"], shape["head_dim"]), gen, dtype=dtype)
    weights = torch.rand(shape["tokens"], shape["heads"], generator=gen)
    cache = randn((batch.num_blocks, BLOCK_SIZE, shape["head_dim"]), gen, dtype=dtype)
    if kv_cache_dtype != AUTO:  # the same keys as the format's rows
        cache = encode_rows(cache.flatten(0, 1), FORMATS[kv_cache_dtype]).view(batch.num_blocks, BLOCK_SIZE, -1)
    args = [t.to(device) for t in (q, weights, cache, batch.block_table, batch.seq_lens_k, batch.cu_seqlens_q)]
    return lambda: indexer_logits(*args, kv_cache_dtype=kv_cache_dtype)


def workload(family: str, device: torch.device, dtype: torch.dtype, count: int) -> Callable[[], object]:
    """One call of `family`'s products on whatever route gemm_for gives (forced_route picks it); count: the weight
    products' rows, or the heads of sparse attention (capabilities.MEASURED_COUNTS) and of the from-memory workloads
    (capabilities.PREFETCH_COUNTS); the other families ignore it."""
    gen = torch.Generator().manual_seed(0)
    if family == caps.WEIGHTS:
        return _weights(device, dtype, count, gen)
    if family == caps.ATTENTION:
        return _attention(device, dtype, gen, count)
    if family == caps.ATTENTION_FROM_MEMORY:
        return _attention(device, dtype, gen, count, tokens=1, keys=32768)
    if family == caps.INDEXER:
        return _indexer(device, dtype, gen, AUTO)
    if family == caps.QUANTIZED_INDEXER:
        return _indexer(device, dtype, gen, "fp8_index")
    if family == caps.QUANTIZED_INDEXER_FROM_MEMORY:
        # A long context's blocks lie anywhere in the cache, as in an engine.
        return _indexer(device, dtype, gen, "fp8_index", shuffle_blocks=True, tokens=1, heads=count, keys=32768)
    raise ValueError(f"family: expected one of {(*caps.FAMILIES, *caps.FROM_MEMORY.values())}, got {family!r}")


def time_routes(
    device: torch.device, dtype: torch.dtype, family: str, routes: tuple[caps.Route, ...], rows: int, reps: int
) -> dict[str, float]:
    """The best of `reps` alternating calls of `family`'s workload on each route (seconds, by Route.label); for the
    weight family also the half route's product as an op's output (by capabilities.output_label). The from-memory
    workloads, which tell apart hints a few tens of percent apart, take the median instead: a call whose rows the
    flush happened to leave in cache is faster than any real one, and the best of 5 took such a call once on a Zen 5
    (the quantized indexer into L2 at 0.41 ms, its other calls 0.55-0.65 ms, the other hints' 0.47-0.58 ms)."""
    call = workload(family, device, dtype, rows)
    gemms = {route.label: from_route(dtype, route) for route in routes}
    calls = dict.fromkeys(gemms, call)
    if family == caps.WEIGHTS:  # and an op's output on the half route: one pass of torch's GEMM, no residual
        output_call = _weights(device, dtype, rows, torch.Generator().manual_seed(0), output=True)
        for route in routes:
            if route.name == caps.HALF:
                gemms[caps.output_label(route)] = gemms[route.label]
                calls[caps.output_label(route)] = output_call
    # The weight family's products read their weight from memory in a model, as the from-memory workloads' rows (the
    # other families' workloads are calls of the ops over their own inputs, as in a decode step, and keep what those
    # calls leave in the caches).
    from_memory = family == caps.WEIGHTS or family in caps.FROM_MEMORY.values()
    flush = torch.empty(cache_flush_bytes() // 4) if from_memory and device.type == "cpu" else None
    forced_family = next((f for f, workload in caps.FROM_MEMORY.items() if workload == family), family)

    def timed(name: str) -> float:
        with forced_route(forced_family, gemms[name]):
            if flush is not None:
                flush.add_(1.0)
            caps._synchronize(device)
            start = time.perf_counter()
            calls[name]()
            caps._synchronize(device)
            return time.perf_counter() - start

    for name in gemms:  # warm-up: first-call set-up (kernel builds, page faults) is not speed
        timed(name)
    samples: dict[str, list[float]] = {name: [] for name in gemms}
    for rep in range(reps):
        # Among the routes: the half route's output product (one pass, a smaller task) must not cut the others short.
        fastest = min(min(samples[route.label], default=math.inf) for route in routes)
        for name in gemms:
            # A route already twice as slow as the fastest cannot win: one timed call is its answer (on a CPU
            # without bf16 units the residual route is ~15x slower, and timing it fully would dominate the probe).
            if rep == 0 or min(samples[name]) <= 2 * fastest:
                samples[name].append(timed(name))
    pick = statistics.median if family in caps.FROM_MEMORY.values() else min
    return {name: pick(times) for name, times in samples.items()}


caps.set_route_timer(time_routes)
