"""How fast vLLM + the glm5-hal plugin would decode if its two context-sized kernels took no time: one engine,
decode windows alternating between the plugin as it is and the plugin with the fp8_index scorer and sparse
attention's kernels replaced by zeros (the top-k, the prologs, vLLM's own work and the plugin's Python still run;
the tokens of those windows mean nothing).

    .venv-vllm/bin/python -m perf.vllm_ablation --context 32768 --windows 6

What it answers: the share of a decode step those kernels are (the rest is the engine's fixed cost per step at
the checkpoint's dims), so whether a speed goal is within the kernels' reach at all. One process, one torch thread,
pinned to the first CPU; checkpoint and dims as perf/vllm_bench.py (glm5-mini dims, index_topk 2048, bf16). A
diagnostic, not the plugin: it swaps two functions of the torch backend's native wrappers while it runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

WAYS = ("as is", "without the scorer and sparse attention")


@contextmanager
def kernels_skipped() -> Iterator[None]:
    """The scorer's and sparse attention's native calls answer zeros (the shapes and dtypes they would write)."""
    import torch

    from backends.torch_eager.native import quantized_index_scores, sparse_attention

    saved = (sparse_attention._run, quantized_index_scores._run_paged)

    def no_attention(kernel, q, rows, keys, topk, scale, d_v, out_dtype, threads):
        return torch.zeros(q.shape[0], q.shape[1], d_v, dtype=out_dtype), torch.zeros(q.shape[0], q.shape[1])

    def no_scores(q, weights, cache, block_table, seq_lens_k, cu_seqlens_q, out, *rest):
        return out.zero_()

    sparse_attention._run, quantized_index_scores._run_paged = no_attention, no_scores
    try:
        yield
    finally:
        sparse_attention._run, quantized_index_scores._run_paged = saved


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=32768, help="prompt length")
    parser.add_argument("--windows", type=int, default=6, help="timed requests per way")
    args = parser.parse_args(argv)
    os.environ.update({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "4", "OMP_NUM_THREADS": "1"})
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    import torch

    from perf.vllm_bench import NEW_TOKENS, cpu_name, decode_windows, write_checkpoints

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        window = decode_windows(write_checkpoints(Path(tmp))["dsa"], args.context)
        rates: dict[str, list[float]] = {way: [] for way in WAYS}
        for _ in range(args.windows):
            rates[WAYS[0]].append(window())
            with kernels_skipped():
                rates[WAYS[1]].append(window())
    print(f"{cpu_name()}; context {args.context}, {args.windows} windows of {NEW_TOKENS - 1} decode steps per way")
    for way, values in rates.items():
        median = statistics.median(values)
        print(f"{way}: median {median:.1f} tok/s ({1e3 / median:.2f} ms a step); {[round(v, 1) for v in values]}")


if __name__ == "__main__":
    main()
