"""RTN-quantize a checkpoint too large for memory (a real GLM-5: ~1.5 TB of bf16), one tensor at a time.

    quantize_checkpoint_streaming(CHECKPOINT, OUT_DIR, config, "w4a8")

reads the input safetensors lazily (glm5_hal.model.checkpoint.CheckpointReader: the headers first, then one
tensor at a time), folds + rotates each tensor with QuaRot (`quarot.rotate_tensor`: a tensor's transform needs
only its own values, the tiny RMSNorm gains, which are read up front, and the rotations), RTN-quantizes it when
`model_quant.linear_scheme` says its call site is quantized, and appends the result to an output shard that is
written once it would grow past `max_shard_bytes`. Peak memory is the largest tensor's transform (its float64
temporaries; row-independent transforms of the big embedding / lm_head tables run on row blocks, see
quarot.ROW_CHUNK_ELEMENTS) plus one output shard, never the model.

The output is what the in-memory path (`quarot` -> CausalLM -> `quantize_model(..., "rtn")` -> `save_quantized`)
writes, tensor for tensor and bit for bit: the same per-tensor fold + rotation, the same RTN on the same values
(a routed expert's gate and up are quantized apart here and stacked there; RTN is per row, so the codes and
scales agree), the same stored tensors and metadata (the output format's checkpoint.CheckpointLayout: the
glm5-hal one by default, or an engine's from quantization/formats/). Only the sharding differs: one
model.safetensors when everything fits in one shard, else model-0000i-of-0000n.safetensors plus the Hugging Face
model.safetensors.index.json (msModelSlim's names for its format); `formats.load_checkpoint` reads all of them.

MTP layers (`model.layers.{i}.*`, i >= num_hidden_layers) are not read: glm5_hal.model does not implement them
and QuaRot cannot rotate them; their names are returned and recorded under "dropped" in quantization.json.

GPTQ is not streamed: its Hessians need calibration activations through the whole model (quantization/cli.py
keeps the in-memory path for `--method gptq`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from glm5_hal.config import ModelConfig
from glm5_hal.model import check_state_dict, expert_module_names, linear_module_names
from glm5_hal.model.checkpoint import CheckpointReader
from glm5_hal.model.fp8 import dequantize_fp8_block, is_fp8_scale_name, scale_name_for
from quantization.checkpoint import (
    GLM5_HAL_LAYOUT,
    CheckpointInfo,
    CheckpointLayout,
    ShardWriter,
    prepare_output_dir,
)
from quantization.model_quant import SCHEMES, linear_scheme, weight_spec
from quantization.quantizers import rtn_quantize
from quantization.quarot import QuaRotRotations, is_mtp_tensor, is_norm_gain, rotate_tensor

# Hugging Face's default shard size (`max_shard_size="5GB"`): a real GLM-5 in W4A8 is ~80 shards.
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9


@dataclass
class StreamingResult:
    """What quantize_checkpoint_streaming wrote.

    directory: the output directory. files: its safetensors files, in order. quantized: {"w8a8" / "w4a8": number of
    quantized weights}. float_tensors: number of tensors stored in floating point. dropped: the MTP tensor names
    left out.
    """

    directory: Path
    files: list[str]
    quantized: dict[str, int] = field(default_factory=dict)
    float_tensors: int = 0
    dropped: list[str] = field(default_factory=list)


class _TensorQuantizer:
    """The per-tensor step: rotate (when rotations are given), then RTN-quantize when the tensor's call site is
    quantized under the scheme, exactly as quantize_model selects and quantizes them."""

    def __init__(
        self,
        config: ModelConfig,
        scheme: str,
        mse_clip: bool,
        group_size: int | None,
        gains: dict[str, Tensor] | None,
        rotations: QuaRotRotations | None,
        layout: CheckpointLayout,
    ) -> None:
        self.config, self.scheme, self.mse_clip, self.group_size = config, scheme, mse_clip, group_size
        self.gains, self.rotations, self.layout = gains, rotations, layout
        # quantize_model's candidates: every linear call site and every routed-experts block (a real GLM-5 has
        # ~1000 of them: sets, built once).
        self.linear_sites = frozenset(linear_module_names(config))
        self.expert_sites = frozenset(expert_module_names(config))

    def kind(self, name: str) -> str | None:
        """ "w8a8" / "w4a8" when the checkpoint tensor `name` is a weight that quantize_model quantizes (a linear
        call site, or one routed expert's gate / up / down_proj), else None (stored as it is)."""
        if not name.endswith(".weight"):
            return None
        base = name.removesuffix(".weight")
        if base in self.linear_sites:
            return linear_scheme(base, self.scheme)
        block = base.rsplit(".", 2)[0]  # "model.layers.N.mlp.experts" of "model.layers.N.mlp.experts.E.down_proj"
        return linear_scheme(block, self.scheme) if block in self.expert_sites else None

    def convert(self, name: str, value: Tensor) -> dict[str, tuple[Tensor, dict]]:
        """{stored name: (tensor, the layout's entry)} for the source tensor `name` = value."""
        if self.rotations is not None:
            value = rotate_tensor(name, value, self.gains, self.config, self.rotations)
        kind = self.kind(name)
        if kind is None:
            return self.layout.store_float(name, value)
        return self.layout.store_quantized(name, rtn_quantize(value, weight_spec(kind, self.mse_clip, self.group_size)))


def quantize_checkpoint_streaming(
    checkpoint: str | Path,
    out_dir: str | Path,
    config: ModelConfig,
    scheme: str,
    *,
    rotate: bool = True,
    seed: int = 0,
    mse_clip: bool = False,
    group_size: int | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    fp8_block_size: tuple[int, int] | None = None,
    layout: CheckpointLayout = GLM5_HAL_LAYOUT,
) -> StreamingResult:
    """QuaRot + RTN-quantize a checkpoint tensor by tensor and write the quantized checkpoint (module docstring).

    Args:
        checkpoint: one .safetensors file or a Hugging Face checkpoint directory (sharded or not; see
            glm5_hal.model.checkpoint.checkpoint_files).
        out_dir: a new or empty directory; gets the safetensors shard(s) (+ index when sharded), config.json and
            quantization.json.
        config: the model config (every non-MTP tensor of the checkpoint must be one of its parameters, with its
            shape).
        scheme: "w8a8" or "w4a8" (model_quant.linear_scheme).
        rotate: fold the RMSNorm gains and rotate with QuaRot (seed: the Hadamard signs) first.
        mse_clip, group_size: as quantize_model's (MSE clip search; int4 group size of the W4A8 experts).
        max_shard_bytes: the largest output shard (a larger single tensor gets a shard of its own).
        fp8_block_size: an FP8 block-scaled source (glm5_hal/model/fp8.py: config.json's quantization_config, read
            by fp8.fp8_block_size): each `X.weight` with an `X.weight_scale_inv` is dequantized to bf16 as it is
            read, and the scales are not carried over. None: a floating source.
        layout: the output format (checkpoint.CheckpointLayout; quantization/formats/ has the engine ones).

    Returns:
        A StreamingResult (files written, quantized / float counts, the MTP tensors dropped).

    Raises:
        ValueError: an unknown scheme, a non-positive max_shard_bytes, or a checkpoint whose non-MTP tensors are
            not exactly config's parameters (missing, extra or misshapen: named before any data is read);
        FileExistsError: out_dir already holds a checkpoint.
    """
    if scheme not in SCHEMES:
        raise ValueError(f"scheme: expected one of {SCHEMES}, got {scheme!r}")
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes: expected a positive byte count, got {max_shard_bytes}")
    if scheme == "w4a8":
        layout.check_group_size(group_size)
    reader = CheckpointReader(checkpoint)
    dropped = sorted(name for name in reader if is_mtp_tensor(name, config))
    is_scale = is_fp8_scale_name if fp8_block_size is not None else (lambda name: False)
    kept = [name for name in reader if not is_mtp_tensor(name, config) and not is_scale(name)]
    # Names and shapes are checked from the headers (meta tensors: no storage) before hours of work start.
    try:
        check_state_dict(config, {name: torch.empty(reader.info(name).shape, device="meta") for name in kept})
    except ValueError as exc:
        raise ValueError(f"checkpoint {checkpoint} (MTP layers aside): {exc}") from exc
    directory = prepare_output_dir(out_dir)

    gains, rotations = None, None
    if rotate:
        gains = {name: reader.read(name) for name in kept if is_norm_gain(name)}
        rotations = QuaRotRotations.for_config(config, seed)

    quantizer = _TensorQuantizer(config, scheme, mse_clip, group_size, gains, rotations, layout)
    writer = ShardWriter(directory, layout, max_shard_bytes)
    result = StreamingResult(directory, [], dropped=dropped)
    described: dict[str, dict] = {}
    for name in kept:  # file by file, in each file's order
        kind = quantizer.kind(name)
        if kind is None:
            result.float_tensors += 1
        else:
            result.quantized[kind] = result.quantized.get(kind, 0) + 1
        # A gain is read once (up front). `source` is released before the next read: one source tensor is alive at
        # a time, besides the gains and the small untouched ones the pending shard keeps as they are.
        source = gains[name] if gains is not None and name in gains else reader.read(name)
        if fp8_block_size is not None and scale_name_for(name) in reader:
            scale = reader.read(scale_name_for(name))
            source = dequantize_fp8_block(source, scale, fp8_block_size, torch.bfloat16, name=name)
        for stored_name, (tensor, entry) in quantizer.convert(name, source).items():
            writer.add(stored_name, tensor)
            described[stored_name] = entry
        del source
    result.files = writer.finish()
    info = CheckpointInfo(config, scheme, "rtn", seed if rotate else None, dropped)
    layout.write_metadata(directory, info, described)
    return result
