"""MLA attention with DeepSeek Sparse Attention, from the public ops:

mla_prolog -> indexer_prolog -> lightning_indexer -> sparse_flash_attention -> W_UV (V half of kv_b_proj)
-> o_proj.

The attention runs in the absorbed (latent) form: the K half of kv_b_proj, W_UK [H, nope, kv_lora], is folded
into the query by mla_prolog, so queries and cache rows are kv_lora + rope = 576 wide; sparse_flash_attention
returns kv_lora-wide latent values per head, which the V half W_UV [H, v_head, kv_lora] maps to v_head.

Decomposed prologs: mla_prolog / indexer_prolog take the dense projection weights. When a projection they fuse
has been replaced by something that is not a plain `Linear` (a quantized linear), the layer runs that prolog
decomposed instead: the projections through the replacement objects, the norms, RoPE and cache writes here
(same maths as the op, see ops_reference/mla.py and indexer.py). kv_b_proj must stay a dense `Linear`: its
halves are used per head, not as a linear map of the layer input.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from glm5_hal.config import ModelConfig
from glm5_hal.kv_formats import AUTO, write_rows
from glm5_hal.model.cache import StepMetadata
from glm5_hal.model.linear import Linear
from glm5_hal.model.norms import LayerNorm, RMSNorm, compute_dtype
from glm5_hal.model.rope import apply_rope
from glm5_hal.ops import indexer_prolog, lightning_indexer, mla_prolog, sparse_flash_attention


def _all_dense(*modules: nn.Module) -> bool:
    # Exact type: a subclass (e.g. an activation recorder or a quantized linear) takes the decomposed path.
    return all(type(m) is Linear for m in modules)


class Indexer(nn.Module):
    """The lightning indexer's projections: wq_b [HI*DI, q_lora], wk [DI, hidden], k_norm (LayerNorm [DI]),
    weights_proj [HI, hidden]."""

    def __init__(self, cfg: ModelConfig, wq_b: Tensor, wk: Tensor, k_norm: LayerNorm, weights_proj: Tensor) -> None:
        super().__init__()
        self.cfg = cfg
        self.wq_b, self.wk, self.weights_proj = Linear(wq_b), Linear(wk), Linear(weights_proj)
        self.k_norm = k_norm
        self.fused = True  # False forces the decomposed prolog (tests compare the two)

    def fused_weights(self) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor] | None:
        """(w_iq, w_ik, k_norm weight, k_norm bias, w_iw): what the fused `indexer_prolog` op takes of this indexer,
        where that op runs its prolog (dense projections and `fused` on); None where the decomposed prolog runs."""
        if not (self.fused and _all_dense(self.wq_b, self.wk, self.weights_proj)):
            return None
        return self.wq_b.weight, self.wk.weight, self.k_norm.weight, self.k_norm.bias, self.weights_proj.weight

    def fused_prolog(
        self,
        weights: tuple[Tensor, Tensor, Tensor, Tensor, Tensor],
        x: Tensor,
        q_norm: Tensor,
        cos: Tensor,
        sin: Tensor,
        cache: Tensor,
        slot_mapping: Tensor,
        kv_cache_dtype: str = AUTO,
    ) -> tuple[Tensor, Tensor]:
        """`prolog` through the fused op, with weights = fused_weights() (which a caller running every decode step
        may hold: the vLLM plugin) and the new tokens' cache slots slot_mapping [T] int64."""
        return indexer_prolog(
            x,
            q_norm,
            *weights,
            cos,
            sin,
            cache,
            slot_mapping,
            rope_interleaved=self.cfg.indexer_rope_interleaved,
            eps=self.k_norm.eps,
            kv_cache_dtype=kv_cache_dtype,
        )

    def prolog(
        self,
        x: Tensor,
        q_norm: Tensor,
        cos: Tensor,
        sin: Tensor,
        cache: Tensor,
        step: StepMetadata,
        kv_cache_dtype: str = AUTO,
    ) -> tuple[Tensor, Tensor]:
        """(q_idx [T, HI, DI], weights [T, HI] fp32); writes the new index keys into cache [nb, bs, DI] (uint8 rows
        of an index format when kv_cache_dtype names one)."""
        cfg = self.cfg
        weights = self.fused_weights()
        if weights is not None:
            return self.fused_prolog(weights, x, q_norm, cos, sin, cache, step.slot_mapping, kv_cache_dtype)
        rope = cfg.qk_rope_head_dim
        q = self.wq_b(q_norm).view(x.shape[0], cfg.index_n_heads, cfg.index_head_dim)
        k = self.k_norm(self.wk(x))
        # RoPE acts on the FIRST rope dims of the indexer vectors (MLA puts it last).
        interleaved = cfg.indexer_rope_interleaved
        q = torch.cat([apply_rope(q[..., :rope], cos, sin, interleaved=interleaved), q[..., rope:]], -1)
        k = torch.cat([apply_rope(k[..., :rope], cos, sin, interleaved=interleaved), k[..., rope:]], -1)
        write_rows(cache, step.slot_mapping, k, kv_cache_dtype)
        weights = self.weights_proj(x).to(compute_dtype(x)) * cfg.indexer_weight_scale
        return q, weights


