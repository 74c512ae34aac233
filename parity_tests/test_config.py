"""Model presets carry OPS.md's numbers; derived values are computed from them."""

from __future__ import annotations

import dataclasses

import pytest

from glm5_hal.config import DEEPSEEK_V32, GLM5, GLM5_MINI, get_preset


def test_glm5_numbers():
    assert (GLM5.hidden_size, GLM5.num_attention_heads, GLM5.q_lora_rank, GLM5.kv_lora_rank) == (6144, 64, 2048, 512)
    assert (GLM5.qk_nope_head_dim, GLM5.qk_rope_head_dim, GLM5.v_head_dim) == (192, 64, 256)
    assert (GLM5.index_n_heads, GLM5.index_head_dim, GLM5.index_topk) == (32, 128, 2048)
    assert GLM5.indexer_rope_interleaved and GLM5.mla_rope_interleaved
    assert (GLM5.n_routed_experts, GLM5.num_experts_per_tok, GLM5.n_shared_experts) == (256, 8, 1)
    assert (GLM5.n_group, GLM5.topk_group, GLM5.routed_scaling_factor) == (1, 1, 2.5)
    assert (GLM5.moe_intermediate_size, GLM5.intermediate_size, GLM5.rms_norm_eps) == (2048, 12288, 1e-5)
    assert GLM5.qk_head_dim == 256 and GLM5.latent_dim == 576
    assert GLM5.sm_scale == pytest.approx(0.0625, abs=0)


def test_deepseek_v32_numbers():
    ds = DEEPSEEK_V32
    assert (ds.hidden_size, ds.num_attention_heads, ds.q_lora_rank, ds.kv_lora_rank) == (7168, 128, 1536, 512)
    assert (ds.qk_nope_head_dim, ds.qk_rope_head_dim, ds.v_head_dim, ds.qk_head_dim) == (128, 64, 128, 192)
    assert (ds.index_n_heads, ds.index_topk, ds.indexer_rope_interleaved) == (64, 2048, False)
    assert (ds.n_group, ds.topk_group, ds.intermediate_size, ds.rms_norm_eps) == (8, 4, 18432, 1e-6)
    assert ds.latent_dim == 576
    # 192^-0.5 with YaRN mscale^2 (factor 40): OPS.md's 0.135234.
    assert ds.sm_scale == pytest.approx(0.135234, abs=5e-7)


def test_mini_keeps_glm5_structure():
    assert GLM5_MINI.latent_dim == 576 and GLM5_MINI.kv_lora_rank == 512
    assert GLM5_MINI.index_head_dim == 128 and GLM5_MINI.qk_rope_head_dim == 64
    assert GLM5_MINI.scoring_func == "sigmoid"
    assert GLM5_MINI.hidden_size < 1024 and GLM5_MINI.n_routed_experts <= 16
    assert GLM5_MINI.sm_scale == GLM5.sm_scale


def test_presets_are_frozen_and_named():
    with pytest.raises(dataclasses.FrozenInstanceError):
        GLM5.hidden_size = 1  # type: ignore[misc]
    assert get_preset("glm5-mini") is GLM5_MINI
    with pytest.raises(ValueError, match="preset: expected one of"):
        get_preset("llama")
