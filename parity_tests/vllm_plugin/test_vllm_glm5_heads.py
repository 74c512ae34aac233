"""vLLM + the plugin at GLM-5's attention and indexer widths: 64 heads, 32 index heads of 128, index_topk 2048.

The other plugin tests run glm5-mini (4 heads, 4 index heads, index_topk 64): the latent and index rows are GLM-5's,
but the routes that depend on the head counts are not (sparse attention takes another kernel build from 14 heads on
a CPU with AVX-512 BF16, the scorer's tiles run 32 heads, and the top-k picks 2048 of every token's keys). Here the
checkpoint keeps GLM-5's head counts and row widths; its hidden and q_lora sizes (GEMM sizes to the plugin's ops) are
cut to 1024 and 512 so that a 2-core machine prefills a prompt past 2048 tokens in seconds, with two layers (a dense
one, then MoE) and 8 small experts. One prompt is longer than index_topk, so its later tokens attend 2048 of their keys.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_vllm_logits import glm5_hal_logprobs, relative_error, served_logprobs, teacher_forced, top5_overlap

from glm5_hal.config import GLM5
from glm5_hal.model import CausalLM
from plugin_fixtures import VOCAB, prompts, write_checkpoint

GLM5_HEADS = GLM5.with_overrides(
    name="glm5-heads",
    hidden_size=1024,
    q_lora_rank=512,
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=128,
    intermediate_size=512,
    first_k_dense_replace=1,
    num_hidden_layers=2,
    vocab_size=VOCAB,
)
LONG_PROMPT = GLM5_HEADS.index_topk + 160  # its last 160 tokens see more keys than they attend
NEW_TOKENS = 8
ENGINE = {"max_model_len": 4096, "enforce_eager": True}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("glm5_heads"), GLM5_HEADS)


def test_fp32_tokens_equal_glm5_hal_at_glm5_heads(checkpoint: Path, vllm) -> None:
    """Greedy fp32 tokens equal CausalLM.generate's for a prompt past index_topk (chunked: 256 tokens a step) and
    a short one in the same batch."""
    batch = prompts((LONG_PROMPT, 40), seed=4)
    served = vllm(checkpoint, [{"prompts": batch, "max_tokens": NEW_TOKENS}], engine=ENGINE)
    expected = CausalLM.from_pretrained(checkpoint).generate(batch, NEW_TOKENS, index_cache_dtype="fp8_index").tokens
    assert served["batches"][0]["tokens"] == expected
    layers = served["layers"]
    assert layers["attention"] == ["GLM5_HAL_SPARSE_MLA"], layers
    assert layers["indexer_cache"] == ["GLM5_HAL_INDEXER"], layers


def attending_every_key(checkpoint: Path, target: Path) -> Path:
    """The same weights with index_topk past the prompt: every token attends all its keys (dense MLA)."""
    target.mkdir()
    config = json.loads((checkpoint / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "index_topk": 2 * ENGINE["max_model_len"]}))
    (target / "model.safetensors").symlink_to(checkpoint / "model.safetensors")
    return target


def test_bf16_logits_match_glm5_hal_at_glm5_heads(checkpoint: Path, vllm, tmp_path: Path) -> None:
    """bf16 next-token distributions at every position of a prompt past index_topk are as accurate as glm5-hal's
    own bf16 model's (both against glm5-hal's fp32 model; the bound of test_vllm_logits) and share its top-5. Past
    index_topk the bound is tighter than what attending every key changes there, so a plugin that selected no keys
    (or the wrong ones) would fail it."""
    prompt = prompts((LONG_PROMPT,), seed=5)[0]
    served = served_logprobs(teacher_forced(vllm, checkpoint, prompt, dtype="bfloat16", **ENGINE))
    exact = glm5_hal_logprobs(checkpoint, prompt, torch.float32)
    own = glm5_hal_logprobs(checkpoint, prompt, torch.bfloat16)
    error, own_error = relative_error(served, exact), relative_error(own, exact)
    overlap = top5_overlap(served, own)
    past_topk = slice(GLM5_HEADS.index_topk, None)  # the positions whose keys the indexer selects
    late_error = relative_error(served[past_topk], exact[past_topk])
    late_own = relative_error(own[past_topk], exact[past_topk])
    print(
        f"glm5 heads bf16: vs glm5-hal fp32, vLLM {error:.2e} (past index_topk {late_error:.2e}) and glm5-hal bf16 "
        f"{own_error:.2e} ({late_own:.2e}); top-5 overlap {overlap:.3f}"
    )
    assert error <= 1.25 * own_error, f"vLLM bf16 error {error:.3e}, glm5-hal bf16 {own_error:.3e}"
    assert late_error <= 1.25 * late_own, f"past index_topk: vLLM {late_error:.3e}, glm5-hal {late_own:.3e}"
    dense = glm5_hal_logprobs(attending_every_key(checkpoint, tmp_path / "dense"), prompt, torch.float32)
    selection_matters = relative_error(dense[past_topk], exact[past_topk])
    print(f"attending every key instead changes the fp32 model by {selection_matters:.2e} past index_topk")
    assert selection_matters > 3 * 1.25 * late_own, "the case cannot tell sparse from dense attention"
    assert overlap >= 0.9, f"top-5 overlap with glm5-hal's bf16 model {overlap:.3f}"
