"""`glm5-hal quantize` on checkpoints too large for memory: per-tensor QuaRot (quarot.rotate_tensor), streaming RTN
quantization shard by shard (quantization/streaming.py) bit for bit equal to the in-memory path, sharded output
read back by load_quantized_model, MTP layers dropped and recorded, and a reader that holds one source tensor at a
time."""

from __future__ import annotations

import json
import weakref
from pathlib import Path

import pytest
import torch

from glm5_hal import cli as glm5_cli
from glm5_hal.config import GLM5_MINI
from glm5_hal.model import CausalLM, random_state_dict
from glm5_hal.model.checkpoint import INDEX_FILE, WEIGHTS_FILE, CheckpointReader, checkpoint_files, load_state_dict
from glm5_hal.model.hf_config import CONFIG_FILE, config_to_hf
from quantization import quarot
from quantization.checkpoint import DESCRIPTION_FILE, load_quantized_model, save_quantized
from quantization.model_quant import quantize_model
from quantization.streaming import StreamingResult, quantize_checkpoint_streaming

CFG = GLM5_MINI
SEED = 4  # QuaRot signs
# Small enough that glm5-mini's quantized output (~5-8 MB) spans several shards, larger than most single tensors.
MAX_SHARD_BYTES = 1 << 20
# A few tensors of GLM-5's MTP layer (model.layers.{num_hidden_layers}.*).
MTP = CFG.num_hidden_layers
MTP_SHAPES = {
    f"model.layers.{MTP}.eh_proj.weight": (CFG.hidden_size, 2 * CFG.hidden_size),
    f"model.layers.{MTP}.enorm.weight": (CFG.hidden_size,),
    f"model.layers.{MTP}.hnorm.weight": (CFG.hidden_size,),
    f"model.layers.{MTP}.input_layernorm.weight": (CFG.hidden_size,),
    f"model.layers.{MTP}.self_attn.q_a_proj.weight": (CFG.q_lora_rank, CFG.hidden_size),
    f"model.layers.{MTP}.shared_head.head.weight": (CFG.vocab_size, CFG.hidden_size),
}


