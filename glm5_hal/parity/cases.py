"""The parity cases: every op at mini and real model dims, plus the ragged and corner cases DESIGN.md lists.

Cases are grouped `regular` (plain shapes), `irregular` (ragged batches, shuffled blocks, odd sizes) and `corner`
(empty rows, zero-token experts, all tokens on one expert, skipped cache writes). `build(gen, dtype)` returns
fresh inputs keyed by the public op's argument names; nothing is zero unless the case is about zeros. The builders
of paged ops pass `batch_options` on to glm5_hal.parity.inputs.paged_batch (garbage table padding, spare blocks).
"""

from __future__ import annotations

import torch

from glm5_hal.config import DEEPSEEK_V32, GLM5, GLM5_MINI, ModelConfig
from glm5_hal.parity.case import FP32_ONLY, Build, Case
from glm5_hal.parity.inputs import (
    SeqSpec,
    mla_weights,
    paged_batch,
    randn,
    random_topk_indices,
    rope_tables,
)
from glm5_hal.parity.quantized_cache import quantized_variants

# Ragged layouts: (q_len, k_len) per sequence.
PREFILL = [SeqSpec(12, 12)]
RAGGED = [SeqSpec(5, 21), SeqSpec(1, 40), SeqSpec(9, 9), SeqSpec(3, 70)]  # chunked prefill, decode, prefill
DECODE = [SeqSpec(1, 33), SeqSpec(1, 7), SeqSpec(1, 64), SeqSpec(1, 1)]
MTP_DECODE = [SeqSpec(2, 50), SeqSpec(2, 2)]  # two new tokens each (multi-token decode)


# ---------------------------------------------------------------------------------------------------- prologs
def mla_prolog_inputs(
    cfg: ModelConfig, seqs: list[SeqSpec], block_size: int, pad: tuple[int, ...] = (), **batch_options: object
) -> Build:
    def build(gen: torch.Generator, dtype: torch.dtype) -> dict:
        batch = paged_batch(seqs, block_size, gen, pad_slots=pad, **batch_options)
        w = mla_weights(cfg, gen, dtype)
        cos, sin = rope_tables(batch.positions, cfg.qk_rope_head_dim, cfg.rope_theta)
        return {
            "x": randn((batch.num_tokens, cfg.hidden_size), gen, dtype=dtype),
            **{k: w[k] for k in ("w_dq", "gamma_cq", "w_uq_qr", "w_uk", "w_dkv_kr", "gamma_ckv")},
            "cos": cos,
            "sin": sin,
            "kv_cache": randn((batch.num_blocks, block_size, cfg.latent_dim), gen, dtype=dtype),
            "slot_mapping": batch.slot_mapping,
            "eps": cfg.rms_norm_eps,
        }

    return build


def indexer_prolog_inputs(
    cfg: ModelConfig, seqs: list[SeqSpec], block_size: int, pad: tuple[int, ...] = (), **batch_options: object
) -> Build:
    def build(gen: torch.Generator, dtype: torch.dtype) -> dict:
        batch = paged_batch(seqs, block_size, gen, pad_slots=pad, **batch_options)
        w = mla_weights(cfg, gen, dtype)
        cos, sin = rope_tables(batch.positions, cfg.qk_rope_head_dim, cfg.rope_theta)
        return {
            "x": randn((batch.num_tokens, cfg.hidden_size), gen, dtype=dtype),
            "q_norm": randn((batch.num_tokens, cfg.q_lora_rank), gen, dtype=dtype),
            **{k: w[k] for k in ("w_iq", "w_ik", "k_norm_weight", "k_norm_bias", "w_iw")},
            "cos": cos,
            "sin": sin,
            "index_k_cache": randn((batch.num_blocks, block_size, cfg.index_head_dim), gen, dtype=dtype),
            "slot_mapping": batch.slot_mapping,
            "rope_interleaved": cfg.indexer_rope_interleaved,
        }

    return build


