"""Parity of the expert-parallel ops and of the model on N ranks, run on every rank of an initialized process group.

    torchrun --nproc-per-node N -m glm5_hal.cli parity --distributed     (the command line, glm5_hal/cli/parity.py)
    glm5_hal.launch.run_ranks(worker, N)                                  (the tests: gloo ranks on the CPU)

Every rank builds every rank's inputs from the run seed, so each computes the float64 reference of the whole
exchange (ops_reference/expert_parallel.py) without gathering anything, then runs ep_dispatch -> its experts ->
ep_combine on its own part and judges its outputs by the tolerance policy (glm5_hal/parity/compare.py):

  ep_dispatch   recv_x equal to the reference's rows (exactly: they are copies; int8 codes and fp32 scales exactly),
                expert_offsets exactly
  ep_combine    out against the reference (float64 experts on the reference's rows) at the dtype's tolerance; for
                SwiGLU experts also against fused_moe of all experts on one process, the identity of OPS.md section 6
  ep_model      the N-rank model's logits for this rank's requests (prefill, decode, a rank idle in some steps,
                prefill mixed with decode) against the single-process CausalLM's on the same requests
The experts run the `torch` backend whatever is tested, so that only the exchange is on trial. `gather_results`
merges every rank's results (one row per case, the worst rank's error) for the table of glm5_hal.parity.runner.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

import ops_reference as ref
from glm5_hal.config import GLM5_MINI
from glm5_hal.ops import EPDispatch, ep_combine, ep_dispatch, fused_moe, grouped_matmul
from glm5_hal.parity.compare import Verdict, compare_exact, compare_float, to_numpy
from glm5_hal.parity.runner import Result, session_seed
from glm5_hal.registry import EP_OP_NAMES
from glm5_hal.selection import OpNotImplementedError, use_backend

EXPERT_BACKEND = "torch"  # runs the experts between the exchanges
EXPERT_OPS = ("fused_moe", "grouped_matmul", "moe_gate", "moe_dispatch", "moe_combine")
INTERMEDIATE = 32  # SwiGLU experts' intermediate width in the cases


@dataclass(frozen=True)
class EPCase:
    """One exchange on W ranks.

    tokens: T per rank, cycled over the ranks. experts_per_rank: E / W, or num_experts: E whatever W is (the case
    is left out where W does not divide it). top_k: k, None for k = E. routing: "uniform" (distinct experts per
    token), "even" (only even experts: odd ones get no rows), "first_rank" (every copy to rank 0's experts),
    "repeats" (a token may name one expert twice). experts: "swiglu" (D -> D, checked against fused_moe too),
    "linear" (D -> out_width) or "identity". strided: x, topk_ids, y and topk_weights are non-contiguous views.
    quantize: int8 transport; the rows are then q * 2^-e per row (exactly representable, so every implementation's
    codes agree: quantization ties are dynamic_quant's own parity, not the exchange's). slow: real GLM-5 dims.
    """

    name: str
    tokens: tuple[int, ...]
    hidden: int = 64
    experts_per_rank: int = 3
    num_experts: int | None = None
    top_k: int | None = 2
    routing: str = "uniform"
    experts: str = "swiglu"
    out_width: int | None = None
    quantize: bool = False
    strided: bool = False
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16)
    slow: bool = False

    def tokens_of(self, world: int) -> list[int]:
        return [self.tokens[r % len(self.tokens)] for r in range(world)]


EP_CASES = [
    EPCase("uneven_tokens", (5, 3, 8, 1)),
    EPCase("rank_without_tokens", (6, 0, 4, 7)),
    EPCase("no_tokens_anywhere", (0,)),
    EPCase("experts_without_rows", (7, 4, 5, 2), experts_per_rank=4, routing="even"),
    EPCase("all_on_first_rank", (4, 6, 3, 5), experts_per_rank=4, routing="first_rank"),
    EPCase("repeated_experts_in_a_row", (5, 4, 6, 3), routing="repeats"),
    EPCase("every_expert_per_token", (3, 2, 4, 1), experts_per_rank=2, top_k=None),
    EPCase("wider_output", (5, 3, 8, 1), experts="linear", out_width=96),
    EPCase("strided_views", (5, 3, 8, 1), strided=True),
    EPCase("quantized_transport", (6, 2, 5, 0), quantize=True),
    EPCase("hidden_1024", (3, 5, 2, 4), hidden=1024, experts_per_rank=2, experts="identity"),
    EPCase("hidden_1024_quantized", (3, 5, 2, 4), hidden=1024, experts_per_rank=2, quantize=True),
    EPCase("glm5_decode_dims", (4, 2, 3, 1), hidden=6144, num_experts=256, top_k=8, experts="identity", slow=True),
]


def ep_cases(quick: bool = False) -> list[EPCase]:
    return [c for c in EP_CASES if not (quick and c.slow)]


def _generator(name: str, dtype: torch.dtype, seed: int) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(f"ep/{name}/{dtype}".encode())) % 2**63)


@dataclass
class _World:
    """Every rank's inputs of one case (identical on every rank)."""

    num_experts: int
    top_k: int
    xs: list[Tensor]
    ids: list[Tensor]
    weights: list[Tensor]
    expert_weights: tuple[Tensor, ...]  # swiglu: (w13 [E, 2I, D], w2 [E, D, I]); linear: (w [E, D', D],)


def _experts_of(case: EPCase, world: int) -> int | None:
    if case.num_experts is not None:
        return case.num_experts if case.num_experts % world == 0 else None
    return case.experts_per_rank * world


def _quantizable_rows(tokens: int, width: int, gen: torch.Generator) -> Tensor:
    """[T, D] rows q * 2^-e with integer q in [-127, 127] and max |q| = 127 per row: dynamic_quant is exact on them."""
    codes = torch.randint(-127, 128, (tokens, width), generator=gen).to(torch.float32)
    if width:
        codes[:, 0] = 127.0
    scale = 2.0 ** -torch.randint(4, 9, (tokens, 1), generator=gen).to(torch.float32)
    return codes * scale


def _routing(case: EPCase, tokens: int, num_experts: int, top_k: int, world: int, gen: torch.Generator) -> Tensor:
    if case.routing == "repeats":  # random ids, and the first token names one expert twice for sure
        ids = torch.randint(0, num_experts, (tokens, top_k), generator=gen)
        ids[:1, 1:2] = ids[:1, :1]
        return ids.to(torch.int32)
    pool = {
        "uniform": torch.arange(num_experts),
        "even": torch.arange(0, num_experts, 2),
        "first_rank": torch.arange(num_experts // world),
    }[case.routing]
    rows = [pool[torch.randperm(pool.numel(), generator=gen)[:top_k]] for _ in range(tokens)]
    return (torch.stack(rows) if rows else torch.zeros(0, top_k, dtype=torch.int64)).to(torch.int32)


def build_world(case: EPCase, world: int, dtype: torch.dtype, seed: int) -> _World | None:
    """Every rank's inputs for `case` on `world` ranks (None when E cannot be split over them)."""
    num_experts = _experts_of(case, world)
    if num_experts is None:
        return None
    top_k = num_experts if case.top_k is None else case.top_k
    gen = _generator(case.name, dtype, seed)
    xs, ids, weights = [], [], []
    for tokens in case.tokens_of(world):
        if case.quantize:
            x = _quantizable_rows(tokens, case.hidden, gen)
        else:
            x = torch.randn(tokens, case.hidden, generator=gen)
        xs.append(x.to(dtype))
        ids.append(_routing(case, tokens, num_experts, top_k, world, gen))
        weights.append(torch.rand(tokens, top_k, generator=gen) + 0.1)
    d, inter = case.hidden, INTERMEDIATE
    if case.experts == "swiglu":
        expert_weights = (
            (torch.randn(num_experts, 2 * inter, d, generator=gen) * d**-0.5).to(dtype),
            (torch.randn(num_experts, d, inter, generator=gen) * inter**-0.5).to(dtype),
        )
    elif case.experts == "linear":
        expert_weights = ((torch.randn(num_experts, case.out_width, d, generator=gen) * d**-0.5).to(dtype),)
    else:
        expert_weights = ()
    return _World(num_experts, top_k, xs, ids, weights, expert_weights)


def _local(weights: tuple[Tensor, ...], rank: int, world: int) -> tuple[Tensor, ...]:
    return tuple(w.chunk(world)[rank] for w in weights)


def _strided(t: Tensor) -> Tensor:
    """The same values in a non-contiguous (column-major) layout."""
    return t.t().contiguous().t() if t.dim() == 2 and t.shape[0] > 1 and t.shape[1] > 1 else t


def _experts(case: EPCase, rows: Tensor, offsets: Tensor, weights: tuple[Tensor, ...]) -> Tensor:
    """The experts of one rank on its received rows (torch backend): [R, D] -> [R, D']."""
    if case.experts == "identity":
        return rows
    if case.experts == "linear":
        return grouped_matmul(rows, weights[0], offsets.to(torch.int64))
    counts = offsets.diff().to(torch.int64)
    local_ids = torch.repeat_interleave(torch.arange(counts.numel(), device=rows.device), counts)
    ones = torch.ones(rows.shape[0], 1, device=rows.device)
    return fused_moe(rows, ones, local_ids[:, None].to(torch.int32), *weights)


def _reference_experts(case: EPCase, rows: np.ndarray, offsets: np.ndarray, weights: tuple) -> np.ndarray:
    if case.experts == "identity":
        return rows
    if case.experts == "linear":
        return ref.grouped_matmul(rows, to_numpy(weights[0]), offsets)
    h = ref.grouped_matmul(rows, to_numpy(weights[0]), offsets)
    return ref.grouped_matmul(ref.silu(h[:, :INTERMEDIATE]) * h[:, INTERMEDIATE:], to_numpy(weights[1]), offsets)


def _dequantized(recv_x: np.ndarray, recv_scale: np.ndarray | None) -> np.ndarray:
    return recv_x.astype(np.float64) * (1.0 if recv_scale is None else recv_scale[:, None])


def _result(op: str, case: str, backend: str, dtype: torch.dtype, verdicts: list[Verdict], rank: int) -> Result:
    failed = [v for v in verdicts if not v.passed]
    worst = max((v.rel_err for v in verdicts), default=0.0)
    detail = "; ".join(f"rank {rank} {v.output}: {v.detail}" for v in failed)
    return Result(op, case, backend, str(dtype).removeprefix("torch."), "fail" if failed else "pass", worst, detail)


def run_ep_case(case: EPCase, backend: str, dtype: torch.dtype, device: torch.device, seed: int) -> list[Result]:
    """One case on this rank (a collective: every rank of the default group runs it). Returns its results for
    ep_dispatch and ep_combine (empty when E cannot be split over this many ranks)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    inputs = build_world(case, world, dtype, seed)
    if inputs is None:
        return []
    dtype_name = str(dtype).removeprefix("torch.")
    x, ids, topk_weights = (t.to(device) for t in (inputs.xs[rank], inputs.ids[rank], inputs.weights[rank]))
    if case.strided:
        x, ids, topk_weights = _strided(x), _strided(ids), _strided(topk_weights)
    local_weights = tuple(w.to(device) for w in _local(inputs.expert_weights, rank, world))
    try:
        with use_backend(backend, ops=EP_OP_NAMES, strict=True):
            sent: EPDispatch = ep_dispatch(x, ids, inputs.num_experts, quantize=case.quantize)
            rows = sent.recv_x if sent.recv_scale is None else sent.recv_x.float() * sent.recv_scale[:, None]
            with use_backend(EXPERT_BACKEND, ops=EXPERT_OPS):
                y = _experts(case, rows.to(dtype), sent.expert_offsets, local_weights)
            out = ep_combine(_strided(y) if case.strided else y, topk_weights, sent.handle)
    except OpNotImplementedError as exc:
        return [Result(op, case.name, backend, dtype_name, "not implemented", 0.0, str(exc)) for op in EP_OP_NAMES]
    except Exception as exc:  # reported in the table; the exchange raised on every rank (or the run fails at once)
        detail = f"rank {rank}: {type(exc).__name__}: {exc}"
        return [Result(op, case.name, backend, dtype_name, "error", float("inf"), detail) for op in EP_OP_NAMES]

    xs64 = [to_numpy(t) for t in inputs.xs]
    outputs, sources = ref.ep_dispatch(
        xs64, [to_numpy(i) for i in inputs.ids], inputs.num_experts, quantize=case.quantize
    )
    want_x, want_scale, want_offsets = outputs[rank]
    dispatch_verdicts = [compare_exact("expert_offsets", sent.expert_offsets.cpu(), want_offsets)]
    dispatch_verdicts.append(compare_exact("recv_x", sent.recv_x.cpu(), want_x))
    if case.quantize:
        dispatch_verdicts.append(compare_exact("recv_scale", sent.recv_scale.cpu(), want_scale))
    ys = [
        _reference_experts(case, _dequantized(rx, rs), offs, _local(inputs.expert_weights, r, world))
        for r, (rx, rs, offs) in enumerate(outputs)
    ]
    want_out = ref.ep_combine(ys, [to_numpy(w) for w in inputs.weights], sources)[rank]
    combine_verdicts = [compare_float("out", out.cpu(), want_out, dtype)]
    if case.experts == "swiglu" and not case.quantize:  # OPS.md's identity: EP == fused_moe on one process
        with use_backend(EXPERT_BACKEND, ops=EXPERT_OPS):
            single = fused_moe(x, topk_weights, ids, *(w.to(device) for w in inputs.expert_weights))
        combine_verdicts.append(compare_float("out vs fused_moe", out.cpu(), to_numpy(single), dtype))
    return [
        _result("ep_dispatch", case.name, backend, dtype, dispatch_verdicts, rank),
        _result("ep_combine", case.name, backend, dtype, combine_verdicts, rank),
    ]


# ---------------------------------------------------------------------------------------------------- the model
@dataclass(frozen=True)
class ModelCase:
    name: str
    dtype: torch.dtype
    layers: int  # 1 dense + (layers - 1) MoE layers


MODEL_CASES = [
    ModelCase("glm5-mini_3_layers", torch.float32, 3),
    ModelCase("glm5-mini_2_layers", torch.bfloat16, 2),
]


def _requests(rank: int, world: int, vocab: int, gen: torch.Generator) -> list[dict[str, Tensor | list[int]]]:
    """This rank's tokens per step: the last rank starts one step late (idle, then prefill beside the others'
    decode); with more than two ranks, rank 1 is idle in the last step."""
    prompts = {f"r{rank}s{i}": torch.randint(0, vocab, (4 + 3 * i + rank,), generator=gen) for i in range(1 + rank % 2)}
    decode = lambda step: {name: [(7 * step + 3 * rank + i) % vocab] for i, name in enumerate(prompts)}  # noqa: E731
    steps = [prompts, decode(1), decode(2)]
    if rank == world - 1 and world > 1:
        steps = [{}, prompts, decode(2)]
    if rank == 1 and world > 2:
        steps[2] = {}
    return steps


def run_model_case(case: ModelCase, backend: str, device: torch.device, seed: int) -> list[Result]:
    """The expert-parallel model against the single-process model on this rank's requests (a collective)."""
    from glm5_hal.model import CausalLM, random_state_dict
    from glm5_hal.model.parallel import ExpertParallelCausalLM

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GLM5_MINI.with_overrides(num_hidden_layers=case.layers, n_routed_experts=4 * world)
    gen = _generator(case.name, case.dtype, seed)
    state = random_state_dict(cfg, seed=int(torch.randint(0, 2**31 - 1, (1,), generator=gen)), dtype=case.dtype)
    steps = _requests(rank, world, cfg.vocab_size, torch.Generator().manual_seed(seed + 7919 * rank))
    dtype_name = str(case.dtype).removeprefix("torch.")
    verdicts: list[Verdict] = []
    try:
        with use_backend(backend, ops=EP_OP_NAMES, strict=True), use_backend(EXPERT_BACKEND, ops=EXPERT_OPS):
            parallel = ExpertParallelCausalLM(cfg, {k: v.to(device) for k, v in state.items()})
            single = CausalLM(cfg, {k: v.to(device) for k, v in state.items()})
            parallel_cache = parallel.new_cache(256, block_size=4, device=device)
            single_cache = single.new_cache(256, block_size=4, device=device)
            for step, tokens in enumerate(steps):
                got = parallel.step(parallel_cache, tokens)
                if tokens:
                    want = single.step(single_cache, tokens)
                    verdicts.append(
                        compare_float(f"logits step {step}", got.logits.cpu(), to_numpy(want.logits), case.dtype)
                    )
                elif got.logits.shape[0] != 0:
                    verdicts.append(Verdict(f"step {step}", False, float("inf"), "an idle rank returned logits"))
    except OpNotImplementedError as exc:
        return [Result("ep_model", case.name, backend, dtype_name, "not implemented", 0.0, str(exc))]
    except Exception as exc:
        return [Result("ep_model", case.name, backend, dtype_name, "error", float("inf"), f"rank {rank}: {exc!r}")]
    return [_result("ep_model", case.name, backend, case.dtype, verdicts, rank)]


def run_distributed_parity(
    backends: list[str],
    device: torch.device | Callable[[str], torch.device],
    *,
    quick: bool = False,
    seed: int | None = None,
    model: bool = True,
) -> list[Result]:
    """Every EP case (and the model cases) on every backend, on this rank. A collective over the default group:
    call it on every rank with the same arguments. device: where this rank's tensors live (or backend -> device)."""
    seed = session_seed() if seed is None else seed
    results: list[Result] = []
    for backend in backends:
        where = device(backend) if callable(device) else device
        for case in ep_cases(quick):
            for dtype in case.dtypes:
                results += run_ep_case(case, backend, dtype, where, seed)
        if model:
            for model_case in MODEL_CASES:
                results += run_model_case(model_case, backend, where, seed)
    return results


def gather_results(results: list[Result]) -> list[Result]:
    """Every rank's results merged, one per (op, case, backend, dtype): failed if any rank failed, the worst error."""
    gathered: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    merged: dict[tuple, Result] = {}
    for rank_results in gathered:
        for r in rank_results:
            key = (r.op, r.case, r.backend, r.dtype)
            if key not in merged:
                merged[key] = r
                continue
            kept = merged[key]
            status = kept.status if kept.status in ("fail", "error") else r.status
            detail = "; ".join(d for d in (kept.detail, r.detail) if d)
            merged[key] = replace(kept, status=status, rel_err=max(kept.rel_err, r.rel_err), detail=detail)
    return list(merged.values())


__all__ = [
    "EPCase",
    "EP_CASES",
    "MODEL_CASES",
    "ep_cases",
    "build_world",
    "run_ep_case",
    "run_model_case",
    "run_distributed_parity",
    "gather_results",
]
