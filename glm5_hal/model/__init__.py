"""A GLM-5 / DeepSeek-V3.2 causal LM built only from the glm5_hal ops (docs/model.md).

Weights: a flat dict of tensors with the Hugging Face checkpoint names (`weights.parameter_shapes(cfg)` lists
them with shapes; `random_state_dict(cfg, seed, dtype)` makes seeded random ones; routed experts are stored per
expert, `model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight`, as in the checkpoints).

    model = CausalLM(cfg, state_dict)                 # cfg: glm5_hal.config.ModelConfig (e.g. GLM5_MINI)
    out = model.prefill(token_ids)                    # one sequence, fresh cache
    out.logits            # [T, vocab]
    out.layer_outputs     # per layer: residual stream [T, hidden] after it (per-layer SQNR)
    out.choices           # per layer: LayerChoices (the keys its indexer selected; a MoE layer's experts)
    other.prefill(token_ids, choices=out.choices)   # same keys, same experts (quantization measurements)

    Precision: the model runs in the dtype of its state dict (bf16, fp16, fp32); a float64 state dict gives a
    float64 model for verification (e.g. QuaRot invariance), on a backend that supports float64 (reference).

    cache = model.new_cache(max_tokens=256, block_size=16)
    out = model.step(cache, {"a": prompt_a, "b": prompt_b})     # ragged batched prefill
    out = model.step(cache, {"a": [next_a], "b": [next_b]})     # decode (any mix of counts works)

Quantization hook (the contract with quantization/): every matmul with a checkpoint weight runs through one
of two swappable call sites.

- `Linear` (linear.py): `.weight` [out, in]; call x [..., in] -> [..., out] in x's dtype. Module paths equal
  the checkpoint prefixes: `model.linears()` returns {path: module} for all of them (q_a_proj, q_b_proj,
  kv_a_proj_with_mqa, kv_b_proj, o_proj, indexer.wq_b / wk / weights_proj, dense and shared-expert
  gate/up/down_proj, mlp.gate (the router, a `TopkRouter(Linear)` that returns fp32 logits and carries
  `e_score_correction_bias`), lm_head). `model.replace_module(path, new)` swaps one; `new` must take and
  return the same shapes and dtype.
- `RoutedExperts` (linear.py): `.w13` [E, 2I, D] (gate rows then up rows), `.w2` [E, D, I]; call
  (x [T, D], topk_weights [T, k] fp32, topk_ids [T, k] int32) -> [T, D], routing weights applied (fused_moe).
  `model.routed_experts()` lists them ("model.layers.N.mlp.experts").

What a replacement changes: when q_a_proj, q_b_proj or kv_a_proj_with_mqa is no longer exactly a `Linear`,
that layer's MLA prolog runs decomposed (the three projections through the replacements, the RMSNorms, RoPE and
the cache write in torch); likewise the indexer prolog for wq_b / wk / weights_proj. kv_b_proj must keep a dense
floating `weight` (its K half is absorbed into the query, its V half applied per head); the recipe keeps it,
the router gates and the indexer's wk / weights_proj unquantized. A subclass of `Linear` (e.g. an activation
recorder for calibration) also takes the decomposed path, so recorders see every projection's input.
"""

from glm5_hal.model.cache import PagedKVCache, StepMetadata
from glm5_hal.model.causal_lm import CausalLM
from glm5_hal.model.decoder import DecoderLayer, DecoderModel, LayerChoices, ModelOutput
from glm5_hal.model.hf_config import config_from_hf, config_to_hf, load_config
from glm5_hal.model.linear import Linear, RoutedExperts
from glm5_hal.model.mlp import Routing
from glm5_hal.model.rope import rope_cos_sin, rope_inv_freq
from glm5_hal.model.weights import (
    check_state_dict,
    expert_module_names,
    linear_module_names,
    parameter_shapes,
    random_state_dict,
)

__all__ = [
    "CausalLM",
    "DecoderLayer",
    "DecoderModel",
    "ModelOutput",
    "LayerChoices",
    "Linear",
    "RoutedExperts",
    "Routing",
    "PagedKVCache",
    "StepMetadata",
    "random_state_dict",
    "parameter_shapes",
    "check_state_dict",
    "linear_module_names",
    "expert_module_names",
    "rope_cos_sin",
    "rope_inv_freq",
    "config_from_hf",
    "config_to_hf",
    "load_config",
]
