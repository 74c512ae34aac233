"""Expert parallelism (OPS.md section 6): ep_dispatch / ep_combine and the model on N ranks, with gloo on the CPU.

Each multi-rank test starts its ranks with glm5_hal.launch.run_ranks (local processes from a forkserver, a gloo
group whose collectives time out, a wall-time bound per test, the first failing rank failing the test at once); the
functions the ranks run are in ep_ranks.py. The float64 reference of the whole exchange is checked by hand here, and
is what every rank's outputs are judged against (glm5_hal/parity/distributed.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import ep_ranks
import numpy as np
import pytest
import torch

import glm5_hal
import ops_reference as ref
from fakes.ascend.fixture import fake_torch_npu_fixture, torch_npu_schemas_fixture  # noqa: F401 (pytest fixtures)
from glm5_hal.cli.info import op_table
from glm5_hal.launch import RankFailed, RankTimeout, run_ranks
from glm5_hal.ops.ep_plan import EPPlan
from glm5_hal.parity.runner import session_seed

ROOT = Path(__file__).resolve().parents[1]
WALL_S = 150.0  # per multi-rank test: a hang fails the test after this long, never the CI job
COLLECTIVE_S = 30.0  # per collective (the process group's timeout)


def _ranks(fn, world, *args, **kwargs):
    return run_ranks(fn, world, args, timeout_s=WALL_S, collective_timeout_s=COLLECTIVE_S, **kwargs)


# --- the reference, by hand ---------------------------------------------------------------------------------------


def test_reference_exchange_by_hand() -> None:
    """2 ranks, E = 4 (rank 0: experts 0, 1; rank 1: experts 2, 3), k = 2: rows land grouped by local expert, then
    by (source rank, token, slot); combine sends each row back and weights it."""
    xs = [np.array([[1.0], [2.0]]), np.array([[10.0]])]
    ids = [np.array([[3, 0], [0, 2]]), np.array([[0, 3]])]
    outputs, sources = ref.ep_dispatch(xs, ids, 4)
    rows0, scale0, offsets0 = outputs[0]
    assert rows0[:, 0].tolist() == [1.0, 2.0, 10.0] and offsets0.tolist() == [0, 3, 3] and scale0 is None
    assert sources[0] == [(0, 0, 1), (0, 1, 0), (1, 0, 0)]
    rows1, _, offsets1 = outputs[1]
    assert rows1[:, 0].tolist() == [2.0, 1.0, 10.0] and offsets1.tolist() == [0, 1, 3]
    assert sources[1] == [(0, 1, 1), (0, 0, 0), (1, 0, 1)]
    weights = [np.array([[0.5, 0.25], [1.0, 2.0]]), np.array([[3.0, 4.0]])]
    ys = [rows0 * 10, rows1 * 100]  # experts: rank 0 multiplies by 10, rank 1 by 100
    outs = ref.ep_combine(ys, weights, sources)
    assert outs[0][:, 0].tolist() == [0.5 * 100 + 0.25 * 10, 1.0 * 20 + 2.0 * 200]
    assert outs[1][:, 0].tolist() == [3.0 * 100 + 4.0 * 1000]


@pytest.mark.parametrize("world", [1, 2, 4])
def test_reference_round_trip_is_fused_moe(world: int) -> None:
    """The identity of OPS.md section 6 in float64: dispatch, each rank's experts, combine == fused_moe on one
    process, for every rank (ragged T, a rank without tokens)."""
    rng = np.random.default_rng(session_seed())
    num_experts, k, d, inter = 4 * world, 3, 8, 5
    tokens = [5, 0, 3, 7][:world]
    xs = [rng.normal(size=(t, d)) for t in tokens]
    ids = [np.array([rng.permutation(num_experts)[:k] for _ in range(t)], np.int64).reshape(t, k) for t in tokens]
    weights = [rng.random((t, k)) for t in tokens]
    w13, w2 = rng.normal(size=(num_experts, 2 * inter, d)), rng.normal(size=(num_experts, d, inter))
    outputs, sources = ref.ep_dispatch(xs, ids, num_experts)
    ys = []
    for rank, (rows, _, offsets) in enumerate(outputs):
        mine = slice(rank * num_experts // world, (rank + 1) * num_experts // world)
        h = ref.grouped_matmul(rows, w13[mine], offsets)
        ys.append(ref.grouped_matmul(ref.silu(h[:, :inter]) * h[:, inter:], w2[mine], offsets))
    for rank, out in enumerate(ref.ep_combine(ys, weights, sources)):
        want = ref.fused_moe(xs[rank], weights[rank], ids[rank], w13, w2) if tokens[rank] else np.zeros((0, d))
        np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)


def _plan(**changes) -> EPPlan:
    """An EPPlan for GLM-5's MoE on 8 ranks, 64 tokens each (inside MC2's documented range)."""
    fields = dict(
        group=None,
        rank=0,
        world_size=8,
        num_experts=256,
        hidden=6144,
        top_k=8,
        dtype=torch.bfloat16,
        quantize=False,
        tokens=(64,) * 8,
        counts=((64 * 8 // 256,) * 256,) * 8,
        rows_unique=True,
        sequence=0,
    )
    return EPPlan(**{**fields, **changes})


def test_plan_receive_order_by_hand() -> None:
    """Rank 1 of 2, L = 2: source 0 sends (expert 2: 2 rows, expert 3: 1), source 1 sends (1, 2). The receive buffer
    is source-major [s0e2 s0e2 s0e3 | s1e2 s1e3 s1e3]; recv_x is expert-major [s0e2 s0e2 s1e2 | s0e3 s1e3 s1e3]."""
    plan = _plan(rank=1, world_size=2, num_experts=4, hidden=8, top_k=2, tokens=(3, 3))
    plan = _plan(**{**plan.__dict__, "counts": ((1, 2, 2, 1), (2, 0, 1, 2))})
    assert plan.send_splits == [2, 3] and plan.recv_splits == [3, 3] and plan.recv_rows == 6
    assert plan.receive_order(torch.device("cpu")).tolist() == [0, 1, 3, 2, 4, 5]
    assert plan.expert_offsets(torch.device("cpu")).tolist() == [0, 3, 6]


# --- registry, selection, local errors -------------------------------------------------------------------------------


def test_the_pair_is_selectable_per_backend() -> None:
    assert glm5_hal.EP_OP_NAMES == ("ep_dispatch", "ep_combine")
    assert op_table("torch")["ep_dispatch"] == "native" and op_table("reference")["ep_combine"] == "native"
    assert op_table("triton")["ep_dispatch"] == "via torch"  # communication, not a kernel
    assert "ep_dispatch" in glm5_hal.explain("ep_dispatch", "cpu")
    with glm5_hal.use_backend("reference", ops=["ep_dispatch"]):
        assert glm5_hal.resolve("ep_dispatch", "cpu").backend == "reference"


def test_without_a_process_group_the_error_says_what_to_do() -> None:
    with pytest.raises(ValueError, match="group: torch.distributed is not initialized"):
        glm5_hal.ep_dispatch(torch.zeros(2, 4), torch.zeros(2, 1, dtype=torch.int32), 2)
    with pytest.raises(TypeError, match="handle: expected the EPHandle"):
        glm5_hal.ep_combine(torch.zeros(2, 4), torch.zeros(2, 1), handle="not a handle")


# --- parity on 2 and 4 ranks ---------------------------------------------------------------------------------------


def _assert_all_pass(results, record_parity) -> None:
    assert results, "no result came back"
    for result in results:
        record_parity(result)
    failed = [r for r in results if r.status != "pass"]
    assert not failed, "\n".join(f"{r.backend} {r.op}/{r.case} {r.dtype}: {r.status} {r.detail}" for r in failed)


@pytest.mark.parametrize("world", [2, 4])
def test_every_case_on_torch_and_reference(world: int, request, record_parity) -> None:
    """Every case of section 6 (uneven T, a rank without tokens, no tokens anywhere, experts without rows, every copy
    on one rank, repeated experts, k = E, D' != D, strided views, int8 transport, real GLM-5 dims) and the model
    cases, against the float64 reference and, for SwiGLU experts, against fused_moe on one process."""
    quick = request.config.getoption("--quick")
    results, _ = _ranks(ep_ranks.parity, world, ["torch", "reference"], quick, session_seed())[0]
    _assert_all_pass(results, record_parity)


@pytest.mark.parametrize("world", [2, 4])
def test_every_case_on_ascend_mc2_fake(world: int, torch_npu_schemas, request, record_parity) -> None:
    """The ascend backend on the strict MC2 fake: the cases inside dispatch_v2 / combine_v2's documented range (bf16,
    H >= 1024, every rank with tokens) run the fused kernels, the rest the portable exchange; all match."""
    quick = request.config.getoption("--quick")
    outcomes = _ranks(ep_ranks.parity, world, ["ascend"], quick, session_seed(), str(torch_npu_schemas))
    results, calls = outcomes[0]
    _assert_all_pass(results, record_parity)
    # hidden_1024 and hidden_1024_quantized in bf16 (+ glm5_decode_dims when it runs and E splits) take MC2.
    expected = 2 + (0 if quick or 256 % world else 1)
    assert calls.get("npu_moe_distribute_dispatch_v2") == expected, calls
    assert calls.get("npu_moe_distribute_combine_v2") == expected, calls


# --- failures: every rank raises, nobody hangs ---------------------------------------------------------------------


def test_a_bad_argument_on_one_rank_raises_on_every_rank() -> None:
    """4 ranks, rank 1 (or every rank) passes a bad argument: every rank raises the same kind of error naming the
    argument, before any data moves, and the group stays usable (a correct round trip right after works)."""
    outcomes = _ranks(ep_ranks.bad_arguments, 4)
    expected = {
        "ids out of range on one rank": ("ValueError", "topk_ids"),
        "num_experts not a multiple of the group size": ("ValueError", "num_experts"),
        "num_experts differs between ranks": ("ValueError", "num_experts"),
        "x of an integer dtype on one rank": ("TypeError", "x:"),
        "hidden size differs between ranks": ("ValueError", "x:"),
        "topk_ids wrong shape on one rank": ("ValueError", "topk_ids"),
        "quantize not a bool on one rank": ("TypeError", "quantize"),
        "y rows not the handle's on one rank": ("ValueError", "y:"),
        "topk_weights wrong shape on one rank": ("ValueError", "topk_weights"),
        "handle of another dispatch on one rank": ("ValueError", "handle"),
        "y width differs between ranks": ("ValueError", "y:"),
    }
    for rank, found in enumerate(outcomes):
        assert set(found) == set(expected)
        for scenario, (kind, message, usable_after) in found.items():
            want_kind, names = expected[scenario]
            assert kind == want_kind, f"rank {rank}, {scenario}: {kind}: {message}"
            assert names in message, f"rank {rank}, {scenario}: {message}"
            assert usable_after, f"rank {rank}, {scenario}: the next exchange failed"
    lone = outcomes[0]["ids out of range on one rank"][1]
    assert "rank(s) [1]" in lone and "before exchanging any data" in lone  # rank 0 is told who failed


@pytest.mark.parametrize("stay_alive_s", [0.0, 6.0], ids=["process-exits", "rank-stays-alive"])
def test_a_rank_raising_midway_does_not_hang_the_others(stay_alive_s: float) -> None:
    """Rank 1 raises between dispatch and combine. If its process exits, rank 0's combine fails at once (the
    connection closes); if it stays alive without combining, rank 0's combine fails at the group's collective
    timeout. Either way rank 0 comes back with an error, well within the wall-time bound."""
    timeout = 3.0
    start = time.monotonic()
    outcomes = run_ranks(
        ep_ranks.rank_fails_midway,
        2,
        (stay_alive_s,),
        timeout_s=WALL_S,
        collective_timeout_s=timeout,
        fail_fast=False,
    )
    elapsed = time.monotonic() - start
    assert outcomes[1].error_type == "ExpertFailure", outcomes[1]
    assert not outcomes[0].ok and "combine failed after" in outcomes[0].message, outcomes[0]
    waited = float(outcomes[0].message.split("after ")[1].split(" s")[0])
    assert waited < timeout + 5.0, outcomes[0].message
    assert elapsed < stay_alive_s + 30.0


def test_the_launcher_fails_fast_and_bounds_wall_time() -> None:
    start = time.monotonic()
    with pytest.raises(RankFailed, match="rank 2 fails at once"):
        run_ranks(ep_ranks.sleeper, 3, (2, 60.0), timeout_s=WALL_S)
    assert time.monotonic() - start < 30.0  # not the sleepers' 60 s
    start = time.monotonic()
    with pytest.raises(RankTimeout, match=r"ranks \[0, 1\] of 2 had not finished"):
        run_ranks(ep_ranks.sleeper, 2, (None, 60.0), timeout_s=2.0)
    assert time.monotonic() - start < 30.0


# --- the int8 transport ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("world", [2, 4])
def test_quantized_transport_error_bound(world: int) -> None:
    """Gaussian rows (std 3): every received row is dynamic_quant's codes and scale of its source row, bit for bit;
    each element is within half a scale step of the source value; and the MoE output keeps >= 35 dB SQNR against the
    unquantized transport (the W8A8 policy of DESIGN.md)."""
    for stats in _ranks(ep_ranks.quantized_transport, world, session_seed()):
        assert stats["codes_equal"] == 1.0 and stats["scales_equal"] == 1.0, stats
        assert stats["worst_error_over_half_scale"] <= 1.0 + 1e-5, stats
        assert stats["sqnr_db"] >= 35.0, stats  # inf on a rank without tokens


# --- the model on N ranks ------------------------------------------------------------------------------------------


def test_each_rank_reads_only_its_experts_from_the_checkpoint(tmp_path: Path) -> None:
    """A safetensors checkpoint read lazily: rank r reads every non-expert tensor and exactly its E/W experts, and its
    logits equal the single-process model's (prefill, and a generation-style logits="last" / record=False step beside
    idle ranks; decode and idle ranks are in the parity model cases)."""
    safetensors_torch = pytest.importorskip("safetensors.torch", reason="safetensors (a core dependency) is missing")
    world = 2
    cfg = glm5_hal.GLM5_MINI.with_overrides(n_routed_experts=4 * world)
    from glm5_hal.model import random_state_dict

    state = random_state_dict(cfg, seed=session_seed() % 1000)
    safetensors_torch.save_file(state, str(tmp_path / "model.safetensors"))
    for rank, found in enumerate(_ranks(ep_ranks.model_from_checkpoint, world, str(tmp_path), session_seed())):
        assert found["read"] == found["expected"], rank
        experts_read = {name.split(".experts.")[1].split(".")[0] for name in found["read"] if ".experts." in name}
        assert experts_read == {str(e) for e in range(4 * rank, 4 * rank + 4)}
        assert found["experts_held"] == 4
        assert found["max_abs_diff"] <= 1e-5 * found["scale"], found
        assert found["last_rows"] == (1 if rank == 0 else 0) and found["last_kept"] == 0, found
        assert found["last_max_abs_diff"] <= 1e-5 * found["scale"], found


# --- the command line ----------------------------------------------------------------------------------------------


def test_parity_distributed_needs_a_launcher(capsys) -> None:
    from glm5_hal.cli import main

    env = {name: os.environ.pop(name) for name in ("RANK", "WORLD_SIZE") if name in os.environ}
    try:
        assert main(["parity", "--distributed"]) == 2
    finally:
        os.environ.update(env)
    assert "torchrun --nproc-per-node N -m glm5_hal.cli parity --distributed" in capsys.readouterr().err


def test_torchrun_parity_distributed_prints_the_table(tmp_path: Path) -> None:
    """The launcher users know, end to end: torchrun starts 2 ranks, rank 0 prints one row per op and backend."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command += ["-m", "glm5_hal.cli", "parity", "--distributed", "--quick", "--backends", "torch"]
    command += ["--timeout", "60", "--json", str(tmp_path / "ep.json")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=WALL_S, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    for op in ("ep_dispatch", "ep_combine", "ep_model"):
        assert any(line.split()[:3] == [op, "torch", "pass"] for line in done.stdout.splitlines()), done.stdout
    assert (tmp_path / "ep.json").is_file()


# --- the Ascend mapping's conditions -------------------------------------------------------------------------------


def test_mc2_is_used_only_where_its_documentation_allows(fake_torch_npu, monkeypatch) -> None:
    from backends.ascend.expert_parallel import hccl_buffer_needed, mc2_unsupported

    # The documented buffer need of GLM-5 on 8 ranks at 64 tokens each is 412 MB, above HCCL's 200 MB default.
    assert "HCCL_BUFFSIZE is 200 MB, the exchange needs 412 MB" in mc2_unsupported(_plan())
    monkeypatch.setenv("HCCL_BUFFSIZE", "1024")
    assert mc2_unsupported(_plan()) is None  # GLM-5 on an A3, 8 ranks
    assert mc2_unsupported(_plan(hidden=7168)) is None  # DeepSeek-V3.2
    refused = {
        "Atlas A3": _plan(),  # with an A2 SoC, below
        "bf16 / fp16": _plan(dtype=torch.float32),
        "ranks": _plan(world_size=512, tokens=(64,) * 512, counts=((1,) * 512,) * 512, num_experts=512),
        "experts": _plan(num_experts=1024, counts=((1,) * 1024,) * 8),
        "H in": _plan(hidden=512),
        "tokens on every rank": _plan(tokens=(64, 0, 64, 64, 64, 64, 64, 64)),
        "k <=": _plan(top_k=32),
        "distinct experts": _plan(rows_unique=False),
    }
    for words, plan in refused.items():
        if words == "Atlas A3":
            monkeypatch.setattr(fake_torch_npu.npu, "soc_version", 223)  # an Atlas A2 (910B)
            assert words in mc2_unsupported(plan)
            monkeypatch.setattr(fake_torch_npu.npu, "soc_version", 250)
        else:
            assert words in (mc2_unsupported(plan) or ""), words
    monkeypatch.setenv("HCCL_BUFFSIZE", str(hccl_buffer_needed(_plan()) // 2**20 - 1))
    assert "HCCL_BUFFSIZE" in mc2_unsupported(_plan())


def test_the_mc2_fake_refuses_what_the_documentation_forbids(torch_npu_schemas) -> None:
    for found in _ranks(ep_ranks.fake_mc2_rejects, 2, str(torch_npu_schemas)):
        assert "x must be 2-D bf16/fp16" in found["fp32 tokens"], found
        assert "must be distinct" in found["repeated expert"], found
        assert "H must lie in [1024, 8192]" in found["H below 1024"], found
        assert "must be the dispatch's, untouched" in found["assist_info changed"], found
