"""glm5-hal's sparse MLA attention backend for vLLM (`GLM5_HAL_SPARSE_MLA`).

vLLM's MLAAttention layer does the MLA algebra itself (W_UK absorption into the query, the W_UV up-projection
after attention); a backend owns the latent cache write and the attention over the 576-wide latent rows. Here:

- `do_kv_cache_update`: the new tokens' rows [kv_c_normed | k_pe] into vLLM's paged latent cache
  [num_blocks, block_size, 576] (the model's dtype, kv_cache_dtype "auto"), or encoded as `fp8_ds_mla` rows
  [num_blocks, block_size, 656] uint8 (FlashMLA's layout, which glm5-hal reads as it is).
- `forward_mqa`: `glm5_hal.sparse_flash_attention` over that cache, in place, for every token (prefill, chunked
  prefill and decode alike: DSA has no dense prefill), with the keys the indexer chose for each token
  (request-local positions, -1 = none) from the layer's shared top-k buffer (indexer.py writes it).

The metadata is vLLM's batch as the glm5-hal contract spells it: cu_seqlens_q = query_start_loc, seq_lens_k =
seq_lens (the context after this step), block_table; no Triton and no host reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionLayer,
    AttentionMetadata,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
    MLAAttentionImpl,
    MultipleOf,
)

from glm5_hal.kv_formats import AUTO, write_rows
from glm5_hal.ops import sparse_flash_attention
from glm5_hal.vllm.caches import on_huge_pages

# vLLM's kv_cache_dtype -> glm5-hal's format of the latent cache ("auto": the model's float dtype).
LATENT_CACHE_FORMATS: dict[str, str] = {"auto": AUTO, "fp8_ds_mla": "fp8_ds_mla"}
SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)
LATENT_WIDTH = 576  # kv_lora_rank 512 + rope 64: GLM-5 and DeepSeek-V3.2


def check_selection(selector: Any) -> None:
    """Refuse, with the reason, a sparse MLA configuration glm5-hal's backend cannot serve (vLLM's
    AttentionSelectorConfig: dtype, kv_cache_dtype, head_size)."""
    if selector.dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"glm5-hal sparse MLA: dtype {selector.dtype} is not supported; expected one of {SUPPORTED_DTYPES}"
        )
    cache_dtype = selector.kv_cache_dtype or "auto"
    if cache_dtype not in LATENT_CACHE_FORMATS:
        raise ValueError(
            f"glm5-hal sparse MLA: kv_cache_dtype {cache_dtype!r} is not supported; expected one of "
            f"{tuple(LATENT_CACHE_FORMATS)} ('fp8_ds_mla': FlashMLA's 656-byte rows)"
        )
    if selector.head_size != LATENT_WIDTH:
        raise ValueError(
            f"glm5-hal sparse MLA: latent width (kv_lora_rank + qk_rope_head_dim) {selector.head_size} is not "
            f"supported; expected {LATENT_WIDTH}"
        )


class Glm5HalSparseMLABackend(AttentionBackend):
    """Sparse MLA through glm5_hal.sparse_flash_attention (module docstring)."""

    supported_dtypes: ClassVar[list[torch.dtype]] = list(SUPPORTED_DTYPES)
    supported_kv_cache_dtypes: ClassVar[list[Any]] = list(LATENT_CACHE_FORMATS)

    @staticmethod
    def get_name() -> str:
        return "GLM5_HAL_SPARSE_MLA"

    @staticmethod
    def get_impl_cls() -> type[Glm5HalSparseMLAImpl]:
        return Glm5HalSparseMLAImpl

    @staticmethod
    def get_builder_cls() -> type[Glm5HalMetadataBuilder]:
        return Glm5HalMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec: Any = None) -> list[int | MultipleOf]:
        return [MultipleOf(1)]  # the ops take any block size

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return [LATENT_WIDTH]

    @classmethod
    def is_mla(cls) -> bool:
        return True

    @classmethod
    def is_sparse(cls) -> bool:
        return True


@dataclass
class Glm5HalMetadata(AttentionMetadata):
    """One step's batch in the glm5-hal contract's terms (docs/ops.md "Conventions"), for the attention and the
    indexer layers alike.

    query_start_loc: [B + 1] int32, cu_seqlens_q. seq_lens: [B] int32, seq_lens_k (keys after this step).
    block_table: [B, max_blocks] int32, this layer's cache blocks per request. slot_mapping: [T] int64.
    num_decodes / num_prefills / num_decode_tokens: what vLLM's MLAAttention reads to split dense-MHA prefill
    from MQA tokens; every token is an MQA token here.
    """

    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: Tensor
    seq_lens: Tensor
    block_table: Tensor
    slot_mapping: Tensor
    num_decodes: int
    num_decode_tokens: int
    num_prefills: int = 0


class Glm5HalMetadataBuilder(AttentionMetadataBuilder[Glm5HalMetadata]):
    """vLLM's CommonAttentionMetadata, sliced to the live requests; no device work, no host reads."""

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any, device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> Glm5HalMetadata:
        m = common_attn_metadata
        reqs = m.num_reqs
        return Glm5HalMetadata(
            num_reqs=reqs,
            num_actual_tokens=m.num_actual_tokens,
            max_query_len=m.max_query_len,
            max_seq_len=m.max_seq_len,
            query_start_loc=m.query_start_loc[: reqs + 1],
            seq_lens=m.seq_lens[:reqs],
            block_table=m.block_table_tensor[:reqs],
            slot_mapping=m.slot_mapping[: m.num_actual_tokens],
            num_decodes=reqs,
            num_decode_tokens=m.num_actual_tokens,
        )


