"""Quantized checkpoints: safetensors with Hugging Face names, the model's config.json and a JSON description of
every tensor. A directory is self-describing: `load_quantized_model(dir)` needs nothing else.

    <dir>/model.safetensors     float tensors as they were (rotated if QuaRot ran); for each quantized linear
                                `X.weight` (int8 [N, K] for w8a8, uint8 [N, K/2] packed int4 for w4a8) and
                                `X.weight_scale` (fp32 [N], or [N, K/group_size] for grouped int4)
      or model-0000i-of-0000n.safetensors + model.safetensors.index.json: the same tensors in shards, with the
                                Hugging Face index ({"metadata": {"total_size"}, "weight_map": {name: file}}), as
                                quantization/streaming.py writes a real-size checkpoint
    <dir>/config.json           the Hugging Face config of the model (glm5_hal.model.hf_config.config_to_hf)
    <dir>/quantization.json     {"format", "version", "config", "scheme", "method", "quarot": {"seed"} | null,
                                 "tensors": {name: {"kind", "dtype", "shape", ...}}, "dropped": [names]}

A tensor's "kind" is "float", "w8a8" or "w4a8" (the weight; with "scale" naming its scale tensor, "in_features"
and "group_size"), or "scale" (with "of" naming its weight). "dropped" names the source tensors left out (the MTP
layers, which glm5_hal.model does not implement). `load_quantized_model` rebuilds the CausalLM with QuantLinear /
QuantRoutedExperts at the quantized call sites, straight from the stored codes: no dequantized (float) copy of a
quantized weight is ever made, so a real GLM-5 loads in its quantized size.

The description is built by the same helpers (`float_entry`, `quantized_tensors`, `build_description`,
`write_metadata`) for the in-memory writer `save_quantized` and the streaming one, so both describe a tensor
identically.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor, nn

from glm5_hal.config import ModelConfig
from glm5_hal.model import CausalLM
from glm5_hal.model.checkpoint import (  # reading checkpoints is a model concern; the names stay importable here
    INDEX_FILE,
    WEIGHTS_FILE,
    CheckpointReader,
    checkpoint_files,  # noqa: F401 (re-exported)
    load_state_dict,  # noqa: F401 (re-exported)
)
from glm5_hal.model.hf_config import CONFIG_FILE, config_to_hf, load_config
from glm5_hal.model.weights import FP32_PARAMETERS
from quantization.experts import QuantRoutedExperts
from quantization.linear import W4A8, W8A8, QuantLinear
from quantization.quantizers import QuantizedWeight

FORMAT = "glm5-hal-quantized"
VERSION = 1
DESCRIPTION_FILE = "quantization.json"


def _safetensors():
    try:
        import safetensors.torch
    except ImportError as exc:  # an optional dependency: say how to get it
        raise ImportError(
            "quantized checkpoints need the `safetensors` package: pip install 'safetensors>=0.4'"
        ) from exc
    return safetensors.torch


def prepare_output_dir(directory: str | Path) -> Path:
    """Create `directory` for a quantized checkpoint. FileExistsError when it already holds safetensors or an
    index: a stale shard or index left beside the new files would be read back with them."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    stale = sorted(p.name for p in (*directory.glob("*.safetensors"), directory / INDEX_FILE) if p.exists())
    if stale:
        raise FileExistsError(
            f"out_dir: {directory} already holds a checkpoint ({stale[:3]}); pass a new or empty directory"
        )
    return directory


def float_entry(value: Tensor) -> dict:
    """The quantization.json entry of a tensor stored as it is."""
    return {"kind": "float", "dtype": str(value.dtype).removeprefix("torch."), "shape": list(value.shape)}


def quantized_tensors(name: str, q: QuantizedWeight) -> dict[str, tuple[Tensor, dict]]:
    """What the checkpoint stores for the quantized weight `name` ("...q_a_proj.weight"): {stored name: (tensor,
    quantization.json entry)} for the codes (int8 [N, K], or packed int4 uint8 [N, K/2]) under `name` and the fp32
    scales ([N], or [N, K/group_size]) under "...weight_scale"."""
    kind = W8A8 if q.spec.bits == 8 else W4A8
    weight = (q.codes if kind == W8A8 else q.packed_int4()).contiguous()
    scale = q.matmul_scale()
    scale_name = name.removesuffix(".weight") + ".weight_scale"
    weight_entry = {
        "kind": kind,
        "dtype": str(weight.dtype).removeprefix("torch."),
        "shape": list(weight.shape),
        "in_features": q.codes.shape[1],
        "group_size": q.spec.group_size,
        "scale": scale_name,
        "packing": "int4, two per byte along K, even k in the low nibble" if kind == W4A8 else "int8",
    }
    scale_entry = {"kind": "scale", "dtype": "float32", "shape": list(scale.shape), "of": name}
    return {name: (weight, weight_entry), scale_name: (scale, scale_entry)}