def cancelling_indexer_projections(build: Build) -> Build:
    """`build`'s indexer_prolog inputs with w_iq's and w_iw's rows made orthogonal to the first token's q_norm and x
    (in float64, then rounded to the case's dtype): every q_idx and head weight of that token is a sum whose terms
    cancel to rounding noise. An fp32 result of such a sum is accurate relative to its terms (their root-sum-square),
    not to itself (glm5_hal/parity/specs.py's scales); the long fuzz profile found a weight of 3.9e-4 from terms of
    4.3."""

    def build_cancelling(gen: torch.Generator, dtype: torch.dtype) -> dict:
        inputs = build(gen, dtype)
        for weight, activation in (("w_iq", "q_norm"), ("w_iw", "x")):
            inputs[weight] = rows_orthogonal_to(inputs[weight], inputs[activation][0])
        return inputs

    return build_cancelling


def cancelling_latent_queries(build: Build) -> Build:
    """`build`'s mla_prolog inputs with each head's w_uk columns made orthogonal to that head's q_nope for the first
    token (q_nope from the case's inputs in float64): every q_lat element of that token is a sum whose terms cancel
    to rounding noise, judged against its terms (glm5_hal/parity/specs.py's scales)."""

    def build_cancelling(gen: torch.Generator, dtype: torch.dtype) -> dict:
        inputs = build(gen, dtype)
        w_uk = inputs["w_uk"]
        heads, nope, _ = w_uk.shape
        c_q = inputs["x"][0].double() @ inputs["w_dq"].double().T
        q_norm = torch.nn.functional.rms_norm(c_q, c_q.shape, inputs["gamma_cq"].double(), inputs["eps"])
        q_nope = (inputs["w_uq_qr"].double() @ q_norm).reshape(heads, -1)[:, :nope]
        for head in range(heads):
            w_uk[head] = rows_orthogonal_to(w_uk[head].T, q_nope[head]).T
        return inputs

    return build_cancelling


def cancelling_latent_rows(build: Build) -> Build:
    """`build`'s mla_prolog inputs with the latent rows of w_dkv_kr made orthogonal to the first token's x: that
    token's c_kv is rounding noise far below RMSNorm's eps, so its normalized cache row is that noise over sqrt(eps),
    as accurate as the projection's rounding over sqrt(eps) allows (the long fuzz profile failed a kv_lora 1 cache
    row whose c sat near sqrt(eps) at 1.12x the tolerance)."""

    def build_cancelling(gen: torch.Generator, dtype: torch.dtype) -> dict:
        inputs = build(gen, dtype)
        latent = inputs["gamma_ckv"].shape[0]
        w = inputs["w_dkv_kr"]
        w[:latent] = rows_orthogonal_to(w[:latent], inputs["x"][0])
        return inputs

    return build_cancelling


def centring_index_keys(build: Build) -> Build:
    """`build`'s indexer_prolog inputs with every row of w_ik given the same component along the first token's x:
    that token's key projections all agree to rounding, so LayerNorm's centring leaves rounding noise, normalized
    over sqrt(var + eps): its cache row is as accurate as that noise allows (the scales of
    glm5_hal/parity/specs.py), as the latent rows of `cancelling_latent_rows` are."""

    def build_centring(gen: torch.Generator, dtype: torch.dtype) -> dict:
        inputs = build(gen, dtype)
        x = inputs["x"][0].double()
        along = x / x.norm()
        inputs["w_ik"] = (rows_orthogonal_to(inputs["w_ik"], x).double() + 0.3 * along).to(dtype)
        return inputs

    return build_centring