def _save_sharded(state: dict[str, torch.Tensor], directory: Path, shards: int) -> Path:
    """`state` as a Hugging Face checkpoint directory: `shards` safetensors files, the index and config.json."""
    import safetensors.torch

    directory.mkdir(parents=True)
    names = list(state)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = names[i::shards]  # interleaved: every shard holds attention, experts and norms
        safetensors.torch.save_file({n: state[n] for n in part}, str(directory / file))
        weight_map.update(dict.fromkeys(part, file))
    (directory / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (directory / CONFIG_FILE).write_text(json.dumps(config_to_hf(CFG)))
    return directory


def _run_quantize(*argv: str) -> int:
    """`glm5-hal quantize ARGV...` through the real command line (its entry-point plugin included)."""
    return glm5_cli.main(["quantize", *argv])


@pytest.fixture(scope="module")
def state() -> dict[str, torch.Tensor]:
    return random_state_dict(CFG, seed=11)


@pytest.fixture(scope="module")
def checkpoint(state, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save_sharded(state, tmp_path_factory.mktemp("source") / "ckpt", shards=3)


def _in_memory(state: dict[str, torch.Tensor], scheme: str, rotate: bool, out: Path) -> CausalLM:
    """The in-memory path: quarot -> CausalLM -> quantize_model (RTN) -> save_quantized. Returns the model."""
    rotated = quarot.quarot(state, CFG, seed=SEED)[0] if rotate else state
    model = CausalLM(CFG, rotated)
    quantized = quantize_model(model, scheme)
    save_quantized(
        out, rotated, quantized, config=CFG, scheme=scheme, method="rtn", quarot_seed=SEED if rotate else None
    )
    return model


# ------------------------------------------------------------------------------------------ per-tensor QuaRot


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_rotate_tensor_equals_the_whole_dict_quarot_for_every_tensor(dtype: torch.dtype) -> None:
    state = random_state_dict(CFG, seed=3, dtype=dtype)
    whole, rotations = quarot.quarot(state, CFG, seed=SEED)
    gains = {n: v for n, v in state.items() if quarot.is_norm_gain(n)}  # all a tensor's transform may read
    assert len(gains) == 4 * CFG.num_hidden_layers + 1
    for name, value in state.items():
        alone = quarot.rotate_tensor(name, value, gains, CFG, rotations)
        assert alone.dtype == value.dtype and alone.shape == value.shape, name
        torch.testing.assert_close(alone, whole[name], rtol=0, atol=0, msg=name)
    # The two-step form (fold, round, rotate, round) is the same map, up to one extra rounding.
    two_step = quarot.rotate_state_dict(quarot.fold_norms(state, CFG), CFG, rotations)
    eps = torch.finfo(dtype).eps
    for name, value in whole.items():
        assert (two_step[name].double() - value.double()).abs().max() <= 8 * eps * value.double().abs().max(), name
    unchanged = {n for n in state if torch.equal(state[n], whole[n])}
    assert unchanged == {n for n in state if n.endswith(("e_score_correction_bias", "k_norm.weight", "k_norm.bias"))}


def test_row_chunks_do_not_change_the_result(monkeypatch) -> None:
    """Row-independent transforms (fold + input side: embed_tokens, lm_head, every reader) run on row blocks."""
    state = random_state_dict(CFG, seed=3)
    gains = {n: v for n, v in state.items() if quarot.is_norm_gain(n)}
    rotations = quarot.QuaRotRotations.for_config(CFG, SEED)
    names = ["model.embed_tokens.weight", "lm_head.weight", "model.layers.1.mlp.experts.5.up_proj.weight"]
    whole = {n: quarot.rotate_tensor(n, state[n], gains, CFG, rotations) for n in names}
    monkeypatch.setattr(quarot, "ROW_CHUNK_ELEMENTS", 3 * CFG.hidden_size + 1)  # 3 rows per block, ragged tail
    for name in names:
        chunked = quarot.rotate_tensor(name, state[name], gains, CFG, rotations)
        torch.testing.assert_close(chunked, whole[name], rtol=0, atol=0, msg=name)


def test_rotate_tensor_refuses_mtp_unknown_names_and_missing_gains(state) -> None:
    rotations = quarot.QuaRotRotations.for_config(CFG, SEED)
    gains = {n: v for n, v in state.items() if quarot.is_norm_gain(n)}
    eh_proj = f"model.layers.{MTP}.eh_proj.weight"
    with pytest.raises(ValueError, match=rf"{eh_proj}.*MTP layer"):
        quarot.rotate_tensor(eh_proj, torch.zeros(MTP_SHAPES[eh_proj]), gains, CFG, rotations)
    with pytest.raises(ValueError, match="o_proj.bias"):
        quarot.rotate_tensor("model.layers.0.self_attn.o_proj.bias", torch.zeros(CFG.hidden_size), gains, CFG, None)
    del gains["model.layers.1.post_attention_layernorm.weight"]
    with pytest.raises(KeyError, match="model.layers.1.post_attention_layernorm.weight"):
        name = "model.layers.1.mlp.experts.0.gate_proj.weight"
        quarot.rotate_tensor(name, state[name], gains, CFG, rotations)
    # The library-level quarot keeps refusing MTP layers; the command drops them (below).
    with pytest.raises(ValueError, match=rf"layers \[{MTP}\] are MTP layers"):
        quarot.quarot({**state, eh_proj: torch.zeros(MTP_SHAPES[eh_proj])}, CFG)


# ------------------------------------------------------------------------------------------ streaming


@pytest.fixture(scope="module")
def quantized(state, checkpoint: Path, tmp_path_factory: pytest.TempPathFactory):
    """(scheme, rotate) -> (directory holding memory/ and stream/, the in-memory quantized model, the
    StreamingResult): both paths run once per module for each pair."""
    done: dict[tuple[str, bool], tuple[Path, CausalLM, StreamingResult]] = {}

    def get(scheme: str, rotate: bool) -> tuple[Path, CausalLM, StreamingResult]:
        if (scheme, rotate) not in done:
            root = tmp_path_factory.mktemp(f"{scheme}-{'quarot' if rotate else 'plain'}")
            model = _in_memory(state, scheme, rotate, root / "memory")
            result = quantize_checkpoint_streaming(
                checkpoint, root / "stream", CFG, scheme, rotate=rotate, seed=SEED, max_shard_bytes=MAX_SHARD_BYTES
            )
            done[scheme, rotate] = root, model, result
        return done[scheme, rotate]

    return get


@pytest.mark.parametrize("rotate", [True, False], ids=["quarot", "no-rotate"])
@pytest.mark.parametrize("scheme", ["w8a8", "w4a8"])
def test_streaming_equals_the_in_memory_path_bit_for_bit(quantized, scheme: str, rotate: bool) -> None:
    root, _, result = quantized(scheme, rotate)
    streamed, expected = load_state_dict(root / "stream"), load_state_dict(root / "memory")
    assert sorted(streamed) == sorted(expected)
    for name, value in expected.items():
        assert streamed[name].dtype == value.dtype, name
        torch.testing.assert_close(streamed[name], value, rtol=0, atol=0, msg=name)
    description = json.loads((root / "stream" / DESCRIPTION_FILE).read_text())
    assert description == json.loads((root / "memory" / DESCRIPTION_FILE).read_text())
    assert description["dropped"] == [] and result.dropped == []
    # Sharded as asked: several files, all in the index, none over the limit but for a single oversized tensor.
    index = json.loads((root / "stream" / INDEX_FILE).read_text())
    assert len(result.files) > 2 and sorted(set(index["weight_map"].values())) == sorted(result.files)
    assert set(index["weight_map"]) == set(streamed)
    for file in result.files:
        shard = load_state_dict(root / "stream" / file)
        size = sum(t.numel() * t.element_size() for t in shard.values())
        assert size <= MAX_SHARD_BYTES or len(shard) == 1, (file, size)
    kinds = [e["kind"] for e in description["tensors"].values()]
    assert result.quantized == {k: kinds.count(k) for k in ("w8a8", "w4a8") if k in kinds}
    assert result.float_tensors == kinds.count("float")


@pytest.mark.usefixtures("model_backend")
def test_the_loaded_streamed_model_equals_the_in_memory_quantized_model(quantized) -> None:
    root, expected, _ = quantized("w4a8", True)
    assert not (root / "stream" / WEIGHTS_FILE).exists()  # sharded: read through the index
    ids = torch.arange(12) * 7 % CFG.vocab_size
    loaded = load_quantized_model(root / "stream")
    torch.testing.assert_close(loaded.prefill(ids).logits, expected.prefill(ids).logits, rtol=0, atol=0)


def test_one_shard_is_model_safetensors_without_an_index(checkpoint: Path, tmp_path: Path) -> None:
    result = quantize_checkpoint_streaming(checkpoint, tmp_path / "out", CFG, "w8a8", seed=SEED)
    assert result.files == [WEIGHTS_FILE]
    assert {p.name for p in (tmp_path / "out").iterdir()} == {WEIGHTS_FILE, CONFIG_FILE, DESCRIPTION_FILE}
    with pytest.raises(FileExistsError, match="already holds a checkpoint"):
        quantize_checkpoint_streaming(checkpoint, tmp_path / "out", CFG, "w8a8")


def test_the_index_decides_which_files_are_read(checkpoint: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in checkpoint.iterdir():
        (copy / f.name).symlink_to(f)
    (copy / "stray.safetensors").symlink_to(checkpoint_files(checkpoint)[0])  # would duplicate every name in it
    assert checkpoint_files(copy) == [copy / f.name for f in checkpoint_files(checkpoint)]
    assert "stray.safetensors" not in [f.name for f in checkpoint_files(copy)]


def test_mismatched_checkpoints_are_named_before_any_data_is_read(state, tmp_path: Path) -> None:
    missing = {n: v for n, v in state.items() if n != "model.layers.1.self_attn.o_proj.weight"}
    source = _save_sharded(missing, tmp_path / "missing", shards=2)
    with pytest.raises(ValueError, match=rf"checkpoint {source} .*missing 1 parameter.*o_proj"):
        quantize_checkpoint_streaming(source, tmp_path / "out", CFG, "w8a8")
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------ bounded reading


class _Spy:
    """Wraps CheckpointReader.read: counts reads by name and the source tensors alive at any time."""

    def __init__(self, real_read) -> None:
        self.real_read = real_read
        self.reads: dict[str, int] = {}
        self.alive: dict[int, tuple[str, int]] = {}  # id -> (name, bytes) of the source tensors not yet freed
        self.peak_large = 0  # most source tensors of over 4096 elements alive at once
        self.peak_bytes = 0

    def __call__(self, reader: CheckpointReader, name: str, **kwargs) -> torch.Tensor:
        tensor = self.real_read(reader, name, **kwargs)
        self.reads[name] = self.reads.get(name, 0) + 1
        key = id(tensor)
        self.alive[key] = (name, tensor.numel() * tensor.element_size())
        weakref.finalize(tensor, self.alive.pop, key, None)
        self.peak_large = max(self.peak_large, sum(b > 4096 * 4 for _, b in self.alive.values()))
        self.peak_bytes = max(self.peak_bytes, sum(b for _, b in self.alive.values()))
        return tensor


def test_the_reader_holds_one_source_tensor_at_a_time_and_skips_mtp(state, tmp_path: Path, monkeypatch) -> None:
    gen = torch.Generator().manual_seed(0)
    with_mtp = {**state, **{n: torch.randn(s, generator=gen) for n, s in MTP_SHAPES.items()}}
    source = _save_sharded(with_mtp, tmp_path / "ckpt", shards=3)
    spy = _Spy(CheckpointReader.read)
    monkeypatch.setattr(CheckpointReader, "read", lambda reader, name, **kw: spy(reader, name, **kw))
    result = quantize_checkpoint_streaming(source, tmp_path / "out", CFG, "w8a8", max_shard_bytes=MAX_SHARD_BYTES)
    assert spy.reads == dict.fromkeys(state, 1), "every model tensor read exactly once, MTP tensors never"
    assert result.dropped == sorted(MTP_SHAPES)
    # Every large tensor is transformed (rotated, quantized) into a new one, so its source dies at once: never two
    # alive. All bytes alive at once: the largest tensor plus the small ones the pending shard keeps as they are.
    total = sum(v.numel() * v.element_size() for v in state.values())
    largest = max(v.numel() * v.element_size() for v in state.values())
    assert spy.peak_large == 1, spy.peak_large
    assert spy.peak_bytes <= largest + 64 * 1024 < total / 4, (spy.peak_bytes, largest, total)


# ------------------------------------------------------------------------------------------ glm5-hal quantize


@pytest.mark.filterwarnings("ignore:GPTQ.*rank-deficient")  # 2 calibration sequences: fast, not accurate
@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_quantize_drops_mtp_layers_with_a_note(state, tmp_path: Path, capsys, method: str) -> None:
    gen = torch.Generator().manual_seed(0)
    with_mtp = {**state, **{n: torch.randn(s, generator=gen) for n, s in MTP_SHAPES.items()}}
    source = _save_sharded(with_mtp, tmp_path / "ckpt", shards=2)
    argv = [str(source), str(tmp_path / "out"), "--method", method, "--calibration-sequences", "2", "--eval-tokens"]
    assert _run_quantize(*argv, "4") == 0
    out = capsys.readouterr().out
    assert f"dropped {len(MTP_SHAPES)} MTP tensor(s)" in out and "logits SQNR" in out
    description = json.loads((tmp_path / "out" / DESCRIPTION_FILE).read_text())
    assert description["dropped"] == sorted(MTP_SHAPES)
    assert not set(MTP_SHAPES) & set(load_state_dict(tmp_path / "out"))
    assert description["method"] == method
    assert _run_quantize(*argv, "0") == 2  # OUT_DIR holds a checkpoint now: refused, nothing overwritten
    assert "already holds a checkpoint" in capsys.readouterr().err