def build_description(
    *,
    config: ModelConfig,
    scheme: str,
    method: str,
    quarot_seed: int | None,
    tensors: dict[str, dict],
    dropped: Sequence[str] = (),
) -> dict:
    """The quantization.json content (module docstring). tensors: {stored name: entry} (float_entry /
    quantized_tensors); dropped: the source tensors left out (MTP layers)."""
    return {
        "format": FORMAT,
        "version": VERSION,
        "config": config.name,
        "scheme": scheme,
        "method": method,
        "quarot": None if quarot_seed is None else {"seed": quarot_seed, "folded_norms": True},
        "activations": "int8 symmetric per token (dynamic_quant)",
        "tensors": dict(sorted(tensors.items())),
        "dropped": sorted(dropped),
    }


def write_metadata(directory: str | Path, description: dict, config: ModelConfig) -> None:
    """Write <directory>/quantization.json (description) and <directory>/config.json (config, Hugging Face form)."""
    directory = Path(directory)
    (directory / DESCRIPTION_FILE).write_text(json.dumps(description, indent=1))
    (directory / CONFIG_FILE).write_text(json.dumps(config_to_hf(config), indent=2))


def save_quantized(
    directory: str | Path,
    float_state: dict[str, Tensor],
    quantized: dict[str, QuantizedWeight],
    *,
    config: ModelConfig,
    scheme: str,
    method: str,
    quarot_seed: int | None,
    dropped: Sequence[str] = (),
) -> Path:
    """Write the quantized checkpoint (see the module docstring) from memory: model.safetensors, config.json (from
    `config`) and quantization.json. float_state: the (rotated) floating state dict; its entries named in
    `quantized` are replaced by their integer codes and scales. dropped: source tensor names left out of
    float_state (MTP layers), recorded in quantization.json. Returns the directory; FileExistsError when it
    already holds a checkpoint (prepare_output_dir)."""
    directory = prepare_output_dir(directory)
    stored = {
        name: (value.contiguous(), float_entry(value)) for name, value in float_state.items() if name not in quantized
    }
    for name, q in quantized.items():
        stored.update(quantized_tensors(name, q))
    _safetensors().save_file({name: t for name, (t, _) in stored.items()}, str(directory / WEIGHTS_FILE))
    description = build_description(
        config=config,
        scheme=scheme,
        method=method,
        quarot_seed=quarot_seed,
        tensors={name: entry for name, (_, entry) in stored.items()},
        dropped=dropped,
    )
    write_metadata(directory, description, config)
    return directory


def read_description(directory: str | Path) -> dict:
    """The parsed <dir>/quantization.json, after checking its format and version (ValueError otherwise)."""
    path = Path(directory) / DESCRIPTION_FILE
    description = json.loads(path.read_text())
    if description.get("format") != FORMAT or description.get("version") != VERSION:
        raise ValueError(
            f"{path}: expected format {FORMAT!r} v{VERSION}, got "
            f"{description.get('format')!r} v{description.get('version')}"
        )
    return description


