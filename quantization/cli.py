"""`glm5-hal quantize`: read a checkpoint (safetensors, Hugging Face names), QuaRot-rotate it, quantize it with a
named scheme, write the quantized checkpoint (weights, config.json, JSON description), and print a quality report.

    glm5-hal quantize CHECKPOINT_DIR OUT_DIR --scheme w4a8 [--method gptq] [--no-rotate]
    glm5-hal quantize model.safetensors OUT_DIR --preset glm5-mini --scheme w4a8

The model config comes from CHECKPOINT_DIR/config.json (a Hugging Face checkpoint directory: GLM-5
`glm_moe_dsa` or DeepSeek-V3.2 `deepseek_v32`, read by glm5_hal.model.hf_config); `--preset` overrides it, and
is needed for a checkpoint without one (a single .safetensors file). OUT_DIR gets model.safetensors,
quantization.json and config.json, so `load_quantized_model(OUT_DIR)` needs nothing else.

Schemes: `w8a8` (every quantized linear W8A8) and `w4a8` (the GLM-5 Ascend mix: W8A8 attention and dense /
shared MLPs, W4A8 routed experts). The quality report compares the quantized model, loaded back from OUT_DIR,
with the floating checkpoint on random held-out tokens (logits SQNR and cosine).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from glm5_hal.config import PRESETS, ModelConfig, get_preset
from glm5_hal.model import CausalLM
from glm5_hal.model.hf_config import CONFIG_FILE, load_config
from quantization.checkpoint import load_quantized_model, load_state_dict, save_quantized
from quantization.metrics import cosine, sqnr_db
from quantization.model_quant import METHODS, SCHEMES, quantize_model
from quantization.quarot import quarot


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `quantize` subcommand (a `glm5_hal.commands` entry point)."""
    p = subparsers.add_parser(
        "quantize", help="QuaRot + W8A8 / W4A8 a checkpoint", description=__doc__.split("\n\n")[0]
    )
    p.add_argument(
        "checkpoint", help="a Hugging Face checkpoint directory (config.json + *.safetensors) or one .safetensors file"
    )
    p.add_argument("out_dir", help="where to write model.safetensors, config.json and quantization.json")
    p.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        help="the model config (default: CHECKPOINT/config.json; required without one)",
    )
    p.add_argument("--scheme", default="w4a8", choices=SCHEMES)
    p.add_argument("--method", default="rtn", choices=METHODS)
    p.add_argument("--no-rotate", action="store_true", help="skip QuaRot (fold + rotate)")
    p.add_argument("--seed", type=int, default=0, help="QuaRot sign seed and the calibration / evaluation tokens")
    p.add_argument(
        "--calibration-sequences", type=int, default=32, help="GPTQ: random sequences of 128 tokens (default 32)"
    )
    p.add_argument("--mse-clip", action="store_true", help="MSE clip search for the weight scales")
    p.add_argument("--eval-tokens", type=int, default=32, help="held-out tokens of the quality report (0: none)")
    p.set_defaults(func=run)


def resolve_config(checkpoint: str | Path, preset: str | None) -> tuple[ModelConfig, str]:
    """(the model config, where it came from): the preset when given, else CHECKPOINT/config.json. A ValueError
    says what is missing when neither is there; config.json's own errors (ValueError) name the key."""
    if preset is not None:
        return get_preset(preset), f"--preset {preset}"
    path = Path(checkpoint)
    if path.is_dir() and (path / CONFIG_FILE).is_file():
        return load_config(path), str(path / CONFIG_FILE)
    where = f"the directory {path} has no {CONFIG_FILE}" if path.is_dir() else f"{path} is not a directory"
    raise ValueError(
        f"CHECKPOINT: no model config to read ({where}); pass a Hugging Face checkpoint directory with a "
        f"{CONFIG_FILE}, or --preset with one of {sorted(PRESETS)}"
    )


def run(args: argparse.Namespace) -> int:
    """The `quantize` subcommand; returns the exit code (2 when the model config cannot be resolved)."""
    try:
        cfg, source = resolve_config(args.checkpoint, args.preset)
    except ValueError as exc:
        print(f"quantize: {exc}", file=sys.stderr)
        return 2
    print(f"model config {cfg.name!r} from {source}")
    state = load_state_dict(args.checkpoint)
    rotated, _ = (state, None) if args.no_rotate else quarot(state, cfg, seed=args.seed)
    gen = torch.Generator().manual_seed(args.seed + 1)
    calibration = [torch.randint(0, cfg.vocab_size, (128,), generator=gen) for _ in range(args.calibration_sequences)]
    model = CausalLM(cfg, rotated)
    quantized = quantize_model(
        model,
        args.scheme,
        args.method,
        calibration=calibration if args.method == "gptq" else (),
        mse_clip=args.mse_clip,
    )
    out = save_quantized(
        args.out_dir,
        rotated,
        quantized,
        config=cfg,
        scheme=args.scheme,
        method=args.method,
        quarot_seed=None if args.no_rotate else args.seed,
    )
    kinds: dict[str, int] = {}
    for q in quantized.values():
        kinds[f"w{q.spec.bits}a8"] = kinds.get(f"w{q.spec.bits}a8", 0) + 1
    print(
        f"wrote {out} ({', '.join(f'{n} {k} weights' for k, n in sorted(kinds.items()))}, "
        f"{len(state) - len(quantized)} float tensors)"
    )
    if args.eval_tokens:
        ids = torch.randint(0, cfg.vocab_size, (args.eval_tokens,), generator=gen)
        reference = CausalLM(cfg, state).prefill(ids)
        loaded = load_quantized_model(out).prefill(ids)  # its own config.json
        print(
            f"quality vs the floating checkpoint on {args.eval_tokens} random tokens: logits SQNR "
            f"{sqnr_db(reference.logits, loaded.logits):.2f} dB, cosine {cosine(reference.logits, loaded.logits):.5f}"
        )
    return 0
