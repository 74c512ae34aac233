"""Named benchmark scenarios: (op, model dims, batch shape) -> fresh inputs, built by the parity input builders.

A scenario set is a name -> list of Scenario; every Scenario builds CPU inputs from a seeded generator (the bench
moves them to the device), through the same `glm5_hal.parity.cases` builders the parity tests use.

    quick                      the first mini-dims parity case of every op (`glm5-hal bench --quick`, the tests)
    decode, mini-decode        one decode step of a layer, batch 4 at 16K keys (mini: 512): MLA and indexer
                               prologs, lightning indexer, sparse attention; MoE of one token (gate, dispatch,
                               grouped GEMM, combine, fused); dynamic quant and Hadamard of the hidden states
    prefill, mini-prefill      a chunked-prefill step: 128 new tokens after 8K keys (mini: 32 at 256), MoE of 32
    batch                      decode at 8K keys, batch 1 / 8 / 32: MLA prolog, indexer, sparse attention
    context                    decode, batch 4, at 4K..128K keys: sparse attention, the indexer, and dense MLA
                               attention over the whole context (the baseline)
    quant                      GLM-5's four attention projections at 4 tokens (decode: weight traffic dominates)
                               and 64 tokens (arithmetic dominates): W8A8, W4A8, the bf16 matmul they are
                               compared with (the baseline) and the fp32 one
    kv-cache, mini-kv-cache    the attention side of a decode step (batch 4 at 16K and 64K keys; mini: 512) with
                               float, fp8 (fp8_ds_mla + fp8_index) and int8 (int8_mla + int8_index) caches
    layer, mini-layer          one whole MoE decoder layer (8 resident experts), decode (1 token) and a prefill
                               chunk (512 new tokens; mini: 16) at 4K..128K keys (mini: 48, 256), against
                               transformers' eager glm_moe_dsa layer on the same weights (perf/layer.py)

GLM-5 has 256 routed experts of 75 MB (bf16 w13 + w2) each; a MoE scenario holds at most MAX_EXPERTS_HELD of them
(see there), so a one-token decode moves exactly what it would with the full table.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from glm5_hal.config import GLM5, GLM5_MINI, ModelConfig
from glm5_hal.kv_formats import AUTO, FAMILIES, OP_CACHE
from glm5_hal.parity import cases as builders
from glm5_hal.parity.inputs import SeqSpec
from glm5_hal.parity.quantized_cache import quantized_build
from perf.baselines import float_matmul_inputs
from perf.layer import DECODE_TOKENS, PREFILL_CHUNK, glm5_layer_inputs, layer_config, transformers_layer_inputs

Build = Callable[[torch.Generator, torch.dtype], dict]

CONTEXTS = (4096, 8192, 16384, 32768, 65536, 131072)
DECODE_BATCH = 4
BATCH_SIZES = (1, 8, 32)
BLOCK = 64  # cache block size: vLLM's default for MLA
# Experts a MoE scenario holds in memory: one token's worth (GLM-5: 8 of 256, 75 MB of bf16 weights each). Decode of
# one token touches exactly that many; more tokens share them, so each expert sees more rows (prefill-like reuse).
MAX_EXPERTS_HELD = 8


@dataclass(frozen=True)
class Scenario:
    """One timed call: `op` (a glm5_hal op, or a perf.baselines baseline) on inputs from `build`.

    context: keys in context, for the latency-vs-context plot (None elsewhere). baseline: the op of the same
    scenario this one is compared with (the `vs baseline` column), e.g. dense attention for sparse attention.
    """

    name: str
    op: str
    build: Build
    context: int | None = None
    baseline: str | None = None


def _without_scores(build: Build) -> Build:
    """The indexer as the decoder calls it: indices only (the builders also ask for the scores parity needs)."""
    return lambda gen, dtype: {**build(gen, dtype), "return_scores": False}


def _attention(cfg: ModelConfig, name: str, seqs: list[SeqSpec], context: int | None = None) -> list[Scenario]:
    """The attention side of a step: MLA prolog, indexer prolog, lightning indexer, sparse attention."""
    topk = cfg.index_topk
    return [
        Scenario(name, "mla_prolog", builders.mla_prolog_inputs(cfg, seqs, BLOCK), context),
        Scenario(name, "indexer_prolog", builders.indexer_prolog_inputs(cfg, seqs, BLOCK), context),
        Scenario(name, "lightning_indexer", _without_scores(builders.indexer_inputs(cfg, seqs, BLOCK, topk)), context),
        Scenario(name, "sparse_flash_attention", builders.sparse_attention_inputs(cfg, seqs, BLOCK, topk), context),
    ]


def _moe(cfg: ModelConfig, name: str, tokens: int) -> list[Scenario]:
    """Routing and experts for `tokens` tokens; the experts held are the ones top-k routing of them can touch."""
    k, hidden, inter = cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size
    experts = min(cfg.n_routed_experts, k * tokens, max(k, MAX_EXPERTS_HELD))
    rows = tokens * k
    per_expert = [rows // experts + (e < rows % experts) for e in range(experts)]
    return [
        Scenario(name, "moe_gate", builders.moe_gate_inputs(cfg, tokens)),
        Scenario(name, "moe_dispatch", builders.moe_dispatch_inputs(tokens, hidden, k, experts)),
        Scenario(name, "grouped_matmul", builders.grouped_matmul_inputs(per_expert, 2 * inter, hidden)),
        Scenario(name, "moe_combine", builders.moe_combine_inputs(tokens, k, hidden)),
        Scenario(name, "fused_moe", builders.fused_moe_inputs(tokens, hidden, inter, k, experts)),
    ]


def _keys(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def _step(cfg: ModelConfig, tag: str, seqs: list[SeqSpec], moe_tokens: int) -> list[Scenario]:
    """One layer step: `seqs` (all alike) through attention, `moe_tokens` tokens through the MoE."""
    tokens = sum(s.q_len for s in seqs)
    name = f"{cfg.name}/{tag}-b{len(seqs)}x{seqs[0].q_len}-{_keys(seqs[0].k_len)}"
    return [
        *_attention(cfg, name, seqs),
        *_moe(cfg, f"{cfg.name}/{tag}-moe-{moe_tokens}tok", moe_tokens),
        Scenario(name, "dynamic_quant", builders.dynamic_quant_inputs((tokens, cfg.hidden_size))),
        Scenario(name, "hadamard_transform", builders.hadamard_inputs((tokens, cfg.hidden_size))),
    ]


def _projections(cfg: ModelConfig, tokens: int) -> list[Scenario]:
    """W8A8 / W4A8 / bf16 / fp32 at the attention projections: (label, out features N, in features K)."""
    heads_v = cfg.num_attention_heads * cfg.v_head_dim
    shapes = [
        ("q_a_proj", cfg.q_lora_rank, cfg.hidden_size),
        ("q_b_proj", cfg.num_attention_heads * cfg.qk_head_dim, cfg.q_lora_rank),
        ("kv_a_proj", cfg.latent_dim, cfg.hidden_size),
        ("o_proj", cfg.hidden_size, heads_v),
    ]
    found = []
    for label, n, k in shapes:
        name = f"{cfg.name}/{label}-{tokens}tok"
        found += [
            Scenario(name, "fp32_matmul", float_matmul_inputs(tokens, n, k)),
            Scenario(name, "bf16_matmul", float_matmul_inputs(tokens, n, k, torch.bfloat16)),
            Scenario(name, "quant_matmul", builders.quant_matmul_inputs(tokens, n, k), baseline="bf16_matmul"),
            Scenario(name, "w4a8_matmul", builders.w4a8_matmul_inputs(tokens, n, k, None), baseline="bf16_matmul"),
        ]
    return found


def _context(context: int) -> list[Scenario]:
    """GLM-5 decode at `context` keys: the sparse path (indexer, then attention over topk keys) and dense
    attention over all of them, which the sparse path replaces."""
    seqs = [SeqSpec(1, context)] * DECODE_BATCH
    name = f"glm5/decode-b{DECODE_BATCH}-{_keys(context)}"
    topk = GLM5.index_topk
    return [
        Scenario(
            name,
            "sparse_flash_attention",
            builders.sparse_attention_inputs(GLM5, seqs, BLOCK, topk),
            context,
            baseline="dense_mla_attention",
        ),
        Scenario(
            name,
            "lightning_indexer",
            _without_scores(builders.indexer_inputs(GLM5, seqs, BLOCK, topk)),
            context,
            baseline="dense_mla_attention",
        ),
        # topk=1: the dense baseline reads the whole context and ignores `indices`; one index keeps the build cheap
        Scenario(name, "dense_mla_attention", builders.sparse_attention_inputs(GLM5, seqs, BLOCK, topk=1), context),
    ]


def _cache_formats(cfg: ModelConfig, contexts: tuple[int, ...]) -> list[Scenario]:
    """Decode, batch 4: the four attention ops on float, fp8 and int8 caches (kv_formats.FAMILIES)."""
    found = []
    for context in contexts:
        seqs = [SeqSpec(1, context)] * DECODE_BATCH
        for family, formats in FAMILIES.items():
            name = f"{cfg.name}/decode-b{DECODE_BATCH}-{_keys(context)}/{family}-cache"
            for s in _attention(cfg, name, seqs, context):
                fmt = formats[OP_CACHE[s.op]]
                # The torch encoder: at 64K keys the bytes only need to be a valid cache of the format.
                build = s.build if fmt == AUTO else quantized_build(s.build, fmt, zero_tiles=False, reference=False)
                found.append(dataclasses.replace(s, build=build))
    return found


def _layer(base: ModelConfig, contexts: tuple[int, ...], chunk: int) -> list[Scenario]:
    """One decoder layer of `base` (perf/layer.py) per decode step and per prefill chunk at each context, ours
    compared with transformers' (the baseline)."""
    cfg = layer_config(base)
    found = []
    for context in contexts:
        for tag, tokens in (("decode", DECODE_TOKENS), (f"prefill{chunk}", chunk)):
            name = f"{base.name}/layer-{tag}-{_keys(context)}"
            found += [
                Scenario(
                    name,
                    "glm5_layer",
                    glm5_layer_inputs(cfg, tokens, context),
                    context,
                    baseline="transformers_layer",
                ),
                Scenario(name, "transformers_layer", transformers_layer_inputs(cfg, tokens, context), context),
            ]
    return found


