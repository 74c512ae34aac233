"""The expert-parallel scenarios of `glm5-hal bench`: ep_dispatch / ep_combine latency and bytes moved per rank.

    glm5-hal bench --scenarios ep-decode,ep-prefill --ep-ranks 2                        # local CPU ranks over gloo
    torchrun --nproc-per-node 8 -m glm5_hal.cli bench --scenarios ep-decode --device cuda --backends torch  # NCCL

GLM-5's MoE dims (hidden 6144, 256 routed experts, top-8), each token's 8 experts drawn uniformly without repeats
(a trained router's bias keeps the load roughly even; a real trace is skewed, which moves more rows to the busiest
rank). Token counts per rank: ep-decode 128 (DeepEP's published low-latency point), ep-prefill 4096 (its normal
point); ep-quick is glm5-mini for the tests. Every scenario runs bf16 (or --dtype) rows, and again with the int8
transport (quantize=True, "-int8").

Per repetition every rank enters a barrier, then the timed call, then waits for its device; the repetition's time is
the slowest rank's (a collective ends for everyone when the last rank is done), and the row reports the median and
10th / 90th percentiles over repetitions. ep_combine is timed on the rows its (untimed) dispatch delivered (identity
experts). Bytes: the payload each rank sends to and receives from the OTHER ranks in that call, from its agreed
split sizes times the row's size on the wire (2D for bf16, D + 4 for the int8 transport; a copy that stays on its
rank moves nothing), the mean and the maximum over ranks; the small agreement exchanges (header and per-expert
counts) are reported apart.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

import glm5_hal
from glm5_hal.config import GLM5, GLM5_MINI, ModelConfig
from glm5_hal.ops.expert_parallel import COMBINE_HEADER, DISPATCH_HEADER
from glm5_hal.selection import use_backend
from glm5_hal.text_table import render_table
from perf.load import LoadMonitor
from perf.timing import synchronize


@dataclass(frozen=True)
class EPScenario:
    name: str
    cfg: ModelConfig
    tokens_per_rank: int


EP_SCENARIOS: dict[str, list[EPScenario]] = {
    "ep-decode": [EPScenario("glm5/ep-decode-128tok", GLM5, 128)],
    "ep-prefill": [EPScenario("glm5/ep-prefill-4096tok", GLM5, 4096)],
    "ep-quick": [EPScenario("mini/ep-16tok", GLM5_MINI, 16)],
}


@dataclass(frozen=True)
class EPRow:
    """One timed (scenario, op, transport) on `ranks` ranks. Times in ms; bytes per rank per call."""

    scenario: str
    op: str
    backend: str
    transport: str  # the dtype of the rows on the wire: "bfloat16", ..., or "int8" (+ 4-byte scale)
    ranks: int
    tokens_per_rank: int
    median_ms: float
    p10_ms: float
    p90_ms: float
    reps: int
    sent_bytes_mean: float  # payload to other ranks, mean over ranks
    sent_bytes_max: float
    received_bytes_mean: float
    received_bytes_max: float
    control_bytes: float  # the agreement exchanges, per rank
    gbps: float  # (sent + received, the busiest rank) / median time


def _inputs(scenario: EPScenario, rank: int, dtype: torch.dtype, device: torch.device, seed: int):
    cfg = scenario.cfg
    gen = torch.Generator().manual_seed(seed * 7919 + rank)
    tokens, k = scenario.tokens_per_rank, cfg.num_experts_per_tok
    x = torch.randn(tokens, cfg.hidden_size, generator=gen).to(dtype)
    scores = torch.rand(tokens, cfg.n_routed_experts, generator=gen)
    ids = scores.topk(k, dim=1).indices.to(torch.int32)  # k distinct experts, uniformly
    weights = torch.rand(tokens, k, generator=gen)
    return x.to(device), ids.to(device), weights.to(device)


def _time(call, device: torch.device, reps: int, warmup: int) -> list[float]:
    """Per repetition, this rank's seconds from a common barrier to its device being done."""
    for _ in range(warmup):
        call()
    synchronize(device)
    times = []
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        call()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return times


def _slowest(times: list[float]) -> list[float]:
    """Per repetition, the slowest rank's time."""
    everyone: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, times)
    return [max(rank_times[i] for rank_times in everyone) for i in range(len(times))]


def _bytes(sent, row_bytes: int) -> tuple[list[float], list[float]]:
    """(payload sent to other ranks, received from other ranks) for every rank, from the agreed plan."""
    plan = sent.handle.plan
    rank = plan.rank
    mine_sent = sum(n for d, n in enumerate(plan.send_splits) if d != rank) * row_bytes
    mine_received = sum(n for s, n in enumerate(plan.recv_splits) if s != rank) * row_bytes
    everyone: list[object] = [None] * plan.world_size
    dist.all_gather_object(everyone, (mine_sent, mine_received))
    return [s for s, _ in everyone], [r for _, r in everyone]


def _row(scenario, op, backend, transport, times, sent, received, control) -> EPRow:
    times = _slowest(times)
    deciles = statistics.quantiles(times, n=10, method="inclusive") if len(times) > 1 else [times[0]] * 9
    median = statistics.median(times)
    busiest = max(s + r for s, r in zip(sent, received))
    return EPRow(
        scenario=scenario.name,
        op=op,
        backend=backend,
        transport=transport,
        ranks=dist.get_world_size(),
        tokens_per_rank=scenario.tokens_per_rank,
        median_ms=median * 1e3,
        p10_ms=deciles[0] * 1e3,
        p90_ms=deciles[-1] * 1e3,
        reps=len(times),
        sent_bytes_mean=statistics.fmean(sent),
        sent_bytes_max=max(sent),
        received_bytes_mean=statistics.fmean(received),
        received_bytes_max=max(received),
        control_bytes=control,
        gbps=busiest / median / 1e9 if median > 0 else 0.0,
    )


