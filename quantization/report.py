"""Quality report: W8A8 / W4A8 on a mini GLM-5, without rotation, with QuaRot + RTN and with QuaRot + GPTQ,
on the model as drawn and on the same model with residual-stream outliers.

    python -m quantization.report [--preset glm5-mini] [--outlier-channels 4] [--outlier-scale 30] [--json FILE]

Outliers: real LLMs carry a few residual-stream channels tens of times larger than the rest (massive
activations), so the RMSNorm outputs every linear reads have a few huge input channels. We induce them by
multiplying `--outlier-channels` random columns of the embedding table by `--outlier-scale`: the residual stream
carries them from the first token on (every layer adds O(1) on top), and each layer's normalised input
inherits them. Nothing else of the model is changed, and the knobs are fixed defaults, not tuned.

Metrics: SQNR (dB) and cosine of the quantized model's per-layer residual streams (rotated back for QuaRot
models) and logits against the same model unquantized. The unquantized model runs in fp32, the widest dtype
the HAL ops take (under GLM5_HAL_BACKEND=reference every op computes in float64 inside); its own rounding
(~1e-7 relative, 140 dB) is far below the quantization noise measured here.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
from torch import Tensor

from glm5_hal.config import ModelConfig, get_preset
from glm5_hal.model import CausalLM, random_state_dict
from quantization.metrics import cosine, sqnr_db
from quantization.model_quant import quantize_model
from quantization.quarot import QuaRotRotations, quarot

VARIANTS = ("no rotation, RTN", "QuaRot + RTN", "QuaRot + GPTQ")


@dataclass
class ReportRow:
    """One quantized model's error against its unquantized self."""

    model: str  # "no outliers" or "outliers"
    scheme: str  # "w8a8" or "w4a8"
    variant: str  # one of VARIANTS
    layer_sqnr_db: list[float]
    logits_sqnr_db: float
    logits_cosine: float
    seconds: float


def with_residual_outliers(
    state_dict: dict[str, Tensor], channels: int, scale: float, seed: int
) -> tuple[dict[str, Tensor], list[int]]:
    """A copy of state_dict whose embedding has `channels` random hidden columns multiplied by `scale`."""
    embed = state_dict["model.embed_tokens.weight"]
    picked = torch.randperm(embed.shape[1], generator=torch.Generator().manual_seed(seed))[:channels]
    scaled = embed.clone()
    scaled[:, picked] *= scale
    return {**state_dict, "model.embed_tokens.weight": scaled}, sorted(picked.tolist())


def measure(
    reference, embedded: Tensor, model: CausalLM, ids: Tensor, rotations: QuaRotRotations | None
) -> tuple[list[float], float, float]:
    """(per-layer SQNR, logits SQNR, logits cosine) of model's prefill of ids against the reference output.

    A layer's SQNR is that of its update to the residual stream (output minus input: attention + MLP), with the
    error of the layers below included; the stream itself is not used because with outliers it is dominated by
    the (exact) embedding channels carried through the skip connections, which would flatter the numbers."""
    out = model.prefill(ids)
    unrotate = (lambda h: h.double()) if rotations is None else (lambda h: rotations.hidden.unrotate(h.double()))
    layers = []
    prev_ref = prev = embedded.double()  # [T, hidden], the unrotated embedding rows (exact in both models)
    for h_ref, h in zip(reference.layer_outputs, out.layer_outputs, strict=True):
        h, h_ref = unrotate(h), h_ref.double()
        layers.append(sqnr_db(h_ref - prev_ref, h - prev))
        prev_ref, prev = h_ref, h
    return layers, sqnr_db(reference.logits, out.logits), cosine(reference.logits, out.logits)


def quality_rows(
    cfg: ModelConfig,
    *,
    seed: int = 0,
    tokens: int = 64,
    calibration_sequences: int = 8,
    calibration_tokens: int = 128,
    outlier_channels: int = 4,
    outlier_scale: float = 30.0,
    variants: Sequence[str] = VARIANTS,
    schemes: Sequence[str] = ("w8a8", "w4a8"),
) -> list[ReportRow]:
    """Every (model, scheme, variant) row of the report. Evaluation tokens and calibration tokens are disjoint
    random draws (held-out evaluation)."""
    gen = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, cfg.vocab_size, (tokens,), generator=gen)
    calibration = [
        torch.randint(0, cfg.vocab_size, (calibration_tokens,), generator=gen) for _ in range(calibration_sequences)
    ]
    clean = random_state_dict(cfg, seed=seed)
    outliers, _ = with_residual_outliers(clean, outlier_channels, outlier_scale, seed)
    rows = []
    for model_name, state in (("no outliers", clean), ("outliers", outliers)):
        reference = CausalLM(cfg, state).prefill(ids)
        embedded = state["model.embed_tokens.weight"][ids]
        rotated_state, rotations = quarot(state, cfg, seed=seed)
        for scheme in schemes:
            for variant in variants:
                start = time.perf_counter()
                rotate = variant.startswith("QuaRot")
                method = "gptq" if variant.endswith("GPTQ") else "rtn"
                model = CausalLM(cfg, rotated_state if rotate else state)
                quantize_model(model, scheme, method, calibration=calibration if method == "gptq" else ())
                layers, logits_sqnr, logits_cos = measure(
                    reference, embedded, model, ids, rotations if rotate else None
                )
                rows.append(
                    ReportRow(model_name, scheme, variant, layers, logits_sqnr, logits_cos, time.perf_counter() - start)
                )
    return rows


def format_table(rows: Sequence[ReportRow]) -> str:
    """A Markdown table: one row per quantized model, per-layer and logits SQNR (dB), logits cosine."""
    layers = len(rows[0].layer_sqnr_db)
    head = [
        "model",
        "scheme",
        "variant",
        *[f"layer {i} update dB" for i in range(layers)],
        "logits dB",
        "logits cosine",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [
            r.model,
            r.scheme,
            r.variant,
            *[f"{v:.2f}" for v in r.layer_sqnr_db],
            f"{r.logits_sqnr_db:.2f}",
            f"{r.logits_cosine:.5f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m quantization.report", description=__doc__.split("\n\n")[0])
    add_report_arguments(parser)
    parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    args = parser.parse_args(argv)
    cfg = get_preset(args.preset)
    rows = quality_rows(
        cfg,
        seed=args.seed,
        tokens=args.tokens,
        calibration_sequences=args.calibration_sequences,
        outlier_channels=args.outlier_channels,
        outlier_scale=args.outlier_scale,
    )
    print(
        f"{cfg.name}: {args.tokens} held-out tokens, GPTQ calibration {args.calibration_sequences} x 128 tokens, "
        f"outliers: {args.outlier_channels} embedding channels x {args.outlier_scale:g}, seed {args.seed}"
    )
    print(format_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)
    return 0


def add_report_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="glm5-mini", help="model config preset (default glm5-mini)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokens", type=int, default=64, help="held-out evaluation tokens (default 64)")
    parser.add_argument("--calibration-sequences", type=int, default=8, help="GPTQ calibration sequences of 128 tokens")
    parser.add_argument("--outlier-channels", type=int, default=4)
    parser.add_argument("--outlier-scale", type=float, default=30.0)


if __name__ == "__main__":
    raise SystemExit(main())
