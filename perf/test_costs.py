"""The cost model against hand-computed FLOPs and bytes."""

from __future__ import annotations

import pytest
import torch

from glm5_hal.config import GLM5, GLM5_MINI
from glm5_hal.parity import cases as builders
from glm5_hal.parity.inputs import SeqSpec
from glm5_hal.registry import OP_NAMES
from perf.baselines import BASELINES, float_matmul_inputs
from perf.costs import COSTS, Cost, cost, dense_mla_attention, visible_keys


def _inputs(build, dtype=torch.bfloat16):
    return build(torch.Generator().manual_seed(0), dtype)


def test_every_op_has_a_cost_model():
    assert set(COSTS) == set(OP_NAMES)
    with pytest.raises(ValueError, match="op: expected one of"):
        cost("nope", {})


def test_sparse_attention_flops_and_gathered_bytes():
    t, h, topk = 3, GLM5.num_attention_heads, 64
    a = _inputs(builders.sparse_attention_inputs(GLM5, [SeqSpec(t, 200)], 64, topk=topk))
    c = cost("sparse_flash_attention", a)
    assert c.flops == 2 * t * h * topk * (576 + 512)
    gathered = t * topk * 576 * 2
    fixed = a["q"].numel() * 2 + a["indices"].numel() * 4 + a["block_table"].numel() * 4 + t * h * (512 * 2 + 4)
    assert c.bytes == gathered + fixed


def test_invalid_indices_are_not_counted():
    a = _inputs(builders.sparse_attention_inputs(GLM5, [SeqSpec(1, 10)], 64, topk=16))  # 10 visible keys
    assert cost("sparse_flash_attention", a).flops == 2 * 64 * 10 * (576 + 512)


def test_visible_keys_follow_the_causal_rule():
    # sequence 0: 2 new tokens at positions 3, 4 -> 4 + 5 keys; sequence 1: one token at position 6 -> 7 keys
    assert visible_keys(torch.tensor([5, 7]), torch.tensor([0, 2, 3])) == 4 + 5 + 7


def test_indexer_counts_every_visible_pair_and_reads_keys_once():
    a = _inputs(builders.indexer_inputs(GLM5, [SeqSpec(2, 100)], 64, topk=32))
    c = cost("lightning_indexer", a)
    pairs = 99 + 100
    assert c.flops == 2 * pairs * 32 * (128 + 1)
    assert c.bytes >= 100 * 128 * 2  # the 100 keys once


def test_dense_attention_is_linear_in_context_and_sparse_is_not():
    short, long = (dense_mla_attention(1, 64, n, n, 2) for n in (4096, 131072))
    assert long.flops / short.flops == 32
    assert long.bytes / short.bytes > 25


def test_matmuls():
    a = _inputs(builders.quant_matmul_inputs(64, 2048, 6144))
    c = cost("quant_matmul", a)
    assert c.flops == 2 * 64 * 2048 * 6144
    assert c.bytes == 64 * 6144 + 64 * 4 + 2048 * 6144 + 2048 * 4 + 64 * 2048 * 2
    w4 = cost("w4a8_matmul", _inputs(builders.w4a8_matmul_inputs(64, 2048, 6144, group_size=None)))
    assert w4.bytes < c.bytes  # half the weight bytes
    g = _inputs(builders.grouped_matmul_inputs([3, 0, 5], 16, 32), torch.float32)
    gc = cost("grouped_matmul", g)
    assert gc.flops == 2 * 8 * 16 * 32
    assert gc.bytes == 8 * 32 * 4 + 4 * 8 + 2 * 16 * 32 * 4 + 8 * 16 * 4  # two active experts' weights


def test_mla_prolog_counts_the_four_projections_and_the_cache_rows():
    t = 3
    a = _inputs(builders.mla_prolog_inputs(GLM5_MINI, [SeqSpec(t, t)], 8))
    # mini: hidden 256, H 4, q_lora 128, kv_lora 512, nope 192, rope 64
    weights = 128 * 256 + 4 * 256 * 128 + 4 * 192 * 512 + 576 * 256
    c = cost("mla_prolog", a)
    assert c.flops == 2 * t * weights
    reads = (t * 256 + weights + 128 + 512) * 2 + 2 * t * 32 * 4 + t * 8  # x, weights, gammas; cos, sin; slots
    writes = (t * 4 * (512 + 64) + t * 128 + t * 576) * 2  # q_lat, q_pe, q_norm, cache rows
    assert c.bytes == reads + writes


