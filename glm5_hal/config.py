"""Model configurations the ops serve: GLM-5, DeepSeek-V3.2 and a small GLM-5-shaped preset for tests.

Every number here is a field of the Hugging Face config of the model (names follow those configs); everything
that follows from them (qk_head_dim, the 576-wide latent row, the softmax scale) is a property, computed once,
never typed twice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class YarnScaling:
    """YaRN RoPE scaling (DeepSeek-V3.2). Only `factor` and `mscale_all_dim` change the softmax scale."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 1.0

    @property
    def attention_mscale(self) -> float:
        """YaRN's attention magnitude correction: 0.1 * mscale_all_dim * ln(factor) + 1 (1 for factor <= 1)."""
        if self.factor <= 1.0:
            return 1.0
        return 0.1 * self.mscale_all_dim * math.log(self.factor) + 1.0


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and routing hyper-parameters of one GLM-5-class model (one decoder layer's view of them)."""

    name: str
    hidden_size: int
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    # Lightning indexer (DeepSeek Sparse Attention).
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    indexer_rope_interleaved: bool
    # MoE.
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    scoring_func: str
    norm_topk_prob: bool
    moe_intermediate_size: int
    intermediate_size: int
    first_k_dense_replace: int
    # Norms, RoPE, vocabulary.
    rms_norm_eps: float
    rope_theta: float
    num_hidden_layers: int
    vocab_size: int
    indexer_norm_eps: float = 1e-6
    mla_rope_interleaved: bool = True
    rope_scaling: YarnScaling | None = field(default=None)

    @property
    def qk_head_dim(self) -> int:
        """Per-head query/key width before absorption: nope + rope (GLM-5: 256, DeepSeek-V3.2: 192)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Width of one MLA KV-cache row and of the absorbed query: kv_lora + rope (576 for both models)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def sm_scale(self) -> float:
        """Softmax scale of the absorbed attention, from the UNabsorbed qk_head_dim (times YaRN mscale^2)."""
        mscale = self.rope_scaling.attention_mscale if self.rope_scaling is not None else 1.0
        return self.qk_head_dim**-0.5 * mscale * mscale

    @property
    def indexer_weight_scale(self) -> float:
        """Factor folded into the indexer head weights: index_n_heads^-0.5 * index_head_dim^-0.5."""
        return self.index_n_heads**-0.5 * self.index_head_dim**-0.5

    def with_overrides(self, **changes: object) -> ModelConfig:
        """A copy with some fields changed (e.g. a smaller index_topk for a test)."""
        return replace(self, **changes)


GLM5 = ModelConfig(
    name="glm5",
    hidden_size=6144,
    num_attention_heads=64,
    q_lora_rank=2048,
    kv_lora_rank=512,
    qk_nope_head_dim=192,
    qk_rope_head_dim=64,
    v_head_dim=256,
    index_n_heads=32,
    index_head_dim=128,
    index_topk=2048,
    indexer_rope_interleaved=True,
    n_routed_experts=256,
    num_experts_per_tok=8,
    n_shared_experts=1,
    n_group=1,
    topk_group=1,
    routed_scaling_factor=2.5,
    scoring_func="sigmoid",
    norm_topk_prob=True,
    moe_intermediate_size=2048,
    intermediate_size=12288,
    first_k_dense_replace=3,
    rms_norm_eps=1e-5,
    rope_theta=1e6,
    num_hidden_layers=78,
    vocab_size=154880,
)

DEEPSEEK_V32 = ModelConfig(
    name="deepseek-v32",
    hidden_size=7168,
    num_attention_heads=128,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    index_n_heads=64,
    index_head_dim=128,
    index_topk=2048,
    indexer_rope_interleaved=False,
    n_routed_experts=256,
    num_experts_per_tok=8,
    n_shared_experts=1,
    n_group=8,
    topk_group=4,
    routed_scaling_factor=2.5,
    scoring_func="sigmoid",
    norm_topk_prob=True,
    moe_intermediate_size=2048,
    intermediate_size=18432,
    first_k_dense_replace=3,
    rms_norm_eps=1e-6,
    rope_theta=1e4,
    num_hidden_layers=61,
    vocab_size=129280,
    rope_scaling=YarnScaling(factor=40.0, original_max_position_embeddings=4096),
)

# GLM-5's structure (576/512 latent, 192/64/256 head split, 128-wide indexer with RoPE 64, sigmoid routing)
# at a size where the whole parity suite runs on a 2-core CPU in seconds.
GLM5_MINI = GLM5.with_overrides(
    name="glm5-mini",
    hidden_size=256,
    num_attention_heads=4,
    q_lora_rank=128,
    index_n_heads=4,
    index_topk=64,
    n_routed_experts=16,
    num_experts_per_tok=4,
    moe_intermediate_size=64,
    intermediate_size=512,
    first_k_dense_replace=1,
    num_hidden_layers=2,
    vocab_size=1024,
)

PRESETS: dict[str, ModelConfig] = {cfg.name: cfg for cfg in (GLM5, DEEPSEEK_V32, GLM5_MINI)}


def get_preset(name: str) -> ModelConfig:
    """The preset called `name`; a ValueError lists the known names otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"preset: expected one of {sorted(PRESETS)}, got {name!r}") from None
