"""ONNX graphs of the attention-side ops: mla_prolog, indexer_prolog, indexer_logits, lightning_indexer and
sparse_flash_attention (OPS.md sections 1-3), in the standard opset.

[x] -> Gemm/RMSNorm/RoPE -> (q_lat, q_pe, q_norm) + ScatterND cache write                      mla_prolog
[x, q_norm] -> Gemm/LayerNorm/RoPE -> (q_idx, weights) + ScatterND cache write             indexer_prolog
[q_idx, weights] -> Gather keys per token -> MatMul/ReLU/MatMul -> causal Where             indexer_logits
indexer_logits -> Pad to >= topk columns with -inf -> TopK -> -1 where the score is -inf  lightning_indexer
[q, indices] -> Gather the selected rows -> MatMul -> masked exp-normalise -> MatMul   sparse_flash_attention

Paged gathers go through one int64 slot table per sequence (blocks.sequence_slots); a gathered key per query
token costs T x S x D (T x topk x 576 for sparse attention), which is small at decode and grows with T in
prefill: the graphs state the math for toolchains to fuse, they are not a prefill kernel.
"""

from __future__ import annotations

from glm5_hal.config import ModelConfig
from glm5_hal.onnx_export.blocks import (
    NEG_INF,
    cast,
    dims,
    flat_cache,
    layer_norm,
    linear,
    rms_norm,
    rope,
    scalar_dim,
    sequence_slots,
    slice_last,
    squeeze,
    token_positions,
    token_sequences,
    unsqueeze,
    write_cache,
)
from glm5_hal.onnx_export.graph import GraphBuilder, TensorSig
from glm5_hal.onnx_export.kv_formats import decode_rows, encode_rows, format_of
from glm5_hal.onnx_export.opgraph import CACHE_OUT_SUFFIX, Dims, OpGraph, Options, require, sig

F32, I32, I64 = "float32", "int32", "int64"
PAGED_INPUTS = (
    sig("block_table", I32, "B", "max_blocks"),
    sig("seq_lens_k", I32, "B"),
    sig("cu_seqlens_q", I32, "B+1"),
)


def _quantized_cache(*names: str):
    """adjust_inputs / adjust_outputs of an op with a cache: with a quantized kv_cache_dtype (glm5_hal.kv_formats)
    the named cache values are uint8 [num_blocks, block_size, row_bytes] instead of fp32 rows."""

    def adjust(sigs: tuple[TensorSig, ...], options: Options) -> tuple[TensorSig, ...]:
        fmt = format_of(options)
        if fmt is None:
            return sigs
        return tuple(sig(s.name, "uint8", *s.shape[:-1], fmt.row_bytes) if s.name in names else s for s in sigs)

    return adjust


def _store(g: GraphBuilder, cache: str, slot_mapping: str, rows: str, o: Options, *, out: str) -> str:
    """write_cache of rows [T, width] fp32, encoded first for a quantized cache."""
    fmt = format_of(o)
    return write_cache(g, cache, slot_mapping, rows if fmt is None else encode_rows(g, rows, fmt), out=out)


def _gather_rows(g: GraphBuilder, cache: str, slots: str, width: int, o: Options) -> str:
    """The cache rows at slots [T, S] as fp32 values [T, S, width]; a quantized cache's gathered rows decoded."""
    fmt = format_of(o)
    if fmt is None:
        return g.op("Gather", flat_cache(g, cache, width), slots)
    return decode_rows(g, g.op("Gather", flat_cache(g, cache, fmt.row_bytes), slots), fmt)


