"""transformers' GLM-5 (`glm_moe_dsa`) and DeepSeek-V3.2 (`deepseek_v32`) causal LMs on glm5_hal.model's weights:
the independent implementation the model tests compare against (test-only; importorskip when missing)."""

from __future__ import annotations

import pytest
import torch

from glm5_hal.config import ModelConfig


def hf_config(cfg: ModelConfig):
    """(transformers' causal-LM class, its config) for cfg: GLM-5 (`glm_moe_dsa`, interleaved indexer RoPE) or
    DeepSeek-V3.2 (`deepseek_v32`, half-split indexer RoPE)."""
    transformers = pytest.importorskip("transformers", reason="transformers (test-only dependency) not installed")
    if cfg.indexer_rope_interleaved:
        config_class, model_class = transformers.GlmMoeDsaConfig, transformers.GlmMoeDsaForCausalLM
    else:
        config_class, model_class = transformers.DeepseekV32Config, transformers.DeepseekV32ForCausalLM
    rope: dict[str, object] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    max_positions = 4096
    if cfg.rope_scaling is not None:
        yarn = cfg.rope_scaling
        rope.update(
            rope_type="yarn",
            factor=yarn.factor,
            original_max_position_embeddings=yarn.original_max_position_embeddings,
            beta_fast=yarn.beta_fast,
            beta_slow=yarn.beta_slow,
            mscale=yarn.mscale,
            mscale_all_dim=yarn.mscale_all_dim,
        )
        max_positions = int(yarn.original_max_position_embeddings * yarn.factor)
    hf_cfg = config_class(
        max_position_embeddings=max_positions,
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        moe_intermediate_size=cfg.moe_intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_attention_heads,
        n_shared_experts=cfg.n_shared_experts,
        n_routed_experts=cfg.n_routed_experts,
        routed_scaling_factor=cfg.routed_scaling_factor,
        kv_lora_rank=cfg.kv_lora_rank,
        q_lora_rank=cfg.q_lora_rank,
        qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim,
        qk_nope_head_dim=cfg.qk_nope_head_dim,
        n_group=cfg.n_group,
        topk_group=cfg.topk_group,
        num_experts_per_tok=cfg.num_experts_per_tok,
        norm_topk_prob=cfg.norm_topk_prob,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_parameters=rope,
        index_topk=cfg.index_topk,
        index_head_dim=cfg.index_head_dim,
        index_n_heads=cfg.index_n_heads,
        first_k_dense_replace=cfg.first_k_dense_replace,
    )
    hf_cfg._attn_implementation = "eager"
    return model_class, hf_cfg


def hf_state_dict(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our checkpoint-named dict in transformers' module layout: per-expert matrices stacked into
    experts.gate_up_proj [E, 2I, D] and experts.down_proj [E, D, I] (what its checkpoint converter does)."""
    out = {k: v for k, v in state.items() if ".mlp.experts." not in k}
    for layer in range(cfg.first_k_dense_replace, cfg.num_hidden_layers):
        p = f"model.layers.{layer}.mlp.experts"
        experts = range(cfg.n_routed_experts)
        out[f"{p}.gate_up_proj"] = torch.stack(
            [torch.cat([state[f"{p}.{e}.gate_proj.weight"], state[f"{p}.{e}.up_proj.weight"]]) for e in experts]
        )
        out[f"{p}.down_proj"] = torch.stack([state[f"{p}.{e}.down_proj.weight"] for e in experts])
    return out


def hf_model(cfg: ModelConfig, state: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32):
    model_class, hf_cfg = hf_config(cfg)
    model = model_class(hf_cfg).eval()
    model.load_state_dict(hf_state_dict(cfg, state), strict=True)
    # transformers builds q_a_layernorm / kv_a_layernorm with a hard-coded eps of 1e-6 while the other norms use
    # rms_norm_eps; mla_prolog takes one eps (rms_norm_eps, as vLLM's DeepSeek/GLM MLA does). Align the
    # reference to the model under test; docs/model.md reports the difference.
    for layer in model.model.layers:
        layer.self_attn.q_a_layernorm.variance_epsilon = cfg.rms_norm_eps
        layer.self_attn.kv_a_layernorm.variance_epsilon = cfg.rms_norm_eps
    return model.to(dtype)
