"""The lightning indexer of a DSA model served by vLLM, run by glm5-hal.

vLLM builds each MLA layer's `Indexer` module (wq_b, the fused wk + weights_proj, k_norm) and its index-key cache
(`DeepseekV32IndexerCache`: uint8 rows of 132 bytes per token). Its own forward quantizes queries with a Triton
kernel and its metadata builder launches another, so neither runs on a CPU. Where glm5-hal serves the layer's
attention, `bind_indexer` gives the Indexer:

- a forward that calls the custom op `glm5_hal_vllm::select_keys`: glm5-hal's indexer prolog (the same
  `glm5_hal.model.attention.Indexer` that CausalLM runs, over vLLM's weight tensors: q and k projections, the k
  LayerNorm, RoPE on the first rope dims, the head weights) writes the new keys into the index cache as glm5-hal's
  `fp8_index` rows (128 e4m3 + an fp32 scale: vLLM's 132-byte layout), then `glm5_hal.lightning_indexer` selects
  each token's top index_topk keys into the model's shared top-k buffer, which the sparse attention reads;
- a cache backend (`Glm5HalIndexerBackend`) whose metadata builder needs no Triton.

The op is opaque to torch.compile (it reads the step's metadata from vLLM's forward context, as vLLM's own
attention ops do) and declares the top-k buffer as the tensor it writes.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor, nn
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.linear import UnquantizedLinearMethod
from vllm.v1.attention.backend import AttentionBackend, MultipleOf

from glm5_hal.config import ModelConfig
from glm5_hal.model.attention import Indexer
from glm5_hal.model.cache import StepMetadata
from glm5_hal.model.norms import LayerNorm, compute_dtype
from glm5_hal.model.rope import rope_cos_sin
from glm5_hal.ops import lightning_indexer
from glm5_hal.ops.common import call_op, custom_op
from glm5_hal.paged import blocks_in_use
from glm5_hal.vllm.caches import on_huge_pages
from glm5_hal.vllm.sparse_mla import Glm5HalMetadata, Glm5HalMetadataBuilder

INDEX_CACHE_FORMAT = "fp8_index"  # vLLM's DeepseekV32IndexerCache rows: 128 e4m3 bytes + 1 fp32 scale
INDEX_ROW_BYTES = 132


class Glm5HalIndexerBackend(AttentionBackend):
    """The index-key cache's backend: storage plus a Triton-free metadata builder (the indexer runs in
    `select_keys`, not in an attention impl)."""

    @staticmethod
    def get_name() -> str:
        return "GLM5_HAL_INDEXER"

    @staticmethod
    def get_impl_cls() -> type:
        raise NotImplementedError("the glm5-hal index-key cache has no attention impl: select_keys reads it")

    @staticmethod
    def get_builder_cls() -> type[Glm5HalMetadataBuilder]:
        return Glm5HalMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec: Any = None) -> list[int | MultipleOf]:
        return [MultipleOf(1)]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return [INDEX_ROW_BYTES]

    supported_kv_cache_dtypes: ClassVar[list[Any]] = []  # any: the cache is always uint8 fp8_index rows


class VllmLinear(nn.Module):
    """A vLLM linear layer (which returns (output, bias)) as the plain y = layer(x) call glm5-hal's model makes; a
    projection vLLM has quantized runs through this, so the indexer prolog runs decomposed around it."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: Tensor) -> Tensor:
        return self.layer(x)[0]