def load_quantized_model(
    directory: str | Path,
    config: ModelConfig | None = None,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> CausalLM:
    """The CausalLM of a quantized checkpoint, with QuantLinear / QuantRoutedExperts (the integer HAL ops) at every
    quantized call site, built without a float copy of any quantized weight.

    directory: written by save_quantized or quantization.streaming (one model.safetensors, or shards with an index).
    config: the model's ModelConfig; default: read from <dir>/config.json.
    dtype: the dtype of the floating tensors (None: as stored; the router bias stays fp32; codes and scales are
    used as stored). device: where the model goes (None: the CPU).

    Tensors are read one at a time as the model is built (glm5_hal.model.checkpoint.CheckpointReader), so the
    peak is the model plus a routed expert's gate and up codes before they are stacked.

    The CausalLM is built on the stored float tensors plus, for each quantized weight, a meta-device placeholder of
    its float shape [N, K] (no storage: loading GLM-5 never allocates its ~1.5 TB of bf16 weights); each call site
    holding a placeholder is then swapped for a module on the stored int8 / packed int4 codes and fp32 scales, used
    as stored (a routed expert's gate|up rows are the gate rows then the up rows of both, codes and scales). A
    placeholder left over (a quantized tensor at no quantized call site) is a ValueError naming it.
    """
    directory = Path(directory)
    description = read_description(directory)
    config = load_config(directory) if config is None else config
    read = CheckpointReader(directory).read
    entries: dict[str, dict] = description["tensors"]
    quantized = {n: e for n, e in entries.items() if e["kind"] in (W8A8, W4A8)}
    state = {n: read(n) for n, e in entries.items() if e["kind"] == "float"}
    if dtype is not None:
        state = {n: t if n.endswith(FP32_PARAMETERS) else t.to(dtype) for n, t in state.items()}
    dtype = state["model.embed_tokens.weight"].dtype
    state.update(
        {n: torch.empty(e["shape"][0], e["in_features"], dtype=dtype, device="meta") for n, e in quantized.items()}
    )
    model = CausalLM(config, state)

    def quant_linear(*names: str) -> QuantLinear:
        # The stored tensors as they are; several weights fused into one GEMM (gate then up) stack along N, which
        # is valid as stored because packed int4 bytes and scales are per row.
        kinds = {(quantized[n]["kind"], quantized[n]["group_size"]) for n in names}
        if len(kinds) != 1:
            raise ValueError(f"{directory}: {list(names)} are fused into one GEMM but quantized differently: {kinds}")
        (kind, group_size), scales = kinds.pop(), [read(quantized[n]["scale"]) for n in names]
        if len(names) == 1:
            return QuantLinear(read(names[0]), scales[0], None, kind, group_size)
        return QuantLinear(torch.cat([read(n) for n in names]), torch.cat(scales), None, kind, group_size)

    for name in quantized:
        if ".mlp.experts." not in name:
            model.replace_module(name.removesuffix(".weight"), quant_linear(name))
    for block in sorted({n.rsplit(".", 3)[0] for n in quantized if ".mlp.experts." in n}):
        per_expert = [f"{block}.{e}" for e in range(config.n_routed_experts)]
        missing = [
            f"{p}.{proj}.weight"
            for p in per_expert
            for proj in ("gate_proj", "up_proj", "down_proj")
            if f"{p}.{proj}.weight" not in quantized
        ]
        if missing:
            raise ValueError(
                f"{directory}: the routed experts of {block} are partly quantized; e.g. {missing[:3]} are not"
            )
        model.replace_module(
            block,
            QuantRoutedExperts(
                [quant_linear(f"{p}.gate_proj.weight", f"{p}.up_proj.weight") for p in per_expert],
                [quant_linear(f"{p}.down_proj.weight") for p in per_expert],
            ),
        )
    check_no_meta_tensors(model, directory)
    return model if device is None else model.to(device)


class QuantizedCheckpointFormat:
    """The glm5_hal.checkpoint_formats plugin of this format: `CausalLM.from_pretrained` on a directory written by
    `glm5-hal quantize` (one whose quantization.json names this format) builds the model with load_quantized_model.
    """

    name = FORMAT

    def detect(self, directory: Path, hf_config: dict) -> bool:
        path = Path(directory) / DESCRIPTION_FILE
        if not path.is_file():
            return False
        try:
            return json.loads(path.read_text()).get("format") == FORMAT
        except (json.JSONDecodeError, AttributeError):
            return False  # a quantization.json of some other tool

    def load(
        self, directory: Path, config: ModelConfig, *, dtype: torch.dtype | None, device: torch.device
    ) -> CausalLM:
        return load_quantized_model(directory, config, dtype=dtype, device=device)


CHECKPOINT_FORMAT = QuantizedCheckpointFormat()


def check_no_meta_tensors(model: nn.Module, directory: str | Path) -> None:
    """ValueError naming the parameters / buffers of `model` (the first three) still on the meta device: placeholders
    that no quantized module replaced. directory: the checkpoint, for the message."""
    tensors = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    left = [name for name, t in tensors if t.is_meta]
    if left:
        raise ValueError(
            f"{directory}: {len(left)} model tensor(s) are still meta placeholders after loading, e.g. {left[:3]}: "
            "quantization.json marks their weights quantized, but no quantized module replaced them"
        )