def bench_this_rank(
    names: list[str], backend: str, device: torch.device, dtype: torch.dtype, reps: int, warmup: int, seed: int
) -> list[EPRow]:
    """Every EP scenario of `names` on this rank (a collective: every rank of the default group runs it)."""
    world = dist.get_world_size()
    rows: list[EPRow] = []
    for scenario in (s for name in names for s in EP_SCENARIOS[name]):
        cfg = scenario.cfg
        x, ids, weights = _inputs(scenario, dist.get_rank(), dtype, device, seed)
        control = (DISPATCH_HEADER + 1 + cfg.n_routed_experts + 3 + COMBINE_HEADER + 1) * 8 * world
        for quantize in (False, True):
            transport = "int8" if quantize else str(dtype).removeprefix("torch.")
            row_bytes = cfg.hidden_size + 4 if quantize else cfg.hidden_size * x.element_size()
            with use_backend(backend, ops=glm5_hal.EP_OP_NAMES, strict=True):
                dispatch = functools.partial(glm5_hal.ep_dispatch, x, ids, cfg.n_routed_experts, quantize=quantize)
                times = _time(dispatch, device, reps, warmup)
                sent = dispatch()
                to_others, from_others = _bytes(sent, row_bytes)
                rows.append(_row(scenario, "ep_dispatch", backend, transport, times, to_others, from_others, control))
                y = sent.recv_x if sent.recv_scale is None else sent.recv_x.float() * sent.recv_scale[:, None]
                combine = functools.partial(glm5_hal.ep_combine, y.to(dtype), weights, sent.handle)
                times = _time(combine, device, reps, warmup)
                # The way back carries rows in y's dtype, and in the other direction.
                to_others, from_others = _bytes(sent, cfg.hidden_size * x.element_size())
                rows.append(_row(scenario, "ep_combine", backend, transport, times, from_others, to_others, control))
    return rows


def format_rows(rows: list[EPRow], *, markdown: bool = False) -> str:
    head = ["op", "scenario", "transport", "ranks", "median ms", "p10-p90 ms", "sent/rank MB", "recv/rank MB", "GB/s"]
    body = [
        [
            r.op,
            r.scenario,
            r.transport,
            str(r.ranks),
            f"{r.median_ms:.3f}",
            f"{r.p10_ms:.3f}-{r.p90_ms:.3f}",
            f"{r.sent_bytes_mean / 1e6:.2f} (max {r.sent_bytes_max / 1e6:.2f})",
            f"{r.received_bytes_mean / 1e6:.2f} (max {r.received_bytes_max / 1e6:.2f})",
            f"{r.gbps:.2f}",
        ]
        for r in rows
    ]
    return render_table(head, body, markdown=markdown)


def _local_rank(rank: int, world: int, names, backend, device_type, dtype, reps, warmup, seed) -> list[EPRow]:
    """One rank of a `--ep-ranks N` run (started by glm5_hal.launch.run_ranks)."""
    return bench_this_rank(names, backend, torch.device(device_type), dtype, reps, warmup, seed)


def run(args: argparse.Namespace, names: list[str], dtype: torch.dtype) -> int:
    """`glm5-hal bench` with EP scenario sets: under torchrun on its ranks, else on --ep-ranks local gloo ranks."""
    backend = args.backends.split(",")[0].strip()
    monitor = LoadMonitor()
    reps, warmup = (3, 1) if args.quick else (args.reps, args.warmup)
    if "WORLD_SIZE" in os.environ:  # torchrun
        device = torch.device(args.device)
        if device.type != "cpu":
            getattr(torch, device.type).set_device(int(os.environ.get("LOCAL_RANK", 0)))
            device = torch.device(device.type, int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(timeout=timedelta(seconds=600))
        try:
            rows = bench_this_rank(names, backend, device, dtype, reps, warmup, args.seed)
            dist.barrier()
        finally:
            dist.destroy_process_group()
        if int(os.environ.get("RANK", 0)) != 0:
            return 0
    else:
        if args.device != "cpu":
            print("--ep-ranks: local ranks run on the CPU over gloo; use torchrun for accelerators", file=sys.stderr)
            return 2
        from glm5_hal.launch import run_ranks

        common = (names, backend, "cpu", dtype, reps, warmup, args.seed)
        rows = run_ranks(_local_rank, args.ep_ranks, common, timeout_s=3600, collective_timeout_s=600)[0]
    print(format_rows(rows))
    busy = monitor.busy_share()
    print(f"CPU: {_cpu_name()}, {os.cpu_count()} cores shared by the ranks", end="")
    print(f"; the CPU was {100 * busy:.0f}% busy meanwhile (ranks and other processes)" if busy is not None else "")
    if args.json:
        with open(args.json, "w") as f:
            meta = {"backend": backend, "device": args.device, "dtype": str(dtype), "torch": torch.__version__}
            meta |= {"cpu": _cpu_name(), "cpu_busy_share": busy}
            json.dump({**meta, "rows": [asdict(r) for r in rows]}, f, indent=2)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(format_rows(rows, markdown=True) + "\n")
    return 0


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"
