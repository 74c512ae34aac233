"""What each rank runs in the expert-parallel tests (test_expert_parallel.py). Not a test module: the functions are
started on N local gloo ranks by glm5_hal.launch.run_ranks, which imports them by name in each rank's process.

Every function takes (rank, world_size, *args) and returns something small and picklable.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.distributed as dist

import glm5_hal
from glm5_hal.parity.distributed import gather_results, run_distributed_parity


def _install_fake(wheel: str | None) -> object:
    if wheel is None:
        return None
    from fakes.ascend.fixture import install_in_process

    return install_in_process(Path(wheel))


def parity(rank: int, world: int, backends: list[str], quick: bool, seed: int, wheel: str | None = None) -> tuple:
    """Every EP case and model case on `backends` -> (merged results, the fake's kernel calls on this rank)."""
    fake = _install_fake(wheel)
    results = gather_results(run_distributed_parity(backends, torch.device("cpu"), quick=quick, seed=seed))
    return results, dict(fake.calls) if fake is not None else {}


def _inputs(rank: int, world: int, tokens: int = 4, hidden: int = 8, experts: int | None = None, k: int = 2):
    gen = torch.Generator().manual_seed(100 + rank)
    num_experts = experts or 2 * world
    x = torch.randn(tokens, hidden, generator=gen)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:k] for _ in range(tokens)]).to(torch.int32)
    return x, ids, torch.rand(tokens, k, generator=gen), num_experts


def _outcome(call) -> tuple[str, str]:
    try:
        call()
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return "", ""


def _round_trip_works(rank: int, world: int) -> bool:
    """A correct dispatch + combine right after an error: every rank is still in step with the others."""
    x, ids, w, e = _inputs(rank, world)
    sent = glm5_hal.ep_dispatch(x, ids, e)
    out = glm5_hal.ep_combine(sent.recv_x, w, sent.handle)
    return bool(torch.allclose(out, x * w.sum(1, keepdim=True), rtol=1e-5, atol=1e-6))


def bad_arguments(rank: int, world: int) -> dict[str, tuple[str, str, bool]]:
    """Each bad-argument scenario on every rank -> {scenario: (exception type, message, round trip works after)}.
    In most scenarios only rank 1 is wrong; every rank must raise, and the group must stay usable."""
    x, ids, w, e = _inputs(rank, world)
    bad = rank == 1
    sent = glm5_hal.ep_dispatch(x, ids, e)
    second = glm5_hal.ep_dispatch(x, ids, e)
    scenarios = {
        "ids out of range on one rank": lambda: glm5_hal.ep_dispatch(x, ids + (e if bad else 0), e),
        "num_experts not a multiple of the group size": lambda: glm5_hal.ep_dispatch(x, ids, e + 1),
        "num_experts differs between ranks": lambda: glm5_hal.ep_dispatch(x, ids, 2 * e if bad else e),
        "x of an integer dtype on one rank": lambda: glm5_hal.ep_dispatch(x.long() if bad else x, ids, e),
        "hidden size differs between ranks": lambda: glm5_hal.ep_dispatch(x[:, :4] if bad else x, ids, e),
        "topk_ids wrong shape on one rank": lambda: glm5_hal.ep_dispatch(x, ids[:, :1].t() if bad else ids, e),
        "quantize not a bool on one rank": lambda: glm5_hal.ep_dispatch(x, ids, e, quantize=1 if bad else False),
        "y rows not the handle's on one rank": lambda: glm5_hal.ep_combine(
            sent.recv_x[1:] if bad else sent.recv_x, w, sent.handle
        ),
        "topk_weights wrong shape on one rank": lambda: glm5_hal.ep_combine(
            sent.recv_x, w[:, :1] if bad else w, sent.handle
        ),
        "handle of another dispatch on one rank": lambda: glm5_hal.ep_combine(
            (second if bad else sent).recv_x, w, (second if bad else sent).handle
        ),
        "y width differs between ranks": lambda: glm5_hal.ep_combine(
            sent.recv_x[:, :4] if bad else sent.recv_x, w, sent.handle
        ),
    }
    found = {}
    for name, call in scenarios.items():
        kind, message = _outcome(call)
        found[name] = (kind, message, _round_trip_works(rank, world))
    glm5_hal.ep_combine(second.recv_x, w, second.handle)  # the pending second dispatch, on every rank
    return found


