"""The decoder layer and the network of the causal LM: embedding -> layers (attention + dense MLP or MoE, pre-norm
residuals) -> final RMSNorm -> lm_head. Built from a checkpoint-named state dict (weights.py). causal_lm.py puts
loading (pretrained.py) and generation (generate.py) on top; this module needs neither."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from glm5_hal.config import ModelConfig
from glm5_hal.model.attention import Indexer, MLAAttention
from glm5_hal.model.cache import PagedKVCache, StepMetadata
from glm5_hal.model.linear import Linear, RoutedExperts
from glm5_hal.model.mlp import MLP, MoE, Routing, TopkRouter
from glm5_hal.model.norms import LayerNorm, RMSNorm, compute_dtype
from glm5_hal.model.rope import rope_cos_sin
from glm5_hal.model.weights import (
    check_state_dict,
    expert_module_names,
    is_moe_layer,
    layer_prefix,
    linear_module_names,
)
from glm5_hal.selection import use_backend


@dataclass(frozen=True)
class LayerChoices:
    """The discrete choices one decoder layer made for its tokens.

    topk_indices: [T, index_topk] int32, the keys each token attends (the lightning indexer's selection, -1 =
    none). routing: a MoE layer's (topk_weights [T, k] fp32, topk_ids [T, k] int32); None in a dense layer.

    Quantization noise flips a few of these choices, and each flip swaps whole keys or experts: an error unrelated
    to how well the GEMMs are quantized. Replaying the floating model's choices in a quantized copy (`choices=`
    of DecoderModel.forward / step / prefill) isolates the quantization error.
    """

    topk_indices: Tensor
    routing: Routing | None


def build_moe(cfg: ModelConfig, state: Mapping[str, Tensor], prefix: str, experts: Sequence[int] | None = None) -> MoE:
    """The MoE block at `prefix` ("model.layers.N.mlp") with the routed `experts` (default: all), in that order."""
    experts = range(cfg.n_routed_experts) if experts is None else experts
    return MoE(
        cfg,
        TopkRouter(state[f"{prefix}.gate.weight"], state[f"{prefix}.gate.e_score_correction_bias"]),
        RoutedExperts.from_expert_weights(
            [state[f"{prefix}.experts.{e}.gate_proj.weight"] for e in experts],
            [state[f"{prefix}.experts.{e}.up_proj.weight"] for e in experts],
            [state[f"{prefix}.experts.{e}.down_proj.weight"] for e in experts],
        ),
        _mlp(state, f"{prefix}.shared_experts"),
    )


# Builds a MoE layer's block from (cfg, state, prefix); the expert-parallel model (parallel.py) passes its own.
MoEBuilder = Callable[[ModelConfig, Mapping[str, Tensor], str], nn.Module]


class DecoderLayer(nn.Module):
    """h + attn(input_layernorm(h)), then h + mlp(post_attention_layernorm(h)); h [T, hidden]."""

    def __init__(
        self, cfg: ModelConfig, layer: int, state: Mapping[str, Tensor], moe_builder: MoEBuilder = build_moe
    ) -> None:
        super().__init__()
        p = layer_prefix(layer)
        a, i = f"{p}.self_attn", f"{p}.self_attn.indexer"
        eps = cfg.rms_norm_eps
        self.layer = layer
        self.input_layernorm = RMSNorm(state[f"{p}.input_layernorm.weight"], eps)
        self.post_attention_layernorm = RMSNorm(state[f"{p}.post_attention_layernorm.weight"], eps)
        indexer = Indexer(
            cfg,
            state[f"{i}.wq_b.weight"],
            state[f"{i}.wk.weight"],
            LayerNorm(state[f"{i}.k_norm.weight"], state[f"{i}.k_norm.bias"], cfg.indexer_norm_eps),
            state[f"{i}.weights_proj.weight"],
        )
        self.self_attn = MLAAttention(
            cfg,
            state[f"{a}.q_a_proj.weight"],
            RMSNorm(state[f"{a}.q_a_layernorm.weight"], eps),
            state[f"{a}.q_b_proj.weight"],
            state[f"{a}.kv_a_proj_with_mqa.weight"],
            RMSNorm(state[f"{a}.kv_a_layernorm.weight"], eps),
            state[f"{a}.kv_b_proj.weight"],
            state[f"{a}.o_proj.weight"],
            indexer,
        )
        m = f"{p}.mlp"
        if is_moe_layer(cfg, layer):
            self.mlp: nn.Module = moe_builder(cfg, state, m)
        else:
            self.mlp = _mlp(state, m)

    def forward(
        self,
        h: Tensor,
        cos: Tensor,
        sin: Tensor,
        cache: PagedKVCache,
        step: StepMetadata,
        choices: LayerChoices | None = None,
    ) -> tuple[Tensor, LayerChoices]:
        """(new residual stream, the choices made). `choices` replays given choices instead (see LayerChoices)."""
        kv_cache, index_k_cache = cache.kv[self.layer], cache.index_k[self.layer]
        forced_keys, forced_routing = (None, None) if choices is None else (choices.topk_indices, choices.routing)
        attn, topk_indices = self.self_attn(
            self.input_layernorm(h),
            cos,
            sin,
            kv_cache,
            index_k_cache,
            step,
            forced_keys,
            kv_cache_dtype=cache.kv_cache_dtype,
            index_cache_dtype=cache.index_cache_dtype,
        )
        h = h + attn
        x = self.post_attention_layernorm(h)
        if isinstance(self.mlp, MoE):
            out, routing = self.mlp(x, forced_routing)
            return h + out, LayerChoices(topk_indices, routing)
        if forced_routing is not None:
            raise ValueError(f"choices: layer {self.layer} is a dense MLP layer, its routing must be None")
        return h + self.mlp(x), LayerChoices(topk_indices, None)


def _mlp(state: Mapping[str, Tensor], prefix: str) -> MLP:
    return MLP(*(state[f"{prefix}.{name}.weight"] for name in ("gate_proj", "up_proj", "down_proj")))


class Embedding(nn.Module):
    """weight [vocab, hidden]; input_ids [T] int -> [T, hidden]."""

    def __init__(self, weight: Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)

    def forward(self, input_ids: Tensor) -> Tensor:
        return self.weight[input_ids]


class DecoderStack(nn.Module):
    """The `model.` part of the checkpoint: embed_tokens, layers, norm."""

    def __init__(self, cfg: ModelConfig, state: Mapping[str, Tensor], moe_builder: MoEBuilder = build_moe) -> None:
        super().__init__()
        self.embed_tokens = Embedding(state["model.embed_tokens.weight"])
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, layer, state, moe_builder) for layer in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(state["model.norm.weight"], cfg.rms_norm_eps)


@dataclass
class ModelOutput:
    """logits: [T, vocab] in the model's dtype. layer_outputs: per decoder layer, the residual stream
    [T, hidden] after that layer (before the final norm), for per-layer error measurements. choices: per decoder
    layer, the keys and experts it chose (LayerChoices); pass them back as `choices=` to make another model (e.g.
    a quantized copy) choose the same."""

    logits: Tensor
    layer_outputs: list[Tensor]
    choices: list[LayerChoices]


class DecoderModel(nn.Module):
    """The network of a GLM-5 / DeepSeek-V3.2 causal LM, whose hot paths all run through the glm5_hal ops: the
    embedding, the decoder layers and the LM head, stepped through a paged cache (causal_lm.CausalLM adds loading
    and generation).

    Module names equal the checkpoint's parameter prefixes (`model.layers.3.self_attn.q_a_proj` holds
    `model.layers.3.self_attn.q_a_proj.weight`), except that a layer's routed experts are one `RoutedExperts`
    at `model.layers.N.mlp.experts` (stacked w13 / w2).
    """

    # The backend every op of this model runs on (None: the usual selection, GLM5_HAL_BACKEND / use_backend / auto).
    backend: str | None = None

    def __init__(self, cfg: ModelConfig, state_dict: dict[str, Tensor]) -> None:
        super().__init__()
        check_state_dict(cfg, state_dict)
        self.cfg = cfg
        self.dtype = state_dict["model.embed_tokens.weight"].dtype
        self.model = DecoderStack(cfg, state_dict)
        self.lm_head = Linear(state_dict["lm_head.weight"])

    @property
    def device(self) -> torch.device:
        """Where the weights (and the caches new_cache makes) live."""
        return self.model.embed_tokens.weight.device

    # --- the quantization hook -------------------------------------------------------------------------------
    def linears(self) -> dict[str, nn.Module]:
        """Every linear call site by module path (router gates and lm_head included), whatever now sits there
        (a `Linear`, or the quantized module that replaced it)."""
        return {name: self.get_submodule(name) for name in linear_module_names(self.cfg)}

    def routed_experts(self) -> dict[str, nn.Module]:
        """The routed-experts call site of every MoE layer by module path ("model.layers.N.mlp.experts")."""
        return {name: self.get_submodule(name) for name in expert_module_names(self.cfg)}

    def replace_module(self, name: str, new: nn.Module) -> nn.Module:
        """Put `new` at module path `name` (e.g. "model.layers.1.mlp.experts"); returns the old module."""
        parent_name, _, child = name.rpartition(".")
        parent = self.get_submodule(parent_name) if parent_name else self
        old = getattr(parent, child)  # AttributeError names the path if it does not exist
        setattr(parent, child, new)
        return old

    # --- running ---------------------------------------------------------------------------------------------
    def new_cache(
        self,
        max_tokens: int,
        *,
        block_size: int = 16,
        device: torch.device | str = "cpu",
        shuffle_seed: int | None = None,
        kv_cache_dtype: str = "auto",
        index_cache_dtype: str = "auto",
    ) -> PagedKVCache:
        """A cache with room for `max_tokens` tokens over all sequences (whole blocks per sequence: leave slack).
        kv_cache_dtype / index_cache_dtype: the caches' formats (PagedKVCache; e.g. "fp8_ds_mla" / "fp8_index")."""
        num_blocks = max(1, -(-max_tokens // block_size))
        return PagedKVCache(
            self.cfg,
            num_blocks,
            block_size,
            self.dtype,
            device,
            shuffle_seed=shuffle_seed,
            kv_cache_dtype=kv_cache_dtype,
            index_cache_dtype=index_cache_dtype,
        )

    @torch.no_grad()
    def forward(
        self,
        input_ids: Tensor,
        cache: PagedKVCache,
        step: StepMetadata,
        *,
        choices: Sequence[LayerChoices] | None = None,
        logits: Literal["all", "last"] = "all",
        record: bool = True,
    ) -> ModelOutput:
        """Run the new tokens input_ids [T] int64 (token-major, laid out as `step` says) through the model,
        writing their cache rows. Returns the logits of every new token and the per-layer outputs.

        choices: None (every layer's indexer and router choose), or ModelOutput.choices of a run of a model of
        the same config over the same step: every layer then attends the same keys and uses the same experts
        and weights.
        logits: "all" ([T, vocab]) or "last" ([B, vocab]: each sequence's last new token, what generation needs;
        lm_head then runs on B rows instead of T).
        record: False leaves ModelOutput.layer_outputs and .choices empty instead of holding every layer's
        [T, hidden] output and [T, index_topk] selection until the call returns (generation)."""
        if logits not in ("all", "last"):
            raise ValueError(f"logits: expected 'all' or 'last', got {logits!r}")
        if input_ids.dim() != 1 or input_ids.shape[0] != step.num_tokens:
            raise ValueError(
                f"input_ids: expected shape [T] with T = {step.num_tokens} (the step's tokens), "
                f"got {tuple(input_ids.shape)}"
            )
        layers = self.model.layers
        forced = [None] * len(layers) if choices is None else list(choices)
        if len(forced) != len(layers):
            raise ValueError(f"choices: expected one LayerChoices per layer ({len(layers)}), got {len(forced)}")
        for i, c in enumerate(forced):
            if c is not None:
                self._check_choices(i, c, step.num_tokens)
        with use_backend(self.backend) if self.backend is not None else contextlib.nullcontext():
            cos, sin = rope_cos_sin(self.cfg, step.positions, compute_dtype(self.model.embed_tokens.weight))
            h = self.model.embed_tokens(input_ids)
            layer_outputs, used = [], []
            for layer, layer_choices in zip(layers, forced, strict=True):
                h, layer_choices = layer(h, cos, sin, cache, step, layer_choices)
                if record:
                    layer_outputs.append(h)
                    used.append(layer_choices)
            if logits == "last":
                h = h[step.cu_seqlens_q[1:].long() - 1]
            return ModelOutput(self.lm_head(self.model.norm(h)), layer_outputs, used)

    def _check_choices(self, layer: int, choices: LayerChoices, num_tokens: int) -> None:
        """Shapes of replayed choices against this step (a choice from another step is a clear error)."""
        cfg = self.cfg
        expected = {"topk_indices": (num_tokens, cfg.index_topk)}
        got = {"topk_indices": tuple(choices.topk_indices.shape)}
        if choices.routing is not None:
            k = cfg.num_experts_per_tok
            expected.update(topk_weights=(num_tokens, k), topk_ids=(num_tokens, k))
            got.update(topk_weights=tuple(choices.routing[0].shape), topk_ids=tuple(choices.routing[1].shape))
        if got != expected:
            raise ValueError(f"choices[{layer}]: expected shapes {expected} for this step, got {got}")

    def step(
        self,
        cache: PagedKVCache,
        tokens: dict[Hashable, Sequence[int] | Tensor],
        *,
        choices: Sequence[LayerChoices] | None = None,
        logits: Literal["all", "last"] = "all",
        record: bool = True,
    ) -> ModelOutput:
        """Append tokens to sequences ({seq_id: token ids}); new ids are prefilled, known ones continue (decode
        or chunked prefill). Logits rows follow the dict's order, token-major. choices, logits, record: see
        forward."""
        ids = [torch.as_tensor(t, dtype=torch.int64).reshape(-1) for t in tokens.values()]
        plan = cache.plan_step(list(tokens), [t.numel() for t in ids])
        return self.forward(torch.cat(ids).to(cache.device), cache, plan, choices=choices, logits=logits, record=record)

    def prefill(
        self,
        input_ids: Tensor | Sequence[int],
        *,
        block_size: int = 16,
        choices: Sequence[LayerChoices] | None = None,
        kv_cache_dtype: str = "auto",
        index_cache_dtype: str = "auto",
    ) -> ModelOutput:
        """One sequence from scratch in a fresh cache (the common case for quality measurements).
        choices: see forward. kv_cache_dtype / index_cache_dtype: the fresh cache's formats (new_cache)."""
        ids = torch.as_tensor(input_ids, dtype=torch.int64).reshape(-1)
        cache = self.new_cache(
            ids.numel(),
            block_size=block_size,
            device=self.device,
            kv_cache_dtype=kv_cache_dtype,
            index_cache_dtype=index_cache_dtype,
        )
        return self.step(cache, {0: ids}, choices=choices)
