"""The FLOP / byte model each op is judged against: `cost(op, inputs) -> Cost`.

FLOPs count a multiply-add as 2 and leave out the small elementwise work (norms, RoPE, softmax) beside the
matmuls. Bytes are the minimum traffic: every input read once, every output written once, at the tensors' own
element sizes; for the sparse ops the gathered cache rows count once per selected key (a row picked by two tokens
is read twice), since that is what a kernel without cross-token reuse must move. A quantized cache (uint8 rows of
glm5_hal.kv_formats) counts its stored bytes: 656 per latent row, 132 per index key. `inputs` are the public op's
keyword arguments (what the glm5_hal.parity.cases builders return).

API (also used by perf/triton_gpu.py):
    cost(op, inputs) -> Cost(flops, bytes); Cost.intensity is FLOP per byte.
    COSTS: op name -> the function behind cost(), one for every op in glm5_hal.registry.OP_NAMES.
    dense_mla_attention(num_tokens, heads, visible, context, elem, d_v) -> Cost of dense MLA attention over the
        whole context (the baseline sparse attention is compared with).
    visible_keys(seq_lens_k, cu_seqlens_q) -> the number of (query, visible key) pairs of a batch.
    decoder_layer(cfg, new_tokens, context, elem, weight_bytes) -> Cost of one whole MoE decoder layer (the
        `layer` bench scenarios, perf/layer.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from glm5_hal.config import ModelConfig
from glm5_hal.registry import OP_NAMES
from ops_reference.hadamard import hadamard_base_size

LATENT = 576  # MLA latent row: 512 compressed KV + 64 RoPE


@dataclass(frozen=True)
class Cost:
    flops: float
    bytes: float

    @property
    def intensity(self) -> float:
        """FLOPs per byte."""
        return self.flops / self.bytes if self.bytes else math.inf


def _nbytes(*tensors: Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, Tensor))


def _q_lens(cu_seqlens_q: Tensor) -> Tensor:
    return (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()


def visible_keys(seq_lens_k: Tensor, cu_seqlens_q: Tensor) -> int:
    """Sum over query tokens of the keys each may see (its position + 1): the dense/indexer work."""
    q_lens, k_lens = _q_lens(cu_seqlens_q), seq_lens_k.long()
    # token i of a sequence sees k_len - q_len + i + 1 keys: sum over i of that
    return int((q_lens * (k_lens - q_lens) + q_lens * (q_lens + 1) // 2).sum())


def _mla_prolog(a: dict) -> Cost:
    x, w_dq, w_uq_qr, w_uk, w_dkv_kr = a["x"], a["w_dq"], a["w_uq_qr"], a["w_uk"], a["w_dkv_kr"]
    t = x.shape[0]
    macs = w_dq.numel() + w_uq_qr.numel() + w_uk.numel() + w_dkv_kr.numel()
    heads, _, kv_lora = w_uk.shape
    rope = 2 * a["cos"].shape[1]
    out = t * (heads * (kv_lora + rope) + w_dq.shape[0]) * x.element_size()
    cache_rows = t * a["kv_cache"].shape[-1] * a["kv_cache"].element_size()
    reads = _nbytes(x, w_dq, a["gamma_cq"], w_uq_qr, w_uk, w_dkv_kr, a["gamma_ckv"], a["cos"], a["sin"])
    return Cost(2.0 * t * macs, reads + out + cache_rows + _nbytes(a["slot_mapping"]))


def _indexer_prolog(a: dict) -> Cost:
    t = a["x"].shape[0]
    macs = a["w_iq"].numel() + a["w_ik"].numel() + a["w_iw"].numel()
    heads, dim = a["w_iw"].shape[0], a["w_ik"].shape[0]
    reads = _nbytes(a["x"], a["q_norm"], a["w_iq"], a["w_ik"], a["k_norm_weight"], a["k_norm_bias"], a["w_iw"])
    key_rows = t * a["index_k_cache"].shape[-1] * a["index_k_cache"].element_size()  # a quantized row's bytes
    writes = t * heads * dim * a["x"].element_size() + key_rows + t * heads * 4
    return Cost(2.0 * t * macs, reads + writes + _nbytes(a["cos"], a["sin"], a["slot_mapping"]))


def _indexer_scores(a: dict) -> tuple[float, int]:
    heads, dim = a["q_idx"].shape[1:]
    pairs = visible_keys(a["seq_lens_k"], a["cu_seqlens_q"])
    cache = a["index_k_cache"]  # each key read once: its row's bytes (132 for a quantized one)
    keys = int(a["seq_lens_k"].long().sum()) * cache.shape[-1] * cache.element_size()
    return 2.0 * pairs * heads * (dim + 1), keys + _nbytes(a["q_idx"], a["weights"], a["block_table"])


def _indexer_logits(a: dict) -> Cost:
    flops, reads = _indexer_scores(a)
    width = a["block_table"].shape[1] * a["index_k_cache"].shape[1]
    return Cost(flops, reads + a["q_idx"].shape[0] * width * 4)


def _lightning_indexer(a: dict) -> Cost:
    flops, reads = _indexer_scores(a)
    per_pick = 4 + (4 if a.get("return_scores", False) else 0)  # int32 index (+ fp32 score)
    return Cost(flops, reads + a["q_idx"].shape[0] * a["topk"] * per_pick)


def _sparse_flash_attention(a: dict) -> Cost:
    q, kv, indices = a["q"], a["kv_cache"], a["indices"]
    heads, width, d_v = q.shape[1], q.shape[-1], a.get("d_v", 512)
    # valid picks: >= 0 and inside the token's sequence (the contract ignores the rest, so no kernel moves them)
    seq_of_token = torch.repeat_interleave(torch.arange(len(a["seq_lens_k"])), _q_lens(a["cu_seqlens_q"]).cpu())
    limit = a["seq_lens_k"].long().cpu()[seq_of_token]
    idx = indices.long().cpu()
    selected = int(((idx >= 0) & (idx < limit[:, None])).sum())
    gathered = selected * kv.shape[-1] * kv.element_size()  # a quantized row's bytes (656), or 576 elements
    out = q.shape[0] * heads * (d_v * q.element_size() + 4)
    return Cost(2.0 * selected * heads * (width + d_v), _nbytes(q, indices, a["block_table"]) + gathered + out)


def dense_mla_attention(num_tokens: int, heads: int, visible: int, context: int, elem: int, d_v: int = 512) -> Cost:
    """Attention of `num_tokens` queries over all `visible` (token, key) pairs of a `context`-key latent cache."""
    flops = 2.0 * visible * heads * (LATENT + d_v)
    return Cost(flops, context * LATENT * elem + num_tokens * heads * (LATENT + d_v) * elem + num_tokens * heads * 4)


def decoder_layer(cfg: ModelConfig, new_tokens: int, context: int, elem: int, weight_bytes: int) -> Cost:
    """One sequence's `new_tokens` tokens (the last of `context` keys) through one MoE decoder layer of `cfg`,
    attention sparse over index_topk keys, each token through num_experts_per_tok routed experts and the shared
    ones. FLOPs: every projection once per token (the MLA prolog's W_UK absorption and W_UV are the two halves of
    kv_b_proj), the indexer over every visible key, attention over min(topk, visible) keys. Bytes: the weights
    (weight_bytes: those the layer holds, every one used), the index-key cache read once, the selected latent
    rows gathered per pick, the new cache rows written, the hidden states in and out."""
    hidden, heads, q = cfg.hidden_size, cfg.num_attention_heads, new_tokens
    per_token_macs = (
        hidden * cfg.q_lora_rank  # q_a_proj
        + cfg.q_lora_rank * heads * cfg.qk_head_dim  # q_b_proj
        + hidden * cfg.latent_dim  # kv_a_proj_with_mqa
        + heads * (cfg.qk_nope_head_dim + cfg.v_head_dim) * cfg.kv_lora_rank  # W_UK absorption and W_UV
        + heads * cfg.v_head_dim * hidden  # o_proj
        + cfg.q_lora_rank * cfg.index_n_heads * cfg.index_head_dim  # indexer wq_b
        + hidden * (cfg.index_head_dim + cfg.index_n_heads)  # indexer wk, weights_proj
        + hidden * cfg.n_routed_experts  # router
        + (cfg.num_experts_per_tok + cfg.n_shared_experts) * 3 * hidden * cfg.moe_intermediate_size  # experts
    )
    lens_k, cu_q = torch.tensor([context]), torch.tensor([0, q])
    visible = visible_keys(lens_k, cu_q)
    selected = sum(min(cfg.index_topk, context - q + i + 1) for i in range(q))
    flops = 2.0 * q * per_token_macs
    flops += 2.0 * visible * cfg.index_n_heads * (cfg.index_head_dim + 1)  # indexer scores, head weighting
    flops += 2.0 * selected * heads * (cfg.latent_dim + cfg.kv_lora_rank)  # QK over 576, PV over 512
    moved = weight_bytes + context * cfg.index_head_dim * elem + selected * cfg.latent_dim * elem
    moved += q * (cfg.latent_dim + cfg.index_head_dim) * elem + 2 * q * hidden * elem
    return Cost(flops, moved)


def _moe_gate(a: dict) -> Cost:
    logits = a["router_logits"]
    t, k = logits.shape[0], a["top_k"]
    return Cost(6.0 * logits.numel(), _nbytes(logits, a["bias"]) + t * k * 8)


def _moe_dispatch(a: dict) -> Cost:
    x, ids = a["x"], a["topk_ids"]
    rows = ids.numel()
    return Cost(0.0, _nbytes(x, ids) + rows * x.shape[1] * x.element_size() + rows * 8 + (a["num_experts"] + 1) * 8)


def _active_expert_bytes(w: Tensor, expert_offsets: Tensor) -> int:
    active = int(((expert_offsets[1:] - expert_offsets[:-1]) > 0).sum())
    return active * w[0].numel() * w.element_size()


def _grouped_matmul(a: dict) -> Cost:
    x, w, offsets = a["x_sorted"], a["w"], a["expert_offsets"]
    m, k = x.shape
    n = w.shape[1]
    return Cost(2.0 * m * n * k, _nbytes(x, offsets) + _active_expert_bytes(w, offsets) + m * n * x.element_size())


def _moe_combine(a: dict) -> Cost:
    y, weights = a["y_sorted"], a["topk_weights"]
    out = weights.shape[0] * y.shape[1] * y.element_size()
    return Cost(2.0 * y.numel(), _nbytes(y, a["src_index"], weights) + out)


def _fused_moe(a: dict) -> Cost:
    x, ids, w13, w2 = a["x"], a["topk_ids"], a["w13"], a["w2"]
    rows, d, inter = ids.numel(), x.shape[1], w2.shape[2]
    active = int(torch.unique(ids).numel())
    weights = active * (w13[0].numel() * w13.element_size() + w2[0].numel() * w2.element_size())
    flops = 2.0 * rows * (d * 2 * inter + inter * d)
    return Cost(flops, _nbytes(x, ids, a["topk_weights"]) + weights + x.numel() * x.element_size())


def _dynamic_quant(a: dict) -> Cost:
    x = a["x"]
    return Cost(3.0 * x.numel(), _nbytes(x) + x.numel() + x.numel() // x.shape[-1] * 4)


def _quant_matmul(a: dict) -> Cost:
    x_q, w_q = a["x_q"], a["w_q"]
    (m, k), n = x_q.shape, w_q.shape[0]
    out = m * n * torch.empty(0, dtype=a.get("out_dtype", torch.bfloat16)).element_size()
    return Cost(2.0 * m * n * k, _nbytes(x_q, a["x_scale"], w_q, a["w_scale"], a.get("bias")) + out)


def _w4a8_matmul(a: dict) -> Cost:
    x_q, w_packed = a["x_q"], a["w_packed"]
    m, k = x_q.shape
    n = w_packed.shape[0]
    out = m * n * torch.empty(0, dtype=a.get("out_dtype", torch.bfloat16)).element_size()
    return Cost(2.0 * m * n * k, _nbytes(x_q, a["x_scale"], w_packed, a["w_scale"]) + out)


def _hadamard_transform(a: dict) -> Cost:
    x = a["x"]
    n = x.shape[-1]
    rows = x.numel() // n
    k = hadamard_base_size(n) or 1
    flops = rows * (n * math.log2(n // k) + 2.0 * n * k)  # butterflies, then the K x K block
    return Cost(flops, 2 * _nbytes(x))


COSTS: dict[str, Callable[[dict], Cost]] = {
    "mla_prolog": _mla_prolog,
    "indexer_prolog": _indexer_prolog,
    "indexer_logits": _indexer_logits,
    "lightning_indexer": _lightning_indexer,
    "sparse_flash_attention": _sparse_flash_attention,
    "moe_gate": _moe_gate,
    "moe_dispatch": _moe_dispatch,
    "grouped_matmul": _grouped_matmul,
    "moe_combine": _moe_combine,
    "fused_moe": _fused_moe,
    "dynamic_quant": _dynamic_quant,
    "quant_matmul": _quant_matmul,
    "w4a8_matmul": _w4a8_matmul,
    "hadamard_transform": _hadamard_transform,
}
assert set(COSTS) == set(OP_NAMES), "every op needs a cost model"


def cost(op: str, inputs: dict) -> Cost:
    """FLOPs and minimum bytes of one call of `op` with these keyword arguments."""
    if op not in COSTS:
        raise ValueError(f"op: expected one of {list(COSTS)}, got {op!r}")
    return COSTS[op](inputs)
