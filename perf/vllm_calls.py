"""Where a layer's decode time goes inside vLLM: the plugin's calls at every level, down to the native kernels.

    OMP_NUM_THREADS=1 taskset -c 1 .venv-vllm/bin/python -m perf.vllm_calls --context 32768 --windows 16

One engine (vLLM + the plugin, in process, one torch thread) on perf/vllm_bench.py's DSA checkpoint decodes
--windows requests of NEW_TOKENS tokens over a cached prompt of --context tokens, with a `perf_counter` around each
level of a layer's call chain (`POINTS`): the plugin's `select_keys` and `forward_mqa`, the public ops, their dispatch
to the backend, the backend's pieces, the native wrappers and the kernels' own Python entries (which call C). Per
window, each level's calls are averaged over their fastest 90%; the table gives the median over the windows, in
microseconds per call (one call per layer and step; the step RoPE tables are made at a step's first layer and
reused by the others). What a level takes beyond the levels under it is Python: argument checks, dispatch, routing,
the plugin's glue.

Why inside the engine: between two calls a decode step's kernels and weights evict the interpreter's code and data
from the CPU's caches, so the same calls cost about twice what perf/decode_calls.py measures in a loop. The timers
add ~1 us a level. Name the CPU with the numbers (printed first); run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

# (label, module, attribute): the function timed, in the table's order (each block from the plugin down to the
# kernels). A class attribute is "Class.method". A function listed under several labels ("dispatch <op>") is wrapped
# once and its calls are told apart by their first argument, the op's name.
POINTS: tuple[tuple[str, str, str], ...] = (
    ("indexer: plugin select_keys", "", ""),  # the span below (SELECT_KEYS)
    ("indexer: plugin prolog", "glm5_hal.model.attention", "Indexer.fused_prolog"),
    ("indexer_prolog op", "glm5_hal.model.attention", "indexer_prolog"),
    ("dispatch indexer_prolog", "glm5_hal.ops.indexer", "dispatch"),
    ("native prolog wrapper", "backends.torch_eager.native.indexer_prolog", "prolog"),
    ("prolog kernels", "backends.torch_eager.native.indexer_prolog", "_run"),
    ("lightning_indexer op", "glm5_hal.vllm.indexer", "lightning_indexer"),
    ("dispatch lightning_indexer", "glm5_hal.ops.indexer", "dispatch"),
    ("scoring batch", "backends.torch_eager.indexer", "_ScoringBatch.__init__"),
    ("row logits", "backends.torch_eager.indexer", "_ScoringBatch.row_logits"),
    ("scorer kernel", "backends.torch_eager.native.quantized_index_scores", "_run_paged"),
    ("top-k", "backends.torch_eager.indexer", "topk_positions"),
    ("top-k kernel", "backends.torch_eager.native.topk", "_run"),
    ("step RoPE tables", "glm5_hal.vllm.indexer", "_step_rope"),
    ("attention: plugin forward_mqa", "glm5_hal.vllm.sparse_mla", "Glm5HalSparseMLAImpl.forward_mqa"),
    ("sparse_flash_attention op", "glm5_hal.vllm.sparse_mla", "sparse_flash_attention"),
    ("dispatch sparse_flash_attention", "glm5_hal.ops.sparse_attention", "dispatch"),
    ("native attention wrapper", "backends.torch_eager.native.sparse_attention", "paged_attention"),
    ("attention kernel", "backends.torch_eager.native.sparse_attention", "_paged_attention"),
    ("cache write: plugin", "glm5_hal.vllm.sparse_mla", "Glm5HalSparseMLAImpl.do_kv_cache_update"),
    ("write_rows", "glm5_hal.vllm.sparse_mla", "write_rows"),
)
# The whole select_keys body (the plugin's indexer call): from its first line (get_forward_context) to the end of
# lightning_indexer, timed apart (it runs inside a custom op whose body the compiled graph holds).
SELECT_KEYS = POINTS[0][0]


def resolve(module: str, attribute: str) -> tuple[object, str, Callable]:
    """(the object holding the function, its name there, the function) of a POINTS entry; a clear error where the
    code no longer has it."""
    owner: object = importlib.import_module(module)
    *path, name = attribute.split(".")
    for part in path:
        owner = getattr(owner, part)
    function = getattr(owner, name, None)
    if not callable(function):
        raise AttributeError(f"perf.vllm_calls: {module}.{attribute} is not a function: update POINTS")
    return owner, name, function


def instrument(times: dict[str, list[float]]) -> None:
    """Wrap every POINTS function (once each) and select_keys' span with a timer appending seconds to times[label]."""
    wrapped = set()
    for label, module, attribute in POINTS:
        if not module or (module, attribute) in wrapped:
            continue
        wrapped.add((module, attribute))
        owner, name, function = resolve(module, attribute)
        per_op = name == "dispatch"

        def timed(*args, _f=function, _label=label, _per_op=per_op, **kwargs):
            start = time.perf_counter()
            result = _f(*args, **kwargs)
            times[f"dispatch {args[0]}" if _per_op else _label].append(time.perf_counter() - start)
            return result

        setattr(owner, name, timed)
    indexer = importlib.import_module("glm5_hal.vllm.indexer")
    started = [0.0]
    context, select = indexer.get_forward_context, indexer.lightning_indexer  # the latter already timed above

    def context_then_clock():
        started[0] = time.perf_counter()
        return context()

    def select_then_clock(*args, **kwargs):
        result = select(*args, **kwargs)
        times[SELECT_KEYS].append(time.perf_counter() - started[0])
        return result

    indexer.get_forward_context, indexer.lightning_indexer = context_then_clock, select_then_clock


def window_means(times: dict[str, list[float]]) -> dict[str, float]:
    """Per key: the mean of the fastest 90% of the window's calls, in microseconds."""
    means = {}
    for key, values in times.items():
        fastest = sorted(values)[: max(1, len(values) * 9 // 10)]
        means[key] = 1e6 * statistics.fmean(fastest)
    return means


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=32768, help="prompt length")
    parser.add_argument("--windows", type=int, default=16, help="timed requests")
    parser.add_argument("--json", type=Path, help="write the medians here")
    args = parser.parse_args(argv)
    if args.context < 1 or args.windows < 1:
        parser.error(f"--context / --windows: expected positive counts, got {args.context} / {args.windows}")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # one process: the timers are in it
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    times: dict[str, list[float]] = defaultdict(list)
    instrument(times)

    from perf.vllm_bench import NEW_TOKENS, cpu_name, decode_windows, write_checkpoints

    print(f"{cpu_name()}; context {args.context}, {args.windows} windows of {NEW_TOKENS - 1} decode steps", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        window = decode_windows(write_checkpoints(Path(tmp))["dsa"], args.context)
        per_window: dict[str, list[float]] = defaultdict(list)
        for _ in range(args.windows):
            times.clear()
            per_window["tok/s"].append(window())
            for key, value in window_means(times).items():
                per_window[key].append(value)
    medians = {key: statistics.median(values) for key, values in per_window.items()}
    print(f"decode {medians.pop('tok/s'):.1f} tok/s (median of the windows); microseconds per call (a layer, a step)")
    print("| level | us |")
    print("|---|---|")
    for label, _, _ in POINTS:
        if label in medians:
            print(f"| {label} | {medians[label]:.1f} |")
    if args.json:
        args.json.write_text(json.dumps({"cpu": cpu_name(), "context": args.context, "us": medians}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
