"""Text generation (token ids in, token ids out) with continuous batching over the paged KV cache.

    out = model.generate([[1, 2, 3], [4, 5]], max_new_tokens=32)                    # greedy
    out = model.generate(prompts, 32, temperature=0.8, top_p=0.95, seed=0, stop_token_ids=[2])
    out.tokens[i]           # the tokens generated for prompts[i] (a stop token, when one ended it, included)
    out.finish_reasons[i]   # "stop" or "length"
    out.stats               # prefill / decode tokens and seconds, tokens per second

Scheduling (vLLM's original scheduler, simplified): at most `max_batch_size` sequences are in the batch. While
prompts wait and the batch has room, a step prefills the waiting prompts that fit (ragged lengths, one `step`
call); otherwise a step decodes one token for every running sequence. A sequence that emits a stop token or
reaches max_new_tokens leaves the batch at once, its cache blocks go back to the free list, and a waiting prompt
takes its place on the next step. Each step computes the logits of each sequence's last token only.

Sampling: temperature 0 is greedy (the first maximal logit on a tie, as torch.argmax). Otherwise softmax(logits /
temperature) in fp32 (fp64 for a float64 model), restricted to the nucleus when top_p < 1 (the most likely tokens
whose cumulative probability reaches top_p: those whose preceding mass is below top_p), renormalised, then drawn
with the sequence's own generator, seeded from (seed, prompt index): a sequence's tokens depend on its logits
and the seed only, not on which other sequences share its batch.
"""

from __future__ import annotations

import contextlib
import math
import secrets
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from glm5_hal.checks import check
from glm5_hal.selection import prepare, use_backend

if TYPE_CHECKING:
    from glm5_hal.model.decoder import DecoderModel

STOP = "stop"  # a stop token was generated (it is the sequence's last token)
LENGTH = "length"  # max_new_tokens were generated


@dataclass(frozen=True)
class GenerationStats:
    """Where the time went. prefill: the steps that fed prompts (and gave each sequence its first token);
    decode: the steps that fed one generated token per running sequence. Seconds are wall time of the steps
    (model, sampling, host transfer of the chosen ids), on the host clock."""

    prefill_tokens: int
    prefill_seconds: float
    decode_tokens: int
    decode_seconds: float
    steps: int
    max_running: int  # the largest batch a decode step ran
    # One-time set-up before the first step (selection.prepare: the backends' probes and kernel builds), which would
    # otherwise land in the first prefill step; near 0 once a machine has kept its probe's decisions.
    setup_seconds: float = 0.0

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prefill_tokens / self.prefill_seconds if self.prefill_seconds > 0 else math.nan

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds > 0 else math.nan


@dataclass(frozen=True)
class Generation:
    """tokens[i]: the ids generated for prompt i. finish_reasons[i]: STOP or LENGTH. seed: the sampling seed
    used (drawn at random when none was given; None for greedy). stats: GenerationStats."""

    tokens: list[list[int]]
    finish_reasons: list[str]
    seed: int | None
    stats: GenerationStats


def _check_int(name: str, value: object, low: int) -> int:
    check(
        isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= low,
        TypeError if not isinstance(value, (int, np.integer)) or isinstance(value, bool) else ValueError,
        lambda: f"{name}: expected an int >= {low}, got {value!r}",
    )
    return int(value)


def _token_list(name: str, ids: object, vocab_size: int) -> list[int]:
    """ids (a sequence of ints or a 1-D integer tensor) as a list of ints in [0, vocab_size)."""
    if isinstance(ids, Tensor):
        check(
            ids.dim() == 1 and not ids.is_floating_point() and not ids.is_complex() and ids.dtype != torch.bool,
            TypeError,
            lambda: f"{name}: expected a 1-D integer tensor, got {ids.dtype} of shape {tuple(ids.shape)}",
        )
        values = ids.tolist()
    else:
        check(
            isinstance(ids, Sequence) and not isinstance(ids, (str, bytes)),
            TypeError,
            lambda: f"{name}: expected a sequence of token ids, got {type(ids).__name__}",
        )
        values = list(ids)
        bad = [v for v in values if not isinstance(v, (int, np.integer)) or isinstance(v, bool)]
        check(not bad, TypeError, lambda: f"{name}: expected int token ids, got {bad[0]!r}")
    out = [int(v) for v in values]
    wrong = [v for v in out if not 0 <= v < vocab_size]
    check(not wrong, ValueError, lambda: f"{name}: expected token ids in [0, {vocab_size}), got {wrong[:3]}")
    return out


