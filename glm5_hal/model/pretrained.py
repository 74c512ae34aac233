"""`CausalLM.from_pretrained`: a checkpoint directory -> a ready model, streamed tensor by tensor.

    model = CausalLM.from_pretrained("path/to/GLM-5", dtype=torch.bfloat16, device="cuda", backend="triton")

The directory holds config.json and the weights. A format registered at the plugin point (formats.py, e.g. the
quantized checkpoints of `glm5-hal quantize`) that recognises it builds the model; otherwise it is read as a
Hugging Face checkpoint: one model.safetensors or shards (with or without model.safetensors.index.json), floating
(bf16 / fp16 / fp32) or FP8 block-scaled (config.json's quantization_config; glm5_hal/model/fp8.py), each FP8
weight dequantized as it is read.

Streaming. The model is first built on the meta device (shapes, no storage), then every parameter gets its
storage on the target device and is filled from the checkpoint, one source tensor at a time: a tensor of the
right dtype is read straight into its place (each routed expert into its slot of the layer's stacked w13 / w2),
others (another dtype, FP8, another device) through one temporary. Peak memory is the model plus the largest
source tensor (plus an FP8 weight's fp32 dequantization buffer), never the checkpoint twice.

Checks before any data is read, from the headers alone: every parameter of config.json's model is present with
its shape, no tensor is left over, FP8 weights come with their scales. A ValueError names the file and tensor.
Multi-token-prediction layers (`model.layers.{i}.*`, i >= num_hidden_layers: GLM-5's layer 78) are not part of
the model and are skipped, as transformers skips them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor, nn

from glm5_hal.config import ModelConfig
from glm5_hal.model.checkpoint import CheckpointReader
from glm5_hal.model.decoder import DecoderModel
from glm5_hal.model.formats import CheckpointFormat, detect_format, registered_formats
from glm5_hal.model.fp8 import (
    QUANT_METHOD,
    dequantize_fp8_block,
    fp8_block_size,
    is_float8_dtype,
    is_fp8_scale_name,
    scale_name_for,
    weight_name_for,
)
from glm5_hal.model.hf_config import CONFIG_FILE, load_config, read_config_json
from glm5_hal.model.weights import FP32_PARAMETERS, is_mtp_tensor, parameter_shapes
from glm5_hal.registry import registry


def from_pretrained(
    path: str | Path,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    backend: str | None = None,
    model_class: type[DecoderModel],
) -> DecoderModel:
    """The model of a checkpoint directory (module docstring): a `model_class` (causal_lm.CausalLM).

    Args:
        path: a directory with config.json (GLM-5 `glm_moe_dsa` or DeepSeek-V3.2 `deepseek_v32`) and the weights.
        dtype: the model's floating dtype (bf16, fp16, fp32; float64 for verification); None: the checkpoint's
            (an FP8 checkpoint's floating tensors, bf16 for the released ones). The router bias stays fp32.
        device: where the weights and the cache live (default "cpu").
        backend: the glm5_hal backend every op of this model runs on (`model.backend`); None: the usual
            selection (GLM5_HAL_BACKEND, `use_backend`, auto).
        model_class: the class built, called as model_class(config, state_dict) (CausalLM.from_pretrained passes
            its own class). A registered format builds its model itself; it must be a model_class.

    Raises:
        FileNotFoundError: no such directory, no config.json or no safetensors file in it.
        ValueError: config.json describes something the model does not implement (naming the key), a missing,
            misshapen, unexpected or undecodable tensor (naming the file and tensor), an unknown or unavailable
            backend, a non-floating dtype, or a quantization_config no registered format reads.
    """
    directory = Path(path)
    if not directory.is_dir():
        raise FileNotFoundError(
            f"path: expected a checkpoint directory ({CONFIG_FILE} + *.safetensors), got {str(path)!r}, which "
            f"{'is a file' if directory.exists() else 'does not exist'}"
        )
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point or dtype.itemsize < 2):
        raise ValueError(f"dtype: expected a floating torch dtype of 16 bits or more, or None, got {dtype!r}")
    if backend is not None:
        _check_backend(backend)
    config = load_config(directory)
    hf_config = read_config_json(directory)
    formats = registered_formats()
    fmt = detect_format(directory, hf_config, formats) or _HuggingFaceFormat(hf_config, formats, model_class)
    model = fmt.load(directory, config, dtype=dtype, device=torch.device("cpu" if device is None else device))
    if not isinstance(model, model_class):
        raise TypeError(
            f"model_class: the checkpoint format {fmt.name!r} built a {type(model).__name__}, expected a "
            f"{model_class.__name__}"
        )
    model.backend = backend
    return model


def _check_backend(name: str) -> None:
    known = registry().names()
    if name not in known:
        raise ValueError(f"backend: expected one of {known}, got {name!r}")
    availability = registry().availability(name)
    if not availability.available:
        raise ValueError(f"backend: {name!r} is unavailable here: {availability.reason}")


class _HuggingFaceFormat:
    """config.json + safetensors with Hugging Face names, floating or FP8 block-scaled (the fallback format)."""

    name = "huggingface"

    def __init__(self, hf_config: dict, others: dict[str, CheckpointFormat], model_class: type[DecoderModel]) -> None:
        self.hf_config = hf_config  # the parsed config.json
        self.others = others  # named in the error for a quantization_config this reader does not read
        self.model_class = model_class

    def detect(self, directory: Path, hf_config: dict) -> bool:
        return True

    def load(self, directory: Path, config: ModelConfig, *, dtype: torch.dtype | None, device: torch.device):
        hf_config = self.hf_config
        qc = hf_config.get("quantization_config")
        method = qc.get("quant_method", QUANT_METHOD) if isinstance(qc, dict) else QUANT_METHOD
        if method != QUANT_METHOD:  # (a quantization_config that is not a dict: fp8_block_size names it below)
            raise ValueError(
                f"{directory / CONFIG_FILE}: quantization_config.quant_method {method!r}: no registered checkpoint "
                f"format reads it (registered: {sorted(self.others) or 'none'}; built in: floating and FP8 "
                f"block-scaled Hugging Face checkpoints)"
            )
        block = fp8_block_size(hf_config)
        reader = CheckpointReader(directory)
        _check_tensors(reader, config, block, directory)
        stored = reader.info("model.embed_tokens.weight").dtype
        dtype = dtype or (stored if not is_float8_dtype(stored) else torch.bfloat16)
        return _stream_into_model(self.model_class, reader, config, dtype, device, block)


def _check_tensors(reader: CheckpointReader, config: ModelConfig, block: tuple[int, int] | None, where: Path) -> None:
    """Names, shapes and dtypes from the headers against config's model (module docstring: Checks)."""
    shapes = parameter_shapes(config)
    missing = [name for name in shapes if name not in reader]
    if missing:
        raise ValueError(
            f"checkpoint {where}: missing {len(missing)} tensor(s) of the model in {CONFIG_FILE}, e.g. "
            f"{missing[0]!r} (shape {shapes[missing[0]]}); files read: {[f.name for f in reader.files]}"
        )
    for name, shape in shapes.items():
        info = reader.info(name)
        if info.shape != shape:
            raise ValueError(
                f"{info.file}: tensor {name!r} has shape {info.shape}, but {CONFIG_FILE} ({config.name!r}) makes "
                f"it {shape}"
            )
        dtype = info.dtype
        scaled = block is not None and scale_name_for(name) in reader
        if scaled and not is_float8_dtype(dtype):
            raise ValueError(f"{info.file}: tensor {name!r} has FP8 block scales but dtype {dtype}, not float8")
        if not scaled and (not dtype.is_floating_point or is_float8_dtype(dtype)):
            why = "without its block scales " + repr(scale_name_for(name)) if is_float8_dtype(dtype) else "stored"
            raise ValueError(
                f"{info.file}: tensor {name!r} is {dtype} {why}; expected a floating tensor"
                + ("" if block is not None else f" ({CONFIG_FILE} has no quantization_config)")
            )
    for name in reader:
        if name in shapes or is_mtp_tensor(name, config):
            continue
        if block is not None and is_fp8_scale_name(name) and weight_name_for(name) in shapes:
            continue
        raise ValueError(
            f"{reader.info(name).file}: unexpected tensor {name!r}: not a parameter of the model in {CONFIG_FILE} "
            f"({config.name!r}, {config.num_hidden_layers} layers)"
        )


def _skeleton(model_class: type[DecoderModel], config: ModelConfig, dtype: torch.dtype) -> DecoderModel:
    """The model on the meta device (no storage): parameters of `dtype`, the FP32_PARAMETERS in fp32."""
    state = {
        name: torch.empty(
            shape, dtype=torch.float32 if name.endswith(FP32_PARAMETERS) else dtype, device=torch.device("meta")
        )
        for name, shape in parameter_shapes(config).items()
    }
    return model_class(config, state)


# One region of a model tensor and the checkpoint tensor that fills it: (checkpoint name, dest -> its region).
Source = tuple[str, Callable[[Tensor], Tensor]]


def _sources(name: str, config: ModelConfig) -> list[Source]:
    """The checkpoint tensors of model tensor `name`: itself, or for a layer's stacked routed experts
    (RoutedExperts: w13 [E, 2I, D] = per expert gate rows then up rows, w2 [E, D, I]) each expert's matrices."""
    block, _, leaf = name.rpartition(".")
    if block.endswith(".mlp.experts") and leaf in ("w13", "w2"):
        inter = config.moe_intermediate_size
        if leaf == "w2":
            return [(f"{block}.{e}.down_proj.weight", lambda d, e=e: d[e]) for e in range(config.n_routed_experts)]
        return [
            source
            for e in range(config.n_routed_experts)
            for source in (
                (f"{block}.{e}.gate_proj.weight", lambda d, e=e: d[e, :inter]),
                (f"{block}.{e}.up_proj.weight", lambda d, e=e: d[e, inter:]),
            )
        ]
    return [(name, lambda d: d)]


def _read_into(reader: CheckpointReader, name: str, dest: Tensor, block: tuple[int, int] | None) -> None:
    """Fill dest (a contiguous model tensor or region of one) with checkpoint tensor `name`, converting dtype /
    device and dequantizing FP8 on the way."""
    if block is not None and scale_name_for(name) in reader:
        weight, scale = reader.read(name), reader.read(scale_name_for(name))
        dest.copy_(dequantize_fp8_block(weight, scale, block, dest.dtype, name=name))
    elif dest.device.type == "cpu" and reader.info(name).dtype == dest.dtype:
        reader.read(name, out=dest)  # straight into place: no temporary
    else:
        dest.copy_(reader.read(name))


def _stream_into_model(
    model_class: type[DecoderModel],
    reader: CheckpointReader,
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    block: tuple[int, int] | None,
) -> DecoderModel:
    """The meta skeleton, each of its tensors given storage on `device` and filled from `reader`."""
    model = _skeleton(model_class, config, dtype)
    filled: dict[int, Tensor] = {}  # id(meta tensor) -> its storage, for a tensor registered at two paths
    for module_name, module in model.named_modules(remove_duplicate=False):
        for table in (module._parameters, module._buffers):
            for leaf, meta in table.items():
                if meta is None:
                    continue
                if id(meta) not in filled:
                    dest = torch.empty(meta.shape, dtype=meta.dtype, device=device)
                    for source, region in _sources(f"{module_name}.{leaf}" if module_name else leaf, config):
                        _read_into(reader, source, region(dest), block)
                    filled[id(meta)] = dest
                dest = filled[id(meta)]
                table[leaf] = nn.Parameter(dest, requires_grad=False) if isinstance(meta, nn.Parameter) else dest
    return model
