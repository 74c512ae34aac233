"""msModelSlim's "ascendv1" format, what vllm-ascend loads with `--quantization ascend` (AscendModelSlimConfig):
the layout msModelSlim 26.1.0's AscendV1Saver writes for W8A8_DYNAMIC linears and W4A8_DYNAMIC (per-channel,
description version "1.0.0") routed experts.

    <dir>/quant_model_weights-0000i-of-0000n.safetensors + quant_model_weights.safetensors.index.json
        (msModelSlim names the shards so even when there is one)
        float tensors under their Hugging Face names (rotated if QuaRot ran), in their own dtype
        W8A8_DYNAMIC  X.weight         int8 [N, K]
                      X.weight_scale   fp32 [N, 1]
                      X.weight_offset  fp32 [N, 1], zeros (symmetric)
        W4A8_DYNAMIC  X.weight         int8 [N/2, K]: int4 codes two per byte along the OUTPUT dim N, row 2i in the
                                       low nibble, row 2i+1 in the high one (msModelSlim's w4a8_pack_int4)
                      X.weight_scale   fp32 [N, 1];  X.weight_offset fp32 [N, 1] zeros
                      X.scale_bias     fp32: 8 * sum_k W[n, k] with W = codes * scale (msModelSlim's
                                       process_scale): [N, 1] for gate / up_proj; [N, 16] for down_proj, one sum per
                                       sixteenth of K (vllm-ascend sums them, or takes 16 / tp of them per rank)
    <dir>/quant_model_description.json   {tensor name: "FLOAT" | "W8A8_DYNAMIC" | "W4A8_DYNAMIC"} for every stored
                                       tensor, plus "version": "1.0.0" (the packed-int4 layout), "group_size": 0
                                       (per-channel int4), "model_quant_type", "metadata": {} (msModelSlim puts
                                       online-rotation info there; QuaRot here is offline only), "optional": {}
    <dir>/config.json                  the model's Hugging Face config (no quantization_config: vllm-ascend is told
                                       `--quantization ascend`) + the glm5-hal provenance

Float call sites (every layer's kv_b_proj, router gate, indexer wk / weights_proj, lm_head, embeddings, norms) are
"FLOAT": vllm-ascend's is_layer_skipped_ascend keeps them unquantized. Only per-channel int4 is written: msModelSlim's
saver has no grouped W4A8 for version 1.0.0 experts, and a grouped checkpoint is refused with a clear error.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor

import ops_reference as ref
from glm5_hal.config import ModelConfig
from glm5_hal.model import CausalLM
from glm5_hal.model.checkpoint import CheckpointReader
from glm5_hal.model.hf_config import load_config
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

FORMAT_NAME = "msmodelslim"
DESCRIPTION_FILE = "quant_model_description.json"
FILE_PREFIX = "quant_model_weights"
DESCRIPTION_VERSION = "1.0.0"  # int4 packed two per int8 along N, scale_bias precomputed
FLOAT, W8A8_DYNAMIC, W4A8_DYNAMIC = "FLOAT", "W8A8_DYNAMIC", "W4A8_DYNAMIC"
_QUANT_TYPES = {W8A8: W8A8_DYNAMIC, W4A8: W4A8_DYNAMIC}
# msModelSlim's process_scale(name, W, tp_num=16): a down_proj's scale_bias holds one sum per K / 16 columns, so
# that tensor parallelism up to 16 can split K (vllm-ascend refuses MoE tp > 16 for this layout).
SCALE_BIAS_SPLITS = 16
# The description's keys that are not tensor names (AscendV1Saver.post_run).
_META_KEYS = ("version", "model_quant_type", "metadata", "group_size", "optional")


def pack_int4_along_n(codes: Tensor) -> Tensor:
    """int4 codes [N, K] (int8 values in [-8, 7], N even) -> int8 [N/2, K]: rows 2i and 2i+1 in the low and high
    nibble of row i (msModelSlim's w4a8_pack_int4: the K-packing of the transpose)."""
    packed = ref.pack_int4(codes.T.numpy())  # [K, N/2] uint8; ValueError for an odd N or values out of range
    return torch.from_numpy(packed).view(torch.int8).T.contiguous()


def unpack_int4_along_n(packed: Tensor) -> Tensor:
    """int8 [N/2, K] -> int4 codes int8 [N, K] (inverse of pack_int4_along_n)."""
    return torch.from_numpy(ref.unpack_int4(packed.T.contiguous().view(torch.uint8).numpy())).T.contiguous()


def scale_bias(name: str, codes: Tensor, scale: Tensor) -> Tensor:
    """msModelSlim's scale_bias of the W4A8 weight `name`: 8 * sum_k W[n, k], W = codes [N, K] * scale [N] in fp32
    (computed as its saver does, so the fp32 sums agree bit for bit): [N, 1] for gate / up_proj, [N, 16] (one sum
    per sixteenth of K) for down_proj."""
    deq = (codes.to(torch.float32).T * scale.to(torch.float32)).T  # AscendV1Saver.on_w4a8_dynamic
    if ".down_proj." in name:
        if deq.shape[1] % SCALE_BIAS_SPLITS:
            raise ValueError(
                f"{name}: msModelSlim's down_proj scale_bias splits K in {SCALE_BIAS_SPLITS}, got K = {deq.shape[1]}"
            )
        per_split = deq.reshape(-1, deq.shape[1] // SCALE_BIAS_SPLITS)
        return (8 * per_split.sum(dim=1, keepdim=True)).reshape(deq.shape[0], -1)
    if ".gate_proj." in name or ".up_proj." in name:
        return 8 * deq.sum(dim=1, keepdim=True)
    raise ValueError(f"{name}: msModelSlim writes W4A8_DYNAMIC for MLP gate / up / down_proj only")


class _MsModelSlimLayout(CheckpointLayout):
    """msModelSlim ascendv1 (module docstring)."""

    name = FORMAT_NAME
    file_prefix = FILE_PREFIX
    always_indexed = True

    def store_float(self, name: str, value: Tensor) -> dict[str, tuple[Tensor, dict]]:
        return {name: (value.contiguous(), {"type": FLOAT, "dtype": str(value.dtype).removeprefix("torch.")})}

    def check_group_size(self, group_size: int | None) -> None:
        if group_size is not None:
            raise ValueError(
                f"group_size: the msModelSlim format stores per-channel int4 only (description version "
                f"{DESCRIPTION_VERSION}, group_size 0), got {group_size}"
            )

    def store_quantized(self, name: str, q: QuantizedWeight) -> dict[str, tuple[Tensor, dict]]:
        kind = W8A8 if q.spec.bits == 8 else W4A8
        quant_type = _QUANT_TYPES[kind]
        self.check_group_size(q.spec.group_size)
        base, scale = name.removesuffix(".weight"), q.scale[:, :1].to(torch.float32).contiguous()
        weight = q.codes.contiguous() if kind == W8A8 else pack_int4_along_n(q.codes)
        stored = {
            name: (weight, {"type": quant_type}),
            f"{base}.weight_scale": (scale, {"type": quant_type}),
            f"{base}.weight_offset": (torch.zeros_like(scale), {"type": quant_type}),
        }
        if kind == W4A8:
            stored[f"{base}.scale_bias"] = (scale_bias(name, q.codes, scale[:, 0]), {"type": quant_type})
        return stored

    def write_metadata(self, directory: Path, info: CheckpointInfo, entries: dict[str, dict]) -> None:
        description: dict[str, object] = {name: entry["type"] for name, entry in sorted(entries.items())}
        types = {entry["type"] for entry in entries.values()}
        description.update(
            {
                "version": DESCRIPTION_VERSION,
                # AscendV1Saver's choice: W8A8_DYNAMIC outranks FLOAT, and W4A8_DYNAMIC is never the model's type.
                "model_quant_type": W8A8_DYNAMIC if types & {W8A8_DYNAMIC, W4A8_DYNAMIC} else FLOAT,
                "metadata": {},
                "group_size": 0,
                "optional": {},
            }
        )
        (directory / DESCRIPTION_FILE).write_text(json.dumps(description, indent=4))
        write_engine_config(directory, engine_config(info, entries, FORMAT_NAME))


MSMODELSLIM_LAYOUT: CheckpointLayout = _MsModelSlimLayout()


def is_msmodelslim(directory: Path, hf_config: dict) -> bool:
    """The format's detection rule: the directory holds quant_model_description.json (hf_config: unused)."""
    return (Path(directory) / DESCRIPTION_FILE).is_file()


def load_msmodelslim(
    directory: str | Path,
    config: ModelConfig | None = None,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> CausalLM:
    """The CausalLM of an msModelSlim ascendv1 checkpoint (W8A8_DYNAMIC, per-channel W4A8_DYNAMIC v1.0.0, FLOAT),
    on the HAL's integer ops, without a float copy of any quantized weight.

    directory: written by `glm5-hal quantize --format msmodelslim` (or msModelSlim with these types and no extra
    tensors such as smoothing scales). config: default: read from <dir>/config.json. dtype, device: the floating
    tensors' dtype and the model's device (checkpoint.build_quantized_model; None: as stored, CPU). Tensors are
    read one at a time, the description checked against the shards' headers first.
    Raises ValueError naming the key / tensor for another description version, per-group int4, other quant types
    (static W8A8, W4A4, ...), non-zero weight offsets (asymmetric weights).
    """
    directory = Path(directory)
    path = directory / DESCRIPTION_FILE
    description = json.loads(path.read_text())
    tensor_types = {k: v for k, v in description.items() if k not in _META_KEYS and isinstance(v, str)}
    quant_types = set(tensor_types.values()) - {FLOAT}
    version = description.get("version")
    if quant_types and version != DESCRIPTION_VERSION:
        raise ValueError(f"{path}: 'version': expected {DESCRIPTION_VERSION!r} (int4 packed along N), got {version!r}")
    group_size = description.get("group_size", 256)  # vllm-ascend's default when the key is absent
    if W4A8_DYNAMIC in quant_types and group_size != 0:
        raise ValueError(f"{path}: 'group_size': expected 0 (per-channel int4), got {group_size!r}")
    unsupported = sorted(quant_types - {W8A8_DYNAMIC, W4A8_DYNAMIC})
    if unsupported:
        raise ValueError(f"{path}: quant types {unsupported} are not supported (W8A8_DYNAMIC, W4A8_DYNAMIC, FLOAT)")
    config = load_config(directory) if config is None else config
    reader = CheckpointReader(directory, index_file=f"{FILE_PREFIX}.safetensors.index.json")
    described, held = set(tensor_types), set(reader)
    if held != described:
        raise ValueError(
            f"{path}: describes {len(described)} tensors but the weights hold {len(held)}; e.g. undescribed "
            f"{sorted(held - described)[:3]}, missing {sorted(described - held)[:3]}"
        )
    quantized: dict[str, StoredQuantWeight] = {}
    parameters: set[str] = set()  # the quantized weights' companions (scale, offset, scale_bias)
    for name, quant_type in tensor_types.items():
        if quant_type == FLOAT or not name.endswith(".weight"):
            continue
        base = name.removesuffix(".weight")
        companions = [f"{base}.weight_scale", f"{base}.weight_offset"]
        if quant_type == W4A8_DYNAMIC:
            companions.append(f"{base}.scale_bias")  # a kernel-side sum of the weights; the HAL ops do not need it
        parameters.update(companions)
        if torch.count_nonzero(reader.read(f"{base}.weight_offset")):
            raise ValueError(f"{base}.weight_offset: expected zeros (symmetric weights)")
        weight, scale = reader.read(name), reader.read(f"{base}.weight_scale")
        if quant_type == W4A8_DYNAMIC:
            weight = torch.from_numpy(ref.pack_int4(unpack_int4_along_n(weight).numpy()))
        kind = W8A8 if quant_type == W8A8_DYNAMIC else W4A8
        quantized[name] = StoredQuantWeight(weight, scale.reshape(-1).to(torch.float32), kind)
    float_state = {name: reader.read(name) for name in reader if name not in quantized and name not in parameters}
    return build_quantized_model(config, float_state, quantized, directory, dtype=dtype, device=device)


CHECKPOINT_FORMAT = QuantizedCheckpointFormat(FORMAT_NAME, is_msmodelslim, load_msmodelslim)
