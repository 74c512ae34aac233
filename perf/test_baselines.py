"""The dense MLA attention baseline is attention over every visible key: it must equal sparse attention (reference
backend) whose indices select all of them, or the context curves compare against the wrong thing."""

from __future__ import annotations

import torch

import glm5_hal
from glm5_hal.config import GLM5_MINI
from glm5_hal.parity import cases as builders
from glm5_hal.parity.inputs import SeqSpec
from perf.baselines import BASELINES, fp32_matmul
from perf.dense import KEY_CHUNK


def test_dense_attention_equals_sparse_attention_over_every_visible_key():
    # ragged: chunked prefill crossing a key-chunk boundary, decode, prefill; shuffled blocks
    seqs = [SeqSpec(3, KEY_CHUNK + 37), SeqSpec(1, 50), SeqSpec(4, 4)]
    inputs = builders.sparse_attention_inputs(GLM5_MINI, seqs, 16, topk=1)(
        torch.Generator().manual_seed(3), torch.float32
    )
    widest = max(s.k_len for s in seqs)
    positions = torch.cat([torch.arange(s.k_len - s.q_len, s.k_len) for s in seqs])
    keys = torch.arange(widest)[None, :]
    everything = torch.where(keys <= positions[:, None], keys, -1).to(torch.int32)  # all visible keys, -1 tail
    with glm5_hal.use_backend("reference"):
        want_out, want_lse = glm5_hal.sparse_flash_attention(**{**inputs, "indices": everything})
    out, lse = BASELINES["dense_mla_attention"].run(**inputs)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)


def test_fp32_matmul_is_the_nn_linear_product():
    x, w = torch.randn(3, 5), torch.randn(7, 5)
    torch.testing.assert_close(fp32_matmul(x, w), torch.nn.functional.linear(x, w))