class ExpertFailure(RuntimeError):
    """Raised by one rank between dispatch and combine in the failure tests."""


def rank_fails_midway(rank: int, world: int, stay_alive_s: float) -> str:
    """All ranks dispatch; rank 1's experts raise. With stay_alive_s > 0 rank 1 then waits that long (alive, never
    combining) before re-raising, so the others can only learn of it from the collective timeout; with 0 it raises
    at once and its process exits."""
    x, ids, w, e = _inputs(rank, world)
    sent = glm5_hal.ep_dispatch(x, ids, e)
    if rank == 1:
        if stay_alive_s:
            time.sleep(stay_alive_s)
        raise ExpertFailure("expert computation failed on rank 1")
    start = time.monotonic()
    try:
        glm5_hal.ep_combine(sent.recv_x, w, sent.handle)
    except Exception as exc:
        raise RuntimeError(f"combine failed after {time.monotonic() - start:.1f} s: {type(exc).__name__}") from exc
    return "combined"


def sleeper(rank: int, world: int, failing_rank: int | None, sleep_s: float) -> int:
    """For the launcher's own tests: `failing_rank` raises at once, the others sleep."""
    if rank == failing_rank:
        raise ExpertFailure(f"rank {rank} fails at once")
    time.sleep(sleep_s)
    return rank


def quantized_transport(rank: int, world: int, seed: int) -> dict[str, float]:
    """Gaussian rows through the int8 transport: the codes and scales against the torch backend's dynamic_quant of
    the source rows, the per-element error against scale / 2, and the MoE output's SQNR against the unquantized
    transport's (same experts)."""
    from backends.torch_eager.quant import dynamic_quant

    gen = torch.Generator().manual_seed(seed)
    tokens, hidden, inter, k, num_experts = [12, 7, 0, 9][:world] + [5] * max(0, world - 4), 256, 64, 4, 4 * world
    xs = [3.0 * torch.randn(t, hidden, generator=gen) for t in tokens]
    ids = [
        torch.stack([torch.randperm(num_experts, generator=gen)[:k] for _ in range(t)]) if t else None for t in tokens
    ]
    ids = [i.to(torch.int32) if i is not None else torch.zeros(0, k, dtype=torch.int32) for i in ids]
    weights = [torch.rand(t, k, generator=gen) for t in tokens]
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) * hidden**-0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) * inter**-0.5
    local = (w13.chunk(world)[rank], w2.chunk(world)[rank])

    def moe(quantize: bool):
        sent = glm5_hal.ep_dispatch(xs[rank], ids[rank], num_experts, quantize=quantize)
        rows = sent.recv_x if not quantize else sent.recv_x.float() * sent.recv_scale[:, None]
        counts = sent.expert_offsets.diff().to(torch.int64)
        local_ids = torch.repeat_interleave(torch.arange(counts.numel()), counts)[:, None].to(torch.int32)
        y = glm5_hal.fused_moe(rows, torch.ones(rows.shape[0], 1), local_ids, *local)
        return sent, glm5_hal.ep_combine(y, weights[rank], sent.handle)

    plain_sent, plain = moe(False)
    sent, quantized = moe(True)
    source_rows = plain_sent.recv_x  # the unquantized transport's rows: the source rows, in the same order
    expected_codes, expected_scales = dynamic_quant(source_rows)
    dequantized = sent.recv_x.float() * sent.recv_scale[:, None]
    bound = (dequantized - source_rows).abs() / (sent.recv_scale[:, None] / 2)
    noise = (quantized - plain).double().pow(2).sum()
    signal = plain.double().pow(2).sum()
    return {
        "codes_equal": float(torch.equal(sent.recv_x, expected_codes)),
        "scales_equal": float(torch.equal(sent.recv_scale, expected_scales)),
        "worst_error_over_half_scale": float(bound.max()) if bound.numel() else 0.0,
        "sqnr_db": float(10 * torch.log10(signal / noise)) if noise > 0 else float("inf"),
    }


