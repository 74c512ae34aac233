"""`glm5-hal quantize`: read a checkpoint (safetensors, Hugging Face names), QuaRot-rotate it, quantize it with a
named scheme, write the quantized checkpoint and its JSON description, and print a quality report.

    glm5-hal quantize CHECKPOINT OUT_DIR --preset glm5-mini --scheme w4a8 [--method gptq] [--no-rotate]

Schemes: `w8a8` (every quantized linear W8A8) and `w4a8` (the GLM-5 Ascend mix: W8A8 attention and dense /
shared MLPs, W4A8 routed experts). The quality report compares the quantized model, loaded back from OUT_DIR,
with the floating checkpoint on random held-out tokens (logits SQNR and cosine).
"""

from __future__ import annotations

import argparse

import torch

from glm5_hal.config import PRESETS, get_preset
from glm5_hal.model import CausalLM
from quantization.checkpoint import load_quantized_model, load_state_dict, save_quantized
from quantization.metrics import cosine, sqnr_db
from quantization.model_quant import METHODS, SCHEMES, quantize_model
from quantization.quarot import quarot


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `quantize` subcommand (a `glm5_hal.commands` entry point)."""
    p = subparsers.add_parser(
        "quantize", help="QuaRot + W8A8 / W4A8 a checkpoint", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("checkpoint", help="a .safetensors file or a directory of them (Hugging Face names)")
    p.add_argument("out_dir", help="where to write model.safetensors and quantization.json")
    p.add_argument("--preset", required=True, choices=sorted(PRESETS), help="the model config of the checkpoint")
    p.add_argument("--scheme", default="w4a8", choices=SCHEMES)
    p.add_argument("--method", default="rtn", choices=METHODS)
    p.add_argument("--no-rotate", action="store_true", help="skip QuaRot (fold + rotate)")
    p.add_argument("--seed", type=int, default=0, help="QuaRot sign seed and the calibration / evaluation tokens")
    p.add_argument("--calibration-sequences", type=int, default=8, help="GPTQ: random sequences of 128 tokens")
    p.add_argument("--mse-clip", action="store_true", help="MSE clip search for the weight scales")
    p.add_argument("--eval-tokens", type=int, default=32, help="held-out tokens of the quality report (0: none)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    cfg = get_preset(args.preset)
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
        loaded = load_quantized_model(out, cfg).prefill(ids)
        print(
            f"quality vs the floating checkpoint on {args.eval_tokens} random tokens: logits SQNR "
            f"{sqnr_db(reference.logits, loaded.logits):.2f} dB, cosine {cosine(reference.logits, loaded.logits):.5f}"
        )
    return 0
