"""The compressed-tensors format (vLLM, SGLang; vllm-ascend's compressed-tensors path): what llm-compressor writes
for integer W8A8 / W4A8 with dynamic per-token int8 activations, which vLLM 0.33 loads as CompressedTensorsW8A8Int8
(linears), CompressedTensorsW8A8Int8MoEMethod / CompressedTensorsW4A8Int8MoEMethod (routed experts).

    <dir>/model.safetensors (or model-0000i-of-0000n.safetensors + model.safetensors.index.json)
        float tensors under their Hugging Face names (rotated if QuaRot ran)
        X.weight        int8 [N, K]: the codes, int8 for W8A8, int4 values in [-8, 7] one per int8 for W4A8
                        (the "int-quantized" compressor stores every integer weight as int8; vLLM's W4A8 int kernels
                        read it so)
        X.weight_scale  fp32 [N, 1] (strategy "channel"), or [N, K/group_size] (strategy "group", W4A8 only)
    <dir>/config.json   the model's Hugging Face config + "quantization_config" (below) + the glm5-hal provenance

quantization_config: quant_method "compressed-tensors", format and every group's format "int-quantized",
quantization_status "compressed", one config group per (bits, group size): weights {"num_bits": 8 | 4, "type":
"int", "symmetric": true, "strategy": "channel" | "group", "dynamic": false}, input_activations {"num_bits": 8,
"type": "int", "symmetric": true, "strategy": "token", "dynamic": true}; its targets are regexes over the module
names with the layer and expert indices generalised (`re:^model\\.layers\\.\\d+\\.self_attn\\.q_a_proj$`), exact
names where one regex would cover call sites quantized differently. "ignore" lists the float call sites the same
way (lm_head, kv_b_proj, the router gates, indexer.wk / weights_proj). "transform_config" is empty: every QuaRot
rotation is folded into the weights, so the engine applies no online transform. Dequantization is
W = codes * scale, exactly what glm5-hal's QuantizedWeight.dequantize gives (tested with the compressed-tensors
package's own decompressor).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import Tensor

import ops_reference as ref
from glm5_hal.config import ModelConfig
from glm5_hal.model import CausalLM, expert_module_names, linear_module_names
from glm5_hal.model.checkpoint import CheckpointReader
from glm5_hal.model.hf_config import CONFIG_FILE, load_config, read_config_json
from quantization.checkpoint import (
    CheckpointInfo,
    CheckpointLayout,
    QuantizedCheckpointFormat,
    StoredQuantWeight,
    build_quantized_model,
)
from quantization.formats.engine_config import engine_config, write_engine_config
from quantization.linear import W4A8, W8A8
from quantization.quantizers import QuantizedWeight

FORMAT_NAME = "compressed-tensors"
QUANT_METHOD = "compressed-tensors"
COMPRESSION_FORMAT = "int-quantized"
# The compressed-tensors release whose config schema this writes (the tests validate it with that package).
SCHEMA_VERSION = "0.20.0"
_EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def call_sites(config: ModelConfig) -> list[str]:
    """Every module whose weight multiplies activations, as the checkpoint names it: the linears, and each routed
    expert's gate / up / down_proj ("model.layers.3.mlp.experts.7.down_proj")."""
    experts = [
        f"{block}.{e}.{proj}"
        for block in expert_module_names(config)
        for e in range(config.n_routed_experts)
        for proj in _EXPERT_PROJECTIONS
    ]
    return [*linear_module_names(config), *experts]


def _weight_args(kind: str, group_size: int | None) -> dict:
    return {
        "num_bits": 8 if kind == W8A8 else 4,
        "type": "int",
        "symmetric": True,
        "strategy": "channel" if group_size is None else "group",
        "group_size": group_size,
        "block_structure": None,
        "dynamic": False,
        "actorder": None,
        "observer": "minmax",
        "observer_kwargs": {},
    }


# Dynamic symmetric int8 per token: glm5_hal.dynamic_quant, vLLM's scaled_int8_quant, torch_npu.npu_dynamic_quant.
_INPUT_ACTIVATIONS = {
    "num_bits": 8,
    "type": "int",
    "symmetric": True,
    "strategy": "token",
    "group_size": None,
    "block_structure": None,
    "dynamic": True,
    "actorder": None,
    "observer": None,
    "observer_kwargs": {},
}


def _generic_target(name: str) -> str:
    """The target matching every module named like `name` up to its layer / expert indices: an exact name when it
    has none ("lm_head"), else a regex ("re:^model\\.layers\\.\\d+\\.mlp\\.experts\\.\\d+\\.down_proj$")."""
    parts = name.split(".")
    if not any(p.isdigit() for p in parts):
        return name
    return "re:^" + r"\.".join(r"\d+" if p.isdigit() else re.escape(p) for p in parts) + "$"


