"""The causal LM on N ranks: attention data-parallel, MoE expert-parallel (docs/expert_parallel.md).

Every rank of the process group holds the whole model except the routed experts, of which it holds only its own
E / W (rank r: global experts [r * E/W, (r+1) * E/W), as ep_dispatch splits them), read from the checkpoint by name:
no other expert's tensor is read. Each rank serves its own requests with its own paged cache (attention is data
parallel); every MoE layer exchanges tokens between the ranks:

    router + moe_gate (this rank's tokens) -> ep_dispatch -> this rank's experts (fused_moe over the received rows,
    one expert per row) -> ep_combine (routing weights applied) -> + shared expert

    weights = SafetensorsWeights("checkpoint/")          # lazy: a tensor is read when asked for
    model = ExpertParallelCausalLM(cfg, weights)         # after torch.distributed.init_process_group()
    cache = model.new_cache(max_tokens=4096)
    out = model.step(cache, {"req-1": prompt})           # a collective: every rank calls step in lockstep,
    out = model.step(cache, {})                          # with {} when it has nothing to run

A step is a collective (each MoE layer runs two), so every rank must call `step` (or `prefill`) the same number of
times; a rank without tokens passes {} and only takes part in the exchanges. Per token, the logits equal the
single-process CausalLM's (same ops, same arithmetic per row: parity_tests/test_expert_parallel_model.py).
"""

from __future__ import annotations

import functools
from collections.abc import Hashable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn

from glm5_hal.config import ModelConfig
from glm5_hal.distributed import resolve_group
from glm5_hal.model.cache import PagedKVCache
from glm5_hal.model.causal_lm import CausalLM
from glm5_hal.model.checkpoint import CheckpointReader
from glm5_hal.model.decoder import DecoderStack, LayerChoices, ModelOutput, build_moe
from glm5_hal.model.linear import Linear
from glm5_hal.model.mlp import MoE, Routing, TopkRouter
from glm5_hal.model.norms import compute_dtype
from glm5_hal.model.weights import is_moe_layer, parameter_shapes
from glm5_hal.ops import ep_combine, ep_dispatch


def expert_range(cfg: ModelConfig, rank: int, world_size: int) -> range:
    """The global experts rank `rank` of `world_size` owns (ep_dispatch's contiguous split)."""
    if cfg.n_routed_experts % world_size:
        raise ValueError(
            f"world_size: expected a divisor of the {cfg.n_routed_experts} routed experts of {cfg.name!r}, got "
            f"{world_size}"
        )
    local = cfg.n_routed_experts // world_size
    return range(rank * local, (rank + 1) * local)


def _expert_of(name: str) -> int | None:
    """The routed expert a checkpoint name belongs to ("...mlp.experts.7.up_proj.weight" -> 7), else None."""
    parts = name.split(".")
    if "experts" in parts:
        index = parts.index("experts") + 1
        if index < len(parts) and parts[index].isdigit():
            return int(parts[index])
    return None


def rank_parameter_names(cfg: ModelConfig, rank: int, world_size: int) -> list[str]:
    """Every parameter rank `rank` of `world_size` loads: all but the routed experts other ranks own."""
    mine = expert_range(cfg, rank, world_size)
    return [name for name in parameter_shapes(cfg) if _expert_of(name) is None or _expert_of(name) in mine]


class SafetensorsWeights(Mapping[str, Tensor]):
    """The tensors of a safetensors checkpoint (one file, or a directory: glm5_hal.model.checkpoint.checkpoint_files)
    by name, each read from disk only when asked for. `read` lists the names read so far.

    Only the headers are read on construction (glm5_hal.model.checkpoint.CheckpointReader, which errors name the
    file and tensor).
    """

    def __init__(self, path: str | Path) -> None:
        self._reader = CheckpointReader(path)
        self.read: list[str] = []

    def __getitem__(self, name: str) -> Tensor:
        tensor = self._reader.read(name)  # KeyError names it
        self.read.append(name)
        return tensor

    def __contains__(self, name: object) -> bool:
        return name in self._reader  # Mapping's default would read the tensor to find out

    def __iter__(self) -> Iterator[str]:
        return iter(self._reader)

    def __len__(self) -> int:
        return len(self._reader)


