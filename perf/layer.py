"""One whole GLM-5 decoder layer, and transformers' eager `glm_moe_dsa` layer on the same weights and cache.

`glm5-hal bench --scenarios layer` times, per context length (4K..128K keys), one decode step (1 new token) and
one prefill chunk (PREFILL_CHUNK new tokens after the rest of the context) through

- `glm5_layer`: glm5_hal.model's DecoderLayer: input RMSNorm, mla_prolog, indexer_prolog, lightning_indexer,
  sparse_flash_attention, W_UV + o_proj, residual, RMSNorm, router + moe_gate + fused_moe + shared expert, on
  the selected glm5_hal backend(s);
- `transformers_layer` (a baseline, timed once): transformers' GlmMoeDsaDecoderLayer with eager attention,
  whose parameters are the same tensors (shared storage, no copy), on a DynamicCache holding the same latent
  rows and indexer keys. Its attention is dense over the whole context (it expands every cached latent row
  through kv_b_proj at every call and masks the keys the indexer did not pick), so its working set grows with
  context x heads; `transformers_layer_bytes` estimates it, and the scenario is skipped, with the estimate in the
  message, where that exceeds HF_MEMORY_FRACTION (or $GLM5_HAL_BENCH_HF_MEMORY_FRACTION) of the memory available
  when it is built.

Experts: a decode token touches num_experts_per_tok (8) of GLM-5's 256 experts, so the layer holds exactly those
8 (RESIDENT experts: n_routed_experts = num_experts_per_tok = 8, every token routed to all of them; the router
scores 8 experts instead of 256, 0.05% of the layer's weight bytes). Decode then moves exactly the real layer's
bytes. A prefill chunk does each token's real expert FLOPs, but over 8 experts where GLM-5 would spread its
tokens over up to 256: its expert weight traffic is that of 8 experts.

Both implementations are judged against one roofline cost (perf/costs.py `decoder_layer`): the layer's minimum
work, sparse attention over index_topk keys.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from glm5_hal.config import ModelConfig
from glm5_hal.model.cache import PagedKVCache, StepMetadata
from glm5_hal.model.decoder import DecoderLayer
from glm5_hal.model.hf_config import config_to_hf
from glm5_hal.model.rope import rope_cos_sin
from glm5_hal.model.weights import random_state_dict
from perf import costs
from perf.costs import Cost

PREFILL_CHUNK = 512  # new tokens of one prefill chunk
DECODE_TOKENS = 1  # one sequence: batch 1, so the 8 resident experts are exactly what the step touches
BLOCK = 64  # cache block size (vLLM's default for MLA)
HF_MEMORY_FRACTION = 0.5  # of MemAvailable: what transformers' layer may use; the rest stays for everyone else
MEMORY_FRACTION_ENV = "GLM5_HAL_BENCH_HF_MEMORY_FRACTION"
WEIGHT_SEED = 1234


class ScenarioSkipped(RuntimeError):
    """A scenario that cannot run here (the reason says why); the bench reports it and goes on."""


def layer_config(base: ModelConfig) -> ModelConfig:
    """One MoE decoder layer of `base` holding the experts one token touches (module docstring). vocab_size 2: the
    layer has no vocabulary, and random_state_dict's embedding and head then stay tiny."""
    resident = base.num_experts_per_tok
    return base.with_overrides(
        name=f"{base.name}-layer",
        num_hidden_layers=1,
        first_k_dense_replace=0,
        n_routed_experts=resident,
        num_experts_per_tok=resident,
        n_group=1,
        topk_group=1,
        vocab_size=2,
    )


@functools.lru_cache(maxsize=1)
def glm5_layer(cfg: ModelConfig, dtype: torch.dtype) -> DecoderLayer:
    """The DecoderLayer of layer_config `cfg` on seeded random weights (cached: one layer's weights are ~1 GB)."""
    state = random_state_dict(cfg, seed=WEIGHT_SEED, dtype=dtype)
    return DecoderLayer(cfg, 0, state)  # the per-expert tensors of `state` die here: only the stacked ones stay


