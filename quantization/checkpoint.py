"""Quantized checkpoints: a safetensors file with Hugging Face names, the model's config.json and a JSON
description of every tensor. A directory is self-describing: `load_quantized_model(dir)` needs nothing else.

    <dir>/model.safetensors     float tensors as they were (rotated if QuaRot ran); for each quantized linear
                                `X.weight` (int8 [N, K] for w8a8, uint8 [N, K/2] packed int4 for w4a8) and
                                `X.weight_scale` (fp32 [N], or [N, K/group_size] for grouped int4)
    <dir>/config.json           the Hugging Face config of the model (glm5_hal.model.hf_config.config_to_hf)
    <dir>/quantization.json     {"format", "version", "config", "scheme", "method", "quarot": {"seed"} | null,
                                 "tensors": {name: {"kind", "dtype", "shape", ...}}}

A tensor's "kind" is "float", "w8a8" or "w4a8" (the weight; with "scale" naming its scale tensor, "in_features"
and "group_size"), or "scale" (with "of" naming its weight). `load_quantized_model` rebuilds the CausalLM with
QuantLinear / QuantRoutedExperts at the quantized call sites, straight from the stored codes: no dequantized
(float) copy of a quantized weight is ever made, so a real GLM-5 loads in its quantized size.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor, nn

from glm5_hal.config import ModelConfig
from glm5_hal.model import CausalLM
from glm5_hal.model.hf_config import CONFIG_FILE, config_to_hf, load_config
from quantization.experts import QuantRoutedExperts
from quantization.linear import W4A8, W8A8, QuantLinear
from quantization.quantizers import QuantizedWeight

FORMAT = "glm5-hal-quantized"
VERSION = 1
WEIGHTS_FILE = "model.safetensors"
DESCRIPTION_FILE = "quantization.json"


def _safetensors():
    try:
        import safetensors.torch
    except ImportError as exc:  # an optional dependency: say how to get it
        raise ImportError(
            "quantized checkpoints need the `safetensors` package: pip install 'safetensors>=0.4'"
        ) from exc
    return safetensors.torch


def load_state_dict(path: str | Path) -> dict[str, Tensor]:
    """All tensors of one safetensors file, or of every *.safetensors file in a directory (HF sharding)."""
    st = _safetensors()
    path = Path(path)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files:
        raise FileNotFoundError(f"checkpoint: no *.safetensors file in {path}")
    state: dict[str, Tensor] = {}
    for f in files:
        state.update(st.load_file(str(f)))
    return state


def save_quantized(
    directory: str | Path,
    float_state: dict[str, Tensor],
    quantized: dict[str, QuantizedWeight],
    *,
    config: ModelConfig,
    scheme: str,
    method: str,
    quarot_seed: int | None,
) -> Path:
    """Write the quantized checkpoint (see the module docstring): model.safetensors, config.json (from `config`)
    and quantization.json. float_state: the (rotated) floating state dict; its entries named in `quantized` are
    replaced by their integer codes and scales. Returns the directory."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, Tensor] = {}
    described: dict[str, dict] = {}
    for name, value in float_state.items():
        if name in quantized:
            continue
        tensors[name] = value.contiguous()
        described[name] = {
            "kind": "float",
            "dtype": str(value.dtype).removeprefix("torch."),
            "shape": list(value.shape),
        }
    for name, q in quantized.items():
        kind = W8A8 if q.spec.bits == 8 else W4A8
        weight = q.codes if kind == W8A8 else q.packed_int4()
        scale_name = name.removesuffix(".weight") + ".weight_scale"
        tensors[name], tensors[scale_name] = weight.contiguous(), q.matmul_scale()
        described[name] = {
            "kind": kind,
            "dtype": str(weight.dtype).removeprefix("torch."),
            "shape": list(weight.shape),
            "in_features": q.codes.shape[1],
            "group_size": q.spec.group_size,
            "scale": scale_name,
            "packing": "int4, two per byte along K, even k in the low nibble" if kind == W4A8 else "int8",
        }
        described[scale_name] = {
            "kind": "scale",
            "dtype": "float32",
            "shape": list(tensors[scale_name].shape),
            "of": name,
        }
    _safetensors().save_file(tensors, str(directory / WEIGHTS_FILE))
    description = {
        "format": FORMAT,
        "version": VERSION,
        "config": config.name,
        "scheme": scheme,
        "method": method,
        "quarot": None if quarot_seed is None else {"seed": quarot_seed, "folded_norms": True},
        "activations": "int8 symmetric per token (dynamic_quant)",
        "tensors": dict(sorted(described.items())),
    }
    (directory / DESCRIPTION_FILE).write_text(json.dumps(description, indent=1))
    (directory / CONFIG_FILE).write_text(json.dumps(config_to_hf(config), indent=2))
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


def load_quantized_model(directory: str | Path, config: ModelConfig | None = None) -> CausalLM:
    """The CausalLM of a quantized checkpoint, with QuantLinear / QuantRoutedExperts (the integer HAL ops) at every
    quantized call site, built without a float copy of any quantized weight.

    directory: written by save_quantized. config: the model's ModelConfig; default: read from <dir>/config.json.

    The CausalLM is built on the stored float tensors plus, for each quantized weight, a meta-device placeholder of
    its float shape [N, K] (no storage: loading GLM-5 never allocates its ~1.5 TB of bf16 weights); each call site
    holding a placeholder is then swapped for a module on the stored int8 / packed int4 codes and fp32 scales, used
    as stored (a routed expert's gate|up rows are the gate rows then the up rows of both, codes and scales). A
    placeholder left over (a quantized tensor at no quantized call site) is a ValueError naming it.
    """
    directory = Path(directory)
    description = read_description(directory)
    config = load_config(directory) if config is None else config
    stored = load_state_dict(directory / WEIGHTS_FILE)
    entries: dict[str, dict] = description["tensors"]
    quantized = {n: e for n, e in entries.items() if e["kind"] in (W8A8, W4A8)}
    state = {n: stored[n] for n, e in entries.items() if e["kind"] == "float"}
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
        (kind, group_size), scales = kinds.pop(), [stored[quantized[n]["scale"]] for n in names]
        if len(names) == 1:
            return QuantLinear(stored[names[0]], scales[0], None, kind, group_size)
        return QuantLinear(torch.cat([stored[n] for n in names]), torch.cat(scales), None, kind, group_size)

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
    return model


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
