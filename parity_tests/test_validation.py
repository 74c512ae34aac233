"""Bad inputs give a ValueError / TypeError naming the argument, what was expected and what came."""

from __future__ import annotations

import re

import pytest
import torch

import glm5_hal
from glm5_hal.parity.cases import cases_for
from glm5_hal.parity.runner import case_generator


def valid_inputs(case_id: str, dtype: torch.dtype = torch.float32) -> dict:
    case = next(c for c in cases_for() if c.id == case_id)
    return case.build(case_generator(case, dtype, seed=1234), dtype)


def call(op: str, inputs: dict):
    return getattr(glm5_hal, op)(**inputs)


def expect(exc: type[Exception], *fragments: str):
    """pytest.raises whose message must contain every fragment (argument name, expected, actual)."""
    return pytest.raises(exc, match=".*".join(re.escape(f) for f in fragments))


# (op, case, argument, replacement builder, exception, message fragments)
BAD_INPUTS = [
    (
        "sparse_flash_attention",
        "sparse_flash_attention/mini_prefill",
        "q",
        lambda a: a["q"].to(torch.int32),
        TypeError,
        ("q: expected dtype", "got int32"),
    ),
    (
        "sparse_flash_attention",
        "sparse_flash_attention/mini_prefill",
        "kv_cache",
        lambda a: a["kv_cache"].to(torch.bfloat16),
        TypeError,
        ("kv_cache: expected dtype float32", "got bfloat16"),
    ),
    (
        "sparse_flash_attention",
        "sparse_flash_attention/mini_prefill",
        "q",
        lambda a: a["q"][..., :500],
        ValueError,
        ("kv_cache: expected shape", "D = 500", "got"),
    ),
    (
        "sparse_flash_attention",
        "sparse_flash_attention/mini_prefill",
        "indices",
        lambda a: a["indices"].to(torch.int64),
        TypeError,
        ("indices: expected dtype int32", "got int64"),
    ),
    (
        "sparse_flash_attention",
        "sparse_flash_attention/mini_prefill",
        "indices",
        lambda a: a["indices"].fill_(-5),
        ValueError,
        ("indices: expected values in [-1,", "got values in [-5, -5]"),
    ),
    (
        "sparse_flash_attention",
        "sparse_flash_attention/ragged_with_invalid",
        "seq_lens_k",
        lambda a: a["seq_lens_k"] + 1000,
        ValueError,
        ("seq_lens_k: expected", "max_blocks * block_size"),
    ),
    (
        "sparse_flash_attention",
        "sparse_flash_attention/ragged_with_invalid",
        "block_table",
        lambda a: a["block_table"].fill_(999),
        ValueError,
        ("block_table: expected block ids in [0,", "got ids"),
    ),
    (
        "sparse_flash_attention",
        "sparse_flash_attention/ragged_with_invalid",
        "cu_seqlens_q",
        lambda a: a["cu_seqlens_q"].flip(0),
        ValueError,
        ("cu_seqlens_q: expected cu_seqlens_q[0] == 0",),
    ),
    (
        "sparse_flash_attention",
        "sparse_flash_attention/ragged_with_invalid",
        "cu_seqlens_q",
        lambda a: a["cu_seqlens_q"][:-1],
        ValueError,
        ("cu_seqlens_q: expected shape",),
    ),
    (
        "sparse_flash_attention",
        "sparse_flash_attention/mini_prefill",
        "d_v",
        lambda a: 600,
        ValueError,
        ("d_v: expected an int in [1, 576]", "got 600"),
    ),
    (
        "sparse_flash_attention",
        "sparse_flash_attention/mini_prefill",
        "kv_cache",
        lambda a: a["kv_cache"].to("meta"),
        ValueError,
        ("one device", "q on cpu", "kv_cache on meta"),
    ),
    (
        "mla_prolog",
        "mla_prolog/mini_prefill",
        "slot_mapping",
        lambda a: a["slot_mapping"] + 10_000,
        ValueError,
        ("slot_mapping: expected values in [-1,",),
    ),
    (
        "mla_prolog",
        "mla_prolog/mini_prefill",
        "slot_mapping",
        lambda a: a["slot_mapping"].to(torch.int32),
        TypeError,
        ("slot_mapping: expected dtype int64", "got int32"),
    ),
    (
        "mla_prolog",
        "mla_prolog/mini_prefill",
        "w_uk",
        lambda a: a["w_uk"][:, :, :100],
        ValueError,
        ("w_dkv_kr: expected shape",),
    ),
    (
        "mla_prolog",
        "mla_prolog/mini_prefill",
        "cos",
        lambda a: a["cos"].to(torch.float64),
        TypeError,
        ("cos: expected dtype float32", "got float64"),
    ),
    (
        "mla_prolog",
        "mla_prolog/mini_prefill",
        "eps",
        lambda a: -1.0,
        ValueError,
        ("eps: expected a positive float", "got -1.0"),
    ),
    (
        "indexer_prolog",
        "indexer_prolog/mini_interleaved",
        "w_iq",
        lambda a: a["w_iq"][:-3],
        ValueError,
        ("w_iq: expected HI * DI rows",),
    ),
    (
        "lightning_indexer",
        "lightning_indexer/mini_decode",
        "topk",
        lambda a: 0,
        ValueError,
        ("topk: expected a positive int", "got 0"),
    ),
    (
        "lightning_indexer",
        "lightning_indexer/mini_decode",
        "weights",
        lambda a: a["weights"].to(torch.bfloat16),
        TypeError,
        ("weights: expected dtype float32", "got bfloat16"),
    ),
    (
        "moe_gate",
        "moe_gate/deepseek_v32_groups",
        "n_group",
        lambda a: 7,
        ValueError,
        ("n_group: expected a divisor of E = 256", "got 7"),
    ),
    (
        "moe_gate",
        "moe_gate/glm5_sigmoid",
        "scoring",
        lambda a: "relu",
        ValueError,
        ("scoring: expected one of", "got 'relu'"),
    ),
    (
        "moe_gate",
        "moe_gate/deepseek_v32_groups",
        "top_k",
        lambda a: 200,
        ValueError,
        ("top_k: expected <= topk_group * E / n_group = 128", "got 200"),
    ),
    (
        "moe_dispatch",
        "moe_dispatch/mini",
        "topk_ids",
        lambda a: a["topk_ids"] + 100,
        ValueError,
        ("topk_ids: expected values in [0, 16)",),
    ),
    (
        "grouped_matmul",
        "grouped_matmul/mini",
        "expert_offsets",
        lambda a: a["expert_offsets"].flip(0),
        ValueError,
        ("expert_offsets: expected a non-decreasing prefix sum",),
    ),
    (
        "grouped_matmul",
        "grouped_matmul/mini",
        "w",
        lambda a: a["w"][:, :, :10],
        ValueError,
        ("w: expected shape", "K = 64"),
    ),
    (
        "moe_combine",
        "moe_combine/mini",
        "src_index",
        lambda a: a["src_index"] * 10,
        ValueError,
        ("src_index: expected values in [0, 92)",),
    ),
    (
        "quant_matmul",
        "quant_matmul/mini",
        "w_q",
        lambda a: a["w_q"].float(),
        TypeError,
        ("w_q: expected dtype int8", "got float32"),
    ),
    ("quant_matmul", "quant_matmul/mini", "out_dtype", lambda a: torch.int32, TypeError, ("out_dtype: expected",)),
    (
        "w4a8_matmul",
        "w4a8_matmul/group_64",
        "group_size",
        lambda a: 48,
        ValueError,
        ("group_size: expected None or an even divisor of K = 256", "got 48"),
    ),
    (
        "hadamard_transform",
        "hadamard_transform/pow2_128",
        "x",
        lambda a: torch.randn(2, 100),
        ValueError,
        ("x: expected a last dim n = K * 2^m", "got n = 100"),
    ),
    (
        "dynamic_quant",
        "dynamic_quant/tokens",
        "x",
        lambda a: [1.0, 2.0],
        TypeError,
        ("x: expected a torch.Tensor", "got list"),
    ),
]


@pytest.mark.parametrize(
    ("op", "case_id", "arg", "make_bad", "exc", "fragments"),
    BAD_INPUTS,
    ids=[f"{op}-{arg}-{i}" for i, (op, _, arg, *_rest) in enumerate(BAD_INPUTS)],
)
def test_bad_input_is_named(op, case_id, arg, make_bad, exc, fragments):
    inputs = valid_inputs(case_id)
    call(op, dict(inputs))  # the valid inputs pass, so the error below is the bad argument's
    inputs[arg] = make_bad(inputs)
    with expect(exc, *fragments):
        call(op, inputs)


def test_value_checks_can_be_disabled(monkeypatch):
    inputs = valid_inputs("moe_combine/mini")
    inputs["src_index"] = inputs["src_index"] * 10
    monkeypatch.setenv("GLM5_HAL_CHECK_VALUES", "0")
    from glm5_hal.checks import value_checks_enabled

    assert not value_checks_enabled(inputs["src_index"])
