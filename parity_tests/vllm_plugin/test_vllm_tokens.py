"""vLLM + the glm5-hal plugin generates, in fp32, the same greedy tokens as glm5_hal.model.CausalLM.generate.

The reference reads the index keys as vLLM stores them (132-byte fp8_index rows), so both select keys from the same
quantized keys. Every case runs four ragged prompts (three longer than index_topk 64, the longest chunked over
several steps), then a second request that shares the first prompt's first 400 tokens (served from vLLM's prefix
cache), 32 new tokens each.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest

from glm5_hal.model import CausalLM
from plugin_fixtures import NEW_TOKENS, prompts

SHARED_PREFIX = 400
CASES = {
    # name: (model_type, engine settings, environment, vLLM's compile mode)
    "glm_moe_dsa-eager": ("glm_moe_dsa", {"enforce_eager": True}, {}, "NONE"),
    # the plugin's default for the DSA models it serves on a CPU: vLLM's compiled CPU mode (Dynamo traced once,
    # Inductor), what vLLM gives other architectures there
    "glm_moe_dsa-default": ("glm_moe_dsa", {"enforce_eager": False}, {}, "DYNAMO_TRACE_ONCE"),
    # vLLM's own default for GlmMoeDsaForCausalLM / DeepseekV32ForCausalLM, asked for (breakable CUDA graphs: no
    # torch.compile on a CPU), with the engine core in its own process as `vllm serve` runs it
    "glm_moe_dsa-breakable-multiprocess": (
        "glm_moe_dsa",
        {"enforce_eager": False},
        {"VLLM_USE_BREAKABLE_CUDAGRAPH": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1"},
        "NONE",
    ),
    # YaRN RoPE, the half-split indexer RoPE, grouped routing; the routed experts through glm5_hal.fused_moe
    "deepseek_v32-eager-fused_moe": ("deepseek_v32", {"enforce_eager": True}, {"GLM5_HAL_VLLM_MOE": "1"}, "NONE"),
}


def requests() -> tuple[list[list[int]], list[list[int]]]:
    """(the first batch's four prompts, the second batch's one prompt sharing the first's prefix)."""
    first = prompts()
    second = [first[0][:SHARED_PREFIX] + prompts((50,), seed=2)[0]]
    return first, second


@cache
def reference(model: Path) -> list[list[int]]:
    """CausalLM.generate's greedy tokens for the first batch's prompts, then the second's."""
    first, second = requests()
    hal = CausalLM.from_pretrained(model)
    return [
        *hal.generate(first, NEW_TOKENS, index_cache_dtype="fp8_index").tokens,
        *hal.generate(second, NEW_TOKENS, index_cache_dtype="fp8_index").tokens,
    ]


@pytest.mark.parametrize("case", list(CASES))
def test_fp32_tokens_equal_glm5_hal(case: str, checkpoints: dict[str, Path], vllm) -> None:
    model_type, engine, env, compile_mode = CASES[case]
    first, second = requests()
    batches = [{"prompts": first, "max_tokens": NEW_TOKENS}, {"prompts": second, "max_tokens": NEW_TOKENS}]
    served = vllm(checkpoints[model_type], batches, engine=engine, env=env)

    tokens = served["batches"][0]["tokens"] + served["batches"][1]["tokens"]
    expected = reference(checkpoints[model_type])
    agree = [
        next((i for i, (a, b) in enumerate(zip(t, e)) if a != b), min(len(t), len(e))) for t, e in zip(tokens, expected)
    ]
    assert tokens == expected, f"{case}: tokens agree for {agree} of {NEW_TOKENS} per request"

    assert served["compile_mode"] == compile_mode, (case, served["compile_mode"])
    compiled_default = "so it runs vLLM's compiled CPU mode" in served["log"]
    # the plugin logs its choice exactly where it made the engine compile (never with enforce_eager or a user setting)
    assert compiled_default == (compile_mode == "DYNAMO_TRACE_ONCE"), f"{case}: the plugin's compiled-mode line"
    layers = served["layers"]  # the plugin really served the model
    assert layers["attention"] == ["GLM5_HAL_SPARSE_MLA"], layers
    assert layers["indexer_cache"] == ["GLM5_HAL_INDEXER"], layers
    # fp32 up-projections keep vLLM's layout (a new one could change a GEMM's order of sums, and these tokens must
    # equal glm5-hal's): only half-precision ones are laid out or packed for their product (up_projections.py)
    assert not any(p.startswith(("W_UK_T float32 1 ", "packed")) for p in layers["up_projections"]), layers
    expected_moe = "Glm5HalUnquantizedMoEMethod" if env.get("GLM5_HAL_VLLM_MOE") == "1" else "UnquantizedFusedMoEMethod"
    assert layers["moe"] == [expected_moe], layers
    # the second request reused the first one's cached blocks (whole blocks of its shared 400 tokens)
    assert served["prefix_cache_hits"] >= SHARED_PREFIX - 16, served["prefix_cache_hits"]