# ------------------------------------------------------------------------------------------------ mla_prolog
def _build_mla_prolog(g: GraphBuilder, v, d: Dims, o: Options) -> dict[str, str]:
    heads, nope, kv_lora, rope_dim = d["H"], d["nope"], d["kv_lora"], 2 * d["rope_half"]
    require(d["HQ"] == heads * (nope + rope_dim), f"w_uq_qr: expected {heads * (nope + rope_dim)} rows, got {d['HQ']}")
    require(d["latent"] == kv_lora + rope_dim, f"kv_cache: expected width {kv_lora + rope_dim}, got {d['latent']}")
    eps = float(o["eps"])
    q_norm = rms_norm(g, linear(g, v["x"], v["w_dq"]), v["gamma_cq"], eps, out="q_norm")
    q = g.op("Reshape", linear(g, q_norm, v["w_uq_qr"]), g.const([0, heads, nope + rope_dim]))  # [T, H, nope+rope]
    # q_lat[t, h] = q_nope[t, h] @ w_uk[h]: a MatMul batched over heads, so heads go first and back.
    q_nope_by_head = g.op("Transpose", slice_last(g, q, 0, nope), perm=[1, 0, 2])  # [H, T, nope]
    q_lat = g.op("Transpose", g.op("MatMul", q_nope_by_head, v["w_uk"]), perm=[1, 0, 2], out="q_lat")
    # The MLA RoPE is interleaved for GLM-5 and DeepSeek-V3.2 alike (OPS.md section 1).
    q_pe = rope(
        g, slice_last(g, q, nope, nope + rope_dim), v["cos"], v["sin"], rank=3, rope_dim=rope_dim, interleaved=True
    )
    kv = linear(g, v["x"], v["w_dkv_kr"])  # [T, kv_lora + rope]
    row = g.op(
        "Concat",
        rms_norm(g, slice_last(g, kv, 0, kv_lora), v["gamma_ckv"], eps),
        rope(
            g,
            slice_last(g, kv, kv_lora, kv_lora + rope_dim),
            v["cos"],
            v["sin"],
            rank=2,
            rope_dim=rope_dim,
            interleaved=True,
        ),
        axis=-1,
    )
    cache = _store(g, v["kv_cache"], v["slot_mapping"], row, o, out="kv_cache" + CACHE_OUT_SUFFIX)
    return {"q_lat": q_lat, "q_pe": q_pe, "q_norm": q_norm, "kv_cache" + CACHE_OUT_SUFFIX: cache}


def _mla_dims(cfg: ModelConfig) -> dict[str, int]:
    heads, nope, rope_dim = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    return {
        "hidden": cfg.hidden_size,
        "q_lora": cfg.q_lora_rank,
        "kv_lora": cfg.kv_lora_rank,
        "H": heads,
        "nope": nope,
        "rope_half": rope_dim // 2,
        "HQ": heads * (nope + rope_dim),
        "latent": cfg.latent_dim,
    }


MLA_PROLOG = OpGraph(
    name="mla_prolog",
    inputs=(
        sig("x", F32, "T", "hidden"),
        sig("w_dq", F32, "q_lora", "hidden"),
        sig("gamma_cq", F32, "q_lora"),
        sig("w_uq_qr", F32, "HQ", "q_lora"),
        sig("w_uk", F32, "H", "nope", "kv_lora"),
        sig("w_dkv_kr", F32, "latent", "hidden"),
        sig("gamma_ckv", F32, "kv_lora"),
        sig("cos", F32, "T", "rope_half"),
        sig("sin", F32, "T", "rope_half"),
        sig("kv_cache", F32, "num_blocks", "block_size", "latent"),
        sig("slot_mapping", I64, "T"),
    ),
    outputs=(
        sig("q_lat", F32, "T", "H", "kv_lora"),
        sig("q_pe", F32, "T", "H", "rope"),
        sig("q_norm", F32, "T", "q_lora"),
        sig("kv_cache" + CACHE_OUT_SUFFIX, F32, "num_blocks", "block_size", "latent"),
    ),
    options_from_config=lambda cfg: {"eps": cfg.rms_norm_eps},
    dims_from_config=_mla_dims,
    derived_dims=lambda d, o: {"rope": 2 * d["rope_half"]},
    build=_build_mla_prolog,
    adjust_inputs=_quantized_cache("kv_cache"),
    adjust_outputs=_quantized_cache("kv_cache" + CACHE_OUT_SUFFIX),
)


