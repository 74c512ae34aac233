"""The config.json every engine format writes: the model's Hugging Face config plus what an engine needs to serve
it (the float dtype, no MTP layers) and a record of how the checkpoint was made (`PROVENANCE_KEY`)."""

from __future__ import annotations

import json
from pathlib import Path

from glm5_hal.model.hf_config import CONFIG_FILE, config_to_hf
from quantization.checkpoint import CheckpointInfo, rotation_metadata

# The config.json key recording how glm5-hal made the checkpoint (engines ignore unknown keys).
PROVENANCE_KEY = "glm5_hal_quantization"


def engine_config(info: CheckpointInfo, entries: dict[str, dict], format_name: str) -> dict:
    """config.json for an engine format.

    info: the checkpoint's CheckpointInfo. entries: the layout's entries of every stored tensor (the embedding's
    float entry gives the model dtype). format_name: the output format, recorded with the provenance.

    `num_nextn_predict_layers` is 0: the MTP layers are not in the checkpoint (`info.dropped`), so an engine must not
    look for them (vLLM and vllm-ascend read it to build the MTP draft model). `torch_dtype` is the dtype of the
    stored float tensors, which the engines use for "auto".
    """
    hf = config_to_hf(info.config)
    hf["num_nextn_predict_layers"] = 0
    hf["torch_dtype"] = entries["model.embed_tokens.weight"]["dtype"]
    hf[PROVENANCE_KEY] = {
        "format": format_name,
        "scheme": info.scheme,
        "method": info.method,
        "activations": "int8 symmetric per token, dynamic",
        "quarot": rotation_metadata(info.quarot_seed),
        "dropped": sorted(info.dropped),
    }
    return hf


def write_engine_config(directory: Path, hf: dict) -> None:
    (directory / CONFIG_FILE).write_text(json.dumps(hf, indent=2))