def transformers_layer(cfg: ModelConfig, ours: DecoderLayer) -> tuple[nn.Module, nn.Module]:
    """(transformers' GlmMoeDsaDecoderLayer on `ours`'s tensors, its rotary embedding).

    The layer is layer 0 of a GlmMoeDsaForCausalLM built on the meta device with eager attention, so transformers'
    own model code picks everything else as it would for a user (its experts implementation: grouped_mm where
    torch has it, else its eager loop); it is then given our tensors (load_state_dict assign=True): no copy.
    """
    try:
        from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM
        from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaRotaryEmbedding
    except ImportError as exc:
        raise ScenarioSkipped(f"transformers with glm_moe_dsa is not installed ({exc})") from None
    hf_cfg = GlmMoeDsaConfig(**config_to_hf(cfg, "glm_moe_dsa"))
    hf_cfg._attn_implementation = "eager"
    with torch.device("meta"):
        layer = GlmMoeDsaForCausalLM(hf_cfg).model.layers[0]
    renamed = {"mlp.experts.w13": "mlp.experts.gate_up_proj", "mlp.experts.w2": "mlp.experts.down_proj"}
    state = {renamed.get(name, name): t for name, t in ours.state_dict(keep_vars=True).items()}
    layer.load_state_dict(state, strict=True, assign=True)
    # transformers hard-codes eps 1e-6 for the two latent norms; mla_prolog uses rms_norm_eps for both
    # (docs/model.md): the same layer, not a different model.
    layer.self_attn.q_a_layernorm.variance_epsilon = cfg.rms_norm_eps
    layer.self_attn.kv_a_layernorm.variance_epsilon = cfg.rms_norm_eps
    return layer.eval(), GlmMoeDsaRotaryEmbedding(hf_cfg)


def transformers_experts_implementation(layer: nn.Module) -> str:
    """Which experts forward transformers chose for `layer` ("grouped_mm", "eager", ...)."""
    return str(layer.mlp.experts.config._experts_implementation)


def _deinterleave(x: Tensor, rope: int) -> Tensor:
    """transformers' layout of a RoPE'd vector whose first `rope` dims hold interleaved pairs: the even dims then the
    odd ones (apply_rotary_pos_emb_interleave writes cat(even', odd')). Dot products are unchanged."""
    return torch.cat([x[..., :rope:2], x[..., 1:rope:2], x[..., rope:]], -1)


@dataclass
class _Context:
    """One sequence's cached context and new tokens, as both implementations see them.

    latent: [cached, kv_lora + rope] (normalised c_kv, then k_pe in OPS.md's interleaved layout); index_keys:
    [cached, index_head_dim] (RoPE'd first rope dims interleaved); h: [new, hidden]; positions: [new] int64.
    """

    latent: Tensor
    index_keys: Tensor
    h: Tensor
    positions: Tensor


def _context(cfg: ModelConfig, new_tokens: int, context: int, gen: torch.Generator, dtype: torch.dtype) -> _Context:
    cached = context - new_tokens
    return _Context(
        latent=torch.randn(cached, cfg.latent_dim, generator=gen).to(dtype),
        index_keys=torch.randn(cached, cfg.index_head_dim, generator=gen).to(dtype),
        h=torch.randn(new_tokens, cfg.hidden_size, generator=gen).to(dtype),
        positions=torch.arange(cached, context),
    )


@dataclass
class GLM5LayerInputs:
    """One timed call of glm5_layer: the layer, its new tokens h [T, hidden], RoPE cos / sin [T, rope / 2], the
    paged cache holding the context and the step writing the new tokens (the same slots on every call)."""

    cfg: ModelConfig
    context: int
    layer: DecoderLayer
    h: Tensor
    cos: Tensor
    sin: Tensor
    cache: PagedKVCache
    step: StepMetadata

    def to_device(self, device: torch.device) -> GLM5LayerInputs:
        """These inputs on `device` (the layer moves in place: it is shared by every input set)."""
        cache = self.cache
        cache.kv = [t.to(device) for t in cache.kv]
        cache.index_k = [t.to(device) for t in cache.index_k]
        cache.device = device
        step = StepMetadata(**{f.name: getattr(self.step, f.name).to(device) for f in dataclasses.fields(StepMetadata)})
        h, cos, sin = (t.to(device) for t in (self.h, self.cos, self.sin))
        return GLM5LayerInputs(self.cfg, self.context, self.layer.to(device), h, cos, sin, cache, step)


