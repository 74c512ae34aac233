"""`glm5-hal kv-cache`: cache bytes per token per layer for each cache format, and the cache's memory at a context.

    glm5-hal kv-cache --preset glm5                       float (bf16), fp8 and int8 caches at 128K tokens
    glm5-hal kv-cache --preset deepseek-v32 --context 1048576 --dtype float16 --json

A token's cache per layer is its latent row (kv_lora + rope values) plus its index key (index_head_dim values):
in the model's dtype for "auto", or the row_bytes of the quantized formats (glm5_hal.kv_formats). The memory of a
context counts every decoder layer (num_hidden_layers; the MTP layer of the checkpoints is not run by the model).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from glm5_hal.config import PRESETS, ModelConfig, get_preset
from glm5_hal.kv_formats import FAMILIES, INDEX, LATENT, bytes_per_token

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
GIB = 1 << 30


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("kv-cache", help="cache bytes per token per layer and memory at a context length")
    parser.add_argument("--preset", default="glm5", help=f"model preset: {', '.join(sorted(PRESETS))} (default glm5)")
    parser.add_argument("--context", type=int, default=131072, help="tokens in the cache (default 131072 = 128K)")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES), help="dtype of the float cache")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(func=run)


def cache_sizes(cfg: ModelConfig, context: int, dtype: torch.dtype) -> list[dict[str, object]]:
    """One row per cache family ("auto" in `dtype`, "fp8", "int8"): bytes per token per layer (latent, index key,
    both), bytes per token over all layers, and the cache at `context` tokens (bytes, and relative to float)."""
    rows = []
    for family, formats in FAMILIES.items():
        latent = bytes_per_token(formats[LATENT], LATENT, cfg.latent_dim, dtype)
        index = bytes_per_token(formats[INDEX], INDEX, cfg.index_head_dim, dtype)
        per_token = (latent + index) * cfg.num_hidden_layers
        rows.append(
            {
                "cache": family,
                "latent_format": formats[LATENT],
                "index_format": formats[INDEX],
                "latent_bytes_per_token_layer": latent,
                "index_bytes_per_token_layer": index,
                "bytes_per_token_layer": latent + index,
                "bytes_per_token": per_token,
                "context": context,
                "context_bytes": per_token * context,
            }
        )
    for row in rows:
        row["vs_float"] = rows[0]["context_bytes"] / row["context_bytes"]
    return rows


def run(args: argparse.Namespace) -> int:
    try:
        cfg = get_preset(args.preset)
    except ValueError as exc:
        print(f"--preset: {exc}", file=sys.stderr)
        return 2
    if args.context < 1:
        print(f"--context: expected a positive number of tokens, got {args.context}", file=sys.stderr)
        return 2
    rows = cache_sizes(cfg, args.context, DTYPES[args.dtype])
    if args.json:
        print(json.dumps({"preset": cfg.name, "layers": cfg.num_hidden_layers, "dtype": args.dtype, "rows": rows}))
        return 0
    print(
        f"{cfg.name}: {cfg.num_hidden_layers} layers, latent row {cfg.latent_dim} values, index key "
        f"{cfg.index_head_dim} values; float cache in {args.dtype}; {args.context} tokens"
    )
    head = ["cache", "latent B", "index B", "B/token/layer", "B/token (all layers)", "GiB at context", "smaller by"]
    body = [
        [
            f"auto ({args.dtype})"
            if r["cache"] == "auto"
            else f"{r['cache']} ({r['latent_format']}, {r['index_format']})",
            str(r["latent_bytes_per_token_layer"]),
            str(r["index_bytes_per_token_layer"]),
            str(r["bytes_per_token_layer"]),
            str(r["bytes_per_token"]),
            f"{r['context_bytes'] / GIB:.2f}",
            f"{r['vs_float']:.2f}x",
        ]
        for r in rows
    ]
    widths = [max(len(x) for x in column) for column in zip(head, *body)]
    for line in (head, *body):
        print("  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(line, widths))))
    return 0
