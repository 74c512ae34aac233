"""Self-describing quantized checkpoints: the Hugging Face config.json reader / writer (glm5_hal.model.hf_config),
`glm5-hal quantize` on a checkpoint directory without --preset, and `load_quantized_model` building the model
without any dequantized (float) copy of a quantized weight."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from glm5_hal import cli as glm5_cli
from glm5_hal.config import DEEPSEEK_V32, GLM5_MINI, PRESETS, ModelConfig
from glm5_hal.model import CausalLM, random_state_dict
from glm5_hal.model.checkpoint import CheckpointReader
from glm5_hal.model.hf_config import CONFIG_FILE, config_from_hf, config_to_hf, load_config
from quantization import cli, quantizers
from quantization.checkpoint import DESCRIPTION_FILE, check_no_meta_tensors, load_quantized_model
from quantization.experts import QuantRoutedExperts
from quantization.linear import QuantLinear
from quantization.model_quant import quantize_model

SCHEME = "w4a8"  # the mix: W8A8 linears and packed-int4 routed experts both load


def _run_quantize(*argv: str) -> int:
    """`glm5-hal quantize ARGV...` through the real command line (its entry-point plugin included)."""
    return glm5_cli.main(["quantize", *argv])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A Hugging Face-style glm5-mini checkpoint directory: model.safetensors + config.json, no preset involved."""
    import safetensors.torch

    directory = tmp_path_factory.mktemp("hf_checkpoint")
    state = random_state_dict(GLM5_MINI, seed=5)
    safetensors.torch.save_file(state, str(directory / "model.safetensors"))
    (directory / CONFIG_FILE).write_text(json.dumps(config_to_hf(GLM5_MINI)))
    return directory, state


@pytest.fixture(scope="module")
def quantized_dir(checkpoint, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`glm5-hal quantize CHECKPOINT_DIR OUT_DIR` with no --preset (no rotation: the in-memory comparison below
    then needs no QuaRot; test_quantization.py covers the rotated round trip)."""
    out = tmp_path_factory.mktemp("quantized") / "out"
    code = _run_quantize(str(checkpoint[0]), str(out), "--scheme", SCHEME, "--no-rotate", "--eval-tokens", "4")
    assert code == 0
    return out


# ------------------------------------------------------------------------------------------ hf config.json


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_hf_config_round_trips_every_preset(preset: str) -> None:
    cfg = PRESETS[preset]
    hf = json.loads(json.dumps(config_to_hf(cfg)))  # through JSON, as written to disk
    assert config_from_hf(hf) == cfg
    assert config_from_hf(hf, name="other") == cfg.with_overrides(name="other")


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_transformers_to_dict_of_our_config_reads_back(preset: str) -> None:
    """transformers loads our config.json as its own config class; its to_dict() reads back to the preset, also
    when built from the class's declared fields only (the other keys then come from the documented defaults)."""
    transformers = pytest.importorskip("transformers", reason="transformers (test-only dependency) not installed")
    import dataclasses

    cfg = PRESETS[preset]
    hf = config_to_hf(cfg)
    cls = {"glm_moe_dsa": transformers.GlmMoeDsaConfig, "deepseek_v32": transformers.DeepseekV32Config}[
        hf["model_type"]
    ]
    assert config_from_hf(cls(**hf).to_dict()) == cfg
    declared = {f.name for f in dataclasses.fields(cls)}
    assert config_from_hf(cls(**{k: v for k, v in hf.items() if k in declared}).to_dict(), name=cfg.name) == cfg


@pytest.mark.parametrize("model_type", ["glm_moe_dsa", "deepseek_v32"])
def test_missing_keys_take_the_transformers_class_defaults(model_type: str) -> None:
    """A file with only its model_type reads as transformers reads it: the same as its default config's to_dict()."""
    transformers = pytest.importorskip("transformers", reason="transformers (test-only dependency) not installed")
    cls = {"glm_moe_dsa": transformers.GlmMoeDsaConfig, "deepseek_v32": transformers.DeepseekV32Config}[model_type]
    assert config_from_hf({"model_type": model_type}) == config_from_hf(cls().to_dict())


def test_legacy_rope_scaling_keys_of_the_deepseek_checkpoint() -> None:
    """DeepSeek-V3.2's config.json predates rope_parameters: `rope_scaling` {"type": "yarn", ...} + `rope_theta`."""
    hf = config_to_hf(DEEPSEEK_V32)
    rope = hf.pop("rope_parameters")
    hf["rope_theta"] = rope.pop("rope_theta")
    hf["rope_scaling"] = {"type": rope.pop("rope_type")} | rope
    assert config_from_hf(hf) == DEEPSEEK_V32
    assert DEEPSEEK_V32.rope_scaling is not None and config_from_hf(hf).sm_scale == DEEPSEEK_V32.sm_scale


_DROP = object()  # _glm5_mini_hf(key=_DROP): the key is missing from the file


def _glm5_mini_hf(**changes: object) -> dict:
    """glm5-mini's config.json with some keys changed or dropped."""
    hf = config_to_hf(GLM5_MINI)
    for key, value in changes.items():
        if value is _DROP:
            hf.pop(key)
        else:
            hf[key] = value
    return hf


@pytest.mark.parametrize(
    ("hf", "message"),
    [
        (_glm5_mini_hf(model_type=_DROP), "'model_type': expected one of ['glm_moe_dsa', 'deepseek_v32'], got None"),
        (_glm5_mini_hf(model_type="llama"), "'model_type': expected one of ['glm_moe_dsa', 'deepseek_v32']"),
        (
            _glm5_mini_hf(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4}),
            "missing key 'rope_parameters.factor'",
        ),
        (
            _glm5_mini_hf(
                rope_parameters={"rope_type": "yarn", "factor": 40, "original_max_position_embeddings": 4096}
            ),
            "missing key 'rope_parameters.mscale'",
        ),
        (_glm5_mini_hf(rope_parameters={"rope_type": "llama3"}), "'rope_parameters.rope_type': expected one of"),
        (_glm5_mini_hf(hidden_size="256"), "'hidden_size': expected int, got '256'"),
        (_glm5_mini_hf(norm_topk_prob=1), "'norm_topk_prob': expected bool, got 1"),
        (_glm5_mini_hf(q_lora_rank=None), "'q_lora_rank': expected int, got None"),
        (_glm5_mini_hf(hidden_act="gelu"), "'hidden_act': expected 'silu'"),
        (_glm5_mini_hf(scoring_func="relu"), "'scoring_func': expected one of ['sigmoid', 'softmax']"),
        (
            _glm5_mini_hf(num_hidden_layers=6, index_topk_freq=4, index_skip_topk_offset=3),
            "glm5-hal runs every layer's indexer",
        ),
        (_glm5_mini_hf(mlp_layer_types=["sparse", "sparse"]), "'mlp_layer_types': expected ['dense', 'sparse']"),
    ],
)
def test_config_errors_name_the_key_and_the_file(hf: dict, message: str) -> None:
    with pytest.raises(ValueError, match="^somewhere/config.json: ") as info:
        config_from_hf(hf, source="somewhere/config.json")
    assert message in str(info.value)


