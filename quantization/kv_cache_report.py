"""Quality of the quantized cache formats (glm5_hal.kv_formats) against the unquantized float64 result.

    python -m quantization.kv_cache_report [--contexts 16384,65536] [--queries 16] [--json FILE] [--markdown FILE]

Op level, per format, at GLM-5 and DeepSeek-V3.2 dims (one sequence of `context` keys whose last `queries`
tokens are the queries, as in a chunked prefill):
- the cache rows come from the model's own prologs (mla_prolog / indexer_prolog, fp32, random weights drawn as the
  parity suite draws them, unit-variance hidden states); those fp32 rows are the exact values;
- index keys: lightning_indexer in float64 (reference backend) over the exact keys and over the stored fp8_index /
  int8_index keys, topk 2048; reported: the top-k overlap |S_q & S| / 2048 (mean and worst query);
- latent rows: sparse_flash_attention in float64 over the float64 selection S, on the exact rows and on the stored
  fp8_ds_mla / int8_mla rows; reported: ||out_q - out|| / ||out|| over all queries and heads, and max |lse_q - lse|.
Queries are exact (float64) on both sides, so the numbers are the cache format's effect alone.

Model level, glm5-mini: the same random-weight model prefilled with float caches and with fp8 or int8 caches
(`CausalLM.prefill(kv_cache_dtype=, index_cache_dtype=)`, torch backend, fp32): logits SQNR free-running and with
the float run's key and expert choices replayed, and the fractions of (token, key) and (token, expert) choices
that stay the same.

Random weights make scores flatter than a trained model's (more near-ties at the top-k boundary), so the overlap
here is a pessimistic estimate of a checkpoint's.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np
import torch

import glm5_hal
import ops_reference as ref
from glm5_hal.config import DEEPSEEK_V32, GLM5, GLM5_MINI, ModelConfig
from glm5_hal.kv_formats import FAMILIES, FORMATS, INDEX, LATENT
from glm5_hal.model import CausalLM, random_state_dict
from glm5_hal.parity.inputs import mla_weights, rope_tables
from glm5_hal.selection import use_backend
from quantization.metrics import sqnr_db
from quantization.report import agreement

CHUNK = 8192  # context tokens per prolog call (bounds the hidden states held at once)
TOPK = 2048


@dataclass
class OpQuality:
    model: str
    context: int
    queries: int
    format: str
    topk_overlap_mean: float  # |S_q & S| / topk, mean over queries (index formats)
    topk_overlap_min: float  # worst query
    out_rel_err: float  # ||out_q - out|| / ||out|| (latent formats)
    lse_max_abs_err: float


@dataclass
class ModelQuality:
    model: str
    cache: str
    tokens: int
    seed: int
    logits_sqnr_db: float  # free-running
    logits_sqnr_db_replayed: float  # the float-cache run's key and expert choices replayed
    key_agreement: float
    expert_agreement: float


def _context_rows(cfg: ModelConfig, weights: dict, context: int, gen: torch.Generator) -> tuple[np.ndarray, ...]:
    """(latent rows [S, 576], index keys [S, 128], hidden states of the last chunk [C, hidden], its positions) of
    `context` tokens of unit-variance hidden states, computed by the public prologs (torch backend, fp32). Only the
    cache rows are kept for earlier chunks: their queries are computed with 1-head, 16-wide stand-in q weights."""
    rope = cfg.qk_rope_head_dim
    latent, index, x = [], [], None
    tiny_q = {  # the q path of a context token is not needed: the smallest shapes the ops accept
        "w_dq": torch.zeros(16, cfg.hidden_size),
        "gamma_cq": torch.ones(16),
        "w_uq_qr": torch.zeros(cfg.qk_nope_head_dim + rope, 16),
        "w_uk": torch.zeros(1, cfg.qk_nope_head_dim, cfg.kv_lora_rank),
    }
    for start in range(0, context, CHUNK):
        n = min(CHUNK, context - start)
        x = torch.randn(n, cfg.hidden_size, generator=gen)
        cos, sin = rope_tables(torch.arange(start, start + n), rope, cfg.rope_theta)
        slots = torch.arange(n, dtype=torch.int64)
        kv = torch.zeros(1, n, cfg.latent_dim)
        glm5_hal.mla_prolog(
            x, **tiny_q, w_dkv_kr=weights["w_dkv_kr"], gamma_ckv=weights["gamma_ckv"], cos=cos, sin=sin,
            kv_cache=kv, slot_mapping=slots, eps=cfg.rms_norm_eps,
        )  # fmt: skip
        keys = torch.zeros(1, n, cfg.index_head_dim)
        glm5_hal.indexer_prolog(
            x, torch.zeros(n, 16), torch.zeros(cfg.index_head_dim, 16), weights["w_ik"], weights["k_norm_weight"],
            weights["k_norm_bias"], torch.zeros(1, cfg.hidden_size), cos, sin, keys, slots,
            rope_interleaved=cfg.indexer_rope_interleaved, eps=cfg.indexer_norm_eps,
        )  # fmt: skip
        latent.append(kv[0].double().numpy())
        index.append(keys[0].double().numpy())
    return np.concatenate(latent), np.concatenate(index), x


def _queries(cfg: ModelConfig, weights: dict, x: torch.Tensor, context: int, count: int):
    """The last `count` tokens' attention queries [T, H, 576] and indexer queries / weights, float64, from the real
    weights (the prologs in fp32 on the torch backend; cache writes go to a scratch cache)."""
    positions = torch.arange(context - count, context)
    cos, sin = rope_tables(positions, cfg.qk_rope_head_dim, cfg.rope_theta)
    xq, skip = x[-count:], torch.full((count,), -1, dtype=torch.int64)
    w = weights
    q_lat, q_pe, q_norm = glm5_hal.mla_prolog(
        xq, w["w_dq"], w["gamma_cq"], w["w_uq_qr"], w["w_uk"], w["w_dkv_kr"], w["gamma_ckv"], cos, sin,
        torch.zeros(1, 1, cfg.latent_dim), skip, cfg.rms_norm_eps,
    )  # fmt: skip
    q_idx, head_weights = glm5_hal.indexer_prolog(
        xq, q_norm, w["w_iq"], w["w_ik"], w["k_norm_weight"], w["k_norm_bias"], w["w_iw"], cos, sin,
        torch.zeros(1, 1, cfg.index_head_dim), skip, rope_interleaved=cfg.indexer_rope_interleaved,
    )  # fmt: skip
    q = torch.cat([q_lat, q_pe], -1)
    return q.double().numpy(), q_idx.double().numpy(), head_weights.double().numpy()


def op_quality(cfg: ModelConfig, context: int, queries: int, seed: int = 0) -> list[OpQuality]:
    """The op-level rows of one model at one context (see the module docstring)."""
    gen = torch.Generator().manual_seed(seed)
    weights = mla_weights(cfg, gen, torch.float32)
    with use_backend("torch"):
        latent, index, x = _context_rows(cfg, weights, context, gen)
        q, q_idx, head_weights = _queries(cfg, weights, x, context, queries)
    # One sequence: the whole context in one block of `context` slots.
    table, lens, cu = np.zeros((1, 1), np.int32), np.array([context], np.int32), np.array([0, queries], np.int32)
    index_cache, latent_cache = index[None], latent[None]
    selected, _ = ref.lightning_indexer(q_idx, head_weights, index_cache, table, lens, cu, TOPK)
    out, lse = ref.sparse_flash_attention(q, latent_cache, selected, table, lens, cu, cfg.sm_scale, cfg.kv_lora_rank)
    rows = []
    for name, fmt in FORMATS.items():
        if fmt.cache == INDEX:
            stored = ref.encode_rows(index, fmt)[None]
            got, _ = ref.lightning_indexer(q_idx, head_weights, stored, table, lens, cu, TOPK, name)
            overlaps = [np.intersect1d(a[a >= 0], b[b >= 0]).size / TOPK for a, b in zip(got, selected)]
            rows.append(OpQuality(cfg.name, context, queries, name, float(np.mean(overlaps)), min(overlaps), 0.0, 0.0))
        else:
            stored = ref.encode_rows(latent, fmt)[None]
            out_q, lse_q = ref.sparse_flash_attention(
                q, stored, selected, table, lens, cu, cfg.sm_scale, cfg.kv_lora_rank, name
            )
            rel = float(np.linalg.norm(out_q - out) / np.linalg.norm(out))
            rows.append(OpQuality(cfg.name, context, queries, name, 1.0, 1.0, rel, float(np.abs(lse_q - lse).max())))
    return rows


def model_quality(cfg: ModelConfig, seeds: Sequence[int], tokens: int) -> list[ModelQuality]:
    """glm5-mini (or any preset small enough) with fp8 and int8 caches against its own float-cache run."""
    rows = []
    for seed in seeds:
        model = CausalLM(cfg, random_state_dict(cfg, seed=seed, dtype=torch.float32))
        ids = torch.randint(0, cfg.vocab_size, (tokens,), generator=torch.Generator().manual_seed(seed + 1))
        with use_backend("torch"):
            base = model.prefill(ids)
            for family, formats in FAMILIES.items():
                if family == "auto":
                    continue
                caches = {"kv_cache_dtype": formats[LATENT], "index_cache_dtype": formats[INDEX]}
                free = model.prefill(ids, **caches)
                replayed = model.prefill(ids, choices=base.choices, **caches)
                experts, keys = agreement(base, free)
                rows.append(
                    ModelQuality(
                        cfg.name,
                        family,
                        tokens,
                        seed,
                        sqnr_db(base.logits, free.logits),
                        sqnr_db(base.logits, replayed.logits),
                        keys,
                        experts,
                    )
                )
    return rows


def format_op_table(rows: Sequence[OpQuality]) -> str:
    lines = [
        "| model | context | format | top-k overlap (mean / worst query) | out rel. error | max abs lse error |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        overlap = (
            "-"
            if FORMATS[r.format].cache == LATENT
            else (
                f"{r.topk_overlap_mean * TOPK:.0f} / {r.topk_overlap_min * TOPK:.0f} of {TOPK} "
                f"({100 * r.topk_overlap_mean:.2f}%)"
            )
        )
        error = "-" if FORMATS[r.format].cache == INDEX else f"{r.out_rel_err:.2e}"
        lse = "-" if FORMATS[r.format].cache == INDEX else f"{r.lse_max_abs_err:.2e}"
        lines.append(f"| {r.model} | {r.context // 1024}K | {r.format} | {overlap} | {error} | {lse} |")
    return "\n".join(lines)


def format_model_table(rows: Sequence[ModelQuality]) -> str:
    lines = [
        "| model | caches | seeds | logits SQNR dB (free-running) | logits SQNR dB (choices replayed) | same keys | "
        "same experts |",
        "|---|---|---|---|---|---|---|",
    ]
    for family in dict.fromkeys(r.cache for r in rows):
        group = [r for r in rows if r.cache == family]

        def span(values: list[float], fmt: str) -> str:
            return f"{fmt.format(np.mean(values))} ({fmt.format(min(values))} .. {fmt.format(max(values))})"

        lines.append(
            f"| {group[0].model} | {family} ({FAMILIES[family][LATENT]}, {FAMILIES[family][INDEX]}) | {len(group)} | "
            f"{span([r.logits_sqnr_db for r in group], '{:.1f}')} | "
            f"{span([r.logits_sqnr_db_replayed for r in group], '{:.1f}')} | "
            f"{span([100 * r.key_agreement for r in group], '{:.2f}%')} | "
            f"{span([100 * r.expert_agreement for r in group], '{:.2f}%')} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m quantization.kv_cache_report", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--contexts", default="16384,65536", help="comma-separated key counts (default 16K, 64K)")
    parser.add_argument("--queries", type=int, default=16, help="query tokens at the end of the context")
    parser.add_argument("--model-seeds", default="0,1,2,3", help="glm5-mini seeds for the model-level rows")
    parser.add_argument("--model-tokens", type=int, default=256, help="prefill length of the model-level rows")
    parser.add_argument("--json", metavar="FILE")
    parser.add_argument("--markdown", metavar="FILE")
    args = parser.parse_args(argv)
    contexts = [int(c) for c in args.contexts.split(",")]
    op_rows = [r for cfg in (GLM5, DEEPSEEK_V32) for c in contexts for r in op_quality(cfg, c, args.queries)]
    seeds = [int(s) for s in args.model_seeds.split(",")]
    model_rows = model_quality(GLM5_MINI, seeds, args.model_tokens)
    text = format_op_table(op_rows) + "\n\n" + format_model_table(model_rows)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ops": [asdict(r) for r in op_rows], "model": [asdict(r) for r in model_rows]}, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text + "\n")
    return 0 if all(math.isfinite(r.out_rel_err) for r in op_rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