@dataclass
class IndexerBinding:
    """What select_keys needs of one layer: vLLM's Indexer (weights, cache, top-k buffer), the model config in
    glm5-hal's terms, and the glm5-hal Indexer over vLLM's tensors (made at the first call, after weight loading).

    A decode step calls select_keys once per layer, and each attribute read through an nn.Module costs a Python
    call: what does not change between steps is read once (cache_layer, index_cache, prolog_weights)."""

    vllm_indexer: nn.Module
    cfg: ModelConfig
    cache_layer: str  # the index-key cache's layer name: its metadata's and slot mapping's key
    index_cache: nn.Module  # vLLM's DeepseekV32IndexerCache: its kv_cache tensor is bound after the model is built
    glm5_hal_indexer: Indexer | None = field(default=None)
    # The fused indexer_prolog op's weights (Indexer.fused_weights), or None where the decomposed prolog runs.
    prolog_weights: tuple[Tensor, ...] | None = field(default=None)
    huge_pages_asked: Tensor | None = field(default=None)  # the cache tensor last given to on_huge_pages

    def indexer(self) -> Indexer:
        if self.glm5_hal_indexer is None:
            self.glm5_hal_indexer = _glm5_hal_indexer(self.vllm_indexer, self.cfg)
            self.prolog_weights = self.glm5_hal_indexer.fused_weights()
        return self.glm5_hal_indexer

    def cache(self) -> Tensor:
        """The layer's index-key cache [num_blocks, block_size, 132] uint8, backed by huge pages once."""
        cache = self.index_cache.kv_cache
        if cache is not self.huge_pages_asked:
            on_huge_pages(cache, "index")
            self.huge_pages_asked = cache
        return cache


_BINDINGS: dict[str, IndexerBinding] = {}  # layer name -> binding, in the process that runs the model


def _is_unquantized(layer: nn.Module) -> bool:
    method = getattr(layer, "quant_method", None)
    return method is None or isinstance(method, UnquantizedLinearMethod)


def _glm5_hal_indexer(vllm_indexer: nn.Module, cfg: ModelConfig) -> Indexer:
    """glm5_hal.model.attention.Indexer sharing vLLM's weight tensors (vLLM fuses wk and weights_proj into one
    [index_head_dim + index_n_heads, hidden] matrix; its k_norm keeps fp32 parameters, cast here to the model's
    dtype as a glm5-hal checkpoint stores them)."""
    fused = vllm_indexer.wk_weights_proj.weight.data
    head_dim = cfg.index_head_dim
    k_norm = vllm_indexer.k_norm
    dtype = fused.dtype
    norm = LayerNorm(k_norm.weight.detach().to(dtype), k_norm.bias.detach().to(dtype), cfg.indexer_norm_eps)
    wq_b = vllm_indexer.wq_b
    dense_wq_b = _is_unquantized(wq_b)
    placeholder = torch.empty(0, 0, dtype=dtype, device=fused.device)
    indexer = Indexer(cfg, wq_b.weight.data if dense_wq_b else placeholder, fused[:head_dim], norm, fused[head_dim:])
    if not dense_wq_b:
        indexer.wq_b = VllmLinear(wq_b)
    return indexer


def _layer_metadata(attn_metadata: Any, layer: str) -> Glm5HalMetadata | None:
    """This step's metadata of `layer` from vLLM's forward context (a dict by layer, a list of such dicts with
    speculative decoding, or None during the profiling run)."""
    if isinstance(attn_metadata, list):
        attn_metadata = attn_metadata[0]
    if isinstance(attn_metadata, dict):
        return attn_metadata.get(layer)
    return attn_metadata


# The RoPE tables of the step being run: (forward context, positions' data and length, dtype, RoPE settings, cos,
# sin). Every layer's indexer of a step rotates at the same positions, so the tables are made once per step (~0.15
# ms a layer at decode on a CPU). The context is held, so that a later step's context cannot reuse its id.
_step_tables: tuple[Any, ...] | None = None