def test_load_config_reads_a_directory_and_names_the_file(tmp_path: Path) -> None:
    (tmp_path / CONFIG_FILE).write_text(json.dumps(config_to_hf(GLM5_MINI)))
    assert load_config(tmp_path) == GLM5_MINI
    (tmp_path / CONFIG_FILE).write_text(json.dumps(_glm5_mini_hf(rope_parameters={"rope_type": "yarn"})))
    with pytest.raises(ValueError, match="rope_parameters.factor") as info:
        load_config(tmp_path)
    assert str(tmp_path / CONFIG_FILE) in str(info.value)
    with pytest.raises(FileNotFoundError, match=CONFIG_FILE):
        load_config(tmp_path / "missing")


# ------------------------------------------------------------------------------------------ glm5-hal quantize


def test_quantize_reads_the_checkpoint_config_and_writes_one(quantized_dir: Path, capsys) -> None:
    assert {p.name for p in quantized_dir.iterdir()} == {"model.safetensors", DESCRIPTION_FILE, CONFIG_FILE}
    assert load_config(quantized_dir) == GLM5_MINI
    assert json.loads((quantized_dir / DESCRIPTION_FILE).read_text())["config"] == GLM5_MINI.name


def test_preset_overrides_config_json(checkpoint) -> None:
    cfg, source = cli.resolve_config(checkpoint[0], "deepseek-v32")
    assert (cfg, source) == (DEEPSEEK_V32, "--preset deepseek-v32")
    cfg, source = cli.resolve_config(checkpoint[0], None)
    assert cfg == GLM5_MINI and source.endswith(CONFIG_FILE)


