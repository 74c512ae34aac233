"""CausalLM.generate and `glm5-hal generate`: greedy equals a step-by-step loop and transformers' greedy output
(on models without score ties), continuous batching of ragged prompts, quantized (FP8 / INT8) caches, stop tokens,
seeded nucleus sampling, argument errors.

Greedy decoding is only well defined where the top two logits of every step are apart by more than the numerical
difference between two implementations (or two batch compositions): a model whose margin falls below MIN_MARGIN
somewhere is a model with a score tie, and the tests draw the next seed instead (the premise of the comparison,
not a tolerance: every token must then agree exactly).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from glm5_hal import cli as glm5_cli
from glm5_hal.config import GLM5_MINI, ModelConfig
from glm5_hal.model import CausalLM, random_state_dict
from glm5_hal.model.generate import LENGTH, STOP, sample_tokens, sequence_seed
from glm5_hal.model.hf_config import CONFIG_FILE, config_to_hf
from glm5_hal.parity.runner import session_seed
from hf_models import hf_model

# 16 indexer heads (no exact indexer-score ties, see test_model.py) and topk 8, so that prompts longer than 8
# tokens run the sparse path.
CFG = GLM5_MINI.with_overrides(index_n_heads=16, index_topk=8)
PROMPT_LENGTHS = (11, 3, 1, 7)
NEW_TOKENS = 6
# fp32 logits are O(1) here; implementations (or batch shapes) differ by ~1e-6: 100x that separates the top two.
MIN_MARGIN = 1e-4
SEED_ATTEMPTS = 8


def _prompts(seed: int, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def _greedy_loop(model: CausalLM, prompt: list[int], steps: int, **cache_formats: str) -> tuple[list[int], float]:
    """(tokens, smallest top-2 logit margin): one sequence, prefill then one decode step per token, argmax.
    cache_formats: kv_cache_dtype / index_cache_dtype of the cache (new_cache)."""
    cache = model.new_cache(len(prompt) + steps, block_size=4, **cache_formats)
    logits = model.step(cache, {0: prompt}).logits[-1]
    tokens, margin = [], math.inf
    while True:
        top2 = logits.topk(2).values
        margin = min(margin, float(top2[0] - top2[1]))
        tokens.append(int(logits.argmax()))
        if len(tokens) == steps:
            return tokens, margin
        logits = model.step(cache, {0: tokens[-1:]}).logits[-1]


def _tie_free(reference, offset: int) -> tuple[dict, list[list[int]], list[list[int]]]:
    """(state, prompts, reference greedy tokens) of the first seed whose reference run has no score tie.
    reference(state, prompts) -> (tokens per prompt, smallest margin)."""
    for attempt in range(SEED_ATTEMPTS):
        seed = (session_seed() + offset + 101 * attempt) % 2**31
        state = random_state_dict(CFG, seed=seed)
        prompts = _prompts(seed + 1, CFG.vocab_size)
        tokens, margin = reference(state, prompts)
        if margin > MIN_MARGIN:
            return state, prompts, tokens
    raise AssertionError(f"no tie-free model in {SEED_ATTEMPTS} seeds: margins this small are not chance")


def _loop_reference(state: dict, prompts: list[list[int]]) -> tuple[list[list[int]], float]:
    model = CausalLM(CFG, state)
    runs = [_greedy_loop(model, p, NEW_TOKENS) for p in prompts]
    return [t for t, _ in runs], min(m for _, m in runs)


@pytest.fixture(scope="module")
def tie_free() -> tuple[dict, list[list[int]], list[list[int]]]:
    """(state dict, prompts, greedy tokens of the step-by-step loop) of a model without score ties."""
    return _tie_free(_loop_reference, 0)


@pytest.fixture(scope="module")
def greedy_case(tie_free) -> tuple[CausalLM, list[list[int]], list[list[int]]]:
    state, prompts, tokens = tie_free
    return CausalLM(CFG, state), prompts, tokens


@pytest.mark.parametrize("max_batch_size", [None, 2, 1])
def test_greedy_equals_a_step_by_step_loop(greedy_case, max_batch_size: int | None) -> None:
    """Ragged prompts in one batch, or through a batch of 2 / 1 (continuous batching: prompts wait and join as
    others finish), on a cache of 4-token blocks: every sequence gets the tokens of its own greedy loop."""
    model, prompts, want = greedy_case
    out = model.generate(prompts, NEW_TOKENS, max_batch_size=max_batch_size, block_size=4)
    assert out.tokens == want
    assert out.finish_reasons == [LENGTH] * len(prompts) and out.seed is None
    s = out.stats
    assert s.prefill_tokens == sum(PROMPT_LENGTHS) and s.decode_tokens == len(prompts) * (NEW_TOKENS - 1)
    assert s.max_running == (max_batch_size or len(prompts))
    assert s.prefill_seconds > 0 and s.decode_seconds > 0 and s.prefill_tokens_per_s > 0
    if max_batch_size == 2:  # prompts given as 1-D tensors, or as one [B, T] tensor when their lengths agree
        tensors = [torch.tensor(p) for p in prompts]
        assert model.generate(tensors, NEW_TOKENS, max_batch_size=2, block_size=4).tokens == want
        same = torch.tensor([p[:1] for p in prompts])
        assert model.generate(same, 2).tokens == model.generate([p[:1] for p in prompts], 2).tokens


def test_greedy_matches_transformers_generate() -> None:
    """transformers' GlmMoeDsaForCausalLM.generate (greedy, fp32, its own cache) on the same weights gives the
    same tokens, dense (short prompts) and sparse (prompt + new tokens beyond index_topk) alike."""

    def reference(state: dict, prompts: list[list[int]]) -> tuple[list[list[int]], float]:
        hf = hf_model(CFG, state)
        tokens, margin = [], math.inf
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                pad_token_id=0,
                eos_token_id=None,
                output_scores=True,
                return_dict_in_generate=True,
            )
            tokens.append(out.sequences[0, len(prompt) :].tolist())
            for scores in out.scores:
                top2 = scores[0].topk(2).values
                margin = min(margin, float(top2[0] - top2[1]))
        return tokens, margin

    state, prompts, want = _tie_free(reference, 1000)
    got = CausalLM(CFG, state).generate(prompts, NEW_TOKENS, max_batch_size=3)
    assert got.tokens == want


FP8_CACHES = {"kv_cache_dtype": "fp8_ds_mla", "index_cache_dtype": "fp8_index"}


def test_greedy_on_quantized_caches_equals_a_step_by_step_loop_on_them(monkeypatch) -> None:
    """The cache formats reach the cache generate makes: on FP8 latent and index-key caches, ragged prompts through a
    batch of 2 get the tokens of their own greedy loop on caches of the same formats."""

    def reference(state: dict, prompts: list[list[int]]) -> tuple[list[list[int]], float]:
        model = CausalLM(CFG, state)
        runs = [_greedy_loop(model, p, NEW_TOKENS, **FP8_CACHES) for p in prompts]
        return [t for t, _ in runs], min(m for _, m in runs)

    state, prompts, want = _tie_free(reference, 2000)
    model = CausalLM(CFG, state)
    made = []
    real_new_cache = model.new_cache
    monkeypatch.setattr(model, "new_cache", lambda *a, **kw: made.append(real_new_cache(*a, **kw)) or made[-1])
    assert model.generate(prompts, NEW_TOKENS, max_batch_size=2, block_size=4, **FP8_CACHES).tokens == want
    assert [(c.kv_cache_dtype, c.index_cache_dtype) for c in made] == [tuple(FP8_CACHES.values())]


def test_stop_tokens_end_only_their_sequence(greedy_case) -> None:
    model, prompts, greedy = greedy_case
    stop = greedy[0][2]  # the third token of the first sequence (maybe others emit it too)
    want = [t[: t.index(stop) + 1] if stop in t else t for t in greedy]
    out = model.generate(prompts, NEW_TOKENS, stop_token_ids=[stop], max_batch_size=2, block_size=4)
    assert out.tokens == want
    assert out.finish_reasons == [STOP if stop in t else LENGTH for t in greedy]


def test_sampling_is_seeded_per_sequence(greedy_case) -> None:
    model, prompts, greedy = greedy_case
    steps = 3  # greedy tokens are a prefix property: the first 3 of the 6-token run
    first = model.generate(prompts, steps, temperature=1.0, top_p=0.9, seed=7)
    assert first.seed == 7
    # Each sequence draws from its own generator: the batch composition does not change what it samples.
    assert model.generate(prompts, steps, temperature=1.0, top_p=0.9, seed=7, max_batch_size=1).tokens == (first.tokens)
    assert model.generate(prompts, steps, temperature=1.0, top_p=0.9, seed=8).tokens != first.tokens
    drawn = model.generate(prompts[:2], 2, temperature=1.0)
    assert isinstance(drawn.seed, int)
    assert model.generate(prompts[:2], 2, temperature=1.0, seed=drawn.seed).tokens == drawn.tokens
    # A nucleus smaller than the top token's probability leaves the top token only: greedy.
    assert model.generate(prompts, steps, temperature=1.0, top_p=1e-6, seed=3).tokens == [t[:steps] for t in greedy]
    assert sequence_seed(7, 0) != sequence_seed(7, 1) != sequence_seed(8, 0)


def test_sample_tokens_distribution() -> None:
    """Temperature and nucleus against their definitions, from 4000 draws (5 standard deviations)."""
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().repeat(4000, 1)
    gens = [torch.Generator().manual_seed(sequence_seed(session_seed(), i)) for i in range(4000)]

    def frequencies(temperature: float, top_p: float) -> torch.Tensor:
        return torch.bincount(torch.tensor(sample_tokens(logits, temperature, top_p, gens)), minlength=4) / 4000

    def expect(want: torch.Tensor, got: torch.Tensor) -> None:
        bound = 5 * (want * (1 - want) / 4000).sqrt() + 1e-9
        assert bool(((got - want).abs() <= bound).all()), (got, want)

    expect(probs, frequencies(1.0, 1.0))
    expect(torch.tensor([0.5, 0.3, 0.0, 0.0]) / 0.8, frequencies(1.0, 0.6))  # 0.5 < 0.6 <= 0.8: two tokens
    expect(torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95, frequencies(1.0, 0.81))
    sharp = probs**2 / (probs**2).sum()  # temperature 0.5 squares the probabilities
    expect(sharp, frequencies(0.5, 1.0))
    assert sample_tokens(logits[:3], 0.0, 1.0, None) == [0, 0, 0]
    tie = torch.tensor([[1.0, 3.0, 3.0, 0.0]])
    assert sample_tokens(tie, 0.0, 1.0, None) == [1]  # greedy takes the first maximal logit
    with pytest.raises(RuntimeError, match=r"logits of batch rows \[1\] contain NaN"):
        sample_tokens(torch.tensor([[0.0, 1.0], [math.nan, 1.0]]), 0.0, 1.0, None)


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"prompts": []}, ValueError, "prompts: expected at least one prompt"),
        ({"prompts": [[1], []]}, ValueError, r"prompts: expected non-empty prompts, prompts \[1\] are empty"),
        ({"prompts": [[1, 1024]]}, ValueError, r"prompts\[0\]: expected token ids in \[0, 1024\), got \[1024\]"),
        ({"prompts": [[1.5]]}, TypeError, r"prompts\[0\]: expected int token ids, got 1\.5"),
        ({"prompts": "123"}, TypeError, "prompts: expected a sequence of token id sequences"),
        ({"prompts": [torch.ones(2, 2, dtype=torch.long)]}, TypeError, r"prompts\[0\]: expected a 1-D integer"),
        ({"max_new_tokens": 0}, ValueError, "max_new_tokens: expected an int >= 1, got 0"),
        ({"temperature": -1.0}, ValueError, "temperature: expected a finite float >= 0"),
        ({"temperature": math.inf}, ValueError, "temperature: expected a finite float >= 0"),
        ({"top_p": 0.0}, ValueError, r"top_p: expected a float in \(0, 1\]"),
        ({"top_p": 1.5}, ValueError, r"top_p: expected a float in \(0, 1\]"),
        ({"stop_token_ids": [-1]}, ValueError, r"stop_token_ids: expected token ids in \[0, 1024\)"),
        ({"seed": -3}, ValueError, "seed: expected an int >= 0"),
        ({"max_batch_size": 0}, ValueError, "max_batch_size: expected an int >= 1"),
        ({"block_size": 2.0}, TypeError, "block_size: expected an int >= 1"),
        ({"kv_cache_dtype": "fp4"}, ValueError, r"kv_cache_dtype: expected one of .* for the latent cache"),
    ],
)
def test_bad_arguments_are_named(greedy_case, kwargs: dict, exc: type, match: str) -> None:
    model = greedy_case[0]
    call = {"prompts": [[1, 2]], "max_new_tokens": 2} | kwargs
    with pytest.raises(exc, match=match):
        model.generate(call.pop("prompts"), call.pop("max_new_tokens"), **call)


def _checkpoint(directory: Path, cfg: ModelConfig, state: dict) -> Path:
    import safetensors.torch

    directory.mkdir()
    safetensors.torch.save_file(state, str(directory / "model.safetensors"))
    (directory / CONFIG_FILE).write_text(json.dumps(config_to_hf(cfg)))
    return directory


def test_generate_command(tie_free, tmp_path: Path, capsys, monkeypatch) -> None:
    state, prompts, greedy = tie_free
    directory = _checkpoint(tmp_path / "ckpt", CFG, state)
    argv = ["generate", str(directory), "--max-new-tokens", str(NEW_TOKENS), "--no-progress"]
    argv += [arg for p in prompts for arg in ("--prompt-ids", ",".join(map(str, p)))]
    assert glm5_cli.main([*argv, "--json", str(tmp_path / "out.json"), "--max-batch-size", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[: len(prompts)] == [f"[{i}] {' '.join(map(str, t))}  (length)" for i, t in enumerate(greedy)]
    # The backends' one-time set-up (probe, kernel builds) is reported on its own, not inside the first prefill step.
    assert lines[-1].startswith("set-up: ") and f"; prefill: {sum(PROMPT_LENGTHS)} tokens in " in lines[-1]
    assert "tokens/s; decode: " in lines[-1]
    written = json.loads((tmp_path / "out.json").read_text())
    assert written["tokens"] == greedy and written["stats"]["decode_tokens"] == len(prompts) * (NEW_TOKENS - 1)
    assert written["stats"]["setup_seconds"] >= 0

    made = []  # --kv-cache picks both caches' formats
    real_new_cache = CausalLM.new_cache
    monkeypatch.setattr(CausalLM, "new_cache", lambda *a, **kw: made.append(real_new_cache(*a, **kw)) or made[-1])
    int8 = ["generate", str(directory), "--prompt-ids", "1,2", "--max-new-tokens", "2", "--kv-cache", "int8"]
    assert glm5_cli.main(int8) == 0
    assert [(c.kv_cache_dtype, c.index_cache_dtype) for c in made] == [("int8_mla", "int8_index")]
    capsys.readouterr()

    assert glm5_cli.main(["generate", str(directory), "--prompt-ids", "1,x"]) == 2
    assert "--prompt-ids #1: expected integer token ids" in capsys.readouterr().err
    assert glm5_cli.main(["generate", str(tmp_path / "missing"), "--prompt-ids", "1"]) == 2
    assert "expected a checkpoint directory" in capsys.readouterr().err
    assert glm5_cli.main(["generate", str(directory), "--prompt-ids", "1", "--top-p", "2"]) == 2
    assert "top_p: expected a float in (0, 1]" in capsys.readouterr().err
