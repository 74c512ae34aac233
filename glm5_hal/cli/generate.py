"""`glm5-hal generate`: load a checkpoint and continue prompts given as token ids (no tokenizer needed).

    glm5-hal generate CHECKPOINT_DIR --prompt-ids 1,2,3 --prompt-ids 4,5 --max-new-tokens 32
    glm5-hal generate CHECKPOINT_DIR --prompt-ids "1 2 3" --temperature 0.8 --top-p 0.95 --seed 0 --stop-token-ids 2

Prints one line per prompt (its index, the generated ids, why it ended), then the prefill and decode throughput.
A progress bar runs on stderr when it is a terminal (--progress / --no-progress force it on / off).
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import torch

from glm5_hal.cli.progress import ProgressBar
from glm5_hal.kv_formats import FAMILIES, INDEX, LATENT
from glm5_hal.model import CausalLM

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "float64": torch.float64}


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "generate",
        help="continue token-id prompts with a checkpoint (continuous batching, greedy or sampled)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("checkpoint", help="a checkpoint directory: config.json + safetensors (what from_pretrained reads)")
    p.add_argument(
        "--prompt-ids",
        action="append",
        required=True,
        metavar="IDS",
        help="one prompt's token ids, comma- or space-separated; repeat for a batch",
    )
    p.add_argument("--max-new-tokens", type=int, default=32, help="per prompt (default 32)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1: all tokens)")
    p.add_argument("--stop-token-ids", default="", metavar="IDS", help="ids that end a sequence (comma-separated)")
    p.add_argument("--seed", type=int, help="sampling seed (default: drawn, and printed)")
    p.add_argument("--max-batch-size", type=int, help="most sequences in the batch at once (default: all prompts)")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="model dtype (default: the checkpoint's)")
    p.add_argument("--device", default="cpu", help="torch device for the weights and cache (default cpu)")
    p.add_argument("--backend", help="glm5_hal backend for every op (default: GLM5_HAL_BACKEND / auto)")
    p.add_argument(
        "--kv-cache",
        default="auto",
        choices=tuple(FAMILIES),
        help="cache formats: the model's dtype (auto), fp8 (fp8_ds_mla + fp8_index), int8 (int8_mla + int8_index)",
    )
    p.add_argument("--json", metavar="FILE", help="also write the tokens and statistics as JSON")
    progress = p.add_mutually_exclusive_group()
    progress.add_argument("--progress", dest="progress", action="store_true", default=None, help="force the bar")
    progress.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    p.set_defaults(func=run)


def parse_ids(text: str, what: str) -> list[int]:
    """'1,2, 3' or '1 2 3' -> [1, 2, 3]; ValueError naming `what` otherwise."""
    parts = text.replace(",", " ").split()
    try:
        return [int(part) for part in parts]
    except ValueError:
        raise ValueError(f"{what}: expected integer token ids separated by commas or spaces, got {text!r}") from None


def run(args: argparse.Namespace) -> int:
    """0 on success; 2 on bad arguments or a checkpoint that does not load (the message says why)."""
    try:
        prompts = [parse_ids(text, f"--prompt-ids #{i + 1}") for i, text in enumerate(args.prompt_ids)]
        stops = parse_ids(args.stop_token_ids, "--stop-token-ids")
        model = CausalLM.from_pretrained(
            args.checkpoint,
            dtype=None if args.dtype is None else DTYPES[args.dtype],
            device=args.device,
            backend=args.backend,
        )
    except (ValueError, TypeError, FileNotFoundError) as exc:
        print(f"generate: {exc}", file=sys.stderr)
        return 2
    print(f"loaded {model.cfg.name!r} ({model.dtype}, {model.device}) from {args.checkpoint}", file=sys.stderr)
    try:
        out = model.generate(
            prompts,
            args.max_new_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            stop_token_ids=stops,
            seed=args.seed,
            max_batch_size=args.max_batch_size,
            progress=ProgressBar(enabled=args.progress),
            kv_cache_dtype=FAMILIES[args.kv_cache][LATENT],
            index_cache_dtype=FAMILIES[args.kv_cache][INDEX],
        )
    except (ValueError, TypeError) as exc:
        print(f"generate: {exc}", file=sys.stderr)
        return 2
    for i, (tokens, reason) in enumerate(zip(out.tokens, out.finish_reasons, strict=True)):
        print(f"[{i}] {' '.join(map(str, tokens))}  ({reason})")
    s = out.stats
    print(
        f"set-up: {s.setup_seconds:.3f} s; "
        f"prefill: {s.prefill_tokens} tokens in {s.prefill_seconds:.3f} s = {_rate(s.prefill_tokens_per_s)}; "
        f"decode: {s.decode_tokens} tokens in {s.decode_seconds:.3f} s = {_rate(s.decode_tokens_per_s)} "
        f"(up to {s.max_running} sequences per decode step, {s.steps} steps)"
        + ("" if out.seed is None else f"; seed {out.seed}")
    )
    if args.json:
        rates = {"prefill_tokens_per_s": s.prefill_tokens_per_s, "decode_tokens_per_s": s.decode_tokens_per_s}
        stats = {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in {**vars(s), **rates}.items()}
        with open(args.json, "w") as f:
            json.dump({"tokens": out.tokens, "finish_reasons": out.finish_reasons, "seed": out.seed, "stats": stats}, f)
    return 0


def _rate(tokens_per_s: float) -> str:
    return "- (no such step)" if math.isnan(tokens_per_s) else f"{tokens_per_s:.1f} tokens/s"
