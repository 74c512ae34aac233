"""The ops are PyTorch custom ops with fake implementations: opcheck passes and torch.compile traces them."""

from __future__ import annotations

import pytest
import torch

import glm5_hal
from glm5_hal.kv_formats import OP_CACHE
from glm5_hal.parity.cases import cases_for
from glm5_hal.parity.runner import case_generator, custom_op_arguments
from glm5_hal.registry import OP_NAMES


def _op_args(op: str, *, quantized: bool = False) -> tuple:
    """The arguments of the op's first quick case with a float cache (or, `quantized`, with a quantized one)."""
    built = (c.build(case_generator(c, torch.float32, seed=7), torch.float32) for c in cases_for(op, quick=True))
    inputs = next(i for i in built if ("kv_cache_dtype" in i) == quantized)
    return custom_op_arguments(op, inputs)


@pytest.mark.parametrize("op", OP_NAMES)
def test_opcheck(op: str) -> None:
    # Schema (declared mutations are the real ones), fake-tensor shapes and dispatcher registration.
    torch.library.opcheck(
        getattr(torch.ops.glm5_hal, op).default,
        _op_args(op),
        test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"),
    )


@pytest.mark.parametrize("op", sorted(OP_CACHE))
def test_opcheck_quantized_cache(op: str) -> None:
    # The same on uint8 caches of a quantized format: the fake shapes must not read the row width as DI / D.
    torch.library.opcheck(
        getattr(torch.ops.glm5_hal, op).default,
        _op_args(op, quantized=True),
        test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"),
    )


def test_torch_compile_fullgraph_matches_eager() -> None:
    case = cases_for("sparse_flash_attention", quick=True)[0]
    inputs = case.build(case_generator(case, torch.float32, seed=3), torch.float32)
    router = torch.randn(inputs["q"].shape[0], 16)

    def attention_then_gate(q, kv_cache, indices, block_table, seq_lens_k, cu_seqlens_q, router_logits):
        out, lse = glm5_hal.sparse_flash_attention(
            q, kv_cache, indices, block_table, seq_lens_k, cu_seqlens_q, 0.0625, 512
        )
        weights, ids = glm5_hal.moe_gate(
            router_logits,
            None,
            top_k=2,
            n_group=1,
            topk_group=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            scoring="sigmoid",
        )
        return out.sum(-1) * 2.0, lse, weights, ids

    args = (
        inputs["q"],
        inputs["kv_cache"],
        inputs["indices"],
        inputs["block_table"],
        inputs["seq_lens_k"],
        inputs["cu_seqlens_q"],
        router,
    )
    eager = attention_then_gate(*args)
    compiled = torch.compile(attention_then_gate, fullgraph=True, backend="aot_eager")(*args)
    for got, want in zip(compiled, eager):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_fake_tensor_shapes_without_data() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(5, 4, 576)
        cache = torch.empty(3, 16, 576)
        out, lse = glm5_hal.sparse_flash_attention(
            q,
            cache,
            torch.empty(5, 32, dtype=torch.int32),
            torch.empty(2, 3, dtype=torch.int32),
            torch.empty(2, dtype=torch.int32),
            torch.empty(3, dtype=torch.int32),
            0.0625,
        )
    assert out.shape == (5, 4, 512) and lse.shape == (5, 4) and lse.dtype == torch.float32
