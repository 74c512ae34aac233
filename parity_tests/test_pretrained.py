"""CausalLM.from_pretrained: Hugging Face checkpoints (one file, shards with and without an index, bf16 / fp32 /
FP8 block-scaled), the quantized checkpoints of `glm5-hal quantize` through the glm5_hal.checkpoint_formats plugin
point, errors that name the file and tensor, and the peak memory of loading (measured in a fresh process)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import warnings
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest
import torch

import glm5_hal
from glm5_hal import cli as glm5_cli
from glm5_hal.config import GLM5_MINI, ModelConfig
from glm5_hal.model import CausalLM, random_state_dict
from glm5_hal.model import formats as formats_module
from glm5_hal.model.checkpoint import INDEX_FILE, CheckpointReader, read_header
from glm5_hal.model.fp8 import dequantize_fp8_block, scale_name_for
from glm5_hal.model.hf_config import CONFIG_FILE, config_to_hf
from glm5_hal.parity.runner import session_seed
from quantization.checkpoint import load_quantized_model

CFG = GLM5_MINI
FP8_QC = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [16, 32]}


def _seed(offset: int) -> int:
    return (session_seed() + offset) % 2**31


def _write(directory: Path, state: dict[str, torch.Tensor], shards: int = 1, *, index: bool = True, **hf) -> Path:
    """`state` as a checkpoint directory: model.safetensors, or `shards` files (with the Hugging Face index when
    `index`), and config.json (CFG's, updated with `hf`)."""
    import safetensors.torch

    directory.mkdir(parents=True)
    names = list(state)
    if shards == 1:
        safetensors.torch.save_file(state, str(directory / "model.safetensors"))
    else:
        weight_map = {}
        for i in range(shards):
            file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            part = names[i::shards]  # interleaved: experts of one layer land in different files
            safetensors.torch.save_file({n: state[n] for n in part}, str(directory / file))
            weight_map.update(dict.fromkeys(part, file))
        if index:
            (directory / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (directory / CONFIG_FILE).write_text(json.dumps({**config_to_hf(CFG), **hf}))
    return directory


def _assert_same_model(got: CausalLM, want: CausalLM) -> None:
    """The same modules with every parameter and buffer equal (values, dtype, shape): the same model."""
    assert [(n, type(m)) for n, m in got.named_modules()] == [(n, type(m)) for n, m in want.named_modules()]
    got_state, want_state = got.state_dict(), want.state_dict()
    assert list(got_state) == list(want_state)
    for name, value in want_state.items():
        assert got_state[name].dtype == value.dtype and torch.equal(got_state[name], value), name


@pytest.fixture(scope="module")
def bf16_state() -> dict[str, torch.Tensor]:
    return random_state_dict(CFG, seed=_seed(2), dtype=torch.bfloat16)


@pytest.mark.parametrize(
    ("shards", "index"), [(1, True), (3, True), (3, False)], ids=["one-file", "sharded+index", "sharded-no-index"]
)
def test_hf_checkpoint_loads_the_model_it_holds(bf16_state, tmp_path: Path, shards: int, index: bool) -> None:
    directory = _write(tmp_path / "ckpt", bf16_state, shards, index=index)
    model = CausalLM.from_pretrained(directory)
    assert model.dtype == torch.bfloat16 and model.backend is None and model.device == torch.device("cpu")
    _assert_same_model(model, CausalLM(CFG, bf16_state))


def test_dtype_and_backend(bf16_state, tmp_path: Path) -> None:
    directory = _write(tmp_path / "ckpt", bf16_state)
    model = CausalLM.from_pretrained(directory, dtype=torch.float32, backend="reference")
    assert model.backend == "reference"
    _assert_same_model(model, CausalLM(CFG, {n: t.float() for n, t in bf16_state.items()}))
    gate = model.get_submodule("model.layers.1.mlp.gate")
    assert gate.weight.dtype == torch.float32 and gate.e_score_correction_bias.dtype == torch.float32


def test_backend_is_used_by_the_model(bf16_state, tmp_path: Path, monkeypatch) -> None:
    """model.backend selects the backend of every op the model calls, whatever the process-wide selection says."""
    from glm5_hal.ops import common

    directory = _write(tmp_path / "ckpt", bf16_state)
    model = CausalLM.from_pretrained(directory, dtype=torch.float32, backend="reference")
    chosen: list[tuple[str, str]] = []
    real_resolve = common.resolve

    def spy(op: str, device_type: str):
        resolution = real_resolve(op, device_type)
        chosen.append((op, resolution.backend))
        return resolution

    monkeypatch.setattr(common, "resolve", spy)
    with glm5_hal.use_backend("torch"):
        model.prefill([1, 2, 3])
    assert chosen and {backend for _, backend in chosen} == {"reference"}, chosen
    assert {op for op, _ in chosen} >= {"mla_prolog", "lightning_indexer", "sparse_flash_attention", "fused_moe"}


def _fp8_source(state: dict[str, torch.Tensor], block: tuple[int, int]) -> tuple[dict, dict]:
    """(stored, expected): every 2-D projection / expert weight (not the embedding or lm_head) as float8_e4m3fn
    codes + fp32 block scales (amax / 448 per block); expected holds their bf16 dequantization."""
    stored, expected = {}, {}
    for name, value in state.items():
        if value.dim() != 2 or "embed_tokens" in name or name == "lm_head.weight" or name.endswith("mlp.gate.weight"):
            stored[name] = expected[name] = value
            continue
        (n, k), (bn, bk) = value.shape, block
        grid = (-(-n // bn), -(-k // bk))
        padded = torch.zeros(grid[0] * bn, grid[1] * bk)
        padded[:n, :k] = value.float()
        blocks = padded.view(grid[0], bn, grid[1], bk)
        scale = (blocks.abs().amax((1, 3)) / 448).clamp(min=1e-12)
        codes = (blocks / scale[:, None, :, None]).view_as(padded)[:n, :k].to(torch.float8_e4m3fn)
        stored[name], stored[scale_name_for(name)] = codes, scale
        expected[name] = dequantize_fp8_block(codes, scale, block, torch.bfloat16, name=name)
    return stored, expected


def test_fp8_checkpoint_dequantizes_on_read(bf16_state, tmp_path: Path) -> None:
    """Ragged 16 x 32 blocks (glm5-mini's 576-row kv_a_proj and 1024-row q_b_proj are not all multiples)."""
    stored, expected = _fp8_source(bf16_state, (16, 32))
    directory = _write(tmp_path / "fp8", stored, 2, quantization_config=FP8_QC)
    model = CausalLM.from_pretrained(directory)
    assert model.dtype == torch.bfloat16
    _assert_same_model(model, CausalLM(CFG, expected))
    # The float32 model dequantizes each FP8 weight straight to fp32 (one rounding, not via bf16).
    exact = {n: t.float() for n, t in expected.items()}
    for name, value in stored.items():
        if value.dtype == torch.float8_e4m3fn:
            exact[name] = dequantize_fp8_block(value, stored[scale_name_for(name)], (16, 32), torch.float32)
    _assert_same_model(CausalLM.from_pretrained(directory, dtype=torch.float32), CausalLM(CFG, exact))


def test_quantized_checkpoint_loads_through_the_plugin_point(bf16_state, tmp_path: Path) -> None:
    source = _write(tmp_path / "bf16", bf16_state)
    out = tmp_path / "w4a8"
    argv = ["quantize", str(source), str(out), "--scheme", "w4a8", "--eval-tokens", "0"]
    assert glm5_cli.main(argv) == 0
    assert "glm5-hal" in formats_module.registered_formats()  # the pyproject.toml entry point
    model = CausalLM.from_pretrained(out)
    ids = torch.randint(0, CFG.vocab_size, (10,), generator=torch.Generator().manual_seed(_seed(3)))
    want = load_quantized_model(out).prefill(ids).logits
    torch.testing.assert_close(model.prefill(ids).logits, want, rtol=0, atol=0)
    as_fp32 = CausalLM.from_pretrained(out, dtype=torch.float32)
    assert as_fp32.dtype == torch.float32 and as_fp32.prefill(ids).logits.dtype == torch.float32


class _Format:
    """A CheckpointFormat claiming directories that hold a file called `marker`."""

    def __init__(self, name: str, marker: str) -> None:
        self.name, self.marker = name, marker
        self.loaded: list[Path] = []

    def detect(self, directory: Path, hf_config: dict) -> bool:
        return (directory / self.marker).exists()

    def load(self, directory: Path, config: ModelConfig, *, dtype, device) -> CausalLM:
        self.loaded.append(directory)
        return CausalLM(config, random_state_dict(config, seed=0))


def test_plugin_formats_detect_conflict_and_failures(bf16_state, tmp_path: Path, monkeypatch) -> None:
    directory = _write(tmp_path / "ckpt", bf16_state)
    a, b = _Format("format-a", "a.marker"), _Format("format-b", "b.marker")
    monkeypatch.setattr(formats_module, "registered_formats", lambda: {"a": a, "b": b})
    from glm5_hal.model import pretrained

    monkeypatch.setattr(pretrained, "registered_formats", formats_module.registered_formats)
    CausalLM.from_pretrained(directory)  # no marker: the Hugging Face reader
    assert a.loaded == [] and b.loaded == []
    (directory / "a.marker").touch()
    CausalLM.from_pretrained(directory, backend="torch")
    assert a.loaded == [directory]
    (directory / "b.marker").touch()
    with pytest.raises(ValueError, match=r"recognised by several checkpoint formats \(\['format-a', 'format-b'\]\)"):
        CausalLM.from_pretrained(directory)


def test_a_subclass_loads_as_itself_and_a_format_must_build_it(bf16_state, tmp_path: Path, monkeypatch) -> None:
    class Mine(CausalLM):
        pass

    directory = _write(tmp_path / "ckpt", bf16_state)
    assert type(Mine.from_pretrained(directory)) is Mine  # the Hugging Face reader builds the class asked for
    plain = _Format("plain", "plain.marker")  # builds a CausalLM, whatever class asked
    from glm5_hal.model import pretrained

    monkeypatch.setattr(pretrained, "registered_formats", lambda: {"plain": plain})
    (directory / "plain.marker").touch()
    assert type(CausalLM.from_pretrained(directory)) is CausalLM
    refused = r"model_class: the checkpoint format 'plain' built a CausalLM, expected a Mine"
    with pytest.raises(TypeError, match=refused):
        Mine.from_pretrained(directory)


def test_a_broken_format_plugin_is_reported_and_skipped(monkeypatch) -> None:
    eps = [
        EntryPoint("broken", "no_such_module_anywhere:FORMAT", formats_module.CHECKPOINT_FORMAT_ENTRY_POINT_GROUP),
        EntryPoint("not-a-format", "json:dumps", formats_module.CHECKPOINT_FORMAT_ENTRY_POINT_GROUP),
        EntryPoint(
            "quantized", "quantization.checkpoint:CHECKPOINT_FORMAT", formats_module.CHECKPOINT_FORMAT_ENTRY_POINT_GROUP
        ),
    ]
    monkeypatch.setattr(formats_module.importlib.metadata, "entry_points", lambda group: eps)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found = formats_module.registered_formats()
    assert list(found) == ["quantized"]
    messages = [str(w.message) for w in caught]
    assert any("'broken' (no_such_module_anywhere:FORMAT) failed to load" in m for m in messages), messages
    assert any("'not-a-format' (json:dumps) is a function, not a CheckpointFormat" in m for m in messages), messages


def test_mtp_layers_are_skipped(bf16_state, tmp_path: Path) -> None:
    mtp = CFG.num_hidden_layers
    extra = {
        f"model.layers.{mtp}.eh_proj.weight": torch.ones(CFG.hidden_size, 2 * CFG.hidden_size),
        f"model.layers.{mtp}.enorm.weight": torch.ones(CFG.hidden_size),
    }
    directory = _write(tmp_path / "ckpt", {**bf16_state, **extra}, 2)
    _assert_same_model(CausalLM.from_pretrained(directory), CausalLM(CFG, bf16_state))


# ------------------------------------------------------------------------------------------ errors


def test_errors_name_the_file_and_the_tensor(bf16_state, tmp_path: Path) -> None:
    name = "model.layers.1.self_attn.o_proj.weight"
    missing = _write(tmp_path / "missing", {n: t for n, t in bf16_state.items() if n != name}, 2)
    with pytest.raises(ValueError, match=rf"checkpoint {missing}: missing 1 tensor.*'{name}' \(shape \(256, 1024\)\)"):
        CausalLM.from_pretrained(missing)

    wrong = _write(tmp_path / "wrong", {**bf16_state, name: torch.zeros(256, 1000, dtype=torch.bfloat16)}, 2)
    shard = CheckpointReader(wrong).info(name).file
    with pytest.raises(
        ValueError, match=rf"{shard}: tensor '{name}' has shape \(256, 1000\), .* makes it \(256, 1024\)"
    ):
        CausalLM.from_pretrained(wrong)

    stray = _write(tmp_path / "stray", {**bf16_state, "model.layers.0.mlp.extra.weight": torch.ones(2)})
    with pytest.raises(
        ValueError, match=r"model\.safetensors: unexpected tensor 'model\.layers\.0\.mlp\.extra\.weight'"
    ):
        CausalLM.from_pretrained(stray)

    ints = _write(tmp_path / "ints", {**bf16_state, name: torch.zeros(256, 1024, dtype=torch.int8)})
    with pytest.raises(
        ValueError, match=rf"model\.safetensors: tensor '{name}' is torch\.int8 stored; expected a float"
    ):
        CausalLM.from_pretrained(ints)

    stored, _ = _fp8_source(bf16_state, (16, 32))
    unscaled = {n: t for n, t in stored.items() if n != scale_name_for(name)}
    fp8 = _write(tmp_path / "fp8", unscaled, quantization_config=FP8_QC)
    with pytest.raises(ValueError, match=rf"tensor '{name}' is torch\.float8_e4m3fn without its block scales"):
        CausalLM.from_pretrained(fp8)
    no_config = _write(tmp_path / "fp8-no-config", stored)
    with pytest.raises(ValueError, match=r"unexpected tensor '.*_scale_inv'|has no quantization_config"):
        CausalLM.from_pretrained(no_config)
    bad_scale = {**stored, scale_name_for(name): torch.ones(3, 3)}
    fp8_bad = _write(tmp_path / "fp8-bad-scale", bad_scale, quantization_config=FP8_QC)
    with pytest.raises(ValueError, match=rf"^{name}_scale_inv: expected shape \(16, 32\)"):
        CausalLM.from_pretrained(fp8_bad)


def test_errors_for_files_and_arguments(bf16_state, tmp_path: Path) -> None:
    directory = _write(tmp_path / "ckpt", bf16_state, 2)
    with pytest.raises(FileNotFoundError, match="expected a checkpoint directory .* does not exist"):
        CausalLM.from_pretrained(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="is a file"):
        CausalLM.from_pretrained(directory / CONFIG_FILE)
    with pytest.raises(ValueError, match=r"backend: expected one of .*, got 'nope'"):
        CausalLM.from_pretrained(directory, backend="nope")
    with pytest.raises(ValueError, match="dtype: expected a floating torch dtype of 16 bits or more"):
        CausalLM.from_pretrained(directory, dtype=torch.int8)
    other = tmp_path / "other"
    other.mkdir()
    (other / CONFIG_FILE).write_text(json.dumps({**config_to_hf(CFG), "quantization_config": {"quant_method": "awq"}}))
    with pytest.raises(
        ValueError, match=r"quant_method 'awq': no registered checkpoint format reads it \(registered: "
    ):
        CausalLM.from_pretrained(other)

    # The index must agree with the shards.
    index = json.loads((directory / INDEX_FILE).read_text())
    first, shard = next(iter(index["weight_map"].items()))
    index["weight_map"][first] = "model-00002-of-00002.safetensors" if shard.startswith("model-00001") else shard
    index["weight_map"]["model.ghost.weight"] = shard
    (directory / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(ValueError, match=rf"{INDEX_FILE}: maps 2 tensor\(s\) wrongly, e.g. '{first}'"):
        CausalLM.from_pretrained(directory)


def test_reader_takes_another_layouts_index_name(bf16_state, tmp_path: Path) -> None:
    """Engine layouts name their index differently (msModelSlim: quant_model_weights.safetensors.index.json)."""
    directory = _write(tmp_path / "ckpt", bf16_state, 2)
    other = "quant_model_weights.safetensors.index.json"
    (directory / INDEX_FILE).rename(directory / other)
    (directory / "stray.safetensors").write_bytes((directory / "model-00001-of-00002.safetensors").read_bytes())
    with pytest.raises(ValueError, match="is stored twice"):  # without its index, every *.safetensors is read
        CheckpointReader(directory)
    reader = CheckpointReader(directory, index_file=other)
    assert [f.name for f in reader.files] == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert torch.equal(reader.read("model.norm.weight"), bf16_state["model.norm.weight"])


def test_corrupt_and_truncated_files_are_named(bf16_state, tmp_path: Path) -> None:
    directory = _write(tmp_path / "ckpt", bf16_state)
    path = directory / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])  # the last tensor's bytes run past the end
    with pytest.raises(ValueError, match=rf"{path}: tensor '.*': bytes .* a corrupt or truncated file"):
        read_header(path)
    path.write_bytes(b"\xff" * 8 + data[8:])
    with pytest.raises(ValueError, match=rf"{path}: not a safetensors file \(header length"):
        CausalLM.from_pretrained(directory)
    path.write_bytes(data)
    reader = CheckpointReader(directory)
    info = reader.info("model.norm.weight")
    with pytest.raises(ValueError, match=r"out: expected a contiguous CPU torch\.bfloat16 tensor of 256 elements"):
        reader.read("model.norm.weight", out=torch.empty(256))
    assert torch.equal(reader.read(info.name), bf16_state["model.norm.weight"])


# ------------------------------------------------------------------------------------------ peak memory

# glm5-mini with a wider model and 64 experts: ~60M parameters (240 MB in fp32), large enough that the process's
# resident-set noise (a few MB) is small beside it.
MEMORY_CFG = GLM5_MINI.with_overrides(
    name="glm5-memory", hidden_size=512, n_routed_experts=64, moe_intermediate_size=256, vocab_size=32768
)

_MEASURE = textwrap.dedent(
    """
    import json, re, sys
    import torch
    from glm5_hal.model import CausalLM
    from glm5_hal.model.checkpoint import load_state_dict
    from glm5_hal.model.hf_config import load_config

    def status(key):
        return int(re.search(key + r":\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) * 1024

    directory, how = sys.argv[1], sys.argv[2]
    config = load_config(directory)  # imports and config first: the baseline holds them
    # The first meta-device op imports torch's meta registrations (~150 MB of Python modules): before the baseline.
    torch.stack([torch.empty(1, device="meta")]).to(torch.float64)
    open("/proc/self/clear_refs", "w").write("5")  # reset the peak (VmHWM) to the current resident set
    before = status("VmRSS")
    if how == "from_pretrained":
        model = CausalLM.from_pretrained(directory)
    else:  # everything in memory first, then the model (stacking the experts copies them)
        model = CausalLM(config, load_state_dict(directory))
    held = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    print(json.dumps({"peak": status("VmHWM") - before, "after": status("VmRSS") - before, "held": held}))
    """
)


def _measure(directory: Path, how: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(directory), how], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="peak RSS reset needs Linux /proc")
def test_peak_memory_of_loading_is_the_model_plus_one_tensor(tmp_path: Path) -> None:
    import safetensors.torch

    state = random_state_dict(MEMORY_CFG, seed=_seed(4))
    weights = sum(t.numel() * t.element_size() for t in state.values())
    largest = max(t.numel() * t.element_size() for t in state.values())
    directory = tmp_path / "ckpt"
    directory.mkdir()
    safetensors.torch.save_file(state, str(directory / "model.safetensors"))
    (directory / CONFIG_FILE).write_text(json.dumps(config_to_hf(MEMORY_CFG)))
    del state
    streamed = _measure(directory, "from_pretrained")
    in_memory = _measure(directory, "state_dict")
    print(
        f"weights {weights / 2**20:.1f} MiB (largest tensor {largest / 2**20:.1f} MiB): from_pretrained peak "
        f"{streamed['peak'] / 2**20:.1f} MiB, state dict + CausalLM peak {in_memory['peak'] / 2**20:.1f} MiB"
    )
    assert streamed["held"] == weights  # fp32 weights: the model holds exactly the checkpoint's bytes
    # The peak is the model plus one tensor, with 16 MiB for the allocator's and the interpreter's own growth.
    assert streamed["peak"] <= streamed["held"] + largest + 16 * 2**20, streamed
    # The measurement sees a doubled load: the in-memory path holds the file's tensors and the stacked experts.
    assert in_memory["peak"] >= streamed["held"] + 0.3 * weights, in_memory
