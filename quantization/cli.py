"""`glm5-hal quantize`: read a checkpoint (safetensors, Hugging Face names), QuaRot-rotate it, quantize it with a
named scheme, write the quantized checkpoint (weights, config.json, JSON description), and print a quality report.

    glm5-hal quantize CHECKPOINT_DIR OUT_DIR --scheme w4a8 [--method gptq] [--no-rotate] [--format FORMAT]
    glm5-hal quantize model.safetensors OUT_DIR --preset glm5-mini --scheme w4a8

The model config comes from CHECKPOINT_DIR/config.json (a Hugging Face checkpoint directory: GLM-5
`glm_moe_dsa` or DeepSeek-V3.2 `deepseek_v32`, read by glm5_hal.model.hf_config); `--preset` overrides it, and
is needed for a checkpoint without one (a single .safetensors file). OUT_DIR (new or empty) gets the weights
(model.safetensors, or model-0000i-of-0000n.safetensors shards of at most --max-shard-bytes plus
model.safetensors.index.json), quantization.json and config.json, so `load_quantized_model(OUT_DIR)` needs
nothing else. `--format compressed-tensors` (vLLM / SGLang) or `--format msmodelslim` (vllm-ascend) writes the same
weights in that engine's layout instead (quantization/formats/); `formats.load_checkpoint(OUT_DIR)` reads any of
the three.

`--method rtn` (the default) streams: quantization/streaming.py reads the checkpoint one tensor at a time, so a
real-size GLM-5 (~1.5 TB of bf16) quantizes in the memory of its largest tensor plus one output shard.
`--method gptq` needs calibration activations through the whole floating model: it loads the checkpoint into
memory (a real-size GLM-5 needs a machine that holds it). MTP layers (`model.layers.{i}.*`, i >=
num_hidden_layers: glm5_hal.model does not implement them, QuaRot cannot rotate them) are dropped, with a note,
and listed under "dropped" in quantization.json.

Schemes: `w8a8` (every quantized linear W8A8) and `w4a8` (the GLM-5 Ascend mix: W8A8 attention and dense /
shared MLPs, W4A8 routed experts). The quality report compares the quantized model, loaded back from OUT_DIR,
with the floating checkpoint on random held-out tokens (logits SQNR and cosine): it builds both models in
memory, so it is skipped, with a note, when the two checkpoints together exceed this machine's physical memory;
`--eval-tokens 0` skips it outright (what a real-size checkpoint wants).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from torch import Tensor

from glm5_hal.config import PRESETS, ModelConfig, get_preset
from glm5_hal.model import CausalLM
from glm5_hal.model.hf_config import CONFIG_FILE, load_config
from quantization.checkpoint import checkpoint_files, load_state_dict, save_quantized
from quantization.formats import FORMATS, layout_for, load_checkpoint
from quantization.fp8 import dequantize_fp8_state_dict, fp8_block_size
from quantization.metrics import cosine, sqnr_db
from quantization.model_quant import METHODS, SCHEMES, quantize_model
from quantization.quarot import is_mtp_tensor, quarot
from quantization.streaming import DEFAULT_MAX_SHARD_BYTES, quantize_checkpoint_streaming


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `quantize` subcommand (a `glm5_hal.commands` entry point)."""
    p = subparsers.add_parser(
        "quantize", help="QuaRot + W8A8 / W4A8 a checkpoint", description=__doc__.split("\n\n")[0]
    )
    p.add_argument(
        "checkpoint", help="a Hugging Face checkpoint directory (config.json + *.safetensors) or one .safetensors file"
    )
    p.add_argument(
        "out_dir",
        help="a new or empty directory for the weights (model.safetensors or shards + index), config.json and "
        "quantization.json",
    )
    p.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        help="the model config (default: CHECKPOINT/config.json; required without one)",
    )
    p.add_argument("--scheme", default="w4a8", choices=SCHEMES)
    p.add_argument(
        "--method",
        default="rtn",
        choices=METHODS,
        help="rtn (default): streamed tensor by tensor, for any checkpoint size; gptq: calibrates through the whole "
        "model, so loads the checkpoint into memory",
    )
    p.add_argument(
        "--format",
        default="glm5-hal",
        choices=FORMATS,
        help="the output layout: glm5-hal (default; glm5_hal.model), compressed-tensors (vLLM / SGLang), msmodelslim "
        "(vllm-ascend --quantization ascend); the same weights in each (docs/quantization.md)",
    )
    p.add_argument("--no-rotate", action="store_true", help="skip QuaRot (fold + rotate)")
    p.add_argument("--seed", type=int, default=0, help="QuaRot sign seed and the calibration / evaluation tokens")
    p.add_argument(
        "--calibration-sequences", type=int, default=32, help="GPTQ: random sequences of 128 tokens (default 32)"
    )
    p.add_argument("--mse-clip", action="store_true", help="MSE clip search for the weight scales")
    p.add_argument(
        "--max-shard-bytes",
        type=int,
        default=DEFAULT_MAX_SHARD_BYTES,
        help=f"rtn: the largest output shard in bytes (default {DEFAULT_MAX_SHARD_BYTES:,}, Hugging Face's 5GB)",
    )
    p.add_argument(
        "--eval-tokens",
        type=int,
        default=32,
        help="held-out tokens of the quality report, which builds the floating and the quantized model in memory "
        "(default 32; 0: no report, what a real-size checkpoint wants; skipped anyway when the two do not fit in "
        "physical memory)",
    )
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