def _targets(sites: dict[str, tuple[str, int | None] | None]) -> dict[tuple[str, int | None] | None, list[str]]:
    """{scheme (kind, group_size), or None for float: its targets} covering every call site exactly once: one generic
    target per module name pattern whose call sites all share a scheme, the exact names otherwise."""
    by_pattern: dict[str, list[str]] = {}
    for name in sites:
        by_pattern.setdefault(_generic_target(name), []).append(name)
    targets: dict[tuple[str, int | None] | None, list[str]] = {}
    for pattern, names in by_pattern.items():
        schemes = {sites[n] for n in names}
        if len(schemes) == 1:
            targets.setdefault(schemes.pop(), []).append(pattern)
        else:
            for n in names:
                targets.setdefault(sites[n], []).append(n)
    return {scheme: sorted(t) for scheme, t in targets.items()}


def quantization_config(config: ModelConfig, entries: dict[str, dict]) -> dict:
    """config.json's "quantization_config" (module docstring) for the stored tensors' entries."""
    sites: dict[str, tuple[str, int | None] | None] = {}
    for name in call_sites(config):
        entry = entries[f"{name}.weight"]
        sites[name] = None if entry["kind"] == "float" else (entry["kind"], entry["group_size"])
    targets = _targets(sites)
    schemes = sorted((s for s in targets if s is not None), key=lambda s: (s[0], s[1] or 0))
    groups = {
        f"group_{i}": {
            "targets": targets[scheme],
            "weights": _weight_args(*scheme),
            "input_activations": dict(_INPUT_ACTIVATIONS),
            "output_activations": None,
            "format": COMPRESSION_FORMAT,
        }
        for i, scheme in enumerate(schemes)
    }
    return {
        "quant_method": QUANT_METHOD,
        "version": SCHEMA_VERSION,
        "format": COMPRESSION_FORMAT,
        "quantization_status": "compressed",
        "config_groups": groups,
        "ignore": targets.get(None, []),
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
        "sparsity_config": {},
        # Online transforms (e.g. a Hadamard before down_proj) would be listed here for the engine to apply; QuaRot's
        # rotations are all folded into the weights, so there are none.
        "transform_config": {},
    }


class _CompressedTensorsLayout(CheckpointLayout):
    """compressed-tensors "int-quantized" (module docstring); Hugging Face shard names."""

    name = FORMAT_NAME

    def store_quantized(self, name: str, q: QuantizedWeight) -> dict[str, tuple[Tensor, dict]]:
        kind = W8A8 if q.spec.bits == 8 else W4A8
        scale_name = name.removesuffix(".weight") + ".weight_scale"
        return {
            name: (q.codes.contiguous(), {"kind": kind, "group_size": q.spec.group_size}),
            scale_name: (q.scale.to(torch.float32).contiguous(), {"kind": "scale", "of": name}),
        }

    def write_metadata(self, directory: Path, info: CheckpointInfo, entries: dict[str, dict]) -> None:
        hf = engine_config(info, entries, FORMAT_NAME)
        hf["quantization_config"] = quantization_config(info.config, entries)
        write_engine_config(directory, hf)


COMPRESSED_TENSORS_LAYOUT: CheckpointLayout = _CompressedTensorsLayout()


def is_compressed_tensors(directory: Path, hf: dict) -> bool:
    """The format's detection rule: the directory's parsed config.json (`hf`) has a quantization_config with
    quant_method "compressed-tensors"."""
    qc = hf.get("quantization_config")
    return isinstance(qc, dict) and qc.get("quant_method") == QUANT_METHOD


def _matches(name: str, targets: Iterable[str]) -> bool:
    # compressed-tensors' and vLLM's matching: "re:" + a regex matched from the start, else an exact module name;
    # the class name "Linear" targets every linear call site.
    return any(re.match(t[3:], name) is not None if t.startswith("re:") else t in (name, "Linear") for t in targets)


def _parse_scheme(group_name: str, group: dict, default_format: str | None, source: str) -> tuple[str, int | None]:
    """(kind, group_size) of one config group (its format defaults to the config's); ValueError naming the group for
    what the HAL ops cannot run."""
    weights, acts = group.get("weights") or {}, group.get("input_activations") or {}
    where = f"{source}: quantization_config.config_groups.{group_name}"
    fmt = group.get("format") or default_format
    if fmt not in (COMPRESSION_FORMAT, "naive-quantized"):
        raise ValueError(f"{where}.format: expected {COMPRESSION_FORMAT!r} (int8 storage of the codes), got {fmt!r}")
    bits, strategy, group_size = weights.get("num_bits"), weights.get("strategy"), weights.get("group_size")
    if weights.get("type") != "int" or not weights.get("symmetric", True) or weights.get("dynamic"):
        raise ValueError(f"{where}.weights: expected static symmetric int weights, got {weights}")
    if bits not in (8, 4) or strategy not in ("channel", "group") or (strategy == "group") != (group_size is not None):
        raise ValueError(
            f"{where}.weights: expected int8 per channel, or int4 per channel / per group, got num_bits={bits}, "
            f"strategy={strategy!r}, group_size={group_size}"
        )
    if bits == 8 and strategy == "group":
        raise ValueError(f"{where}.weights: int8 weights must be per channel (quant_matmul), got group {group_size}")
    expected_acts = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
    if {k: acts.get(k) for k in expected_acts} != expected_acts:
        raise ValueError(
            f"{where}.input_activations: expected dynamic symmetric int8 per token (what dynamic_quant computes), "
            f"got {acts or None}"
        )
    return (W8A8 if bits == 8 else W4A8), group_size