def sequence_seed(seed: int, index: int) -> int:
    """The seed of prompt `index`'s generator: (seed, index) mixed by NumPy's SeedSequence, so neighbouring
    seeds and indices give unrelated streams."""
    return int(np.random.SeedSequence([seed, index]).generate_state(1, dtype=np.uint64)[0])


def sample_tokens(
    logits: Tensor, temperature: float, top_p: float, generators: Sequence[torch.Generator] | None
) -> list[int]:
    """One token id per row of logits [B, vocab] (module docstring: Sampling). generators: one CPU generator
    per row (unused when temperature is 0). RuntimeError naming the rows whose logits hold NaN."""
    nan_rows = torch.isnan(logits).any(-1)
    if bool(nan_rows.any()):
        raise RuntimeError(f"logits of batch rows {nan_rows.nonzero().flatten().tolist()} contain NaN")
    if temperature == 0:
        return logits.argmax(-1).tolist()
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    probs = torch.softmax(logits.to(dtype) / temperature, -1).cpu()
    if top_p < 1:
        sorted_probs, order = probs.sort(-1, descending=True)
        before = sorted_probs.cumsum(-1) - sorted_probs  # mass of the more likely tokens
        sorted_probs = sorted_probs.masked_fill(before >= top_p, 0)  # the first token always stays
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    assert generators is not None and len(generators) == probs.shape[0]
    return [int(torch.multinomial(row, 1, generator=gen)) for row, gen in zip(probs, generators, strict=True)]