class Glm5HalSparseMLAImpl(MLAAttentionImpl[Glm5HalMetadata]):
    """The latent cache write and sparse attention of one MLA layer (module docstring)."""

    is_sparse: ClassVar[bool] = True
    supports_dense_mha_prefill: bool = False  # every token attends its top-k keys through forward_mqa
    can_return_lse_for_decode: bool = True

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes: list[float] | None,
        sliding_window: int | None,
        kv_cache_dtype: str,
        logits_soft_cap: float | None,
        attn_type: str,
        kv_sharing_target_layer_name: str | None,
        topk_indices_buffer: Tensor | None = None,
        indexer: object | None = None,
        **mla_args: Any,
    ) -> None:
        unsupported = {
            "alibi_slopes": alibi_slopes,
            "sliding_window": sliding_window,
            "logits_soft_cap": logits_soft_cap,
            "kv_sharing_target_layer_name": kv_sharing_target_layer_name,
        }
        given = {k: v for k, v in unsupported.items() if v is not None}
        if given:
            raise NotImplementedError(f"glm5-hal sparse MLA: {sorted(given)} are not supported (got {given})")
        if topk_indices_buffer is None:
            raise ValueError("glm5-hal sparse MLA: topk_indices_buffer: expected the model's shared top-k buffer")
        if kv_cache_dtype not in LATENT_CACHE_FORMATS:
            raise ValueError(
                f"glm5-hal sparse MLA: kv_cache_dtype {kv_cache_dtype!r} is not supported; expected one of "
                f"{tuple(LATENT_CACHE_FORMATS)}"
            )
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.cache_format = LATENT_CACHE_FORMATS[kv_cache_dtype]
        self.kv_lora_rank: int = mla_args["kv_lora_rank"]
        self.topk_indices_buffer = topk_indices_buffer
        self.huge_pages_asked: Tensor | None = None  # the latent cache last given to on_huge_pages

    def record_logical_topk_ready(self) -> None:
        """vLLM's MLA layer signals here that the indexer has written the top-k buffer; the ops run in order on
        the layer's stream, so there is nothing to wait for."""

    def do_kv_cache_update(
        self,
        kv_c_normed: Tensor,
        k_pe: Tensor,
        kv_cache: Tensor,
        slot_mapping: Tensor,
        kv_cache_dtype: str,
        k_scale: Tensor,
    ) -> None:
        """kv_c_normed [T, 512], k_pe [T, 1, 64] or [T, 64]: rows [kv_c_normed | k_pe] to the slots
        slot_mapping [T'] (T' <= T, -1 = padding); kv_cache [num_blocks, block_size, 576 or 656]."""
        if kv_cache.numel() == 0:
            return  # the profiling run before the cache exists
        if kv_cache is not self.huge_pages_asked:  # a decode step comes here once per layer: ask once per cache
            on_huge_pages(kv_cache, "latent")
            self.huge_pages_asked = kv_cache
        slots = slot_mapping.flatten()
        n = slots.shape[0]
        rows = torch.cat([kv_c_normed[:n], k_pe[:n].reshape(n, -1)], dim=-1)
        write_rows(kv_cache, slots, rows, LATENT_CACHE_FORMATS[kv_cache_dtype])

    def forward_mqa(
        self,
        q: Tensor | tuple[Tensor, Tensor],
        kv_c_and_k_pe_cache: Tensor,
        attn_metadata: Glm5HalMetadata,
        layer: AttentionLayer,
    ) -> tuple[Tensor, Tensor]:
        """q: [T, H, 576] (or its (absorbed nope [T, H, 512], rope [T, H, 64]) parts). Returns the latent
        output [T, H, 512] in q's dtype and the natural-log lse [T, H] fp32."""
        if isinstance(q, tuple):
            q = torch.cat(q, dim=-1)
        tokens = attn_metadata.num_actual_tokens
        return sparse_flash_attention(
            q[:tokens],
            kv_c_and_k_pe_cache,
            self.topk_indices_buffer[:tokens],
            attn_metadata.block_table,
            attn_metadata.seq_lens,
            attn_metadata.query_start_loc,
            self.scale,
            d_v=self.kv_lora_rank,
            kv_cache_dtype=self.cache_format,
        )
