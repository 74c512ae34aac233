"""The cost model against hand-computed FLOPs and bytes."""

from __future__ import annotations

import pytest
import torch

from glm5_hal.config import GLM5
from glm5_hal.parity import cases as builders
from glm5_hal.parity.inputs import SeqSpec
from glm5_hal.registry import OP_NAMES
from perf.costs import COSTS, cost, dense_mla_attention, visible_keys


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