# -------------------------------------------------------------------------------------------- indexer_prolog
def _rope_first(g: GraphBuilder, x: str, cos: str, sin: str, *, rank: int, rope_dim: int, width: int, o: Options):
    """RoPE on the FIRST rope_dim dims of x [..., width] (the indexer's layout; MLA puts RoPE last)."""
    rotated = rope(
        g,
        slice_last(g, x, 0, rope_dim),
        cos,
        sin,
        rank=rank,
        rope_dim=rope_dim,
        interleaved=bool(o["rope_interleaved"]),
    )
    return g.op("Concat", rotated, slice_last(g, x, rope_dim, width), axis=-1)


def _build_indexer_prolog(g: GraphBuilder, v, d: Dims, o: Options) -> dict[str, str]:
    heads, head_dim, rope_dim = d["HI"], d["DI"], 2 * d["rope_half"]
    require(d["HIDI"] == heads * head_dim, f"w_iq: expected {heads * head_dim} rows, got {d['HIDI']}")
    q = g.op("Reshape", linear(g, v["q_norm"], v["w_iq"]), g.const([0, heads, head_dim]))  # [T, HI, DI]
    q_idx = _rope_first(g, q, v["cos"], v["sin"], rank=3, rope_dim=rope_dim, width=head_dim, o=o)
    k = layer_norm(g, linear(g, v["x"], v["w_ik"]), v["k_norm_weight"], v["k_norm_bias"], float(o["eps"]))
    k = _rope_first(g, k, v["cos"], v["sin"], rank=2, rope_dim=rope_dim, width=head_dim, o=o)
    weight_scale = g.const(heads**-0.5 * head_dim**-0.5, F32)
    weights = g.op("Mul", linear(g, v["x"], v["w_iw"]), weight_scale, out="weights")
    out_name = "index_k_cache" + CACHE_OUT_SUFFIX
    cache = _store(g, v["index_k_cache"], v["slot_mapping"], k, o, out=out_name)
    return {"q_idx": q_idx, "weights": weights, out_name: cache}


def _indexer_dims(cfg: ModelConfig) -> dict[str, int]:
    return {
        "hidden": cfg.hidden_size,
        "q_lora": cfg.q_lora_rank,
        "HI": cfg.index_n_heads,
        "DI": cfg.index_head_dim,
        "HIDI": cfg.index_n_heads * cfg.index_head_dim,
        "rope_half": cfg.qk_rope_head_dim // 2,
    }


INDEXER_PROLOG = OpGraph(
    name="indexer_prolog",
    inputs=(
        sig("x", F32, "T", "hidden"),
        sig("q_norm", F32, "T", "q_lora"),
        sig("w_iq", F32, "HIDI", "q_lora"),
        sig("w_ik", F32, "DI", "hidden"),
        sig("k_norm_weight", F32, "DI"),
        sig("k_norm_bias", F32, "DI"),
        sig("w_iw", F32, "HI", "hidden"),
        sig("cos", F32, "T", "rope_half"),
        sig("sin", F32, "T", "rope_half"),
        sig("index_k_cache", F32, "num_blocks", "block_size", "DI"),
        sig("slot_mapping", I64, "T"),
    ),
    outputs=(
        sig("q_idx", F32, "T", "HI", "DI"),
        sig("weights", F32, "T", "HI"),
        sig("index_k_cache" + CACHE_OUT_SUFFIX, F32, "num_blocks", "block_size", "DI"),
    ),
    options_from_config=lambda cfg: {"rope_interleaved": cfg.indexer_rope_interleaved, "eps": cfg.indexer_norm_eps},
    dims_from_config=_indexer_dims,
    build=_build_indexer_prolog,
    adjust_inputs=_quantized_cache("index_k_cache"),
    adjust_outputs=_quantized_cache("index_k_cache" + CACHE_OUT_SUFFIX),
)


