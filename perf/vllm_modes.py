"""Decode speed of vLLM + the glm5-hal plugin in two vLLM modes, or against vLLM's dense MLA, timed at the same time.

    .venv-vllm/bin/python -m perf.vllm_modes --context 4096 --windows 10 --rounds 2
    .venv-vllm/bin/python -m perf.vllm_modes --context 16384 --modes compiled,dense --windows 8 --rounds 2
    .venv-vllm/bin/python -m perf.vllm_modes --context 16384 --modes compiled,dense --heads 16 --index-heads 16
    .venv-vllm/bin/python -m perf.vllm_modes --context 32768 --modes compiled,dense --windows 8 --alternate
    .venv-vllm/bin/python -m perf.vllm_modes --context 32768 --modes compiled,compiled --trees .,../other \
        --windows 10 --rounds 3 --alternate        # two source trees of the plugin, the same mode

Why at the same time: on a shared machine the same engine's decode speed moves by a third between minutes, so two
modes timed one after the other cannot be told apart at a 20% difference. Here two engines (one per mode, each in its
own process, one torch thread, pinned to its own core) prefill the same prompt, wait for each other, then each
decodes --windows requests of NEW_TOKENS tokens (prefix caching on: a window is the decode, not the prefill). Both
see the same machine at the same time; each round swaps the cores. Needs at least two CPUs.

At once, the two engines also share the L3 and the memory bus, and dense streams its whole latent cache every step,
which slows the plugin's scattered reads (at 32K on a Zen 4 the plugin decoded ~120 tok/s beside dense and ~165 alone,
docs/vllm.md). With --alternate they take turns instead, one window each while the other waits (`take_turns`): each
engine decodes alone, as a sequential bench times it, and the two still sample the same minutes of the machine.

Modes (`MODES`): `compiled` is the plugin's default for the DSA models it serves on a CPU (vLLM's compiled CPU mode,
Dynamo traced once, Inductor); `breakable` is vLLM's own default for these architectures
(VLLM_USE_BREAKABLE_CUDAGRAPH=1: breakable CUDA graphs, no torch.compile on a CPU); `eager` is --enforce-eager;
`dense` is perf/vllm_bench.py's `vllm dense` way (the same weights relabelled deepseek_v3, vLLM's own MLA over every
key, its default mode, the prompt prefilled in chunks and cached as the plugin's is: `prefill_dense_in_chunks`), so
`compiled,dense` is that bench's plugin / dense ratio with both sides on the machine at once; `4k-pages` is
`compiled` with GLM5_HAL_VLLM_HUGE_PAGES=0 (the KV caches on vLLM's own pages); `bmm-up-proj` is `compiled` with
GLM5_HAL_VLLM_PACKED_UP_PROJ=0 (the absorbed up-projections through torch.bmm, not vLLM's packed bmm_cpu).
Checkpoints and dims as perf/vllm_bench.py (glm5-mini dims, index_topk 2048, bf16); --heads / --index-heads change the
attention and indexer head counts of both checkpoints (the dense per-key work grows with the first, the indexer's
with the second).

--trees A,B runs the first engine on the glm5-hal source tree A and the second on B (each worker's working directory
and the head of its PYTHONPATH: the tree's glm5_hal, backends, ops_reference and quantization; this repository's
perf/ either way, so a tree from before --trees works), so that a change is timed against the code before
it in the same minutes: e.g. a `git worktree` of the commit before beside this one, `--modes compiled,compiled`. The
engines are then named `<mode>-A` and `<mode>-B`. Each round prints the glm5_hal each engine imported.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from perf.vllm_bench import (
    BENCH_CONFIG,
    NEW_TOKENS,
    cpu_name,
    decode_windows,
    prefill_dense_in_chunks,
    write_checkpoints,
)

MODES: dict[str, tuple[dict[str, str], dict[str, object], str]] = {
    # name: (environment, LLM settings, checkpoint: vllm_bench.write_checkpoints' key)
    "compiled": ({}, {}, "dsa"),
    "breakable": ({"VLLM_USE_BREAKABLE_CUDAGRAPH": "1"}, {}, "dsa"),
    "eager": ({}, {"enforce_eager": True}, "dsa"),
    "dense": ({}, {}, "dense"),
    "4k-pages": ({"GLM5_HAL_VLLM_HUGE_PAGES": "0"}, {}, "dsa"),  # compiled, the KV caches left on vLLM's pages
    "bmm-up-proj": ({"GLM5_HAL_VLLM_PACKED_UP_PROJ": "0"}, {}, "dsa"),  # compiled, the up-projections on torch.bmm
}
BARRIER_TIMEOUT_S = 1800  # the other engine's start and prefill


def _worker(
    label: str, mode: str, model: str, context: int, windows: int, barrier: Path, order: list[str]
) -> list[float]:
    """Decode rates of `windows` requests of one engine (mode, named `label`: the mode, or the mode and its tree),
    after both engines prefilled; order: the two labels in turn order when they alternate (take_turns), empty when
    they decode at once."""
    if MODES[mode][2] == "dense":
        prefill_dense_in_chunks()  # and prefix caching on: its windows decode, as the plugin's do
    window = decode_windows(model, context, **MODES[mode][1])
    (barrier / f"{READY}{label}").touch()
    deadline = time.monotonic() + BARRIER_TIMEOUT_S
    while sum(1 for entry in barrier.iterdir() if entry.name.startswith(READY)) < 2:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{label}: the other engine was not ready within {BARRIER_TIMEOUT_S} s")
        time.sleep(0.2)

    if not order:
        return [window() for _ in range(windows)]
    return take_turns(label, order, barrier, window, windows)


TURN_FILE = "turn"
REPOSITORY = Path(__file__).resolve().parents[1]
# A --trees worker: started in its tree, it imports the tree's packages first (their submodules then load from the
# tree too), then runs this repository's perf.vllm_modes as the worker (argv[1]: this repository; the rest: --worker's).
TREE_PACKAGES = ("glm5_hal", "backends", "ops_reference", "quantization")
TREE_WORKER = f"""
import importlib, runpy, sys
for package in {TREE_PACKAGES!r}:
    importlib.import_module(package)
