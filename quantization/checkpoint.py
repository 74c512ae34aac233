"""Quantized checkpoints: the layout machinery every output format shares, and the project's own format.

A format is a `CheckpointLayout`: what one source tensor becomes on disk (a float tensor as it is; a quantized
weight as the format's integer codes and scales), how the safetensors shards are named, and the metadata written
beside them. `save_quantized` (in memory) and quantization/streaming.py (tensor by tensor) write any layout;
quantization/formats/ holds the engine layouts (compressed-tensors for vLLM / SGLang, msModelSlim for vllm-ascend)
and `formats.load_checkpoint` reads each back. This module's layout, `GLM5_HAL_LAYOUT`, is the project's own:

    <dir>/model.safetensors     float tensors as they were (rotated if QuaRot ran); for each quantized linear
                                `X.weight` (int8 [N, K] for w8a8, uint8 [N, K/2] packed int4 for w4a8) and
                                `X.weight_scale` (fp32 [N], or [N, K/group_size] for grouped int4)
      or model-0000i-of-0000n.safetensors + model.safetensors.index.json: the same tensors in shards, with the
                                Hugging Face index ({"metadata": {"total_size"}, "weight_map": {name: file}}), as
                                quantization/streaming.py writes a real-size checkpoint
    <dir>/config.json           the Hugging Face config of the model (glm5_hal.model.hf_config.config_to_hf)
    <dir>/quantization.json     {"format", "version", "config", "scheme", "method", "quarot": {...} | null,
                                 "tensors": {name: {"kind", "dtype", "shape", ...}}, "dropped": [names]}

A tensor's "kind" is "float", "w8a8" or "w4a8" (the weight; with "scale" naming its scale tensor, "in_features"
and "group_size"), or "scale" (with "of" naming its weight). "dropped" names the source tensors left out (the MTP
layers, which glm5_hal.model does not implement). "quarot" (`rotation_metadata`) says which rotations are folded
into the weights and that the model needs no online Hadamard. `load_quantized_model` rebuilds the CausalLM with
QuantLinear / QuantRoutedExperts at the quantized call sites, straight from the stored codes
(`build_quantized_model`, shared by every format's reader): no dequantized (float) copy of a quantized weight is
ever made, so a real GLM-5 loads in its quantized size. Every format is also a `QuantizedCheckpointFormat` at
glm5_hal's `glm5_hal.checkpoint_formats` plugin point (this one: `CHECKPOINT_FORMAT`), so
`CausalLM.from_pretrained(dir)` reads all of them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from glm5_hal.config import ModelConfig
from glm5_hal.model import CausalLM
from glm5_hal.model.checkpoint import (  # reading checkpoints is a model concern; the names stay importable here
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
    stale = sorted(p.name for p in (*directory.glob("*.safetensors"), *directory.glob("*.safetensors.index.json")))
    if stale:
        raise FileExistsError(
            f"out_dir: {directory} already holds a checkpoint ({stale[:3]}); pass a new or empty directory"
        )
    return directory


def rotation_metadata(quarot_seed: int | None) -> dict | None:
    """What every format records about QuaRot (None: no rotation ran). All four rotations and the RMSNorm gains are
    folded into the stored weights, so the quantized model is the Hugging Face graph as it is: an engine applies
    no online Hadamard (none is needed for MLA, as in msModelSlim's rotation of this family)."""
    if quarot_seed is None:
        return None
    return {
        "seed": quarot_seed,
        "folded_norms": True,
        "folded_rotations": {
            "hidden": "Q [hidden_size]: embed_tokens, every reader and writer of the residual stream, lm_head",
            "q_latent": "R_q [q_lora_rank]: q_a_proj rows, q_b_proj and indexer.wq_b columns",
            "kv_latent": "R_kv [kv_lora_rank]: the c_kv rows of kv_a_proj_with_mqa, kv_b_proj columns",
            "v_head": "R_v [v_head_dim], per head: the V rows of kv_b_proj, o_proj columns",
        },
        "online_rotations": [],
        "engine_must_apply": "nothing: no online Hadamard, the rotations are folded into the stored weights",
    }


@dataclass(frozen=True)
class CheckpointInfo:
    """What a layout's metadata records besides the tensors.

    config: the model config. scheme: "w8a8" / "w4a8". method: "rtn" / "gptq". quarot_seed: the QuaRot seed, None
    when no rotation ran. dropped: the source tensors left out (MTP layers).
    """

    config: ModelConfig
    scheme: str
    method: str
    quarot_seed: int | None
    dropped: Sequence[str] = ()


class CheckpointLayout:
    """How one output format stores a quantized checkpoint (subclasses: GLM5_HAL_LAYOUT below, and
    quantization/formats/). Both writers call `store_float` / `store_quantized` per source tensor, write the returned
    tensors into shards named after `file_prefix`, then call `write_metadata` with every stored tensor's entry.

    name: the format's name (`glm5-hal quantize --format`). file_prefix: shards are `<prefix>.safetensors`, or
    `<prefix>-0000i-of-0000n.safetensors` with `<prefix>.safetensors.index.json`. always_indexed: use the sharded
    names and the index even for one shard (msModelSlim does).
    """

    name: str = ""
    file_prefix: str = "model"
    always_indexed: bool = False

    @property
    def index_file(self) -> str:
        return f"{self.file_prefix}.safetensors.index.json"

    def check_group_size(self, group_size: int | None) -> None:
        """ValueError when the format cannot store int4 weights with this group size (None: per channel); the
        writers call it before writing anything."""

    def store_float(self, name: str, value: Tensor) -> dict[str, tuple[Tensor, dict]]:
        """{stored name: (tensor, entry)} for the float source tensor `name` (stored as it is by default)."""
        return {name: (value.contiguous(), float_entry(value))}

    def store_quantized(self, name: str, q: QuantizedWeight) -> dict[str, tuple[Tensor, dict]]:
        """{stored name: (tensor, entry)} for the quantized weight `name` ("...q_a_proj.weight")."""
        raise NotImplementedError

    def write_metadata(self, directory: Path, info: CheckpointInfo, entries: dict[str, dict]) -> None:
        """Write the format's metadata files into `directory`; entries: {stored name: entry} of every tensor."""
        raise NotImplementedError


def float_entry(value: Tensor) -> dict:
    """The quantization.json entry of a tensor stored as it is."""
    return {"kind": "float", "dtype": str(value.dtype).removeprefix("torch."), "shape": list(value.shape)}


def quantized_tensors(name: str, q: QuantizedWeight) -> dict[str, tuple[Tensor, dict]]:
    """What the glm5-hal format stores for the quantized weight `name` ("...q_a_proj.weight"): {stored name: (tensor,
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


def build_description(info: CheckpointInfo, tensors: dict[str, dict]) -> dict:
    """The quantization.json content (module docstring). tensors: {stored name: entry} (float_entry /
    quantized_tensors)."""
    return {
        "format": FORMAT,
        "version": VERSION,
        "config": info.config.name,
        "scheme": info.scheme,
        "method": info.method,
        "quarot": rotation_metadata(info.quarot_seed),
        "activations": "int8 symmetric per token (dynamic_quant)",
        "tensors": dict(sorted(tensors.items())),
        "dropped": sorted(info.dropped),
    }


class _Glm5HalLayout(CheckpointLayout):
    """The project's own format (module docstring)."""

    name = "glm5-hal"

    def store_quantized(self, name: str, q: QuantizedWeight) -> dict[str, tuple[Tensor, dict]]:
        return quantized_tensors(name, q)

    def write_metadata(self, directory: Path, info: CheckpointInfo, entries: dict[str, dict]) -> None:
        (directory / DESCRIPTION_FILE).write_text(json.dumps(build_description(info, entries), indent=1))
        (directory / CONFIG_FILE).write_text(json.dumps(config_to_hf(info.config), indent=2))


GLM5_HAL_LAYOUT: CheckpointLayout = _Glm5HalLayout()


class ShardWriter:
    """Collects a layout's output tensors and writes a shard whenever the next tensor would take it past max_bytes (a
    tensor larger than max_bytes gets a shard of its own). Shards get temporary names until finish() knows their
    count."""

    def __init__(self, directory: Path, layout: CheckpointLayout, max_bytes: int) -> None:
        self.directory, self.layout, self.max_bytes = directory, layout, max_bytes
        self.pending: dict[str, Tensor] = {}
        self.pending_bytes = 0
        self.written: list[tuple[Path, list[str]]] = []  # (temporary file, its tensor names)
        self.total_bytes = 0

    def add(self, name: str, tensor: Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.max_bytes:
            self._flush()
        self.pending[name] = tensor
        self.pending_bytes += size
        self.total_bytes += size

    def _flush(self) -> None:
        path = self.directory / f"{self.layout.file_prefix}-part-{len(self.written) + 1:05d}.safetensors.tmp"
        _safetensors().save_file(self.pending, str(path))
        self.written.append((path, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> list[str]:
        """Write the last shard, give the shards their final names (`<prefix>.safetensors` when there is one and
        the layout allows it; else `<prefix>-0000i-of-0000n.safetensors` and the index) and return the file
        names."""
        if self.pending or not self.written:
            self._flush()
        count, prefix = len(self.written), self.layout.file_prefix
        indexed = count > 1 or self.layout.always_indexed
        names = (
            [f"{prefix}-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
            if indexed
            else [f"{prefix}.safetensors"]
        )
        weight_map: dict[str, str] = {}
        for (path, tensors), final in zip(self.written, names, strict=True):
            path.rename(self.directory / final)
            weight_map.update(dict.fromkeys(tensors, final))
        if indexed:
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
            (self.directory / self.layout.index_file).write_text(json.dumps(index, indent=2))
        return names


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
    layout: CheckpointLayout = GLM5_HAL_LAYOUT,
) -> Path:
    """Write the quantized checkpoint from memory in `layout`'s format (default: the glm5-hal one, see the module
    docstring): one shard of weights, and the layout's metadata (config.json included). float_state: the (rotated)
    floating state dict; its entries named in `quantized` are replaced by their integer codes and scales. dropped:
    source tensor names left out of float_state (MTP layers), recorded in the metadata. Returns the directory;
    FileExistsError when it already holds a checkpoint (prepare_output_dir); ValueError when the layout cannot store
    an int4 group size used (check_group_size)."""
    for group_size in {q.spec.group_size for q in quantized.values() if q.spec.bits == 4}:
        layout.check_group_size(group_size)
    directory = prepare_output_dir(directory)
    writer = ShardWriter(directory, layout, max_bytes=float("inf"))
    entries: dict[str, dict] = {}
    for name in {**float_state, **quantized}:
        q = quantized.get(name)
        stored = layout.store_float(name, float_state[name]) if q is None else layout.store_quantized(name, q)
        for stored_name, (tensor, entry) in stored.items():
            writer.add(stored_name, tensor)
            entries[stored_name] = entry
    writer.finish()
    layout.write_metadata(directory, CheckpointInfo(config, scheme, method, quarot_seed, dropped), entries)
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


@dataclass(frozen=True)
class StoredQuantWeight:
    """One quantized weight in the layout the HAL GEMMs read (what QuantLinear holds), whatever format it came from.

    weight: int8 [N, K] (w8a8), or uint8 [N, K/2] (w4a8: int4 two per byte along K, even k in the low nibble).
    scale: fp32 [N] per channel, or [N, K/group_size]. kind: "w8a8" / "w4a8". group_size: None or the int4 group.
    """

    weight: Tensor
    scale: Tensor
    kind: str
    group_size: int | None = None

    @property
    def in_features(self) -> int:
        return self.weight.shape[1] * (2 if self.kind == W4A8 else 1)


# Weights glm5_hal.model uses as dense float matrices, never through a swappable call site.
_FLOAT_ONLY_WEIGHTS = ("self_attn.kv_b_proj.weight", "mlp.gate.weight")


def build_quantized_model(
    config: ModelConfig,
    float_state: dict[str, Tensor],
    quantized: dict[str, StoredQuantWeight],
    source: str | Path,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> CausalLM:
    """The CausalLM of a quantized checkpoint, with QuantLinear / QuantRoutedExperts (the integer HAL ops) at every
    quantized call site, built without a float copy of any quantized weight (every format's reader ends here).

    float_state: the stored float tensors by checkpoint name. quantized: {weight name ("...q_a_proj.weight"):
    StoredQuantWeight}. source: the checkpoint, for error messages. Both dicts are consumed (emptied): the model
    takes their tensors, and a routed expert's gate and up codes are released once stacked into its gate|up GEMM,
    so the peak is the model plus one expert's stacked pair, not the quantized weights twice.
    dtype: the floating tensors' dtype (None: as given; the FP32_PARAMETERS, the router bias, stay fp32; codes and
    scales are used as given). device: where the model goes (None: where the tensors are).

    The CausalLM is built on the float tensors plus, for each quantized weight, a meta-device placeholder of its
    float shape [N, K] (no storage: loading GLM-5 never allocates its ~1.5 TB of bf16 weights); each call site
    holding a placeholder is then swapped for a module on the codes and scales as given (a routed expert's gate|up
    rows are the gate rows then the up rows of both, codes and scales). A placeholder left over (a quantized tensor
    at no quantized call site), or a quantized kv_b_proj / router gate (glm5_hal.model uses them as dense float
    matrices: kv_b_proj split per head, the router in fp32), is a ValueError naming it.
    """
    float_only = sorted(n for n in quantized if n.endswith(_FLOAT_ONLY_WEIGHTS))
    if float_only:
        raise ValueError(
            f"{source}: {float_only[:3]} are quantized, but glm5_hal.model runs kv_b_proj (absorbed per head) and the "
            "router gate (fp32 logits) in floating point only"
        )
    state: dict[str, Tensor] = {}
    while float_state:  # one tensor converted at a time (the original released as its copy is made)
        name, tensor = float_state.popitem()
        state[name] = tensor if dtype is None or name.endswith(FP32_PARAMETERS) else tensor.to(dtype)
    dtype = state["model.embed_tokens.weight"].dtype
    state.update(
        {n: torch.empty(q.weight.shape[0], q.in_features, dtype=dtype, device="meta") for n, q in quantized.items()}
    )
    model = CausalLM(config, state)
    del state

    def quant_linear(*names: str) -> QuantLinear:
        # Several weights fused into one GEMM (gate then up) stack along N, which is valid as stored because packed
        # int4 bytes and scales are per row.
        kinds = {(quantized[n].kind, quantized[n].group_size) for n in names}
        if len(kinds) != 1:
            raise ValueError(f"{source}: {list(names)} are fused into one GEMM but quantized differently: {kinds}")
        (kind, group_size), parts = kinds.pop(), [quantized.pop(n) for n in names]
        if len(parts) == 1:
            return QuantLinear(parts[0].weight, parts[0].scale, None, kind, group_size)
        weight, scale = torch.cat([p.weight for p in parts]), torch.cat([p.scale for p in parts])
        return QuantLinear(weight, scale, None, kind, group_size)

    linears = [n for n in quantized if ".mlp.experts." not in n]
    expert_blocks = sorted({n.rsplit(".", 3)[0] for n in quantized if ".mlp.experts." in n})
    for name in linears:
        model.replace_module(name.removesuffix(".weight"), quant_linear(name))
    for block in expert_blocks:
        per_expert = [f"{block}.{e}" for e in range(config.n_routed_experts)]
        missing = [
            f"{p}.{proj}.weight"
            for p in per_expert
            for proj in ("gate_proj", "up_proj", "down_proj")
            if f"{p}.{proj}.weight" not in quantized
        ]
        if missing:
            raise ValueError(
                f"{source}: the routed experts of {block} are partly quantized; e.g. {missing[:3]} are not"
            )
        model.replace_module(
            block,
            QuantRoutedExperts(
                [quant_linear(f"{p}.gate_proj.weight", f"{p}.up_proj.weight") for p in per_expert],
                [quant_linear(f"{p}.down_proj.weight") for p in per_expert],
            ),
        )
    check_no_meta_tensors(model, source)
    return model if device is None else model.to(device)


def load_quantized_model(
    directory: str | Path,
    config: ModelConfig | None = None,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> CausalLM:
    """The CausalLM of a glm5-hal-format checkpoint (build_quantized_model: no float copy of a quantized weight).

    directory: written by save_quantized or quantization.streaming (one model.safetensors, or shards with an index).
    config: the model's ModelConfig; default: read from <dir>/config.json.
    dtype, device: the floating tensors' dtype and the model's device (build_quantized_model; None: as stored, CPU).
    The stored int8 / packed int4 codes and fp32 scales are the HAL layout already: used as stored. Tensors are
    read one at a time (glm5_hal.model.checkpoint.CheckpointReader), each into memory of its own (no mapping of the
    files), so the peak is the model plus one routed expert's stacked gate|up codes.
    """
    directory = Path(directory)
    description = read_description(directory)
    config = load_config(directory) if config is None else config
    read = CheckpointReader(directory).read
    entries: dict[str, dict] = description["tensors"]
    quantized = {
        n: StoredQuantWeight(read(n), read(e["scale"]), e["kind"], e["group_size"])
        for n, e in entries.items()
        if e["kind"] in (W8A8, W4A8)
    }
    float_state = {n: read(n) for n, e in entries.items() if e["kind"] == "float"}
    return build_quantized_model(config, float_state, quantized, directory, dtype=dtype, device=device)


def is_glm5_hal_checkpoint(directory: Path, hf_config: dict) -> bool:
    """The glm5-hal format's detection rule: a quantization.json naming this format (one of another tool's, or
    not JSON, is not claimed). hf_config: unused (the plugin point's signature)."""
    path = Path(directory) / DESCRIPTION_FILE
    if not path.is_file():
        return False
    try:
        description = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False
    return isinstance(description, dict) and description.get("format") == FORMAT


@dataclass(frozen=True)
class QuantizedCheckpointFormat:
    """A quantized checkpoint format at glm5_hal's `glm5_hal.checkpoint_formats` plugin point
    (glm5_hal/model/formats.py: name, detect, load), so `CausalLM.from_pretrained` reads its directories; pyproject
    registers one per output format (this module's CHECKPOINT_FORMAT and quantization/formats/'s).

    name: the output format (`glm5-hal quantize --format`). recognises(directory, hf_config): the format's one
    detection rule (metadata files only; False for any other format). reader(directory, config, dtype=, device=):
    the format's reader (a CausalLM on the HAL's integer ops).
    """

    name: str
    recognises: Callable[[Path, dict], bool]
    reader: Callable[..., CausalLM]

    def detect(self, directory: Path, hf_config: dict) -> bool:
        return self.recognises(Path(directory), hf_config)

    def load(
        self, directory: Path, config: ModelConfig | None, *, dtype: torch.dtype | None, device: torch.device | None
    ) -> CausalLM:
        return self.reader(directory, config, dtype=dtype, device=device)


CHECKPOINT_FORMAT = QuantizedCheckpointFormat(GLM5_HAL_LAYOUT.name, is_glm5_hal_checkpoint, load_quantized_model)


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
