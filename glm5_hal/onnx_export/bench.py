"""onnxruntime vs the `torch` backend on the CPU, op by op, side by side in one run, at decode shapes.

    python -m glm5_hal.onnx_export.bench                                   both scenarios, every op
    python -m glm5_hal.onnx_export.bench --scenarios glm5-decode --ops fused_moe --markdown table.md

Each op gets the same inputs (built by the parity case builders at the scenario's shapes) on both sides: the
torch backend through the public op (`glm5_hal.<op>` with GLM5_HAL_CHECK_VALUES=0, as in production), and
onnxruntime through a session of the op's graph exported at those dims (`export_like`), with the same number
of intra-op threads (`--threads`, default 1: on a machine shared with other jobs, OpenMP's thread barrier makes
every multi-threaded torch GEMM wait for a descheduled peer, ~30 ms for a 4 x 256 x 128 GEMM on 2 busy cores,
which would measure the scheduler, not the op). Latency is the median wall time of repeated calls after warm-up
(p10-p90 spread shown); both sides are synchronous on the CPU. perf/ had no timing utilities when this was
written; this module's own median-of-N timing is deliberately small so it can switch to them.

Scenarios: 4 sequences decoding one token each over contexts of 3072, 2048, 1024 and 512 keys (block size 64),
topk = the preset's index_topk. The GLM-5 MoE GEMMs use 8 of the 256 experts, all routed to (the fp32 weights
of 256 experts are 38 GB; per token the work is the same 8 expert GEMVs either way).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

import glm5_hal
from glm5_hal.config import GLM5, GLM5_MINI, ModelConfig
from glm5_hal.parity import cases as builders
from glm5_hal.parity.inputs import SeqSpec
from glm5_hal.registry import OP_NAMES
from glm5_hal.selection import use_backend

DECODE = [SeqSpec(1, 3072), SeqSpec(1, 2048), SeqSpec(1, 1024), SeqSpec(1, 512)]
BLOCK_SIZE = 64
BENCH_EXPERTS = 8  # experts materialised for the GLM-5 MoE GEMMs (see the module docstring)


@dataclass(frozen=True)
class Scenario:
    name: str
    cfg: ModelConfig
    seqs: list[SeqSpec]

    @property
    def tokens(self) -> int:
        return sum(s.q_len for s in self.seqs)


SCENARIOS = {s.name: s for s in (Scenario("mini-decode", GLM5_MINI, DECODE), Scenario("glm5-decode", GLM5, DECODE))}


def op_inputs(op: str, sc: Scenario, gen: torch.Generator) -> dict:
    """Inputs of `op` at the scenario's shapes, from the parity case builders (fp32)."""
    cfg, seqs, tokens = sc.cfg, sc.seqs, sc.tokens
    k, hidden, inter = cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size
    experts = min(cfg.n_routed_experts, BENCH_EXPERTS) if cfg.hidden_size >= 4096 else cfg.n_routed_experts
    rows = tokens * k
    make: dict[str, Callable[[], Callable]] = {
        "mla_prolog": lambda: builders.mla_prolog_inputs(cfg, seqs, BLOCK_SIZE),
        "indexer_prolog": lambda: builders.indexer_prolog_inputs(cfg, seqs, BLOCK_SIZE),
        "indexer_logits": lambda: builders.indexer_inputs(cfg, seqs, BLOCK_SIZE),
        "lightning_indexer": lambda: builders.indexer_inputs(cfg, seqs, BLOCK_SIZE, topk=cfg.index_topk),
        "sparse_flash_attention": lambda: builders.sparse_attention_inputs(cfg, seqs, BLOCK_SIZE, topk=cfg.index_topk),
        "moe_gate": lambda: builders.moe_gate_inputs(cfg, tokens),
        "moe_dispatch": lambda: builders.moe_dispatch_inputs(tokens, hidden, k, cfg.n_routed_experts),
        "grouped_matmul": lambda: builders.grouped_matmul_inputs(
            [rows // experts + (e < rows % experts) for e in range(experts)], 2 * inter, hidden
        ),
        "moe_combine": lambda: builders.moe_combine_inputs(tokens, k, hidden),
        "fused_moe": lambda: builders.fused_moe_inputs(tokens, hidden, inter, min(k, experts), experts),
        "dynamic_quant": lambda: builders.dynamic_quant_inputs((tokens, hidden)),
        "quant_matmul": lambda: builders.quant_matmul_inputs(tokens, cfg.q_lora_rank, hidden),
        "w4a8_matmul": lambda: builders.w4a8_matmul_inputs(tokens, 2 * inter, hidden, 128),
        "hadamard_transform": lambda: builders.hadamard_inputs((tokens, hidden)),
    }
    inputs = make[op]()(gen, torch.float32)
    if "out_dtype" in inputs:
        inputs["out_dtype"] = torch.float32  # the graphs are fp32; compare like with like
    return inputs


def median_time(fn: Callable[[], object], *, repeats: int, budget_s: float) -> tuple[float, float, float]:
    """(median, p10, p90) seconds of fn() over up to `repeats` calls after two warm-up calls; stops early (after
    at least 5 calls) once `budget_s` is spent."""
    fn()
    fn()
    samples: list[float] = []
    start = time.perf_counter()
    while len(samples) < repeats and (len(samples) < 5 or time.perf_counter() - start < budget_s):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    samples.sort()
    pick = lambda q: samples[min(len(samples) - 1, int(q * len(samples)))]
    return statistics.median(samples), pick(0.1), pick(0.9)


@dataclass(frozen=True)
class Row:
    scenario: str
    op: str
    torch_s: tuple[float, float, float]
    onnx_s: tuple[float, float, float]

    @property
    def speedup(self) -> float:
        """torch time / onnxruntime time (> 1: onnxruntime is faster)."""
        return self.torch_s[0] / self.onnx_s[0]


def bench_op(op: str, sc: Scenario, *, repeats: int, budget_s: float, threads: int, seed: int = 0) -> Row:
    from glm5_hal.onnx_export.export import export_like
    from glm5_hal.onnx_export.runtime import feeds, session

    inputs = op_inputs(op, sc, torch.Generator().manual_seed(seed))
    with use_backend("torch", strict=True):
        torch_s = median_time(lambda: getattr(glm5_hal, op)(**inputs), repeats=repeats, budget_s=budget_s)
    sess = session(export_like(op, inputs, cfg=sc.cfg), threads=threads)
    fed = feeds(sess, inputs)
    onnx_s = median_time(lambda: sess.run(None, fed), repeats=repeats, budget_s=budget_s)
    return Row(sc.name, op, torch_s, onnx_s)


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next((line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")), cpu)
    except OSError:
        pass
    import onnxruntime

    return (
        f"{cpu}, {os.cpu_count()} logical CPUs, {torch.get_num_threads()} intra-op thread(s) on each side; "
        f"torch {torch.__version__}, onnxruntime {onnxruntime.__version__}, Python {platform.python_version()}"
    )


def _ms(t: tuple[float, float, float]) -> str:
    return f"{t[0] * 1e3:.3f} ({t[1] * 1e3:.3f}-{t[2] * 1e3:.3f})"


def format_table(rows: Sequence[Row]) -> str:
    """Markdown: median ms (p10-p90) per side, and which side is faster by how much."""
    lines = [
        "| scenario | op | torch ms | onnxruntime ms | faster |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        faster = f"onnxruntime x{r.speedup:.2f}" if r.speedup >= 1 else f"torch x{1 / r.speedup:.2f}"
        lines.append(f"| {r.scenario} | {r.op} | {_ms(r.torch_s)} | {_ms(r.onnx_s)} | {faster} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m glm5_hal.onnx_export.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma-separated: {', '.join(SCENARIOS)}")
    parser.add_argument("--ops", default=",".join(OP_NAMES), help="comma-separated ops (default: all)")
    parser.add_argument("--repeats", type=int, default=25, help="timed calls per op and side (default 25)")
    parser.add_argument("--budget", type=float, default=2.0, help="seconds per op and side before stopping early")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads for torch and onnxruntime (1)")
    parser.add_argument("--markdown", metavar="FILE", help="also write the table (and the machine) as Markdown")
    args = parser.parse_args(argv)
    scenarios = [SCENARIOS[s.strip()] for s in args.scenarios.split(",") if s.strip()]
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    unknown = sorted(set(ops) - set(OP_NAMES))
    if unknown:
        parser.error(f"--ops: unknown {unknown}; known: {list(OP_NAMES)}")
    os.environ["GLM5_HAL_CHECK_VALUES"] = "0"  # production setting: no value checks that read the inputs
    torch.set_num_threads(args.threads)
    rows = []
    for sc in scenarios:
        for op in ops:
            rows.append(bench_op(op, sc, repeats=args.repeats, budget_s=args.budget, threads=args.threads))
            print(format_table(rows[-1:]).splitlines()[-1], flush=True)
    table = format_table(rows)
    print(f"\n{machine()}\n\n{table}")
    if args.markdown:
        with open(args.markdown, "w") as fh:
            fh.write(f"{machine()}\n\n{table}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