class MLAAttention(nn.Module):
    """One layer's attention. Call: (x [T, hidden] normed, cos/sin [T, rope/2] fp32, kv_cache, index_k_cache,
    step[, topk_indices]) -> ([T, hidden] in x's dtype, the key selection used); writes the new tokens' latent and
    index-key rows into the two caches."""

    def __init__(
        self,
        cfg: ModelConfig,
        q_a_proj: Tensor,
        q_a_layernorm: RMSNorm,
        q_b_proj: Tensor,
        kv_a_proj_with_mqa: Tensor,
        kv_a_layernorm: RMSNorm,
        kv_b_proj: Tensor,
        o_proj: Tensor,
        indexer: Indexer,
    ) -> None:
        super().__init__()
        if not cfg.mla_rope_interleaved:
            raise NotImplementedError(
                f"{cfg.name}: mla_rope_interleaved=False; mla_prolog implements the interleaved MLA RoPE of GLM-5 and "
                "DeepSeek-V3.2 only"
            )
        self.cfg = cfg
        self.q_a_proj, self.q_b_proj = Linear(q_a_proj), Linear(q_b_proj)
        self.kv_a_proj_with_mqa, self.kv_b_proj, self.o_proj = (
            Linear(kv_a_proj_with_mqa),
            Linear(kv_b_proj),
            Linear(o_proj),
        )
        self.q_a_layernorm, self.kv_a_layernorm = q_a_layernorm, kv_a_layernorm
        self.indexer = indexer
        self.fused = True  # False forces the decomposed MLA prolog (tests compare the two)

    def kv_b_halves(self) -> tuple[Tensor, Tensor]:
        """(W_UK [H, nope, kv_lora], W_UV [H, v_head, kv_lora]) from kv_b_proj [H * (nope + v_head), kv_lora]."""
        weight = getattr(self.kv_b_proj, "weight", None)
        if not isinstance(weight, Tensor) or not weight.is_floating_point() or weight.dim() != 2:
            raise TypeError(
                "kv_b_proj: expected a module with a dense floating-point 2-D `weight` (it is absorbed per head, "
                f"never quantized), got {type(self.kv_b_proj).__name__}"
            )
        cfg = self.cfg
        w = weight.view(cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, -1)
        return w[:, : cfg.qk_nope_head_dim].contiguous(), w[:, cfg.qk_nope_head_dim :].contiguous()

    def _mla_prolog(
        self,
        x: Tensor,
        w_uk: Tensor,
        cos: Tensor,
        sin: Tensor,
        kv_cache: Tensor,
        step: StepMetadata,
        kv_cache_dtype: str = AUTO,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """(q_lat [T, H, kv_lora], q_pe [T, H, rope], q_norm [T, q_lora]); writes kv_cache."""
        cfg = self.cfg
        eps = self.q_a_layernorm.eps
        if self.kv_a_layernorm.eps != eps:
            raise ValueError(
                f"kv_a_layernorm.eps: mla_prolog takes one eps for both norms, got {eps} and {self.kv_a_layernorm.eps}"
            )
        if self.fused and _all_dense(self.q_a_proj, self.q_b_proj, self.kv_a_proj_with_mqa):
            return mla_prolog(
                x,
                self.q_a_proj.weight,
                self.q_a_layernorm.weight,
                self.q_b_proj.weight,
                w_uk.to(x.dtype),
                self.kv_a_proj_with_mqa.weight,
                self.kv_a_layernorm.weight,
                cos,
                sin,
                kv_cache,
                step.slot_mapping,
                eps,
                kv_cache_dtype=kv_cache_dtype,
            )
        nope, kv_lora = cfg.qk_nope_head_dim, cfg.kv_lora_rank
        q_norm = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(q_norm).view(x.shape[0], cfg.num_attention_heads, cfg.qk_head_dim)
        acc = compute_dtype(x)
        q_lat = torch.einsum("thn,hnc->thc", q[..., :nope].to(acc), w_uk.to(acc)).to(x.dtype)
        q_pe = apply_rope(q[..., nope:], cos, sin, interleaved=True)
        kv = self.kv_a_proj_with_mqa(x)
        row = torch.cat(
            [
                self.kv_a_layernorm(kv[:, :kv_lora]),
                apply_rope(kv[:, kv_lora:], cos, sin, interleaved=True),
            ],
            -1,
        )
        write_rows(kv_cache, step.slot_mapping, row, kv_cache_dtype)
        return q_lat, q_pe, q_norm

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        kv_cache: Tensor,
        index_k_cache: Tensor,
        step: StepMetadata,
        topk_indices: Tensor | None = None,
        *,
        kv_cache_dtype: str = AUTO,
        index_cache_dtype: str = AUTO,
    ) -> tuple[Tensor, Tensor]:
        """(output [T, hidden], the key selection used: topk_indices [T, index_topk] int32, -1 = none).

        topk_indices: None (the lightning indexer selects), or a selection to use instead (e.g. a quantized model
        replaying its floating original's, see CausalLM.forward); the indexer prolog still runs, to write the
        new tokens' index keys. kv_cache_dtype / index_cache_dtype: the formats of the two caches (PagedKVCache)."""
        cfg = self.cfg
        w_uk, w_uv = self.kv_b_halves()
        q_lat, q_pe, q_norm = self._mla_prolog(x, w_uk, cos, sin, kv_cache, step, kv_cache_dtype)
        q_idx, head_weights = self.indexer.prolog(x, q_norm, cos, sin, index_k_cache, step, index_cache_dtype)
        if topk_indices is None:
            topk_indices = lightning_indexer(
                q_idx,
                head_weights,
                index_k_cache,
                step.block_table,
                step.seq_lens_k,
                step.cu_seqlens_q,
                cfg.index_topk,
                kv_cache_dtype=index_cache_dtype,
            )
        latent_out, _ = sparse_flash_attention(
            torch.cat([q_lat, q_pe], -1),
            kv_cache,
            topk_indices,
            step.block_table,
            step.seq_lens_k,
            step.cu_seqlens_q,
            cfg.sm_scale,
            d_v=cfg.kv_lora_rank,
            kv_cache_dtype=kv_cache_dtype,
        )  # [T, H, kv_lora]
        values = torch.einsum("thc,hvc->thv", latent_out, w_uv.to(latent_out.dtype))  # [T, H, v_head]
        return self.o_proj(values.reshape(x.shape[0], cfg.num_attention_heads * cfg.v_head_dim)), topk_indices
