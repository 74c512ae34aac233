"""The out-of-tree MLA layer: vLLM's MultiHeadLatentAttentionWrapper, plus glm5-hal's indexer where glm5-hal's
sparse MLA backend was chosen for the layer, and the route of its absorbed up-projections (up_projections.py).

vLLM builds a DSA layer's Indexer before the MLA wrapper and hands it over; the wrapper's constructor chooses the
attention backend. So the wrapper is where the plugin learns whether the layer is glm5-hal's (the platform had no
sparse MLA backend, or GLM5_HAL_VLLM=1) and, if so, binds the Indexer to glm5-hal's (indexer.py). Every other MLA
layer (a dense model, a platform with its own DSA kernels) is vLLM's own, untouched.
"""

from __future__ import annotations

from typing import Any

from vllm.config import get_current_vllm_config
from vllm.logger import init_logger
from vllm.model_executor.custom_op import PluggableLayer, op_registry_oot
from vllm.model_executor.layers.mla import MultiHeadLatentAttentionWrapper

from glm5_hal.config import ModelConfig
from glm5_hal.model.hf_config import config_from_hf
from glm5_hal.vllm.indexer import bind_indexer
from glm5_hal.vllm.settings import LOGGER
from glm5_hal.vllm.sparse_mla import Glm5HalSparseMLAImpl
from glm5_hal.vllm.up_projections import route_after_loading

logger = init_logger(LOGGER)

# vLLM renames a YaRN rope_type in the shared HF config object when it builds a DeepSeek attention layer.
_VLLM_ROPE_TYPES = {"deepseek_yarn": "yarn"}


def model_config_of(hf_config: Any) -> ModelConfig:
    """glm5-hal's ModelConfig of the served model, from vLLM's HF config object (config_from_hf's rules: an
    unsupported feature is a ValueError naming it)."""
    hf = hf_config.to_dict()
    rope = dict(hf.get("rope_parameters") or {})
    if rope.get("rope_type") in _VLLM_ROPE_TYPES:
        rope["rope_type"] = _VLLM_ROPE_TYPES[rope["rope_type"]]
        hf["rope_parameters"] = rope
    return config_from_hf(hf, source="vLLM's model config")


class Glm5HalMLAWrapper(MultiHeadLatentAttentionWrapper):
    """vLLM's MLA layer; where its attention backend is glm5-hal's, its indexer is glm5-hal's too."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.glm5_hal = isinstance(self.mla_attn.impl, Glm5HalSparseMLAImpl)
        if not self.glm5_hal:
            return
        features = {
            "fuse_qkv_rmsnorm": self.fuse_qkv_rmsnorm,
            "dcp_q_replicate": self.dcp_q_replicate,
            "g_proj": self.g_proj is not None,
            "no q_lora_rank": self.q_lora_rank is None,
        }
        unsupported = sorted(name for name, used in features.items() if used)
        if unsupported:
            raise NotImplementedError(f"glm5-hal sparse MLA ({self.prefix}): {unsupported} are not supported")
        if self.indexer is not None:
            cfg = model_config_of(get_current_vllm_config().model_config.hf_config)
            bind_indexer(self.indexer, cfg)
        route_after_loading(self.mla_attn)


def register_mla_layer() -> None:
    """Register Glm5HalMLAWrapper as vLLM's out-of-tree MultiHeadLatentAttentionWrapper, unless another plugin
    already replaced that layer (then glm5-hal's indexer cannot be bound, which is said once)."""
    name = MultiHeadLatentAttentionWrapper.__name__
    current = op_registry_oot.get(name)
    if current is Glm5HalMLAWrapper:
        return
    if current is not None:
        logger.warning(
            "glm5-hal vLLM plugin: %s is already replaced by %s; glm5-hal's indexer is not installed",
            name,
            current.__qualname__,
        )
        return
    PluggableLayer.register_oot(Glm5HalMLAWrapper, name=name)