def _step_rope(context: Any, cfg: ModelConfig, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """rope_cos_sin(cfg, positions, dtype), made at the step's first layer and reused by its others."""
    global _step_tables
    # What rope_cos_sin reads of the config (each layer has its own ModelConfig object, equal to the others).
    key = (positions.data_ptr(), positions.shape[0], dtype, cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling)
    held = _step_tables
    if held is None or held[0] is not context or held[1] != key:
        held = _step_tables = (context, key, *rope_cos_sin(cfg, positions, dtype))
    return held[2], held[3]


def _select_keys(
    hidden_states: Tensor, q_c: Tensor, positions: Tensor, topk_indices_buffer: Tensor, layer_name: str
) -> None:
    """hidden_states [T, hidden] (the attention input), q_c [T, q_lora] (the normed query latent), positions [T]:
    writes the new tokens' index keys into the layer's index cache and their top-k keys (request-local positions,
    -1 = none) into topk_indices_buffer[:T] (T = this step's tokens; vLLM may pad the inputs beyond it)."""
    binding = _BINDINGS[layer_name]
    context = get_forward_context()
    metadata = _layer_metadata(context.attn_metadata, binding.cache_layer)
    if metadata is None:
        return  # the profiling run: no cache yet
    tokens = metadata.num_actual_tokens
    cfg = binding.cfg
    cache = binding.cache()
    slots = context.slot_mapping[binding.cache_layer][:tokens]
    x, q = hidden_states[:tokens], q_c[:tokens]
    cos, sin = _step_rope(context, cfg, positions[:tokens], compute_dtype(x))
    indexer = binding.indexer()
    if binding.prolog_weights is not None:
        q_idx, weights = indexer.fused_prolog(binding.prolog_weights, x, q, cos, sin, cache, slots, INDEX_CACHE_FORMAT)
    else:
        step = StepMetadata(
            positions[:tokens], slots, metadata.block_table, metadata.seq_lens, metadata.query_start_loc
        )
        q_idx, weights = indexer.prolog(x, q, cos, sin, cache, step, INDEX_CACHE_FORMAT)
    topk = lightning_indexer(
        q_idx,
        weights,
        cache,
        # vLLM's block table is as wide as max_model_len, and the indexer scores and ranks every position its table
        # addresses: only the blocks the batch's longest sequence uses
        blocks_in_use(metadata.block_table, metadata.max_seq_len, cache.shape[1]),
        metadata.seq_lens,
        metadata.query_start_loc,
        cfg.index_topk,
        kv_cache_dtype=INDEX_CACHE_FORMAT,
    )
    topk_indices_buffer[:tokens].copy_(topk)


# Registered as glm5-hal's ops are, so that call_op runs the body directly in plain eager mode (a decode step calls
# it once per layer, and the custom op's dispatch adds seven Python layers to each call: ~0.2 ms under cProfile).
select_keys = custom_op("select_keys", mutates_args=("topk_indices_buffer",), namespace="glm5_hal_vllm")(_select_keys)


@select_keys.register_fake
def _select_keys_fake(
    hidden_states: Tensor, q_c: Tensor, positions: Tensor, topk_indices_buffer: Tensor, layer_name: str
) -> None:
    return None


def _indexer_forward(self: nn.Module, hidden_states: Tensor, qr: Tensor, positions: Tensor, rotary_emb: Any) -> Tensor:
    """The bound replacement of vLLM's Indexer.forward (its rotary_emb argument is unused: glm5-hal's RoPE
    tables come from the model config, as in CausalLM)."""
    call_op(select_keys, hidden_states, qr, positions, self.topk_indices_buffer, self._glm5_hal_layer)
    return self.topk_indices_buffer


def bind_indexer(vllm_indexer: nn.Module, cfg: ModelConfig) -> None:
    """Make vLLM's Indexer module run glm5-hal's indexer (module docstring). Its cache must be the 132-byte
    fp8_index rows vLLM allocates for DeepSeek-V3.2 / GLM-5."""
    cache = vllm_indexer.k_cache
    if cache.dtype != torch.uint8 or cache.head_dim != INDEX_ROW_BYTES:
        raise ValueError(
            f"glm5-hal indexer: {cache.prefix}: expected a uint8 index-key cache of {INDEX_ROW_BYTES}-byte rows "
            f"(fp8_index), got {cache.dtype} rows of {cache.head_dim}"
        )
    if cfg.index_head_dim != 128:
        raise ValueError(f"glm5-hal indexer: index_head_dim: expected 128 (fp8_index rows), got {cfg.index_head_dim}")
    # glm5-hal reads the dense projection weights themselves; on a CPU vLLM would otherwise repack them for its own
    # GEMM and free them after loading (the flag is the one vLLM's MLA layer sets on kv_b_proj for the same reason).
    for dense in (vllm_indexer.wq_b, vllm_indexer.wk_weights_proj):
        if _is_unquantized(dense):
            dense._cpu_skip_gemm_dispatch = True
    layer = vllm_indexer.prefix
    _BINDINGS[layer] = IndexerBinding(vllm_indexer, cfg, cache.prefix, cache)
    vllm_indexer._glm5_hal_layer = layer
    vllm_indexer.forward = types.MethodType(_indexer_forward, vllm_indexer)
    cache.get_attn_backend = lambda: Glm5HalIndexerBackend