def rows_orthogonal_to(w: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """w [N, K] with every row's component in the span of v ([K], or [R, K] with R < K) removed (in float64, then
    rounded to w's dtype): each product of a row of w with a row of v is a sum whose terms cancel to rounding noise."""
    basis, _ = torch.linalg.qr(v.double().reshape(-1, v.shape[-1]).T)  # [K, R], orthonormal columns
    w64 = w.double()
    return (w64 - (w64 @ basis) @ basis.T).to(w.dtype)


# ---------------------------------------------------------------------------------------------------- indexer
def indexer_inputs(
    cfg: ModelConfig, seqs: list[SeqSpec], block_size: int, topk: int | None = None, **batch_options: object
) -> Build:
    def build(gen: torch.Generator, dtype: torch.dtype) -> dict:
        batch = paged_batch(seqs, block_size, gen, **batch_options)
        inputs = {
            "q_idx": randn((batch.num_tokens, cfg.index_n_heads, cfg.index_head_dim), gen, dtype=dtype),
            # Mixed-sign head weights, as weights_proj produces: ReLU and the signs both matter.
            "weights": randn((batch.num_tokens, cfg.index_n_heads), gen, std=cfg.indexer_weight_scale),
            "index_k_cache": randn((batch.num_blocks, block_size, cfg.index_head_dim), gen, dtype=dtype),
            "block_table": batch.block_table,
            "seq_lens_k": batch.seq_lens_k,
            "cu_seqlens_q": batch.cu_seqlens_q,
        }
        if topk is not None:
            inputs.update(topk=topk, return_scores=True)
        return inputs

    return build


# ---------------------------------------------------------------------------------------------- sparse attention
def sparse_attention_inputs(
    cfg: ModelConfig,
    seqs: list[SeqSpec],
    block_size: int,
    topk: int,
    invalid_fraction: float = 0.0,
    empty_rows: tuple[int, ...] = (),
    **batch_options: object,
) -> Build:
    def build(gen: torch.Generator, dtype: torch.dtype) -> dict:
        batch = paged_batch(seqs, block_size, gen, **batch_options)
        indices = random_topk_indices(batch, topk, gen, invalid_fraction=invalid_fraction)
        for t in empty_rows:
            indices[t] = -1
        return {
            "q": randn((batch.num_tokens, cfg.num_attention_heads, cfg.latent_dim), gen, dtype=dtype),
            "kv_cache": randn((batch.num_blocks, block_size, cfg.latent_dim), gen, dtype=dtype),
            "indices": indices,
            "block_table": batch.block_table,
            "seq_lens_k": batch.seq_lens_k,
            "cu_seqlens_q": batch.cu_seqlens_q,
            "sm_scale": cfg.sm_scale,
            "d_v": cfg.kv_lora_rank,
        }

    return build


# -------------------------------------------------------------------------------------------------------- MoE
def moe_gate_inputs(
    cfg: ModelConfig, tokens: int, *, scoring: str | None = None, bias: bool = True, norm: bool | None = None
) -> Build:
    def build(gen: torch.Generator, dtype: torch.dtype) -> dict:
        return {
            "router_logits": randn((tokens, cfg.n_routed_experts), gen, std=2.0),
            "bias": randn((cfg.n_routed_experts,), gen, std=0.1) if bias else None,
            "top_k": cfg.num_experts_per_tok,
            "n_group": cfg.n_group,
            "topk_group": cfg.topk_group,
            "routed_scaling_factor": cfg.routed_scaling_factor,
            "norm_topk_prob": cfg.norm_topk_prob if norm is None else norm,
            "scoring": scoring or cfg.scoring_func,
        }

    return build


def _topk_ids(tokens: int, k: int, num_experts: int, gen: torch.Generator, used_experts: int | None) -> torch.Tensor:
    """[T, k] int32 distinct expert ids per token, drawn from the first `used_experts` experts only."""
    pool = num_experts if used_experts is None else used_experts
    rows = [torch.randperm(pool, generator=gen)[:k] for _ in range(tokens)]
    return torch.stack(rows).to(torch.int32) if rows else torch.zeros(0, k, dtype=torch.int32)


def _routing(tokens: int, k: int, num_experts: int, gen: torch.Generator, used_experts: int | None):
    ids = _topk_ids(tokens, k, num_experts, gen, used_experts)
    weights = torch.rand((tokens, k), generator=gen) + 0.1
    return weights, ids


def moe_dispatch_inputs(tokens: int, width: int, k: int, num_experts: int, used_experts: int | None = None) -> Build:
    def build(gen: torch.Generator, dtype: torch.dtype) -> dict:
        return {
            "x": randn((tokens, width), gen, dtype=dtype),
            "topk_ids": _topk_ids(tokens, k, num_experts, gen, used_experts),
            "num_experts": num_experts,
        }

    return build


def grouped_matmul_inputs(group_sizes: list[int], n: int, k: int) -> Build:
    def build(gen: torch.Generator, dtype: torch.dtype) -> dict:
        offsets = torch.zeros(len(group_sizes) + 1, dtype=torch.int64)
        offsets[1:] = torch.cumsum(torch.tensor(group_sizes), 0)
        return {
            "x_sorted": randn((int(offsets[-1]), k), gen, dtype=dtype),
            "w": randn((len(group_sizes), n, k), gen, std=k**-0.5, dtype=dtype),
            "expert_offsets": offsets,
        }

    return build


def cancelling_grouped_products(build: Build) -> Build:
    """`build`'s grouped_matmul inputs with each expert's weight rows made orthogonal to that expert's rows of x
    (fewer rows than K per expert): every output cancels to rounding noise, and is judged against its terms' root-
    sum-square (the long fuzz profile failed an fp32 output of three cancelling terms at 1.1e-4 of itself)."""

    def build_cancelling(gen: torch.Generator, dtype: torch.dtype) -> dict:
        inputs = build(gen, dtype)
        offsets = inputs["expert_offsets"].tolist()
        for expert, (start, end) in enumerate(zip(offsets, offsets[1:])):
            if end > start:
                inputs["w"][expert] = rows_orthogonal_to(inputs["w"][expert], inputs["x_sorted"][start:end])
        return inputs

    return build_cancelling


def moe_combine_inputs(tokens: int, k: int, width: int) -> Build:
    def build(gen: torch.Generator, dtype: torch.dtype) -> dict:
        return {
            "y_sorted": randn((tokens * k, width), gen, dtype=dtype),
            "src_index": torch.randperm(tokens * k, generator=gen),
            "topk_weights": torch.rand((tokens, k), generator=gen) + 0.1,
        }

    return build


def fused_moe_inputs(
    tokens: int, width: int, inter: int, k: int, num_experts: int, used_experts: int | None = None
) -> Build:
    def build(gen: torch.Generator, dtype: torch.dtype) -> dict:
        weights, ids = _routing(tokens, k, num_experts, gen, used_experts)
        return {
            "x": randn((tokens, width), gen, dtype=dtype),
            "topk_weights": weights,
            "topk_ids": ids,
            "w13": randn((num_experts, 2 * inter, width), gen, std=width**-0.5, dtype=dtype),
            "w2": randn((num_experts, width, inter), gen, std=inter**-0.5, dtype=dtype),
        }

    return build


def cancelling_down_projections(build: Build) -> Build:
    """`build`'s fused_moe inputs with each expert's down projection w2 made orthogonal to the activations
    silu(x w1^T) * (x w3^T) of the tokens routed to it (float64 from the case's x and w13; fewer tokens per expert
    than the intermediate size): every output cancels to rounding noise, and is judged against its terms' root-
    sum-square."""

    def build_cancelling(gen: torch.Generator, dtype: torch.dtype) -> dict:
        inputs = build(gen, dtype)
        x, ids, w13, w2 = inputs["x"].double(), inputs["topk_ids"], inputs["w13"], inputs["w2"]
        for expert in ids.unique().tolist():
            tokens = (ids == expert).any(dim=1)
            gate, up = (x[tokens] @ w13[expert].double().T).chunk(2, dim=1)
            w2[expert] = rows_orthogonal_to(w2[expert], torch.nn.functional.silu(gate) * up)
        return inputs

    return build_cancelling


# ------------------------------------------------------------------------------------------------ quantization
def dynamic_quant_inputs(shape: tuple[int, ...], zero_rows: tuple[int, ...] = ()) -> Build:
    def build(gen: torch.Generator, dtype: torch.dtype) -> dict:
        x = randn(shape, gen, std=3.0, dtype=dtype)
        for r in zero_rows:
            x.view(-1, shape[-1])[r] = 0
        return {"x": x}

    return build


def _int8(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    return torch.randint(-127, 128, shape, generator=gen, dtype=torch.int8)


def _scales(n: int, gen: torch.Generator, unit: bool) -> torch.Tensor:
    return torch.ones(n) if unit else torch.rand(n, generator=gen) * 0.02 + 1e-3


def quant_matmul_inputs(m: int, n: int, k: int, *, bias: bool = False, unit_scales: bool = False) -> Build:
    def build(gen: torch.Generator, dtype: torch.dtype) -> dict:
        return {
            "x_q": _int8((m, k), gen),
            "x_scale": _scales(m, gen, unit_scales),
            "w_q": _int8((n, k), gen),
            "w_scale": _scales(n, gen, unit_scales),
            "bias": randn((n,), gen) if bias else None,
            "out_dtype": dtype,
        }

    return build


def w4a8_matmul_inputs(m: int, n: int, k: int, group_size: int | None, unit_scales: bool = False) -> Build:
    def build(gen: torch.Generator, dtype: torch.dtype) -> dict:
        nibbles = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)  # every int4 pair
        scale_shape = n if group_size is None else n * (k // group_size)
        w_scale = _scales(scale_shape, gen, unit_scales)
        return {
            "x_q": _int8((m, k), gen),
            "x_scale": _scales(m, gen, unit_scales),
            "w_packed": nibbles,
            "w_scale": w_scale if group_size is None else w_scale.reshape(n, k // group_size),
            "group_size": group_size,
            "out_dtype": dtype,
        }

    return build


def hadamard_inputs(shape: tuple[int, ...], scale: float | None = None) -> Build:
    def build(gen: torch.Generator, dtype: torch.dtype) -> dict:
        return {"x": randn(shape, gen, dtype=dtype), "scale": scale}

    return build


MINI, G5, DS = GLM5_MINI, GLM5, DEEPSEEK_V32
MINI_HALF_SPLIT = GLM5_MINI.with_overrides(name="glm5-mini-halfsplit", indexer_rope_interleaved=False)
MINI_GROUPS = GLM5_MINI.with_overrides(name="glm5-mini-groups", n_group=4, topk_group=2)

CASES: list[Case] = [
    # mla_prolog
    Case("mla_prolog", "mini_prefill", "regular", mla_prolog_inputs(MINI, PREFILL, 8)),
    Case("mla_prolog", "mini_ragged_shuffled", "irregular", mla_prolog_inputs(MINI, RAGGED, 16)),
    Case("mla_prolog", "mini_decode", "regular", mla_prolog_inputs(MINI, DECODE, 16)),
    Case("mla_prolog", "padding_slots_skipped", "corner", mla_prolog_inputs(MINI, RAGGED, 16, pad=(0, 7, 17))),
    Case(
        "mla_prolog",
        "decode_latent_queries_cancel",
        "corner",
        cancelling_latent_queries(mla_prolog_inputs(MINI, [SeqSpec(1, 9)], 8)),
    ),
    Case(
        "mla_prolog",
        "decode_latent_rows_cancel",
        "corner",
        cancelling_latent_rows(mla_prolog_inputs(MINI, [SeqSpec(1, 9)], 8)),
    ),
    Case("mla_prolog", "glm5_dims", "regular", mla_prolog_inputs(G5, [SeqSpec(3, 40)], 64), slow=True),
    Case("mla_prolog", "deepseek_v32_dims", "regular", mla_prolog_inputs(DS, [SeqSpec(2, 9)], 64), slow=True),
    # indexer_prolog
    Case("indexer_prolog", "mini_interleaved", "regular", indexer_prolog_inputs(MINI, PREFILL, 8)),
    Case("indexer_prolog", "mini_half_split", "regular", indexer_prolog_inputs(MINI_HALF_SPLIT, RAGGED, 16)),
    Case("indexer_prolog", "padding_slots_skipped", "corner", indexer_prolog_inputs(MINI, RAGGED, 16, pad=(1, 17))),
    Case(
        "indexer_prolog",
        "decode_projections_cancel",
        "corner",
        cancelling_indexer_projections(indexer_prolog_inputs(MINI, [SeqSpec(1, 9)], 8)),
    ),
    Case(
        "indexer_prolog",
        "decode_keys_centre_to_noise",
        "corner",
        centring_index_keys(indexer_prolog_inputs(MINI, [SeqSpec(1, 9)], 8)),
    ),
    Case("indexer_prolog", "glm5_dims", "regular", indexer_prolog_inputs(G5, [SeqSpec(3, 40)], 64), slow=True),
    Case("indexer_prolog", "deepseek_v32_dims", "regular", indexer_prolog_inputs(DS, [SeqSpec(2, 9)], 64), slow=True),
    # indexer_logits
    Case("indexer_logits", "mini_prefill", "regular", indexer_inputs(MINI, PREFILL, 8)),
    Case("indexer_logits", "mini_ragged_shuffled", "irregular", indexer_inputs(MINI, RAGGED, 16)),
    Case("indexer_logits", "decode_mtp", "irregular", indexer_inputs(MINI, MTP_DECODE, 16)),
    # lightning_indexer
    Case("lightning_indexer", "fewer_visible_than_topk", "corner", indexer_inputs(MINI, PREFILL, 8, topk=16)),
    Case("lightning_indexer", "topk_wider_than_cache", "corner", indexer_inputs(MINI, PREFILL, 8, topk=32)),
    Case("lightning_indexer", "mini_ragged_shuffled", "irregular", indexer_inputs(MINI, RAGGED, 16, topk=8)),
    Case("lightning_indexer", "mini_decode", "regular", indexer_inputs(MINI, DECODE, 16, topk=16)),
    Case("lightning_indexer", "decode_mtp", "irregular", indexer_inputs(MINI, MTP_DECODE, 16, topk=24)),
    Case("lightning_indexer", "topk_1", "corner", indexer_inputs(MINI, RAGGED, 16, topk=1)),
    Case(
        "lightning_indexer",
        "glm5_dims_topk2048",
        "regular",
        indexer_inputs(G5, [SeqSpec(3, 3000), SeqSpec(1, 2100)], 64, topk=2048),
        slow=True,
    ),
    # sparse_flash_attention
    Case("sparse_flash_attention", "mini_prefill", "regular", sparse_attention_inputs(MINI, PREFILL, 8, topk=16)),
    Case(
        "sparse_flash_attention",
        "ragged_with_invalid",
        "irregular",
        sparse_attention_inputs(MINI, RAGGED, 16, topk=24, invalid_fraction=0.2),
    ),
    Case("sparse_flash_attention", "decode", "regular", sparse_attention_inputs(MINI, DECODE, 16, topk=32)),
    Case(
        "sparse_flash_attention",
        "empty_rows",
        "corner",
        sparse_attention_inputs(MINI, RAGGED, 16, topk=8, empty_rows=(0, 5, 17)),
    ),
    Case(
        "sparse_flash_attention",
        "glm5_dims_topk2048",
        "regular",
        sparse_attention_inputs(G5, [SeqSpec(2, 4000), SeqSpec(1, 1500)], 64, topk=2048, invalid_fraction=0.05),
        slow=True,
    ),
    Case(
        "sparse_flash_attention",
        "deepseek_v32_heads",
        "regular",
        sparse_attention_inputs(DS, [SeqSpec(1, 3000)], 64, topk=2048),
        slow=True,
    ),
    # moe_gate (router logits are fp32 in every model)
    Case("moe_gate", "glm5_sigmoid", "regular", moe_gate_inputs(G5, 37), dtypes=FP32_ONLY),
    Case("moe_gate", "deepseek_v32_groups", "regular", moe_gate_inputs(DS, 37), dtypes=FP32_ONLY),
    Case(
        "moe_gate",
        "mini_groups_softmax",
        "irregular",
        moe_gate_inputs(MINI_GROUPS, 19, scoring="softmax"),
        dtypes=FP32_ONLY,
    ),
    Case(
        "moe_gate",
        "no_bias_unnormalised",
        "corner",
        moe_gate_inputs(MINI, 19, bias=False, norm=False),
        dtypes=FP32_ONLY,
    ),
    # moe_dispatch
    Case("moe_dispatch", "mini", "regular", moe_dispatch_inputs(23, 64, 4, 16)),
    Case("moe_dispatch", "zero_token_experts", "corner", moe_dispatch_inputs(23, 64, 3, 16, used_experts=5)),
    Case("moe_dispatch", "all_tokens_one_expert", "corner", moe_dispatch_inputs(23, 64, 1, 16, used_experts=1)),
    # grouped_matmul
    Case("grouped_matmul", "mini", "regular", grouped_matmul_inputs([5, 9, 3, 7], 48, 64)),
    Case("grouped_matmul", "zero_token_experts", "corner", grouped_matmul_inputs([0, 6, 0, 0, 11, 0], 40, 32)),
    Case("grouped_matmul", "all_rows_one_expert", "corner", grouped_matmul_inputs([0, 0, 17, 0], 24, 40)),
    Case(
        "grouped_matmul",
        "products_cancel",
        "corner",
        cancelling_grouped_products(grouped_matmul_inputs([1, 3, 0, 2], 5, 4)),
    ),
    Case("grouped_matmul", "glm5_expert_dims", "regular", grouped_matmul_inputs([3, 0, 5], 2048, 6144), slow=True),
    # moe_combine
    Case("moe_combine", "mini", "regular", moe_combine_inputs(23, 4, 64)),
    Case("moe_combine", "top1", "corner", moe_combine_inputs(9, 1, 48)),
    # fused_moe
    Case("fused_moe", "mini", "regular", fused_moe_inputs(21, 256, 64, 4, 16)),
    Case("fused_moe", "zero_token_experts", "corner", fused_moe_inputs(21, 256, 64, 4, 16, used_experts=6)),
    Case("fused_moe", "all_tokens_one_expert", "corner", fused_moe_inputs(9, 128, 32, 1, 8, used_experts=1)),
    Case("fused_moe", "products_cancel", "corner", cancelling_down_projections(fused_moe_inputs(5, 48, 16, 2, 4))),
    # dynamic_quant
    Case("dynamic_quant", "tokens", "regular", dynamic_quant_inputs((37, 256))),
    Case("dynamic_quant", "zero_row_3d", "corner", dynamic_quant_inputs((3, 5, 96), zero_rows=(4, 11))),
    # quant_matmul
    Case("quant_matmul", "mini", "regular", quant_matmul_inputs(17, 48, 256, bias=True)),
    Case(
        "quant_matmul",
        "unit_scales_exact",
        "corner",
        quant_matmul_inputs(9, 40, 512, unit_scales=True),
        dtypes=FP32_ONLY,
        exact=True,
    ),
    Case("quant_matmul", "glm5_q_a_proj_dims", "regular", quant_matmul_inputs(4, 2048, 6144), slow=True),
    # w4a8_matmul
    Case("w4a8_matmul", "per_channel", "regular", w4a8_matmul_inputs(17, 48, 256, None)),
    Case("w4a8_matmul", "group_64", "irregular", w4a8_matmul_inputs(13, 40, 256, 64)),
    Case(
        "w4a8_matmul",
        "unit_scales_exact",
        "corner",
        w4a8_matmul_inputs(9, 24, 512, None, unit_scales=True),
        dtypes=FP32_ONLY,
        exact=True,
    ),
    Case("w4a8_matmul", "glm5_expert_dims_g128", "regular", w4a8_matmul_inputs(4, 2048, 6144, 128), slow=True),
    # hadamard_transform
    Case("hadamard_transform", "pow2_128", "regular", hadamard_inputs((9, 128))),
    Case("hadamard_transform", "k_sizes", "irregular", hadamard_inputs((3, 12 * 4))),
    *(
        Case("hadamard_transform", f"k{k}", "irregular", hadamard_inputs((2, k * 2)))
        for k in (20, 28, 36, 40, 52, 60, 108, 140, 156, 172)
    ),
    Case("hadamard_transform", "explicit_scale", "corner", hadamard_inputs((4, 64), scale=0.5)),
    Case("hadamard_transform", "glm5_hidden_6144", "regular", hadamard_inputs((3, 6144)), slow=True),
    Case("hadamard_transform", "deepseek_hidden_7168", "regular", hadamard_inputs((3, 7168)), slow=True),
]


# The quantized cache formats (OPS.md section 7): every case of a cache op again on each format's bytes.
CASES += quantized_variants(CASES)


def cases_for(op: str | None = None, *, quick: bool = False) -> list[Case]:
    return [c for c in CASES if (op is None or c.op == op) and not (quick and c.slow)]
