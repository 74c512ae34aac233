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
from each. `detect_format(dir)` says which one a directory holds.
"""

from __future__ import annotations

from pathlib import Path

from glm5_hal.config import ModelConfig
from glm5_hal.model import CausalLM
from glm5_hal.model.hf_config import CONFIG_FILE, read_config_json
from quantization.checkpoint import DESCRIPTION_FILE, GLM5_HAL_LAYOUT, CheckpointLayout, load_quantized_model
from quantization.formats.compressed_tensors import (
    COMPRESSED_TENSORS_LAYOUT,
    is_compressed_tensors,
    load_compressed_tensors,
)
from quantization.formats.msmodelslim import DESCRIPTION_FILE as MSMODELSLIM_DESCRIPTION_FILE
from quantization.formats.msmodelslim import MSMODELSLIM_LAYOUT, load_msmodelslim

LAYOUTS: dict[str, CheckpointLayout] = {
    layout.name: layout for layout in (GLM5_HAL_LAYOUT, COMPRESSED_TENSORS_LAYOUT, MSMODELSLIM_LAYOUT)
}
FORMATS = tuple(LAYOUTS)
_READERS = {
    GLM5_HAL_LAYOUT.name: load_quantized_model,
    COMPRESSED_TENSORS_LAYOUT.name: load_compressed_tensors,
    MSMODELSLIM_LAYOUT.name: load_msmodelslim,
}


def layout_for(format_name: str) -> CheckpointLayout:
    """The CheckpointLayout of an output format; ValueError listing FORMATS otherwise."""
    if format_name not in LAYOUTS:
        raise ValueError(f"format: expected one of {list(FORMATS)}, got {format_name!r}")
    return LAYOUTS[format_name]


def detect_format(directory: str | Path) -> str:
    """Which format a quantized checkpoint directory holds, from its metadata files: quantization.json (glm5-hal),
    quant_model_description.json (msmodelslim), or a config.json whose quantization_config has quant_method
    "compressed-tensors". ValueError naming what was found when none, or more than one, matches."""
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"directory: {directory} is not a directory")
    found = []
    if (directory / DESCRIPTION_FILE).is_file():
        found.append(GLM5_HAL_LAYOUT.name)
    if (directory / MSMODELSLIM_DESCRIPTION_FILE).is_file():
        found.append(MSMODELSLIM_LAYOUT.name)
    if (directory / CONFIG_FILE).is_file() and is_compressed_tensors(read_config_json(directory)):
        found.append(COMPRESSED_TENSORS_LAYOUT.name)
    if len(found) != 1:
        raise ValueError(
            f"{directory}: expected exactly one quantized-checkpoint format: {DESCRIPTION_FILE} (glm5-hal), "
            f"{MSMODELSLIM_DESCRIPTION_FILE} (msmodelslim) or a {CONFIG_FILE} quantization_config with quant_method "
            f"'compressed-tensors'; found {found or 'none'} (files: {sorted(p.name for p in directory.iterdir())[:8]})"
        )
    return found[0]


def load_checkpoint(directory: str | Path, config: ModelConfig | None = None) -> CausalLM:
    """The CausalLM of a quantized checkpoint in any of FORMATS (detect_format), on the HAL's integer ops.
    config: default: the directory's config.json."""
    return _READERS[detect_format(directory)](directory, config)