def _hal_weight(name: str, codes: Tensor, scale: Tensor, kind: str, group_size: int | None) -> StoredQuantWeight:
    """The stored int8 codes [N, K] and scales [N, 1] / [N, G] in the HAL layout (packed int4 along K for W4A8)."""
    if codes.dtype != torch.int8 or codes.dim() != 2:
        raise ValueError(f"{name}: expected int8 codes [N, K], got {codes.dtype} {tuple(codes.shape)}")
    groups = 1 if group_size is None else codes.shape[1] // group_size
    if tuple(scale.shape) != (codes.shape[0], groups):
        raise ValueError(f"{name}_scale: expected shape {(codes.shape[0], groups)}, got {tuple(scale.shape)}")
    scale = (scale[:, 0] if group_size is None else scale).to(torch.float32).contiguous()
    if kind == W8A8:
        return StoredQuantWeight(codes, scale, kind)
    packed = torch.from_numpy(ref.pack_int4(codes.numpy()))  # ValueError for values outside [-8, 7]
    return StoredQuantWeight(packed, scale, kind, group_size)


def load_compressed_tensors(
    directory: str | Path,
    config: ModelConfig | None = None,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> CausalLM:
    """The CausalLM of a compressed-tensors checkpoint with dynamic int8 activations (W8A8 / W4A8, "int-quantized"),
    on the HAL's integer ops, without a float copy of any quantized weight.

    directory: a checkpoint written by `glm5-hal quantize --format compressed-tensors` (or llm-compressor in the
    same scheme). config: default: read from <dir>/config.json. dtype, device: the floating tensors' dtype and the
    model's device (checkpoint.build_quantized_model; None: as stored, CPU). Tensors are read one at a time (each
    int4 weight packed as it is read), names checked from the headers first.
    Raises ValueError naming the key / tensor for what the HAL cannot run as stored: another quantization format or
    scheme (static or float activations, asymmetric weights, per-tensor / block scales), online transforms
    ("transform_config"), a quantized KV cache, zero points.
    """
    directory = Path(directory)
    source = str(directory / CONFIG_FILE)
    hf = read_config_json(directory)
    if not is_compressed_tensors(directory, hf):
        raise ValueError(f"{source}: expected a quantization_config with quant_method {QUANT_METHOD!r}")
    qc = hf["quantization_config"]
    if qc.get("transform_config"):
        raise ValueError(
            f"{source}: quantization_config.transform_config asks for online transforms, which glm5_hal.model does "
            "not apply (QuaRot checkpoints from glm5-hal fold every rotation into the weights)"
        )
    if qc.get("kv_cache_scheme"):
        raise ValueError(f"{source}: quantization_config.kv_cache_scheme (a quantized KV cache) is not supported")
    config = load_config(directory) if config is None else config
    groups = qc.get("config_groups") or {}
    schemes = [
        (_parse_scheme(g, group, qc.get("format"), source), group.get("targets") or []) for g, group in groups.items()
    ]
    ignore = qc.get("ignore") or []
    reader = CheckpointReader(directory)
    sites: dict[str, tuple[str, int | None]] = {}  # quantized weight name -> its scheme
    for site in call_sites(config):
        if _matches(site, ignore):
            continue
        scheme = next((s for s, targets in schemes if _matches(site, targets)), None)
        if scheme is None:
            continue
        if f"{site}.weight_scale" not in reader:
            raise ValueError(
                f"{directory}: {site} is quantized by quantization_config but {site}.weight_scale is missing"
            )
        if f"{site}.weight_zero_point" in reader:
            raise ValueError(f"{directory}: {site}.weight_zero_point: asymmetric weights are not supported")
        sites[f"{site}.weight"] = scheme
    scales = {f"{name}_scale" for name in sites}
    floats = [n for n in reader if n not in sites and n not in scales]
    leftover = sorted(n for n in floats if n.rsplit(".", 1)[-1] in ("weight_scale", "input_scale", "weight_zero_point"))
    if leftover:
        raise ValueError(f"{directory}: quantization parameters of no quantized call site, e.g. {leftover[:3]}")
    quantized = {
        name: _hal_weight(name, reader.read(name), reader.read(f"{name}_scale"), *scheme)
        for name, scheme in sites.items()
    }
    float_state = {name: reader.read(name) for name in floats}
    return build_quantized_model(config, float_state, quantized, directory, dtype=dtype, device=device)


CHECKPOINT_FORMAT = QuantizedCheckpointFormat(FORMAT_NAME, is_compressed_tensors, load_compressed_tensors)
