"""The output formats of `glm5-hal quantize --format` and their readers.

    glm5-hal            glm5_hal.model                   written: checkpoint.GLM5_HAL_LAYOUT
                                                         read: checkpoint.load_quantized_model
    compressed-tensors  vLLM / SGLang (GPUs), vllm-ascend's compressed-tensors path
                                                         written: compressed_tensors.COMPRESSED_TENSORS_LAYOUT
                                                         read: compressed_tensors.load_compressed_tensors
    msmodelslim         vllm-ascend --quantization ascend (Ascend NPUs)
                                                         written: msmodelslim.MSMODELSLIM_LAYOUT
                                                         read: msmodelslim.load_msmodelslim

The three hold the same rotated, quantized weights: `load_checkpoint` gives the same model (bit-identical logits)
from each. `detect_format(dir)` says which one a directory holds. Each format's detection rule and reader form its
`CHECKPOINT_FORMAT` (checkpoint.QuantizedCheckpointFormat), registered in pyproject.toml at glm5_hal's
`glm5_hal.checkpoint_formats` plugin point: `CausalLM.from_pretrained(dir)` reads all three, through the same rules.
"""

from __future__ import annotations

from pathlib import Path

import torch

from glm5_hal.config import ModelConfig
from glm5_hal.model import CausalLM
from glm5_hal.model.hf_config import CONFIG_FILE, read_config_json
from quantization import checkpoint
from quantization.checkpoint import DESCRIPTION_FILE, GLM5_HAL_LAYOUT, CheckpointLayout, QuantizedCheckpointFormat
from quantization.formats import compressed_tensors, msmodelslim
from quantization.formats.compressed_tensors import COMPRESSED_TENSORS_LAYOUT
from quantization.formats.msmodelslim import MSMODELSLIM_LAYOUT

LAYOUTS: dict[str, CheckpointLayout] = {
    layout.name: layout for layout in (GLM5_HAL_LAYOUT, COMPRESSED_TENSORS_LAYOUT, MSMODELSLIM_LAYOUT)
}
FORMATS = tuple(LAYOUTS)
# Each output format's detection rule and reader, by format name (the plugin objects pyproject.toml registers).
CHECKPOINT_FORMATS: dict[str, QuantizedCheckpointFormat] = {
    fmt.name: fmt
    for fmt in (checkpoint.CHECKPOINT_FORMAT, compressed_tensors.CHECKPOINT_FORMAT, msmodelslim.CHECKPOINT_FORMAT)
}


def layout_for(format_name: str) -> CheckpointLayout:
    """The CheckpointLayout of an output format; ValueError listing FORMATS otherwise."""
    if format_name not in LAYOUTS:
        raise ValueError(f"format: expected one of {list(FORMATS)}, got {format_name!r}")
    return LAYOUTS[format_name]


def detect_format(directory: str | Path) -> str:
    """Which format a quantized checkpoint directory holds, by each format's detection rule (CHECKPOINT_FORMATS):
    a quantization.json naming the glm5-hal format, a quant_model_description.json (msmodelslim), or a config.json
    whose quantization_config has quant_method "compressed-tensors". ValueError naming what was found when none, or
    more than one, matches."""
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"directory: {directory} is not a directory")
    hf = read_config_json(directory) if (directory / CONFIG_FILE).is_file() else {}
    found = [name for name, fmt in CHECKPOINT_FORMATS.items() if fmt.detect(directory, hf)]
    if len(found) != 1:
        raise ValueError(
            f"{directory}: expected exactly one quantized-checkpoint format: {DESCRIPTION_FILE} (glm5-hal), "
            f"{msmodelslim.DESCRIPTION_FILE} (msmodelslim) or a {CONFIG_FILE} quantization_config with quant_method "
            f"'compressed-tensors'; found {found or 'none'} (files: {sorted(p.name for p in directory.iterdir())[:8]})"
        )
    return found[0]


def load_checkpoint(
    directory: str | Path,
    config: ModelConfig | None = None,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> CausalLM:
    """The CausalLM of a quantized checkpoint in any of FORMATS (detect_format), on the HAL's integer ops.
    config: default: the directory's config.json. dtype, device: see checkpoint.build_quantized_model."""
    return CHECKPOINT_FORMATS[detect_format(directory)].load(directory, config, dtype=dtype, device=device)
