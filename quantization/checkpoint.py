"""Quantized checkpoints: a safetensors file with Hugging Face names plus a JSON description of every tensor.

    <dir>/model.safetensors     float tensors as they were (rotated if QuaRot ran); for each quantized linear
                                `X.weight` (int8 [N, K] for w8a8, uint8 [N, K/2] packed int4 for w4a8) and
                                `X.weight_scale` (fp32 [N], or [N, K/group_size] for grouped int4)
    <dir>/quantization.json     {"format", "version", "config", "scheme", "method", "quarot": {"seed"} | null,
                                 "tensors": {name: {"kind", "dtype", "shape", ...}}}

A tensor's "kind" is "float", "w8a8" or "w4a8" (the weight; with "scale" naming its scale tensor and
"group_size"), or "scale" (with "of" naming its weight). `load_quantized_model` rebuilds the CausalLM with
QuantLinear / QuantRoutedExperts at the quantized call sites.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor

from glm5_hal.config import ModelConfig
from glm5_hal.model import CausalLM
from quantization.experts import QuantRoutedExperts
from quantization.linear import W4A8, W8A8, QuantLinear
from quantization.quantizers import QuantizedWeight, WeightQuantSpec

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
    """Write the quantized checkpoint (see the module docstring). float_state: the (rotated) floating state dict;
    its entries named in `quantized` are replaced by their integer codes and scales. Returns the directory."""
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
    return directory


def _quantized_weight(codes_or_packed: Tensor, scale: Tensor, entry: dict) -> QuantizedWeight:
    """Back to a QuantizedWeight (unpacked int codes, [N, G] scales) from the stored tensors."""
    if entry["kind"] == W8A8:
        return QuantizedWeight(codes_or_packed, scale.reshape(scale.shape[0], -1), WeightQuantSpec(bits=8))
    import ops_reference as ref

    codes = torch.from_numpy(ref.unpack_int4(codes_or_packed.numpy()))
    return QuantizedWeight(
        codes, scale.reshape(scale.shape[0], -1), WeightQuantSpec(bits=4, group_size=entry["group_size"])
    )


def load_quantized_model(directory: str | Path, config: ModelConfig) -> CausalLM:
    """The CausalLM of a quantized checkpoint: built on the dequantized weights, then every quantized linear and
    routed-expert block swapped for its QuantLinear / QuantRoutedExperts (which run the integer HAL ops)."""
    directory = Path(directory)
    description = json.loads((directory / DESCRIPTION_FILE).read_text())
    if description.get("format") != FORMAT or description.get("version") != VERSION:
        raise ValueError(
            f"{directory / DESCRIPTION_FILE}: expected format {FORMAT!r} v{VERSION}, got "
            f"{description.get('format')!r} v{description.get('version')}"
        )
    stored = load_state_dict(directory / WEIGHTS_FILE)
    entries = description["tensors"]
    weights = {
        n: _quantized_weight(stored[n], stored[e["scale"]], e) for n, e in entries.items() if e["kind"] in (W8A8, W4A8)
    }
    state = {n: stored[n] for n, e in entries.items() if e["kind"] == "float"}
    dtype = state["model.embed_tokens.weight"].dtype
    state.update({n: q.dequantize(dtype) for n, q in weights.items()})
    model = CausalLM(config, state)
    expert_blocks = sorted({n.rsplit(".", 3)[0] for n in weights if ".mlp.experts." in n})
    for name, q in weights.items():
        if ".mlp.experts." not in name:
            model.replace_module(name.removesuffix(".weight"), QuantLinear.from_quantized(q))
    for block in expert_blocks:
        gate_up, down = [], []
        for e in range(config.n_routed_experts):
            gate, up = weights[f"{block}.{e}.gate_proj.weight"], weights[f"{block}.{e}.up_proj.weight"]
            both = QuantizedWeight(torch.cat([gate.codes, up.codes]), torch.cat([gate.scale, up.scale]), gate.spec)
            gate_up.append(QuantLinear.from_quantized(both))
            down.append(QuantLinear.from_quantized(weights[f"{block}.{e}.down_proj.weight"]))
        model.replace_module(block, QuantRoutedExperts(gate_up, down))
    return model
