"""`glm5-hal parity --distributed`: the expert-parallel ops and the N-rank model on every rank torchrun started.

    torchrun --nproc-per-node 8 -m glm5_hal.cli parity --distributed                 # the GPUs / NPUs of one machine
    torchrun --nproc-per-node 2 -m glm5_hal.cli parity --distributed --backends torch   # two CPU ranks over gloo

Each rank runs on its backend's device (glm5_hal.parity.parity_device; an accelerator rank uses device LOCAL_RANK)
in a process group over every device backend torch has here (gloo for the CPU, NCCL for CUDA, HCCL for Ascend).
Rank 0 prints the op x backend table, one row per (op, backend) over all ranks; every rank exits 1 on a failure.
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from glm5_hal.parity.runner import ENV_SEED, format_table, parity_device, session_seed, summarise, write_report
from glm5_hal.registry import registry

TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
DISTRIBUTED_OPS = ("ep_dispatch", "ep_combine", "ep_model")


def ep_backends() -> list[str]:
    """Available backends with their own expert-parallel exchange (those delegating it to torch would repeat it)."""
    reg = registry()
    found = []
    for name in reg.names():
        backend = reg.get(name)
        if backend is None or not reg.availability(name).available:
            continue
        if "ep_dispatch" in reg.ops(name) and "ep_dispatch" not in backend.delegates:
            found.append(name)
    return found


def _device(backend: str, local_rank: int) -> torch.device:
    device_type = parity_device(backend)
    if device_type == "cpu":
        return torch.device("cpu")
    module = getattr(torch, device_type, None)
    if module is not None and hasattr(module, "set_device"):
        module.set_device(local_rank)
    return torch.device(device_type, local_rank)


def run(args: argparse.Namespace, backends: list[str] | None, ops: list[str] | None) -> int:
    missing = [name for name in TORCHRUN_ENV if name not in os.environ]
    if missing:
        print(
            f"--distributed: {', '.join(missing)} not set; start the ranks with "
            "`torchrun --nproc-per-node N -m glm5_hal.cli parity --distributed`",
            file=sys.stderr,
        )
        return 2
    reg = registry()
    backends = backends or ep_backends()
    unknown = [b for b in backends if b not in reg.names()]
    if unknown:
        print(f"--backends: unknown {unknown}; known: {reg.names()}", file=sys.stderr)
        return 2
    for name in backends:
        if not reg.availability(name).available:
            print(f"backend {name}: unavailable ({reg.availability(name).reason})", file=sys.stderr)
            return 2
    bad_ops = sorted(set(ops or ()) - set(DISTRIBUTED_OPS))
    if bad_ops:
        print(f"--ops: unknown {bad_ops} for --distributed; known: {list(DISTRIBUTED_OPS)}", file=sys.stderr)
        return 2
    local_rank = int(os.environ["LOCAL_RANK"])
    devices = {backend: _device(backend, local_rank) for backend in backends}
    dist.init_process_group(timeout=timedelta(seconds=args.timeout))
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        seed = [session_seed() if args.seed is None else args.seed]
        dist.broadcast_object_list(seed, src=0)  # one seed for every rank: they build each other's inputs
        os.environ[ENV_SEED] = str(seed[0])
        from glm5_hal.parity.distributed import gather_results, run_distributed_parity

        wanted = set(ops or DISTRIBUTED_OPS)
        if rank == 0:
            where = ", ".join(f"{b} on {d.type}" for b, d in devices.items())
            print(f"parity --distributed: {world} ranks, {where}; seed {seed[0]}", flush=True)
        results = run_distributed_parity(
            backends, lambda backend: devices[backend], quick=args.quick, seed=seed[0], model="ep_model" in wanted
        )
        merged = [r for r in gather_results(results) if r.op in wanted]
        failures = [r for r in merged if r.status in ("fail", "error")]
        if rank == 0:
            print(format_table(summarise(merged)))
            for r in failures:
                print(f"FAILED {r.backend} {r.op}/{r.case} {r.dtype}: {r.detail}")
            write_report(merged, json_path=args.json, markdown_path=args.markdown)
            if failures:
                print(f"{len(failures)} of {len(merged)} checks failed (rerun with --seed {seed[0]})")
        dist.barrier()  # nobody tears the group down while a peer still talks (gloo aborts then)
        return 1 if failures else 0
    finally:
        dist.destroy_process_group()