# ------------------------------------------------------------------------------------ indexer scores and top-k
def indexer_scores(g: GraphBuilder, v, d: Dims, o: Options) -> str:
    """[T, S] fp32: I[t, s] = sum_j weights[t, j] * ReLU(q_idx[t, j] . k[s]) where s <= pos(t), -inf elsewhere."""
    layout = token_sequences(g, v["q_idx"], v["cu_seqlens_q"])
    slots = g.op("Gather", sequence_slots(g, v["block_table"], v["index_k_cache"]), layout.seq)  # [T, S]
    keys = _gather_rows(g, v["index_k_cache"], slots, d["DI"], o)  # [T, S, DI]
    # keys @ q^T rather than q @ keys^T: the transpose then copies the small q, not the gathered keys.
    dots = g.op("MatMul", keys, g.op("Transpose", v["q_idx"], perm=[0, 2, 1]))  # [T, S, HI]
    scores = squeeze(g, g.op("MatMul", g.op("Relu", dots), unsqueeze(g, v["weights"], 2)), 2)  # [T, S]
    key_pos = g.op("Range", g.const(0), scalar_dim(g, slots, 1), g.const(1))  # [S]
    pos = token_positions(g, layout, v["seq_lens_k"])
    visible = g.op("LessOrEqual", unsqueeze(g, key_pos, 0), unsqueeze(g, pos, 1))  # [T, S]
    return g.op("Where", visible, scores, g.const(NEG_INF, F32), out="logits")


def _build_lightning_indexer(g: GraphBuilder, v, d: Dims, o: Options) -> dict[str, str]:
    topk = int(o["topk"])
    logits = indexer_scores(g, v, d, o)
    # TopK needs k <= the axis length; a cache narrower than topk gets -inf columns, which come out as -1.
    missing = g.op("Max", g.op("Sub", g.const([topk]), dims(g, logits, 1, 2)), g.const([0]))
    pads = g.op("Concat", g.const([0, 0, 0]), missing, axis=0)
    padded = g.op("Pad", logits, pads, g.const(NEG_INF, F32), mode="constant")
    scores, positions = g.op(
        "TopK", padded, g.const([topk]), axis=-1, largest=1, sorted=1, n_out=2, out=["scores", g.fresh("topk_idx")]
    )
    invisible = g.op("Equal", scores, g.const(NEG_INF, F32))
    indices = cast(g, g.op("Where", invisible, g.const(-1), positions), I32, out="indices")
    return {"indices": indices, "scores": scores}


INDEXER_SCORING_INPUTS = (
    sig("q_idx", F32, "T", "HI", "DI"),
    sig("weights", F32, "T", "HI"),
    sig("index_k_cache", F32, "num_blocks", "block_size", "DI"),
    *PAGED_INPUTS,
)

INDEXER_LOGITS = OpGraph(
    name="indexer_logits",
    inputs=INDEXER_SCORING_INPUTS,
    outputs=(sig("logits", F32, "T", "S"),),
    options_from_config=lambda cfg: {},
    dims_from_config=lambda cfg: {"HI": cfg.index_n_heads, "DI": cfg.index_head_dim},
    build=lambda g, v, d, o: {"logits": indexer_scores(g, v, d, o)},
    adjust_inputs=_quantized_cache("index_k_cache"),
)

LIGHTNING_INDEXER = OpGraph(
    name="lightning_indexer",
    inputs=INDEXER_SCORING_INPUTS,
    outputs=(sig("indices", I32, "T", "topk"), sig("scores", F32, "T", "topk")),
    options_from_config=lambda cfg: {"topk": cfg.index_topk},
    dims_from_config=lambda cfg: {"HI": cfg.index_n_heads, "DI": cfg.index_head_dim},
    derived_dims=lambda d, o: {"topk": int(o["topk"])},
    build=_build_lightning_indexer,
    adjust_inputs=_quantized_cache("index_k_cache"),
)