def generate(
    model: DecoderModel,
    prompts: Sequence[Sequence[int] | Tensor],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_p: float = 1.0,
    stop_token_ids: Sequence[int] = (),
    seed: int | None = None,
    max_batch_size: int | None = None,
    block_size: int = 16,
    progress: Callable[[int, int, str], None] | None = None,
    kv_cache_dtype: str = "auto",
    index_cache_dtype: str = "auto",
) -> Generation:
    """Generate up to max_new_tokens tokens after each prompt (module docstring).

    Args:
        model: a CausalLM (any DecoderModel); its cache lives on model.device, its ops on model.backend (or the
            usual selection).
        prompts: token id lists (or 1-D integer tensors; or one [B, T] tensor), each non-empty, ids in
            [0, vocab_size); ragged.
        max_new_tokens: >= 1, per prompt.
        temperature: >= 0; 0 is greedy. top_p: in (0, 1], the nucleus (1: the whole vocabulary).
        stop_token_ids: ids that end a sequence (the stop token is kept as its last token).
        seed: seeds the sampling (per prompt: sequence_seed(seed, i)); None draws one (Generation.seed says which).
        max_batch_size: most sequences in the batch at once (None: every prompt at once); the others wait and
            join as sequences finish.
        block_size: tokens per cache block. The cache is sized for the max_batch_size longest sequences, so a
            step is never refused for lack of blocks.
        progress: called as progress(generated tokens, len(prompts) * max_new_tokens, label) after each step.
        kv_cache_dtype, index_cache_dtype: the formats of the latent KV and indexer-key caches ("auto": the model's
            dtype; "fp8_ds_mla" / "int8_mla" and "fp8_index" / "int8_index": quantized, glm5_hal.kv_formats).

    Returns:
        A Generation.

    Raises:
        TypeError / ValueError: an argument of the wrong type or out of range (naming it).
        RuntimeError: NaN logits.
    """
    vocab = model.cfg.vocab_size
    if isinstance(prompts, Tensor) and prompts.dim() == 2:  # [B, T]: B prompts of T tokens
        prompts = list(prompts)
    check(
        isinstance(prompts, Sequence) and not isinstance(prompts, (str, bytes)),
        TypeError,
        lambda: f"prompts: expected a sequence of token id sequences, got {type(prompts).__name__}",
    )
    check(len(prompts) > 0, ValueError, lambda: "prompts: expected at least one prompt, got none")
    ids = [_token_list(f"prompts[{i}]", p, vocab) for i, p in enumerate(prompts)]
    empty = [i for i, p in enumerate(ids) if not p]
    check(not empty, ValueError, lambda: f"prompts: expected non-empty prompts, prompts {empty[:3]} are empty")
    max_new_tokens = _check_int("max_new_tokens", max_new_tokens, 1)
    check(
        isinstance(temperature, (int, float)) and not isinstance(temperature, bool),
        TypeError,
        lambda: f"temperature: expected a float, got {temperature!r}",
    )
    check(
        math.isfinite(temperature) and temperature >= 0,
        ValueError,
        lambda: f"temperature: expected a finite float >= 0, got {temperature!r}",
    )
    check(
        isinstance(top_p, (int, float)) and not isinstance(top_p, bool),
        TypeError,
        lambda: f"top_p: expected a float, got {top_p!r}",
    )
    check(0 < top_p <= 1, ValueError, lambda: f"top_p: expected a float in (0, 1], got {top_p!r}")
    stops = frozenset(_token_list("stop_token_ids", stop_token_ids, vocab))
    if seed is not None:
        seed = _check_int("seed", seed, 0)
    batch = len(ids) if max_batch_size is None else min(_check_int("max_batch_size", max_batch_size, 1), len(ids))
    block_size = _check_int("block_size", block_size, 1)

    sampled = temperature > 0
    if sampled and seed is None:
        seed = secrets.randbits(63)
    generators = [torch.Generator().manual_seed(sequence_seed(seed, i)) for i in range(len(ids))] if sampled else None
    # Blocks for the `batch` longest sequences (prompt + new tokens), the most that can be in the cache at once.
    blocks = sorted((-(-(len(p) + max_new_tokens) // block_size) for p in ids), reverse=True)
    cache = model.new_cache(
        sum(blocks[:batch]) * block_size,
        block_size=block_size,
        device=model.device,
        kv_cache_dtype=kv_cache_dtype,
        index_cache_dtype=index_cache_dtype,
    )

    setup_started = time.perf_counter()
    with use_backend(model.backend) if model.backend is not None else contextlib.nullcontext():
        prepare(model.device)
    setup_seconds = time.perf_counter() - setup_started

    waiting, running = deque(range(len(ids))), []
    tokens: list[list[int]] = [[] for _ in ids]
    reasons: list[str | None] = [None] * len(ids)
    prefill_tokens = decode_tokens = steps = max_running = 0
    prefill_seconds = decode_seconds = 0.0
    total = len(ids) * max_new_tokens
    while waiting or running:
        start = time.perf_counter()
        prefill = bool(waiting) and len(running) < batch
        if prefill:  # feed the waiting prompts that fit
            stepped = [waiting.popleft() for _ in range(min(batch - len(running), len(waiting)))]
            feed = {i: ids[i] for i in stepped}
        else:  # one token for every running sequence
            stepped = list(running)
            feed = {i: tokens[i][-1:] for i in stepped}
        logits = model.step(cache, feed, logits="last", record=False).logits
        step_generators = None if generators is None else [generators[i] for i in stepped]
        chosen = sample_tokens(logits, temperature, top_p, step_generators)
        seconds = time.perf_counter() - start  # sample_tokens brought the ids to the host: the step is done
        if prefill:
            prefill_seconds += seconds
            prefill_tokens += sum(len(ids[i]) for i in stepped)
            running += stepped
        else:
            decode_seconds += seconds
            decode_tokens += len(stepped)
            max_running = max(max_running, len(stepped))
        steps += 1
        for i, token in zip(stepped, chosen, strict=True):
            tokens[i].append(token)
            if token in stops:
                reasons[i] = STOP
            elif len(tokens[i]) == max_new_tokens:
                reasons[i] = LENGTH
            if reasons[i] is not None:
                running.remove(i)
                cache.free(i)
        if progress is not None:  # a sequence that stopped early counts as done in full
            done = sum(max_new_tokens if r is not None else len(t) for t, r in zip(tokens, reasons, strict=True))
            progress(done, total, f"{len(running)} running, {len(waiting)} waiting")
    stats = GenerationStats(
        prefill_tokens, prefill_seconds, decode_tokens, decode_seconds, steps, max_running, setup_seconds
    )
    return Generation(tokens, [str(r) for r in reasons], seed if sampled else None, stats)
