"""Decode speed of vLLM + the glm5-hal plugin against vLLM's own dense MLA and against glm5-hal's CausalLM.generate.

    .venv-vllm/bin/python -m perf.vllm_bench --contexts 4096,16384,32768 --json docs/perf/vllm_cpu.json \
        --markdown docs/perf/vllm_cpu.md

Run it in the vLLM environment (docs/vllm.md). One random checkpoint with glm5-mini's dimensions and GLM-5's
index_topk 2048 (so DSA reads 2048 of the context's keys, as GLM-5 does), in bf16 (vLLM's CPU MLA packs weights for
AMX where the CPU has it and refuses fp32 there). Per context length, one prompt of that many random tokens, then
NEW_TOKENS greedy tokens; decode tokens per second = (generated - 1) / (time of the last token - time of the
first), so the prompt's prefill is not in it. Three ways, each in a fresh process, each after a warm-up request
(native kernels built, first-call costs paid):

- `vllm+glm5-hal`: vLLM serving the DSA checkpoint through the plugin;
- `vllm dense`: the same weights without the indexer, labelled `deepseek_v3`: vLLM's own CPU MLA over every key
  (its prompt prefilled in chunks: `prefill_dense_in_chunks`);
- `glm5-hal generate`: CausalLM.generate (index keys as fp8_index rows, as vLLM stores them).

Medians over --repeats requests per way and context, one torch thread each (OMP_NUM_THREADS=1). The machine's CPU
goes into the results; run it on a quiet machine (other processes make OpenMP's spinning workers many times
slower).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from glm5_hal.config import GLM5_MINI, ModelConfig

NEW_TOKENS = 33  # 32 decode steps after the first token
BENCH_CONFIG: ModelConfig = GLM5_MINI.with_overrides(name="glm5-mini-topk2048", index_topk=2048)
WAYS = ("vllm+glm5-hal", "vllm dense", "glm5-hal generate")


def cpu_name() -> str:
    """The CPU's model name and the vector extensions that matter here (lscpu's view)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or "unknown CPU"
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    units = [f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8") if f in flags]
    return f"{model}, {os.cpu_count()} CPUs, {' '.join(units) or 'no AVX2'}"


def write_checkpoints(root: Path, config: ModelConfig = BENCH_CONFIG) -> dict[str, Path]:
    """The DSA checkpoint of `config` (random bf16 weights) and its dense relabelling (no indexer tensors, model_type
    deepseek_v3), in root / "dsa" and root / "dense"."""
    import safetensors.torch
    import torch

    from glm5_hal.model import config_to_hf, random_state_dict

    state = random_state_dict(config, seed=0, dtype=torch.bfloat16)
    hf = config_to_hf(config)
    hf["max_position_embeddings"] = 65536
    paths = {"dsa": root / "dsa", "dense": root / "dense"}
    for path in paths.values():
        path.mkdir(parents=True)
    safetensors.torch.save_file(state, str(paths["dsa"] / "model.safetensors"))
    (paths["dsa"] / "config.json").write_text(json.dumps(hf))
    dense_state = {k: v for k, v in state.items() if ".indexer." not in k}
    safetensors.torch.save_file(dense_state, str(paths["dense"] / "model.safetensors"))
    dense = {k: v for k, v in hf.items() if not k.startswith("index") and k != "indexer_rope_interleave"}
    dense.update(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"])
    (paths["dense"] / "config.json").write_text(json.dumps(dense))
    return paths


def prefill_dense_in_chunks() -> None:
    """Keep chunked prefill and prefix caching on for the dense model in this process (call before building its LLM).

    Why: without AMX, vLLM's CPU platform turns both off for every MLA model, and its CPU MLA prefill (CPU_SDPA_MLA)
    then computes a prompt's attention whole, with [heads, S, S] fp32 scores: 16 GiB at 32K (and as much again for
    the softmax), which a 24 GiB machine cannot hold. With the settings kept, vLLM prefills the prompt in chunks over
    the cached context through the same backend's context-chunk path. Only the prefill changes: the decode steps this
    bench times run vLLM's dense MLA unchanged. Checked on the bench checkpoint (3000-token prompt, 17 greedy
    tokens): chunks of 1024 and a whole prefill give the same tokens, and a second request hits the prefix cache
    (2992 tokens) and gives them again.
    """
    from vllm.platforms import cpu

    from glm5_hal.vllm.plugin import _restore_scheduling, _scheduling

    platform_update = cpu.CpuPlatform.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config) -> None:
        kept = _scheduling(vllm_config)
        platform_update(cls, vllm_config)
        _restore_scheduling(vllm_config, kept)

    cpu.CpuPlatform.check_and_update_config = classmethod(check_and_update_config)


def prompt(length: int, seed: int) -> list[int]:
    import torch

    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, BENCH_CONFIG.vocab_size, (length,), generator=generator).tolist()


def decode_rate(output: Any) -> float:
    """Decode tokens per second of one finished request (a vLLM RequestOutput): (generated - 1) / (time of the last
    token - time of the first), so the prompt's prefill is not in it."""
    stats = output.metrics
    return (len(output.outputs[0].token_ids) - 1) / (stats.last_token_ts - stats.first_token_ts)