sys.path.insert(0, sys.argv[1])
sys.argv = ["perf.vllm_modes", *sys.argv[2:]]
runpy.run_module("perf.vllm_modes", run_name="__main__", alter_sys=True)
"""
READY = "ready."  # barrier files: READY + the engine's label, once it has prefilled


def take_turns(
    mode: str, order: list[str], folder: Path, window: Callable[[], float], windows: int, poll_s: float = 0.01
) -> list[float]:
    """`windows` calls of `window`, each made while the other engine waits: mode waits until folder/TURN_FILE names
    it (order[0] goes first; the file is written whole by a rename), runs one window, then hands the turn to the
    other mode. Returns the windows' results."""
    other = order[1] if mode == order[0] else order[0]
    turn = folder / TURN_FILE
    rates = []
    for _ in range(windows):
        deadline = time.monotonic() + BARRIER_TIMEOUT_S
        while (turn.read_text() if turn.exists() else order[0]) != mode:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{mode}: {other} did not hand over the turn within {BARRIER_TIMEOUT_S} s")
            time.sleep(poll_s)
        rates.append(window())
        handover = folder / f"{TURN_FILE}.{mode}"
        handover.write_text(other)
        handover.replace(turn)
    return rates


def _round(
    modes: list[str],
    cores: list[int],
    models: dict[str, Path],
    context: int,
    windows: int,
    alternate: bool,
    trees: list[Path] | None = None,
) -> dict[str, list[float]]:
    """One round: the two modes' engines, mode i on core cores[i] (and on source tree trees[i] where given),
    decoding at once or (alternate) in turns. Returns each engine's rates by its label (`engine_labels`)."""
    labels = engine_labels(modes, trees)
    with tempfile.TemporaryDirectory() as barrier:
        workers = {}
        for i, (label, mode, core) in enumerate(zip(labels, modes, cores, strict=True)):
            env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "4"}
            env.update({"OMP_NUM_THREADS": "1", **MODES[mode][0]})
            cwd = None
            if trees is not None:  # that tree's packages first (TREE_WORKER)
                cwd = str(trees[i])
                env["PYTHONPATH"] = os.pathsep.join(filter(None, [cwd, env.get("PYTHONPATH", "")]))
            model = models[MODES[mode][2]]
            # With trees: the tree's packages, then this repository's perf/ (a tree's own may predate --trees).
            runner = ["-m", "perf.vllm_modes"] if trees is None else ["-c", TREE_WORKER, str(REPOSITORY)]
            command = [sys.executable, *runner, "--worker", label, mode, str(model)]
            command += [str(context), str(windows), barrier, str(core), ",".join(labels) if alternate else "-"]
            workers[label] = subprocess.Popen(
                command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        rates = {}
        for label, worker in workers.items():
            out, err = worker.communicate(timeout=2 * BARRIER_TIMEOUT_S)
            if worker.returncode != 0:
                for other in workers.values():
                    other.kill()
                raise RuntimeError(f"{label}: exit {worker.returncode}\n{err[-3000:]}")
            result = json.loads(out.strip().splitlines()[-1])
            rates[label] = result["rates"]
            if trees is not None:
                print(f"  {label}: glm5_hal from {result['glm5_hal']}", flush=True)
        return rates


def engine_labels(modes: list[str], trees: list[Path] | None) -> list[str]:
    """The two engines' names: their modes, or with --trees `<mode>-A` and `<mode>-B` (the modes may then be equal)."""
    return list(modes) if trees is None else [f"{mode}-{tree}" for mode, tree in zip(modes, "AB", strict=True)]


def parse_trees(value: str) -> list[Path]:
    """--trees: two glm5-hal source trees (directories holding the packages TREE_WORKER imports), comma-separated."""
    trees = [Path(part.strip()).resolve() for part in value.split(",")]
    if len(trees) != 2:
        raise argparse.ArgumentTypeError(f"expected two source trees, comma-separated, got {value!r}")
    for tree in trees:
        missing = [package for package in TREE_PACKAGES if not (tree / package / "__init__.py").is_file()]
        if missing:
            raise argparse.ArgumentTypeError(f"{tree}: expected a glm5-hal source tree, without {missing}")
    return trees


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=4096, help="prompt length")
    parser.add_argument("--modes", default="compiled,breakable", help=f"two of {tuple(MODES)}, comma-separated")
    parser.add_argument("--windows", type=int, default=10, help="timed requests per engine and round")
    parser.add_argument("--rounds", type=int, default=2, help="rounds, the cores swapped each time")
    parser.add_argument("--heads", type=int, default=BENCH_CONFIG.num_attention_heads, help="attention heads")
    parser.add_argument("--index-heads", type=int, default=BENCH_CONFIG.index_n_heads, help="indexer heads")
    parser.add_argument(
        "--alternate",
        action="store_true",
        help="the engines take turns, one window each while the other waits (each decodes alone, in the same minutes)",
    )
    parser.add_argument(
        "--trees",
        type=parse_trees,
        help="two glm5-hal source trees A,B: the first engine runs A's code, the second B's (module docstring)",
    )
    parser.add_argument("--worker", nargs=8, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        label, mode, model, context, windows, barrier, core, order = args.worker
        os.sched_setaffinity(0, {int(core)})
        turns = [] if order == "-" else order.split(",")
        rates = _worker(label, mode, model, int(context), int(windows), Path(barrier), turns)
        import glm5_hal

        print(json.dumps({"rates": rates, "glm5_hal": str(Path(glm5_hal.__file__).parent)}))
        return
    modes = [m.strip() for m in args.modes.split(",")]
    same_allowed = args.trees is not None  # two trees: the same mode on both is the point
    if len(modes) != 2 or not set(modes) <= set(MODES) or (modes[0] == modes[1] and not same_allowed):
        parser.error(f"--modes: expected two names from {tuple(MODES)} (different unless --trees), got {args.modes!r}")
    if args.heads < 1 or args.index_heads < 1:
        parser.error(f"--heads / --index-heads: expected positive counts, got {args.heads} / {args.index_heads}")
    cores = sorted(os.sched_getaffinity(0))[:2]
    if len(cores) < 2:
        parser.error("needs two CPUs: the engines run at the same time, one core each")
    config = BENCH_CONFIG.with_overrides(
        name=f"{BENCH_CONFIG.name}-{args.heads}h-{args.index_heads}ih",
        num_attention_heads=args.heads,
        index_n_heads=args.index_heads,
    )
    timing = "in turns, one engine decoding at a time" if args.alternate else "both engines decoding at once"
    print(
        f"{cpu_name()}; {config.name}; context {args.context}, {args.windows} windows of {NEW_TOKENS - 1} decode "
        f"steps, {timing}",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as tmp:
        models = write_checkpoints(Path(tmp), config)
        labels = engine_labels(modes, args.trees)
        for r in range(args.rounds):
            placed = cores if r % 2 == 0 else cores[::-1]
            rates = _round(modes, placed, models, args.context, args.windows, args.alternate, args.trees)
            medians = {m: statistics.median(rates[m]) for m in labels}
            where = ", ".join(f"{m} on CPU {c}" for m, c in zip(labels, placed, strict=True))
            print(
                f"round {r + 1} ({where}): "
                + ", ".join(f"{m} median {medians[m]:.1f} tok/s" for m in labels)
                + f"; {labels[0]} / {labels[1]} = {medians[labels[0]] / medians[labels[1]]:.2f}x",
                flush=True,
            )
            print("  " + json.dumps({m: [round(x, 1) for x in rates[m]] for m in labels}), flush=True)


if __name__ == "__main__":
    main()
