"""Checkpoint formats `CausalLM.from_pretrained` can read, and how a package adds one.

A Hugging Face checkpoint (config.json + safetensors, floating or FP8 block-scaled) is read by glm5_hal itself
(glm5_hal/model/pretrained.py). Other formats, such as the quantized checkpoints `glm5-hal quantize` writes, are
built from modules of packages glm5_hal may not import (DESIGN.md layout): those packages register a
`CheckpointFormat` under the entry-point group `glm5_hal.checkpoint_formats`, the way backends and subcommands
plug in:

    [project.entry-points."glm5_hal.checkpoint_formats"]
    glm5-hal-quantized = "quantization.checkpoint:CHECKPOINT_FORMAT"

from_pretrained asks every registered format whether it recognises the directory (`detect`); the one that does
builds the model (`load`). Two formats claiming one directory is an error naming both; when none does, the
Hugging Face reader runs. A format whose entry point fails to import is reported (a warning naming it) and
skipped: a broken plugin must not stop other checkpoints from loading.
"""

from __future__ import annotations

import importlib.metadata
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from glm5_hal.config import ModelConfig

if TYPE_CHECKING:
    from glm5_hal.model.decoder import DecoderModel

CHECKPOINT_FORMAT_ENTRY_POINT_GROUP = "glm5_hal.checkpoint_formats"


@runtime_checkable
class CheckpointFormat(Protocol):
    """One checkpoint format: how to recognise a directory in it, and how to build the model from it.

    name: a short label for messages ("glm5-hal-quantized", "compressed-tensors", ...).
    detect(directory, hf_config): True when `directory` is in this format. hf_config is its parsed config.json
        (e.g. for a `quantization_config` to inspect). Must be cheap (read small metadata files only) and must not
        raise for a directory in another format.
    load(directory, config, dtype=..., device=...): the model (a glm5_hal.model.CausalLM). config: the ModelConfig
        of config.json; dtype: the floating dtype asked for (None: the checkpoint's own); device: where the weights
        go. Errors name the file and tensor at fault.
    """

    name: str

    def detect(self, directory: Path, hf_config: dict) -> bool: ...

    def load(
        self, directory: Path, config: ModelConfig, *, dtype: torch.dtype | None, device: torch.device
    ) -> DecoderModel: ...


def registered_formats() -> dict[str, CheckpointFormat]:
    """Every `glm5_hal.checkpoint_formats` entry point by name (entry points that fail to load are warned about
    and left out, as are objects that are not a CheckpointFormat)."""
    found: dict[str, CheckpointFormat] = {}
    entry_points = importlib.metadata.entry_points(group=CHECKPOINT_FORMAT_ENTRY_POINT_GROUP)
    for ep in sorted(entry_points, key=lambda e: e.name):
        try:
            fmt = ep.load()
        except Exception as exc:  # a broken plugin must not stop other checkpoints from loading
            warnings.warn(f"checkpoint format {ep.name!r} ({ep.value}) failed to load: {exc!r}", stacklevel=2)
            continue
        if not isinstance(fmt, CheckpointFormat):
            warnings.warn(
                f"checkpoint format {ep.name!r} ({ep.value}) is a {type(fmt).__name__}, not a CheckpointFormat "
                "(name, detect, load)",
                stacklevel=2,
            )
            continue
        found[ep.name] = fmt
    return found


def detect_format(
    directory: Path, hf_config: dict, formats: dict[str, CheckpointFormat] | None = None
) -> CheckpointFormat | None:
    """The registered format (`formats`, default: registered_formats()) that recognises `directory`, or None
    when none does. ValueError naming them when several do."""
    formats = registered_formats() if formats is None else formats
    claims = [fmt for fmt in formats.values() if fmt.detect(directory, hf_config)]
    if len(claims) > 1:
        raise ValueError(
            f"{directory}: recognised by several checkpoint formats ({[f.name for f in claims]}); "
            "their detect() rules overlap"
        )
    return claims[0] if claims else None