# glm5-mini with 16 indexer heads: no exact indexer-score ties (docs/model.md), so both layers pick the same keys.
MINI_LAYER_BASE = GLM5_MINI.with_overrides(index_n_heads=16)
MINI_LAYER_CONTEXTS = (48, 256)  # below and above index_topk (64)
MINI_PREFILL_CHUNK = 16


def _quick() -> list[Scenario]:
    first: dict[str, builders.Case] = {}
    for case in builders.CASES:
        if not case.slow:
            first.setdefault(case.op, case)
    return [Scenario(f"mini/{case.name}", case.op, case.build) for case in first.values()]


def _batch() -> list[Scenario]:
    found = []
    for batch in BATCH_SIZES:
        scenarios = _attention(GLM5, f"glm5/decode-b{batch}-8k", [SeqSpec(1, 8192)] * batch)
        found += [s for s in scenarios if s.op != "indexer_prolog"]
    return found


SCENARIOS: dict[str, Callable[[], list[Scenario]]] = {
    "quick": _quick,
    "decode": lambda: _step(GLM5, "decode", [SeqSpec(1, 16384)] * DECODE_BATCH, moe_tokens=1),
    "prefill": lambda: _step(GLM5, "prefill", [SeqSpec(128, 8192)], moe_tokens=32),
    "mini-decode": lambda: _step(GLM5_MINI, "decode", [SeqSpec(1, 512)] * DECODE_BATCH, moe_tokens=4),
    "mini-prefill": lambda: _step(GLM5_MINI, "prefill", [SeqSpec(32, 256)], moe_tokens=32),
    "batch": _batch,
    "context": lambda: [s for context in CONTEXTS for s in _context(context)],
    "quant": lambda: _projections(GLM5, DECODE_BATCH) + _projections(GLM5, 64),
    "kv-cache": lambda: _cache_formats(GLM5, (16384, 65536)),
    "mini-kv-cache": lambda: _cache_formats(GLM5_MINI, (512,)),
    "layer": lambda: _layer(GLM5, CONTEXTS, PREFILL_CHUNK),
    "mini-layer": lambda: _layer(MINI_LAYER_BASE, MINI_LAYER_CONTEXTS, MINI_PREFILL_CHUNK),
}


def select(names: list[str], ops: list[str] | None = None) -> list[Scenario]:
    """The scenarios of the named sets, in order; with `ops`, only those ops and the baselines they are compared
    with. A ValueError names unknown sets."""
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        raise ValueError(f"--scenarios: unknown {unknown}; known: {list(SCENARIOS)}")
    chosen = [s for n in names for s in SCENARIOS[n]()]
    if ops is None:
        return chosen
    wanted = {(s.name, s.baseline) for s in chosen if s.op in ops and s.baseline}
    return [s for s in chosen if s.op in ops or (s.name, s.op) in wanted]