# ------------------------------------------------------------------------------------- sparse_flash_attention
def _build_sparse_flash_attention(g: GraphBuilder, v, d: Dims, o: Options) -> dict[str, str]:
    d_v = int(o["d_v"])
    require(0 < d_v <= d["latent"], f"d_v: expected 1..{d['latent']}, got {d_v}")
    layout = token_sequences(g, v["q"], v["cu_seqlens_q"])
    idx = cast(g, v["indices"], I64)  # [T, topk]
    k_len = unsqueeze(g, g.op("Gather", cast(g, v["seq_lens_k"], I64), layout.seq), 1)  # [T, 1]
    valid = g.op("And", g.op("GreaterOrEqual", idx, g.const(0)), g.op("Less", idx, k_len))  # [T, topk]
    safe_idx = g.op("Where", valid, idx, g.const(0))  # invalid entries read position 0, masked below
    slots = sequence_slots(g, v["block_table"], v["kv_cache"])  # [B, S]
    row_start = g.op("Mul", unsqueeze(g, layout.seq, 1), dims(g, slots, 1, 2))  # [T, 1]
    slot = g.op("Gather", g.op("Reshape", slots, g.const([-1])), g.op("Add", row_start, safe_idx))  # [T, topk]
    keys = _gather_rows(g, v["kv_cache"], slot, d["latent"], o)  # [T, topk, 576]
    # Scores as [T, topk, H] (keys @ q^T) so only q is transposed; the softmax runs over axis 1.
    scores = g.op(
        "Mul", g.op("MatMul", keys, g.op("Transpose", v["q"], perm=[0, 2, 1])), g.const(float(o["sm_scale"]), F32)
    )
    scores = g.op("Where", unsqueeze(g, valid, 2), scores, g.const(NEG_INF, F32))
    # Softmax by hand: ONNX Softmax gives NaN on an all -inf row, and the contract wants out = 0, lse = -inf there.
    peak = g.op("ReduceMax", scores, g.const([1]), keepdims=1)  # [T, 1, H]
    peak = g.op("Where", g.op("Equal", peak, g.const(NEG_INF, F32)), g.const(0.0, F32), peak)
    weights = g.op("Exp", g.op("Sub", scores, peak))  # exp(-inf) = 0 for invalid entries
    total = g.op("ReduceSum", weights, g.const([1]), keepdims=1)  # [T, 1, H]
    # Natural log; log(0) = -inf for an empty row.
    lse = g.op("Squeeze", g.op("Add", peak, g.op("Log", total)), g.const([1]), out="lse")
    unnormalised = g.op("MatMul", g.op("Transpose", weights, perm=[0, 2, 1]), keys)  # [T, H, 576]
    safe_total = g.op("Where", g.op("Equal", total, g.const(0.0, F32)), g.const(1.0, F32), total)
    out = g.op("Div", slice_last(g, unnormalised, 0, d_v), g.op("Transpose", safe_total, perm=[0, 2, 1]), out="out")
    return {"out": out, "lse": lse}


SPARSE_FLASH_ATTENTION = OpGraph(
    name="sparse_flash_attention",
    inputs=(
        sig("q", F32, "T", "H", "latent"),
        sig("kv_cache", F32, "num_blocks", "block_size", "latent"),
        sig("indices", I32, "T", "topk"),
        *PAGED_INPUTS,
    ),
    outputs=(sig("out", F32, "T", "H", "d_v"), sig("lse", F32, "T", "H")),
    options_from_config=lambda cfg: {"sm_scale": cfg.sm_scale, "d_v": cfg.kv_lora_rank},
    dims_from_config=lambda cfg: {"H": cfg.num_attention_heads, "latent": cfg.latent_dim, "topk": cfg.index_topk},
    derived_dims=lambda d, o: {"d_v": int(o["d_v"])},
    build=_build_sparse_flash_attention,
    adjust_inputs=_quantized_cache("kv_cache"),
)

GRAPHS = (MLA_PROLOG, INDEXER_PROLOG, INDEXER_LOGITS, LIGHTNING_INDEXER, SPARSE_FLASH_ATTENTION)
