"""Checkpoint parameter names and shapes of a GLM-5 / DeepSeek-V3.2 causal LM, and seeded random weights.

Names are those of the Hugging Face checkpoints (and of transformers' `glm_moe_dsa` / `deepseek_v32` modules,
whose experts are stored per expert in the checkpoint): a real safetensors shard loads by name.
"""

from __future__ import annotations

import re

import torch
from torch import Tensor

from glm5_hal.config import ModelConfig


def layer_prefix(layer: int) -> str:
    return f"model.layers.{layer}"


_LAYER_INDEX = re.compile(r"model\.layers\.(\d+)\.")


def is_mtp_tensor(name: str, cfg: ModelConfig) -> bool:
    """Whether checkpoint tensor `name` belongs to a multi-token-prediction layer: `model.layers.{i}.*` with
    i >= num_hidden_layers (GLM-5's layer 78: eh_proj, enorm, hnorm, shared_head, ...). The model does not
    implement them; loaders skip them (as transformers does) and `glm5-hal quantize` drops them."""
    m = _LAYER_INDEX.match(name)
    return m is not None and int(m.group(1)) >= cfg.num_hidden_layers


def is_moe_layer(cfg: ModelConfig, layer: int) -> bool:
    """Layers 0 .. first_k_dense_replace-1 have a dense MLP; the rest the MoE block."""
    return layer >= cfg.first_k_dense_replace


def parameter_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter of the model by checkpoint name, with its shape (nn.Linear layout [out, in])."""
    hidden, heads = cfg.hidden_size, cfg.num_attention_heads
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, hidden)}
    for layer in range(cfg.num_hidden_layers):
        p = layer_prefix(layer)
        attn, idx = f"{p}.self_attn", f"{p}.self_attn.indexer"
        shapes.update(
            {
                f"{p}.input_layernorm.weight": (hidden,),
                f"{p}.post_attention_layernorm.weight": (hidden,),
                f"{attn}.q_a_proj.weight": (cfg.q_lora_rank, hidden),
                f"{attn}.q_a_layernorm.weight": (cfg.q_lora_rank,),
                f"{attn}.q_b_proj.weight": (heads * cfg.qk_head_dim, cfg.q_lora_rank),
                f"{attn}.kv_a_proj_with_mqa.weight": (cfg.latent_dim, hidden),
                f"{attn}.kv_a_layernorm.weight": (cfg.kv_lora_rank,),
                f"{attn}.kv_b_proj.weight": (heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank),
                f"{attn}.o_proj.weight": (hidden, heads * cfg.v_head_dim),
                f"{idx}.wq_b.weight": (cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank),
                f"{idx}.wk.weight": (cfg.index_head_dim, hidden),
                f"{idx}.k_norm.weight": (cfg.index_head_dim,),
                f"{idx}.k_norm.bias": (cfg.index_head_dim,),
                f"{idx}.weights_proj.weight": (cfg.index_n_heads, hidden),
            }
        )
        if is_moe_layer(cfg, layer):
            mlp, inter = f"{p}.mlp", cfg.moe_intermediate_size
            shapes[f"{mlp}.gate.weight"] = (cfg.n_routed_experts, hidden)
            shapes[f"{mlp}.gate.e_score_correction_bias"] = (cfg.n_routed_experts,)
            for e in range(cfg.n_routed_experts):
                shapes.update(_mlp_shapes(f"{mlp}.experts.{e}", hidden, inter))
            shapes.update(_mlp_shapes(f"{mlp}.shared_experts", hidden, inter * cfg.n_shared_experts))
        else:
            shapes.update(_mlp_shapes(f"{p}.mlp", hidden, cfg.intermediate_size))
    shapes["model.norm.weight"] = (hidden,)
    shapes["lm_head.weight"] = (cfg.vocab_size, hidden)
    return shapes


def _mlp_shapes(prefix: str, hidden: int, inter: int) -> dict[str, tuple[int, ...]]:
    return {
        f"{prefix}.gate_proj.weight": (inter, hidden),
        f"{prefix}.up_proj.weight": (inter, hidden),
        f"{prefix}.down_proj.weight": (hidden, inter),
    }


# Parameters kept in fp32 whatever the model dtype (as in the checkpoints and in transformers).
FP32_PARAMETERS = ("e_score_correction_bias",)


def random_state_dict(cfg: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32) -> dict[str, Tensor]:
    """Seeded random weights for every parameter of `cfg`'s model, by checkpoint name, on the CPU.

    Scales keep activations O(1) through the layers, as in a trained model: a linear [out, in] is
    N(0, 1/in); norm gains 1 + N(0, 0.1^2); the indexer LayerNorm bias N(0, 0.1^2); the router bias
    N(0, 0.01^2) (fp32); embeddings N(0, 1). The values are drawn in fp32 then cast to `dtype`.
    """
    gen = torch.Generator().manual_seed(seed)
    state: dict[str, Tensor] = {}
    for name, shape in parameter_shapes(cfg).items():
        noise = torch.randn(shape, generator=gen, dtype=torch.float32)
        if name.endswith("e_score_correction_bias"):
            state[name] = 0.01 * noise
            continue
        if name.endswith("k_norm.bias"):
            value = 0.1 * noise
        elif len(shape) == 1:  # RMSNorm / LayerNorm gains
            value = 1.0 + 0.1 * noise
        elif name == "model.embed_tokens.weight":
            value = noise
        else:
            value = noise * shape[1] ** -0.5
        state[name] = value.to(dtype)
    return state


def check_state_dict(cfg: ModelConfig, state_dict: dict[str, Tensor]) -> None:
    """Every parameter present with its shape; a ValueError names the first missing / misshapen / extra one."""
    shapes = parameter_shapes(cfg)
    missing = [name for name in shapes if name not in state_dict]
    if missing:
        raise ValueError(
            f"state_dict: missing {len(missing)} parameter(s) of {cfg.name!r}, e.g. {missing[:3]} "
            f"(names follow the Hugging Face checkpoint)"
        )
    for name, shape in shapes.items():
        got = tuple(state_dict[name].shape)
        if got != shape:
            raise ValueError(f"state_dict[{name!r}]: expected shape {shape}, got {got}")
    extra = sorted(set(state_dict) - set(shapes))
    if extra:
        raise ValueError(f"state_dict: {len(extra)} unexpected parameter(s) for {cfg.name!r}, e.g. {extra[:3]}")


def linear_module_names(cfg: ModelConfig) -> list[str]:
    """Module paths of every linear call site (a 2-D checkpoint weight that multiplies activations): all 2-D
    parameters except the embedding table and the per-expert matrices (those form `RoutedExperts`)."""
    return [
        name.removesuffix(".weight")
        for name, shape in parameter_shapes(cfg).items()
        if len(shape) == 2 and name != "model.embed_tokens.weight" and ".mlp.experts." not in name
    ]


def expert_module_names(cfg: ModelConfig) -> list[str]:
    """Module paths of the routed experts, one `RoutedExperts` per MoE layer."""
    return [f"{layer_prefix(n)}.mlp.experts" for n in range(cfg.num_hidden_layers) if is_moe_layer(cfg, n)]