def glm5_layer_inputs(
    cfg: ModelConfig, new_tokens: int, context: int
) -> Callable[[torch.Generator, torch.dtype], dict]:
    def build(gen: torch.Generator, dtype: torch.dtype) -> dict:
        layer = glm5_layer(cfg, dtype)
        ctx = _context(cfg, new_tokens, context, gen, dtype)
        cache = PagedKVCache(cfg, -(-context // BLOCK), BLOCK, dtype)
        filled = cache.plan_step([0], [context - new_tokens])
        cache.kv[0].view(-1, cfg.latent_dim)[filled.slot_mapping] = ctx.latent
        cache.index_k[0].view(-1, cfg.index_head_dim)[filled.slot_mapping] = ctx.index_keys
        step = cache.plan_step([0], [new_tokens])
        cos, sin = rope_cos_sin(cfg, step.positions, torch.float32)
        return {"inputs": GLM5LayerInputs(cfg, context, layer, ctx.h, cos, sin, cache, step)}

    return build


@dataclass
class TransformersLayerInputs:
    """One timed call of transformers_layer: its layer, h [1, T, hidden], (cos, sin), the additive causal mask
    [1, 1, T, context], and a DynamicCache reset to the context before every call (its update concatenates)."""

    cfg: ModelConfig
    context: int
    layer: nn.Module
    h: Tensor
    position_ids: Tensor
    position_embeddings: tuple[Tensor, Tensor]
    mask: Tensor
    cache: object
    cached: tuple[Tensor, Tensor, Tensor]  # (keys [1, 1, L, kv_lora], values [1, 1, L, rope], index keys [1, L, DI])

    def to_device(self, device: torch.device) -> TransformersLayerInputs:
        """These inputs on `device` (the layer moves in place: it is shared by every input set)."""
        cached = tuple(t.to(device) for t in self.cached)
        layer_cache = self.cache.layers[0]
        layer_cache.keys, layer_cache.values, layer_cache.indexer_keys = cached
        layer_cache.device = layer_cache.indexer_device = device
        cos, sin = (t.to(device) for t in self.position_embeddings)
        return TransformersLayerInputs(
            self.cfg,
            self.context,
            self.layer.to(device),
            self.h.to(device),
            self.position_ids.to(device),
            (cos, sin),
            self.mask.to(device),
            self.cache,
            cached,
        )


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (None off Linux)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def transformers_layer_bytes(cfg: ModelConfig, new_tokens: int, context: int, elem: int) -> int:
    """Estimated peak bytes one eager transformers layer call allocates beyond its weights. Alive throughout: the
    latent cache and indexer keys re-concatenated, every cached row expanded by kv_b_proj [context, H * (nope + v)],
    key_states [H, context, qk_head_dim] and a contiguous copy of the value view. On top, first the indexer's fp32
    keys and scores [T, HI, context] (the scores and their ReLU), then, once those are freed, the attention scores
    [H, T, context] (in the activation dtype, and fp32 in the softmax); and the masks. Measured (peak RSS growth
    of a call, GLM-5 layer in bf16 on a CPU): decode at 4K keys 481 MiB (estimate 488), a 512-token chunk at 4K
    1631 MiB (estimate 1519): within 7%, well inside HF_MEMORY_FRACTION's margin."""
    heads, q, n = cfg.num_attention_heads, new_tokens, context
    cache = n * (cfg.latent_dim + cfg.index_head_dim) * elem
    expanded = n * heads * (cfg.qk_nope_head_dim + cfg.v_head_dim) * elem
    keys_values = n * heads * (cfg.qk_head_dim + cfg.v_head_dim) * elem
    indexer = n * cfg.index_head_dim * 4 + 2 * q * cfg.index_n_heads * n * 4 + 2 * q * n * 4
    scores = heads * q * n * (2 * elem + 4)
    masks = q * n * (1 + 2 * elem)
    return cache + expanded + keys_values + max(indexer, scores) + masks


def transformers_layer_inputs(
    cfg: ModelConfig, new_tokens: int, context: int
) -> Callable[[torch.Generator, torch.dtype], dict]:
    def build(gen: torch.Generator, dtype: torch.dtype) -> dict:
        need = transformers_layer_bytes(cfg, new_tokens, context, torch.empty(0, dtype=dtype).element_size())
        available, fraction = available_memory_bytes(), memory_fraction()
        if available is not None and need > fraction * available:
            raise ScenarioSkipped(
                f"transformers' eager layer needs ~{need / 2**30:.1f} GiB here (estimate: dense attention over "
                f"{context} keys), more than {fraction:.0%} of the {available / 2**30:.1f} GiB available"
            )
        layer, rotary = _transformers_layer_cached(cfg, dtype)  # ScenarioSkipped without transformers
        from transformers import DynamicCache

        ctx = _context(cfg, new_tokens, context, gen, dtype)
        rope, kv_lora = cfg.qk_rope_head_dim, cfg.kv_lora_rank
        cache = DynamicCache(config=layer.self_attn.config)
        k_pe = _deinterleave(ctx.latent[:, kv_lora:], rope)
        cache.update(ctx.latent[None, None, :, :kv_lora], k_pe[None, None], 0)
        cache.update_indexer(_deinterleave(ctx.index_keys, rope)[None], 0)
        position_ids = ctx.positions[None]
        h = ctx.h[None]
        mask = torch.zeros(1, 1, new_tokens, context, dtype=dtype)
        future = torch.arange(context)[None, :] > ctx.positions[:, None]
        mask[0, 0].masked_fill_(future, torch.finfo(dtype).min)
        cached = (cache.layers[0].keys, cache.layers[0].values, cache.layers[0].indexer_keys)
        return {
            "inputs": TransformersLayerInputs(
                cfg, context, layer, h, position_ids, rotary(h, position_ids), mask, cache, cached
            )
        }

    return build


@functools.lru_cache(maxsize=1)
def _transformers_layer_cached(cfg: ModelConfig, dtype: torch.dtype) -> tuple[nn.Module, nn.Module]:
    return transformers_layer(cfg, glm5_layer(cfg, dtype))


def run_glm5_layer(inputs: GLM5LayerInputs) -> Tensor:
    """The new residual stream [T, hidden] (writes the new tokens' cache rows)."""
    out, _ = inputs.layer(inputs.h, inputs.cos, inputs.sin, inputs.cache, inputs.step)
    return out


@torch.no_grad()
def run_transformers_layer(inputs: TransformersLayerInputs) -> Tensor:
    """The new residual stream [1, T, hidden], from the cache as built (reset first: each call appends to it)."""
    layer_cache = inputs.cache.layers[0]
    layer_cache.keys, layer_cache.values, layer_cache.indexer_keys = inputs.cached
    out, _ = inputs.layer(
        inputs.h,
        attention_mask=inputs.mask,
        position_ids=inputs.position_ids,
        cache=inputs.cache,
        use_cache=True,
        position_embeddings=inputs.position_embeddings,
    )
    return out


def _weight_bytes(layer: DecoderLayer) -> int:
    return sum(t.numel() * t.element_size() for t in [*layer.parameters(), *layer.buffers()])


def layer_cost(inputs: dict) -> Cost:
    """The roofline cost of the scenario's layer call (either implementation): costs.decoder_layer."""
    x = inputs["inputs"]
    cfg, context, new_tokens = x.cfg, x.context, x.h.shape[-2]
    weights = _weight_bytes(glm5_layer(cfg, x.h.dtype))
    return costs.decoder_layer(cfg, new_tokens, context, x.h.element_size(), weights)


@dataclass(frozen=True)
class LayerOp:
    run: Callable[..., object]  # keyword inputs -> output
    cost: Callable[[dict], Cost]


# The layer as the model runs it (timed per backend, like an op) and transformers' (a baseline, timed once:
# perf/baselines.py).
GLM5_LAYER = LayerOp(run_glm5_layer, layer_cost)
TRANSFORMERS_LAYER = LayerOp(run_transformers_layer, layer_cost)
LAYER_OPS: dict[str, LayerOp] = {"glm5_layer": GLM5_LAYER}


def memory_fraction() -> float:
    """HF_MEMORY_FRACTION, or GLM5_HAL_BENCH_HF_MEMORY_FRACTION when set (e.g. 0.8 on a machine to oneself)."""
    value = os.environ.get(MEMORY_FRACTION_ENV)
    if value is None:
        return HF_MEMORY_FRACTION
    try:
        fraction = float(value)
    except ValueError:
        fraction = -1.0
    if not 0 < fraction <= 1:
        raise ValueError(f"{MEMORY_FRACTION_ENV}: expected a fraction in (0, 1], got {value!r}")
    return fraction