def test_quantize_without_config_json_or_preset_is_a_clear_error(checkpoint, tmp_path: Path, capsys) -> None:
    weights = checkpoint[0] / "model.safetensors"
    assert _run_quantize(str(weights), str(tmp_path / "out"), "--eval-tokens", "0") == 2
    err = capsys.readouterr().err
    assert "is not a directory" in err and "--preset" in err and CONFIG_FILE in err
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "model.safetensors").symlink_to(weights)
    assert _run_quantize(str(bare), str(tmp_path / "out"), "--eval-tokens", "0") == 2
    assert f"the directory {bare} has no {CONFIG_FILE}" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------ loading


@pytest.mark.usefixtures("model_backend")
def test_loaded_model_without_config_equals_the_in_memory_quantized_model(checkpoint, quantized_dir: Path) -> None:
    ids = torch.arange(12) * 7 % GLM5_MINI.vocab_size
    own = load_quantized_model(quantized_dir).prefill(ids).logits
    given = load_quantized_model(quantized_dir, GLM5_MINI).prefill(ids).logits
    torch.testing.assert_close(own, given, rtol=0, atol=0)
    expected = CausalLM(GLM5_MINI, checkpoint[1])
    quantize_model(expected, SCHEME)
    torch.testing.assert_close(own, expected.prefill(ids).logits, rtol=0, atol=0)


class _FloatWriteRecorder(TorchDispatchMode):
    """Records every op that writes real (non-meta) floating data, other than a view: (op, its output elements,
    whether it read int8 / uint8 codes). Dequantizing a stored weight is such an op (codes cast or multiplied by
    their scale), and so is allocating a float [N, K] weight, placeholder or not. Reading a stored tensor from the
    file (the buffer CheckpointReader.read allocates and fills) is not recorded: `reading` is set meanwhile."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[tuple[str, int, bool]] = []
        self.reading = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.reading:
            return out
        inputs = [a for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor)]
        outputs = [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor)]
        written = sum(t.numel() for t in outputs if t.is_floating_point() and not t.is_meta)
        if written and not func.is_view:
            reads_codes = any(t.dtype in (torch.int8, torch.uint8) for t in inputs)
            self.writes.append((str(func), written, reads_codes))
        return out


def test_loading_never_materialises_a_dequantized_weight(quantized_dir: Path, monkeypatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("load_quantized_model dequantized a weight")

    monkeypatch.setattr(quantizers, "dequantize", refuse)
    monkeypatch.setattr(quantizers.QuantizedWeight, "dequantize", refuse)
    recorder, real_read = _FloatWriteRecorder(), CheckpointReader.read

    def read(reader: CheckpointReader, name: str, **kwargs: object) -> torch.Tensor:
        recorder.reading = True
        try:
            return real_read(reader, name, **kwargs)
        finally:
            recorder.reading = False

    monkeypatch.setattr(CheckpointReader, "read", read)
    with recorder:
        model = load_quantized_model(quantized_dir)
    entries = json.loads((quantized_dir / DESCRIPTION_FILE).read_text())["tensors"]
    scale_elements = sum(torch.Size(e["shape"]).numel() for e in entries.values() if e["kind"] == "scale")
    # The only float data the loader computes: fp32 scales (a routed expert's gate and up scales concatenated).
    assert not [w for w in recorder.writes if w[2]], recorder.writes
    assert sum(w[1] for w in recorder.writes) <= scale_elements, recorder.writes
    # Every quantized call site holds integer codes, and the model's float tensors are exactly the checkpoint's
    # float ones: not one float element of a quantized weight is held anywhere.
    for name, entry in entries.items():
        if entry["kind"] in ("w8a8", "w4a8"):
            module = model.get_submodule(name.rsplit(".", 3)[0] if ".mlp.experts." in name else name[: -len(".weight")])
            assert isinstance(module, (QuantLinear, QuantRoutedExperts)), (name, type(module))
    tensors = [*model.parameters(), *model.buffers()]
    float_elements = sum(t.numel() for t in tensors if t.is_floating_point())
    checkpoint_float = sum(torch.Size(e["shape"]).numel() for e in entries.values() if e["kind"] == "float")
    assert float_elements == checkpoint_float + scale_elements


def test_a_meta_placeholder_left_over_is_named() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2, device="meta"))
    with pytest.raises(ValueError, match=r"still meta placeholders.*\['0.weight', '0.bias'\]"):
        check_no_meta_tensors(model, "ckpt")


def test_load_without_config_json_names_the_file(quantized_dir: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in ("model.safetensors", DESCRIPTION_FILE):
        (copy / name).symlink_to(quantized_dir / name)
    with pytest.raises(FileNotFoundError, match=str(copy / CONFIG_FILE)):
        load_quantized_model(copy)
    assert isinstance(load_quantized_model(copy, GLM5_MINI).cfg, ModelConfig)