def model_from_checkpoint(rank: int, world: int, path: str, seed: int) -> dict[str, object]:
    """ExpertParallelCausalLM from a safetensors checkpoint: which tensors this rank read, and its logits of a
    prompt against the single-process model's. Then a generation-style step (logits="last", record=False) on
    rank 0 with the other ranks idle: rank 0's last-token logits against the same reference, and what every rank
    kept."""
    from glm5_hal.model import CausalLM
    from glm5_hal.model.parallel import ExpertParallelCausalLM, SafetensorsWeights, rank_parameter_names

    cfg = glm5_hal.GLM5_MINI.with_overrides(n_routed_experts=4 * world)
    weights = SafetensorsWeights(path)
    model = ExpertParallelCausalLM(cfg, weights)
    read = sorted(weights.read)
    prompt = torch.randint(0, cfg.vocab_size, (6 + rank,), generator=torch.Generator().manual_seed(seed + rank))
    got = model.prefill(prompt).logits
    want = CausalLM(cfg, {name: weights[name] for name in weights}).prefill(prompt).logits
    tokens = {"req": prompt} if rank == 0 else {}
    last = model.step(model.new_cache(prompt.numel()), tokens, logits="last", record=False)
    return {
        "last_rows": last.logits.shape[0],
        "last_max_abs_diff": float((last.logits - want[-1:]).abs().max()) if rank == 0 else 0.0,
        "last_kept": len(last.layer_outputs) + len(last.choices),
        "read": read,
        "expected": sorted(rank_parameter_names(cfg, rank, world)),
        "experts_held": model.model.layers[1].mlp.experts.num_experts,
        "max_abs_diff": float((got - want).abs().max()),
        "scale": float(want.abs().max()),
    }


def fake_mc2_rejects(rank: int, world: int, wheel: str) -> dict[str, str]:
    """Calls the torch_npu documentation forbids, made on every rank: the strict fake must refuse each (the names of
    the rules it cites come back)."""
    fake = _install_fake(wheel)
    from backends.ascend.expert_parallel import _comm_name, _mc2_group

    group = _mc2_group(dist.group.WORLD)
    name = _comm_name(group, torch.device("cpu"))
    x, ids, w, e = _inputs(rank, world, hidden=1024)
    sizes = {"ep_world_size": world, "ep_rank_id": rank, "moe_expert_num": e}
    dispatch = fake.npu_moe_distribute_dispatch_v2
    found = {
        "fp32 tokens": _outcome(lambda: dispatch(x, ids, name, **sizes, shared_expert_num=0))[1],
        "repeated expert": _outcome(
            lambda: dispatch(x.bfloat16(), ids[:, [0, 0]].contiguous(), name, **sizes, shared_expert_num=0)
        )[1],
        "H below 1024": _outcome(lambda: dispatch(x[:, :512].bfloat16(), ids, name, **sizes, shared_expert_num=0))[1],
    }
    outs = dispatch(x.bfloat16(), ids, name, **sizes, shared_expert_num=0, global_bs=x.shape[0] * world)
    tampered = outs[2].clone()
    tampered[0] += 1
    combine = fake.npu_moe_distribute_combine_v2
    found["assist_info changed"] = _outcome(
        lambda: combine(
            outs[0],
            ids,
            tampered,
            outs[4],
            w,
            name,
            **sizes,
            tp_send_counts=outs[5],
            shared_expert_num=0,
            global_bs=x.shape[0] * world,
        )
    )[1]
    return found
