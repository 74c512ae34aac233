"""Quality report: W8A8 / W4A8 on a mini GLM-5, without rotation, with QuaRot + RTN and with QuaRot + GPTQ,
on the model as drawn and on the same model with residual-stream outliers.

    python -m quantization.report [--preset glm5-mini] [--outlier-channels 4] [--outlier-scale 30] [--json FILE]

Outliers: real LLMs carry a few residual-stream channels tens of times larger than the rest (massive
activations), so the RMSNorm outputs every linear reads have a few huge input channels. We induce them by
multiplying `--outlier-channels` random columns of the embedding table by `--outlier-scale`: the residual stream
carries them from the first token on (every layer adds O(1) on top), and each layer's normalised input
inherits them. Nothing else of the model is changed, and the knobs are fixed defaults, not tuned.

Metrics: SQNR (dB) and cosine of the quantized model's per-layer residual-stream updates (rotated back for
QuaRot models) and logits against the same model unquantized, run in float64 (the HAL's float64 verification
mode, on the reference backend, whatever backend the quantized models run on). The quantized models take fp32
activations (the integer ops' widest); fp32 rounding alone (~1e-7 relative, ~140 dB) is far below the
quantization noise measured here.

Discrete choices: the MoE router picks experts and the lightning indexer picks the keys each token attends
(when the context is longer than index_topk). Quantization noise flips a few of those choices; each flip swaps a
whole expert's output or a key's contribution, an error far larger than the GEMMs' and unrelated to how well
they are quantized (with it, GPTQ-vs-RTN and rotation comparisons come out seed-dependent). So the per-layer and
logits numbers are measured with the quantized model replaying the float model's choices (`choices=` of
CausalLM.prefill: same keys, same experts and weights), which isolates the quantization error; the free-running
logits SQNR and the fractions of expert and key choices that stay the same are reported beside them, as what a
deployment sees.
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
from glm5_hal.model import CausalLM, ModelOutput, random_state_dict
from glm5_hal.selection import use_backend
from quantization.metrics import cosine, sqnr_db
from quantization.model_quant import quantize_model
from quantization.quarot import QuaRotRotations, quarot

VARIANTS = ("no rotation, RTN", "QuaRot + RTN", "QuaRot + GPTQ")


@dataclass
class ReportRow:
    """One quantized model's error against its unquantized self (see the module docstring for "choices")."""

    model: str  # "no outliers" or "outliers"
    scheme: str  # "w8a8" or "w4a8"
    variant: str  # one of VARIANTS
    layer_sqnr_db: list[float]  # per layer, SQNR of its residual update (float choices replayed)
    logits_sqnr_db: float  # float model's choices replayed
    logits_cosine: float  # float model's choices replayed
    free_logits_sqnr_db: float  # the quantized model making its own choices
    expert_agreement: float  # fraction of (token, expert) choices equal to the float model's, free-running
    key_agreement: float  # fraction of (token, selected key) choices equal to the float model's, free-running
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


@dataclass
class Measurement:
    """What `measure` returns: the error numbers of one quantized model (ReportRow's fields of the same names)."""

    layer_sqnr_db: list[float]
    logits_sqnr_db: float
    logits_cosine: float
    free_logits_sqnr_db: float
    expert_agreement: float
    key_agreement: float


def _shared_choices(reference: Tensor, other: Tensor) -> tuple[int, int]:
    """(how many of other's choices [T, k] (ints, -1 = none) are also in reference's row, how many it made)."""
    ref, got = reference.long(), other.long()
    width = int(max(ref.max(), got.max())) + 2  # one extra column absorbs -1 (shifted to 0)
    chosen = torch.zeros(ref.shape[0], width, dtype=torch.bool)
    chosen.scatter_(1, ref + 1, True)
    made = got >= 0
    return int((chosen.gather(1, got + 1) & made).sum()), int(made.sum())


def agreement(reference: ModelOutput, out: ModelOutput) -> tuple[float, float]:
    """(expert agreement, key agreement): the fractions of out's (token, expert) choices of every MoE layer and
    (token, selected key) choices of every layer that `reference` made too (1.0 where no such choice exists)."""
    counts = {"experts": [0, 0], "keys": [0, 0]}  # [shared, made]
    for ref, got in zip(reference.choices, out.choices, strict=True):
        pairs = [("keys", ref.topk_indices, got.topk_indices)]
        if ref.routing is not None:
            pairs.append(("experts", ref.routing[1], got.routing[1]))
        for kind, a, b in pairs:
            shared, made = _shared_choices(a, b)
            counts[kind][0] += shared
            counts[kind][1] += made
    experts, keys = (shared / made if made else 1.0 for shared, made in counts.values())
    return experts, keys