def decode_windows(model: str | Path, context: int, **llm_settings: Any) -> Callable[[], float]:
    """An engine over `model` (bf16, prefix caching on) with one prompt of `context` random tokens prefilled and
    cached, and the function that decodes one window over it: NEW_TOKENS greedy tokens after the cached prompt,
    returning decode_rate. llm_settings: further vllm.LLM arguments (a mode's). The benches that time windows of one
    engine (perf/vllm_modes.py, perf/vllm_calls.py, perf/vllm_ablation.py) start theirs here."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=str(model),
        dtype="bfloat16",
        skip_tokenizer_init=True,
        max_model_len=context + NEW_TOKENS + 16,
        enable_prefix_caching=True,  # every window after the first request decodes over the cached prompt
        disable_log_stats=False,  # the per-request token timestamps
        **llm_settings,
    )
    request = [TokensPrompt(prompt_token_ids=prompt(context, seed=1))]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, detokenize=False)
    llm.generate(request, params)  # prefill, and every first-call cost
    return lambda: decode_rate(llm.generate(request, params)[0])


def _vllm_worker(model: str, context: int, repeats: int) -> list[float]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    if json.loads((Path(model) / "config.json").read_text())["model_type"] == "deepseek_v3":
        prefill_dense_in_chunks()
    llm = LLM(
        model=model,
        dtype="bfloat16",
        skip_tokenizer_init=True,
        max_model_len=context + NEW_TOKENS + 16,
        enable_prefix_caching=False,  # each request pays its own prefill, and none is in the decode timing
        disable_log_stats=False,  # the per-request token timestamps
    )
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, detokenize=False)
    llm.generate([TokensPrompt(prompt_token_ids=prompt(64, seed=0))], params)  # warm-up
    rates = []
    for r in range(repeats):
        rates.append(decode_rate(llm.generate([TokensPrompt(prompt_token_ids=prompt(context, seed=1 + r))], params)[0]))
    return rates


def _generate_worker(model: str, context: int, repeats: int) -> list[float]:
    import torch

    from glm5_hal.model import CausalLM

    torch.set_num_threads(1)
    hal = CausalLM.from_pretrained(model, dtype=torch.bfloat16)
    hal.generate([prompt(64, seed=0)], NEW_TOKENS, index_cache_dtype="fp8_index")  # warm-up
    rates = []
    for r in range(repeats):
        stats = hal.generate([prompt(context, seed=1 + r)], NEW_TOKENS, index_cache_dtype="fp8_index").stats
        rates.append(stats.decode_tokens_per_s)
    return rates


def run_way(way: str, paths: dict[str, Path], context: int, repeats: int, timeout_s: float) -> list[float]:
    """Decode tokens/s of one way at one context, in a fresh process (its own engine, caches and threads)."""
    model = paths["dense" if way == "vllm dense" else "dsa"]
    worker = "generate" if way == "glm5-hal generate" else "vllm"
    # One thread for every way: vLLM's CPU worker serves with one torch thread on this machine's 2 cores anyway, and
    # OpenMP workers spinning against each other (or anything else running) distort the small decode GEMMs.
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "4", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "perf.vllm_bench", "--worker", worker, str(model), str(context), str(repeats)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"{way} at {context}: exit {done.returncode}\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def markdown(results: dict) -> str:
    lines = [
        f"vLLM {results['vllm']}, torch {results['torch']}, {results['cpu']}; {results['model']}, bf16, one prompt, "
        f"{NEW_TOKENS - 1} decode tokens, median of {results['repeats']} requests ({results['date']})",
        "",
        "| context | vllm+glm5-hal tok/s | vllm dense tok/s | glm5-hal generate tok/s | plugin / dense | "
        "plugin / generate |",
        "|---|---|---|---|---|---|",
    ]
    for row in results["rows"]:
        plugin, dense, own = (row[w] for w in WAYS)
        cells = [
            f"{v:.2f}" if v is not None else f"failed ({row[f'{w} error']})" for w, v in zip(WAYS, (plugin, dense, own))
        ]
        ratios = [f"{plugin / v:.2f}x" if plugin is not None and v is not None else "-" for v in (dense, own)]
        lines.append(f"| {row['context']} | {' | '.join(cells)} | {' | '.join(ratios)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", default="4096,16384,32768", help="prompt lengths, comma-separated")
    parser.add_argument("--repeats", type=int, default=2, help="timed requests per way and context (median)")
    parser.add_argument("--ways", default=",".join(WAYS), help=f"a subset of {WAYS}")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per way and context")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--markdown", type=Path, help="write the table here")
    parser.add_argument("--worker", nargs=4, metavar=("KIND", "MODEL", "CONTEXT", "REPEATS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        kind, model, context, repeats = args.worker
        worker = _generate_worker if kind == "generate" else _vllm_worker
        print(json.dumps(worker(model, int(context), int(repeats))))
        return
    import torch
    import vllm

    ways = [w.strip() for w in args.ways.split(",")]
    unknown = sorted(set(ways) - set(WAYS))
    if unknown:
        parser.error(f"--ways: expected names from {WAYS}, got {unknown}")
    results = {
        "cpu": cpu_name(),
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "model": f"{BENCH_CONFIG.name} (glm5-mini dims, index_topk {BENCH_CONFIG.index_topk})",
        "repeats": args.repeats,
        "date": time.strftime("%Y-%m-%d"),
        "rows": [],
    }
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_checkpoints(Path(tmp))
        for context in (int(c) for c in args.contexts.split(",")):
            row: dict = {"context": context}
            for way in ways:
                try:
                    rates = run_way(way, paths, context, args.repeats, args.timeout)
                except (RuntimeError, subprocess.TimeoutExpired) as exc:  # one way failing keeps the others' rows
                    row[way], row[f"{way} error"] = None, str(exc).splitlines()[0]
                    print(f"{context:>6} {way:<18} failed: {row[f'{way} error']}", flush=True)
                    continue
                row[way] = statistics.median(rates)
                row[f"{way} all"] = rates
                print(f"{context:>6} {way:<18} {row[way]:8.2f} tok/s  {rates}", flush=True)
            results["rows"].append(row)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    if args.markdown and all(w in ways for w in WAYS):
        args.markdown.write_text(markdown(results))
    print(markdown(results) if all(w in ways for w in WAYS) else json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