class ExpertParallelMoE(MoE):
    """A MoE block whose routed experts are spread over the ranks of `group`; x [T, D] -> [T, D] on each rank.

    experts: this rank's RoutedExperts (E / W experts; a quantized replacement works the same). quantize_dispatch:
    the tokens travel as int8 + scale (ep_dispatch(quantize=True)) and are dequantized to x's dtype before the
    experts. A collective: every rank of the group must call it, with T = 0 when it has no tokens.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        gate: TopkRouter,
        experts: nn.Module,
        shared_experts: nn.Module,
        group: dist.ProcessGroup,
        quantize_dispatch: bool = False,
    ) -> None:
        super().__init__(cfg, gate, experts, shared_experts)
        self.group = group
        self.quantize_dispatch = quantize_dispatch

    def forward(self, x: Tensor, routing: Routing | None = None) -> tuple[Tensor, Routing]:
        topk_weights, topk_ids = self.route(x) if routing is None else routing
        sent = ep_dispatch(x, topk_ids, self.cfg.n_routed_experts, group=self.group, quantize=self.quantize_dispatch)
        rows = sent.recv_x
        if sent.recv_scale is not None:  # dequantize where the experts run
            rows = (rows.to(torch.float32) * sent.recv_scale[:, None]).to(x.dtype)
        # The received rows are grouped by local expert: fused_moe with one expert per row (weight 1, exact) runs
        # each row through its expert with the single-process model's arithmetic.
        counts = sent.expert_offsets.diff().to(torch.int64)
        local_ids = torch.repeat_interleave(torch.arange(counts.numel(), device=x.device), counts)
        ones = torch.ones(rows.shape[0], 1, dtype=compute_dtype(x), device=x.device)
        y = self.experts(rows, ones, local_ids[:, None].to(torch.int32))
        out = ep_combine(y, topk_weights.to(compute_dtype(x)), sent.handle) + self.shared_experts(x)
        return out, (topk_weights, topk_ids)


class ExpertParallelCausalLM(CausalLM):
    """CausalLM on the ranks of a process group: attention data-parallel, MoE expert-parallel (module docstring).

    cfg: the model config; its n_routed_experts must be a multiple of the group's size.
    weights: name -> tensor, with the checkpoint names (a dict, or SafetensorsWeights to read lazily); only the
        names rank_parameter_names lists for this rank are read.
    group: the process group (None: the default one). quantize_dispatch: int8 token transport (see ep_dispatch).

    Module paths are CausalLM's; `model.layers.N.mlp.experts` holds this rank's experts only (E / W of them, in
    global order), so `routed_experts()` and `replace_module` (quantization) act on them.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        weights: Mapping[str, Tensor],
        *,
        group: dist.ProcessGroup | None = None,
        quantize_dispatch: bool = False,
    ) -> None:
        nn.Module.__init__(self)  # CausalLM.__init__ wants every expert; build the same modules from this rank's
        self.group = resolve_group(group)
        self.rank, self.world_size = dist.get_rank(self.group), dist.get_world_size(self.group)
        self.experts_owned = expert_range(cfg, self.rank, self.world_size)
        shapes = parameter_shapes(cfg)
        state: dict[str, Tensor] = {}
        for name in rank_parameter_names(cfg, self.rank, self.world_size):
            if name not in weights:
                raise ValueError(
                    f"weights: missing {name!r} of {cfg.name!r} (names follow the Hugging Face checkpoints)"
                )
            state[name] = weights[name]
            if tuple(state[name].shape) != shapes[name]:
                raise ValueError(f"weights[{name!r}]: expected shape {shapes[name]}, got {tuple(state[name].shape)}")
        self.cfg = cfg
        self.dtype = state["model.embed_tokens.weight"].dtype
        build = functools.partial(self._build_moe, group=self.group, quantize_dispatch=quantize_dispatch)
        self.model = DecoderStack(cfg, state, moe_builder=build)
        self.lm_head = Linear(state["lm_head.weight"])

    def _build_moe(
        self, cfg: ModelConfig, state: Mapping[str, Tensor], prefix: str, *, group, quantize_dispatch
    ) -> ExpertParallelMoE:
        moe = build_moe(cfg, state, prefix, self.experts_owned)
        return ExpertParallelMoE(cfg, moe.gate, moe.experts, moe.shared_experts, group, quantize_dispatch)

    @torch.no_grad()
    def step(
        self,
        cache: PagedKVCache,
        tokens: dict[Hashable, Sequence[int] | Tensor],
        *,
        choices: Sequence[LayerChoices] | None = None,
        logits: Literal["all", "last"] = "all",
        record: bool = True,
    ) -> ModelOutput:
        """CausalLM.step on this rank's requests; a collective. With no tokens ({} or only empty lists) this rank
        only takes part in the MoE layers' exchanges, and the output has zero rows (and no layer outputs or
        choices when record is False). choices, logits, record: see CausalLM.forward."""
        if sum(torch.as_tensor(t).numel() for t in tokens.values()) == 0:
            return self._idle_step(cache, record)
        return super().step(cache, tokens, choices=choices, logits=logits, record=record)

    def _idle_step(self, cache: PagedKVCache, record: bool = True) -> ModelOutput:
        """Every MoE layer's collectives with zero tokens, in layer order (what the other ranks' step runs)."""
        cfg, device = self.cfg, cache.device
        h = torch.zeros(0, cfg.hidden_size, dtype=self.dtype, device=device)
        no_keys = torch.zeros(0, cfg.index_topk, dtype=torch.int32, device=device)
        outputs, choices = [], []
        for n, layer in enumerate(self.model.layers):
            routing = None
            if is_moe_layer(cfg, n):
                _, routing = layer.mlp(h)
            if record:
                outputs.append(h)
                choices.append(LayerChoices(no_keys, routing))
        logits = torch.zeros(0, cfg.vocab_size, dtype=self.dtype, device=device)
        return ModelOutput(logits, outputs, choices)


__all__ = [
    "ExpertParallelCausalLM",
    "ExpertParallelMoE",
    "SafetensorsWeights",
    "expert_range",
    "rank_parameter_names",
]