def source_fp8_block_size(checkpoint: str | Path) -> tuple[int, int] | None:
    """The FP8 block size of a checkpoint directory whose config.json says it is FP8 block-scaled (DeepSeek-V3.2,
    GLM-5-FP8; quantization/fp8.py), else None (a floating checkpoint, or no config.json)."""
    path = Path(checkpoint)
    if not (path.is_dir() and (path / CONFIG_FILE).is_file()):
        return None
    return fp8_block_size(json.loads((path / CONFIG_FILE).read_text()))


def load_float_checkpoint(checkpoint: str | Path) -> dict[str, Tensor]:
    """Every tensor of the checkpoint, FP8 block-scaled weights dequantized to bf16 (their scales dropped)."""
    state = load_state_dict(checkpoint)
    block = source_fp8_block_size(checkpoint)
    return state if block is None else dequantize_fp8_state_dict(state, block, torch.bfloat16)


def run(args: argparse.Namespace) -> int:
    """The `quantize` subcommand; returns the exit code (2 when the model config cannot be resolved or OUT_DIR
    already holds a checkpoint)."""
    try:
        cfg, source = resolve_config(args.checkpoint, args.preset)
    except ValueError as exc:
        print(f"quantize: {exc}", file=sys.stderr)
        return 2
    print(f"model config {cfg.name!r} from {source}")
    quarot_seed = None if args.no_rotate else args.seed
    try:
        if args.method == "rtn":
            result = quantize_checkpoint_streaming(
                args.checkpoint,
                args.out_dir,
                cfg,
                args.scheme,
                rotate=not args.no_rotate,
                seed=args.seed,
                mse_clip=args.mse_clip,
                max_shard_bytes=args.max_shard_bytes,
                fp8_block_size=source_fp8_block_size(args.checkpoint),
                layout=layout_for(args.format),
            )
            out, kinds, floats, dropped = result.directory, result.quantized, result.float_tensors, result.dropped
        else:
            out, kinds, floats, dropped = _quantize_in_memory(args, cfg, quarot_seed)
    except FileExistsError as exc:  # OUT_DIR holds a previous checkpoint: nothing was written
        print(f"quantize: {exc}", file=sys.stderr)
        return 2
    if dropped:
        print(
            f"dropped {len(dropped)} MTP tensor(s) (layers >= num_hidden_layers = {cfg.num_hidden_layers}: "
            "glm5_hal.model does not implement the multi-token-prediction head and QuaRot cannot rotate it); "
            f'quantization.json lists them under "dropped"'
        )
    print(f"wrote {out} ({', '.join(f'{n} {k} weights' for k, n in sorted(kinds.items()))}, {floats} float tensors)")
    if args.eval_tokens:
        _quality_report(args, cfg, out)
    return 0


def _quantize_in_memory(
    args: argparse.Namespace, cfg: ModelConfig, quarot_seed: int | None
) -> tuple[Path, dict[str, int], int, list[str]]:
    """GPTQ: the whole checkpoint in memory (calibration runs the floating model). -> (out dir, {kind: quantized
    weights}, float tensors, dropped MTP tensor names)."""
    loaded = load_float_checkpoint(args.checkpoint)
    dropped = sorted(name for name in loaded if is_mtp_tensor(name, cfg))
    state = {name: value for name, value in loaded.items() if not is_mtp_tensor(name, cfg)}
    del loaded
    rotated = state if quarot_seed is None else quarot(state, cfg, seed=quarot_seed)[0]
    gen = torch.Generator().manual_seed(args.seed + 1)
    calibration = [torch.randint(0, cfg.vocab_size, (128,), generator=gen) for _ in range(args.calibration_sequences)]
    quantized = quantize_model(
        CausalLM(cfg, rotated), args.scheme, args.method, calibration=calibration, mse_clip=args.mse_clip
    )
    out = save_quantized(
        args.out_dir,
        rotated,
        quantized,
        config=cfg,
        scheme=args.scheme,
        method=args.method,
        quarot_seed=quarot_seed,
        dropped=dropped,
        layout=layout_for(args.format),
    )
    kinds: dict[str, int] = {}
    for q in quantized.values():
        kinds[f"w{q.spec.bits}a8"] = kinds.get(f"w{q.spec.bits}a8", 0) + 1
    return out, kinds, len(state) - len(quantized), dropped


def _physical_memory_bytes() -> int | None:
    """This machine's physical memory, or None where the OS does not say."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def _quality_report(args: argparse.Namespace, cfg: ModelConfig, out: Path) -> None:
    """Print the logits SQNR / cosine of the quantized model (loaded from `out`) against the floating checkpoint
    on args.eval_tokens random tokens; skipped with a note when both models cannot fit in physical memory."""
    needed = sum(f.stat().st_size for f in (*checkpoint_files(args.checkpoint), *checkpoint_files(out)))
    memory = _physical_memory_bytes()
    if memory is not None and needed > memory:
        print(
            f"quality report skipped: the floating and quantized checkpoints take {needed / 1e9:.1f} GB, more than "
            f"this machine's {memory / 1e9:.1f} GB of memory (--eval-tokens 0 skips it without this note)"
        )
        return
    # Their own generator (the calibration tokens use seed + 1), so the held-out tokens are the same whichever
    # method ran.
    ids = torch.randint(0, cfg.vocab_size, (args.eval_tokens,), generator=torch.Generator().manual_seed(args.seed + 2))
    state = {n: v for n, v in load_float_checkpoint(args.checkpoint).items() if not is_mtp_tensor(n, cfg)}
    reference = CausalLM(cfg, state).prefill(ids)
    del state
    loaded = load_checkpoint(out).prefill(ids)  # its own format and config.json
    print(
        f"quality vs the floating checkpoint on {args.eval_tokens} random tokens: logits SQNR "
        f"{sqnr_db(reference.logits, loaded.logits):.2f} dB, cosine {cosine(reference.logits, loaded.logits):.5f}"
    )