def measure(
    reference: ModelOutput,
    embedded: Tensor,
    model: CausalLM,
    ids: Tensor,
    rotations: QuaRotRotations | None,
) -> Measurement:
    """The error of model's prefill of ids against the float model's output `reference`.

    A layer's SQNR is that of its update to the residual stream (output minus input: attention + MLP), with the
    error of the layers below included; the stream itself is not used because with outliers it is dominated by
    the (exact) embedding channels carried through the skip connections, which would flatter the numbers. Layers
    and logits are measured with the reference's key and expert choices replayed; the free-running model gives
    the free logits SQNR and the agreements."""
    free = model.prefill(ids)
    out = model.prefill(ids, choices=reference.choices)
    unrotate = (lambda h: h.double()) if rotations is None else (lambda h: rotations.hidden.unrotate(h.double()))
    layers = []
    prev_ref = prev = embedded.double()  # [T, hidden], the unrotated embedding rows (exact in both models)
    for h_ref, h in zip(reference.layer_outputs, out.layer_outputs, strict=True):
        h, h_ref = unrotate(h), h_ref.double()
        layers.append(sqnr_db(h_ref - prev_ref, h - prev))
        prev_ref, prev = h_ref, h
    return Measurement(
        layers,
        sqnr_db(reference.logits, out.logits),
        cosine(reference.logits, out.logits),
        sqnr_db(reference.logits, free.logits),
        *agreement(reference, free),
    )


def float64_prefill(cfg: ModelConfig, state_dict: dict[str, Tensor], ids: Tensor) -> ModelOutput:
    """The prefill of ids by the model of state_dict in float64, on the reference backend (docs/ops.md, "float64
    verification mode"): the error-free baseline every quantized model is measured against."""
    wide = {name: t.double() if t.is_floating_point() else t for name, t in state_dict.items()}
    with use_backend("reference"):
        return CausalLM(cfg, wide).prefill(ids)


def quality_rows(
    cfg: ModelConfig,
    *,
    seed: int = 0,
    tokens: int = 128,
    calibration_sequences: int = 32,
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
        reference = float64_prefill(cfg, state, ids)
        embedded = state["model.embed_tokens.weight"][ids]
        rotated_state, rotations = quarot(state, cfg, seed=seed)
        for scheme in schemes:
            for variant in variants:
                start = time.perf_counter()
                rotate = variant.startswith("QuaRot")
                method = "gptq" if variant.endswith("GPTQ") else "rtn"
                model = CausalLM(cfg, rotated_state if rotate else state)
                quantize_model(model, scheme, method, calibration=calibration if method == "gptq" else ())
                m = measure(reference, embedded, model, ids, rotations if rotate else None)
                rows.append(ReportRow(model_name, scheme, variant, **asdict(m), seconds=time.perf_counter() - start))
    return rows


def format_table(rows: Sequence[ReportRow]) -> str:
    """A Markdown table: one row per quantized model; per-layer and logits SQNR (dB) and logits cosine with the
    float model's choices replayed, then free-running logits SQNR and expert / key agreement."""
    layers = len(rows[0].layer_sqnr_db)
    head = [
        "model",
        "scheme",
        "variant",
        *[f"layer {i} update dB" for i in range(layers)],
        "logits dB",
        "logits cosine",
        "free-running logits dB",
        "same experts",
        "same keys",
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
            f"{r.free_logits_sqnr_db:.2f}",
            f"{100 * r.expert_agreement:.1f}%",
            f"{100 * r.key_agreement:.1f}%",
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
        f"outliers: {args.outlier_channels} embedding channels x {args.outlier_scale:g}, seed {args.seed}; "
        "layers, logits and cosine with the float model's key and expert choices replayed"
    )
    print(format_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)
    return 0


def add_report_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="glm5-mini", help="model config preset (default glm5-mini)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokens", type=int, default=128, help="held-out evaluation tokens (default 128)")
    parser.add_argument(
        "--calibration-sequences", type=int, default=32, help="GPTQ calibration sequences of 128 tokens (default 32)"
    )
    parser.add_argument("--outlier-channels", type=int, default=4)
    parser.add_argument("--outlier-scale", type=float, default=30.0)


if __name__ == "__main__":
    raise SystemExit(main())