def test_indexer_prolog():
    t = 5
    a = _inputs(builders.indexer_prolog_inputs(GLM5_MINI, [SeqSpec(t, 9)], 8))
    # mini: hidden 256, q_lora 128, HI 4, DI 128
    weights = 4 * 128 * 128 + 128 * 256 + 4 * 256
    c = cost("indexer_prolog", a)
    assert c.flops == 2 * t * weights
    reads = (t * 256 + t * 128 + weights + 2 * 128) * 2 + 2 * t * 32 * 4 + t * 8  # ..., norm weight and bias
    writes = (t * 4 * 128 + t * 128) * 2 + t * 4 * 4  # q_idx, key rows, fp32 weights
    assert c.bytes == reads + writes


def test_indexer_logits_writes_the_full_score_matrix():
    a = _inputs(builders.indexer_inputs(GLM5_MINI, [SeqSpec(2, 10), SeqSpec(1, 20)], 8))
    c = cost("indexer_logits", a)
    pairs = 9 + 10 + 20
    assert c.flops == 2 * pairs * 4 * (128 + 1)
    keys = 30 * 128 * 2
    reads = 3 * 4 * 128 * 2 + 3 * 4 * 4 + a["block_table"].numel() * 4
    assert c.bytes == keys + reads + 3 * (3 * 8) * 4  # 3 blocks of 8 addressable: [T, 24] fp32


def test_lightning_indexer_output_bytes_follow_return_scores():
    a = _inputs(builders.indexer_inputs(GLM5_MINI, [SeqSpec(2, 10)], 8, topk=4))
    with_scores, without = cost("lightning_indexer", a), cost("lightning_indexer", {**a, "return_scores": False})
    assert with_scores.bytes - without.bytes == 2 * 4 * 4  # T x topk fp32 scores


def test_moe_routing_ops():
    t, e, k, d = 5, 16, 4, 64
    gate = cost("moe_gate", _inputs(builders.moe_gate_inputs(GLM5_MINI, t), torch.float32))
    assert (gate.flops, gate.bytes) == (6 * t * e, t * e * 4 + e * 4 + t * k * 8)
    dispatch = cost("moe_dispatch", _inputs(builders.moe_dispatch_inputs(t, d, k, e), torch.float32))
    assert dispatch.flops == 0
    assert dispatch.bytes == t * d * 4 + t * k * 4 + t * k * d * 4 + t * k * 8 + (e + 1) * 8
    combine = cost("moe_combine", _inputs(builders.moe_combine_inputs(t, k, d), torch.float32))
    assert combine.flops == 2 * t * k * d
    assert combine.bytes == t * k * d * 4 + t * k * 8 + t * k * 4 + t * d * 4


def test_fused_moe_reads_only_the_experts_the_tokens_use():
    t, d, inter, k, e = 6, 128, 32, 2, 8
    a = _inputs(builders.fused_moe_inputs(t, d, inter, k, e, used_experts=3), torch.float32)
    c = cost("fused_moe", a)
    assert c.flops == 2 * t * k * (d * 2 * inter + inter * d)
    active = len(set(a["topk_ids"].flatten().tolist()))
    assert active <= 3
    assert c.bytes == t * d * 4 + t * k * 4 + t * k * 4 + active * 3 * inter * d * 4 + t * d * 4


def test_dynamic_quant_and_hadamard():
    q = cost("dynamic_quant", _inputs(builders.dynamic_quant_inputs((3, 5, 96))))
    assert q.bytes == 15 * 96 * 2 + 15 * 96 + 15 * 4
    h = cost("hadamard_transform", _inputs(builders.hadamard_inputs((4, 128)), torch.float32))
    assert h.flops == 4 * (128 * 7 + 2 * 128)  # 7 butterfly levels, then the scale
    assert h.bytes == 2 * 4 * 128 * 4
    h12 = cost("hadamard_transform", _inputs(builders.hadamard_inputs((1, 12 * 64)), torch.float32))
    assert h12.flops == 12 * 64 * 6 + 2 * 12 * 64 * 12  # 6 levels over 2^6, then the 12 x 12 block


def test_baseline_costs():
    a = _inputs(float_matmul_inputs(4, 8, 16))
    assert BASELINES["fp32_matmul"].cost(a) == Cost(2 * 4 * 8 * 16, (4 * 16 + 8 * 16 + 4 * 8) * 4)
    a = _inputs(builders.sparse_attention_inputs(GLM5, [SeqSpec(1, 300), SeqSpec(1, 100)], 64, topk=1))
    assert BASELINES["dense_mla_attention"].cost(a) == dense_mla_attention(2, 64, 400, 400, 2)


def test_indices_past_the_sequence_end_are_not_counted():
    a = _inputs(builders.sparse_attention_inputs(GLM5, [SeqSpec(1, 200)], 64, topk=6))
    a["indices"] = torch.tensor([[0, 5, -1, 250, 3, 200]], dtype=torch.int32)  # 200 and 250 are past the end
    assert cost("sparse_flash_attention", a).flops == 2 * 64 * 3 * (576 + 512)
