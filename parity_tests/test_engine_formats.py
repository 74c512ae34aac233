"""`glm5-hal quantize --format {compressed-tensors,msmodelslim}`: the engine layouts checked with the engines' own
code, and read back by glm5_hal.model into the very model the glm5-hal format gives.

- compressed-tensors: the package's own decompressor (CompressedTensorsDequantizer, on CPU) must give every weight
  exactly as glm5-hal dequantizes it, and its own matcher must put every call site in the intended group / ignore.
- msModelSlim: its own saver helpers (w4a8_pack_int4, process_scale from the published wheel) must produce the
  stored int4 bytes and scale_bias exactly; the description must name every tensor.
- vLLM / vllm-ascend loaders (not installable on a CPU CI: vLLM wheels pull a CUDA torch, vllm-ascend needs CANN):
  run when their files are importable (docs/quantization.md says how), skipped with the reason otherwise.
- Round trip: each format loads back to bit-identical logits.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import sys
import types
from pathlib import Path

import pytest
import torch

from glm5_hal import cli as glm5_cli
from glm5_hal.config import GLM5_MINI
from glm5_hal.model import formats as formats_module
from glm5_hal.model import random_state_dict
from glm5_hal.model.hf_config import CONFIG_FILE, config_to_hf
from quantization import quarot
from quantization.checkpoint import StoredQuantWeight, build_quantized_model, load_state_dict, save_quantized
from quantization.formats import FORMATS, detect_format, layout_for, load_checkpoint
from quantization.formats import compressed_tensors as ct_format
from quantization.formats import msmodelslim as ms_format
from quantization.linear import W4A8, W8A8
from quantization.model_quant import linear_scheme, quantize_model
from quantization.quantizers import dequantize
from quantization.streaming import quantize_checkpoint_streaming

CFG = GLM5_MINI
SEED = 4
SCHEMES = ("w8a8", "w4a8")
ENGINE_FORMATS = ("compressed-tensors", "msmodelslim")
GROUP_SIZE = 32  # grouped int4: compressed-tensors only (msModelSlim's layout is per channel)


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Hugging Face-style glm5-mini checkpoint directory (bf16, as released checkpoints are)."""
    import safetensors.torch

    directory = tmp_path_factory.mktemp("engine_source")
    safetensors.torch.save_file(
        random_state_dict(CFG, seed=SEED, dtype=torch.bfloat16), str(directory / "m.safetensors")
    )
    (directory / CONFIG_FILE).write_text(json.dumps(config_to_hf(CFG)))
    return directory


@pytest.fixture(scope="module")
def written(source: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    """{(format, scheme): directory} written by the streaming path (QuaRot + RTN), plus ("compressed-tensors",
    "w4a8-g32"): grouped int4 experts."""
    root = tmp_path_factory.mktemp("engine_formats")
    out: dict[tuple[str, str], Path] = {}
    for fmt in FORMATS:
        for scheme in SCHEMES:
            out[fmt, scheme] = root / f"{fmt}-{scheme}"
            quantize_checkpoint_streaming(source, out[fmt, scheme], CFG, scheme, seed=SEED, layout=layout_for(fmt))
    for fmt in ("glm5-hal", "compressed-tensors"):
        out[fmt, "w4a8-g32"] = root / f"{fmt}-w4a8-g32"
        quantize_checkpoint_streaming(
            source, out[fmt, "w4a8-g32"], CFG, "w4a8", seed=SEED, group_size=GROUP_SIZE, layout=layout_for(fmt)
        )
    return out


def _reference_weights(directory: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor, str]]:
    """{weight name: (int codes [N, K], scales [N, G], kind)} read from a glm5-hal-format directory."""
    import ops_reference as ref

    description = json.loads((directory / "quantization.json").read_text())["tensors"]
    stored = load_state_dict(directory)
    weights = {}
    for name, entry in description.items():
        if entry["kind"] in (W8A8, W4A8):
            codes = stored[name]
            if entry["kind"] == W4A8:
                codes = torch.from_numpy(ref.unpack_int4(codes.numpy()))
            scale = stored[entry["scale"]]
            weights[name] = (codes, scale.reshape(codes.shape[0], -1), entry["kind"])
    return weights


def _call_site_kinds(config=CFG, scheme: str = "w4a8") -> dict[str, str | None]:
    """{call site: "w8a8" / "w4a8" / None} as quantize_model assigns them."""
    kinds = {}
    for site in ct_format.call_sites(config):
        block = site.rsplit(".", 2)[0] if ".mlp.experts." in site else site
        kinds[site] = linear_scheme(block, scheme)
    return kinds


# ------------------------------------------------------------------------------------------ compressed-tensors


@pytest.mark.parametrize("variant", ["w8a8", "w4a8", "w4a8-g32"])
def test_compressed_tensors_package_decompresses_every_weight_exactly(written, variant: str) -> None:
    ct = pytest.importorskip("compressed_tensors", reason="compressed-tensors (test extra) is not installed")
    from compressed_tensors.entrypoints.convert.converters import CompressedTensorsDequantizer

    directory = written["compressed-tensors", variant]
    stored = load_state_dict(directory)
    # validate(): decompress every targeted module and fail on any quantization parameter left over.
    decompressed = CompressedTensorsDequantizer(directory, dtype=torch.float32).validate(dict(stored))
    reference = _reference_weights(written["glm5-hal", variant])
    assert reference, "the glm5-hal checkpoint holds no quantized weight"
    for name, (codes, scale, _) in reference.items():
        expected = dequantize(codes, scale, torch.float32)
        assert decompressed[name].dtype == torch.float32, name
        torch.testing.assert_close(decompressed[name], expected, rtol=0, atol=0, msg=name)
        assert stored[name].dtype == torch.int8 and torch.equal(stored[name], codes), name
    floats = [n for n in stored if not n.endswith("weight_scale") and n not in reference]
    for name in floats:
        assert torch.equal(decompressed[name], stored[name]), name
    assert set(decompressed) == {*floats, *reference}
    qc = json.loads((directory / CONFIG_FILE).read_text())["quantization_config"]
    assert qc["version"] == ct_format.SCHEMA_VERSION and ct.__version__.startswith("0.20.")


def test_compressed_tensors_matcher_assigns_every_call_site_to_its_scheme(written) -> None:
    pytest.importorskip("compressed_tensors", reason="compressed-tensors (test extra) is not installed")
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.utils.match import match_name

    hf = json.loads((written["compressed-tensors", "w4a8"] / CONFIG_FILE).read_text())
    config = QuantizationConfig.model_validate(hf["quantization_config"])
    assert config.format == "int-quantized" and config.quantization_status == "compressed"
    for site, kind in _call_site_kinds().items():
        ignored = any(match_name(site, target) for target in config.ignore)
        groups = [g for g, s in config.config_groups.items() if any(match_name(site, t) for t in s.targets)]
        if kind is None:
            assert ignored and not groups, site
            continue
        assert not ignored and len(groups) == 1, (site, groups)
        scheme = config.config_groups[groups[0]]
        assert scheme.weights.num_bits == (8 if kind == W8A8 else 4) and scheme.weights.strategy == "channel", site
        acts = scheme.input_activations
        assert (acts.num_bits, acts.type, acts.strategy, acts.dynamic, acts.symmetric) == (
            8,
            "int",
            "token",
            True,
            True,
        )
    assert hf["quantization_config"]["transform_config"] == {}  # no online transform for the engine to apply
    assert hf["glm5_hal_quantization"]["quarot"]["online_rotations"] == []


# ------------------------------------------------------------------------------------------ msModelSlim


def _msmodelslim_pack_module():
    """msModelSlim's saver helpers (msmodelslim/core/quant_service/modelslim_v1/save/utils/pack.py), loaded from the
    installed wheel by file: importing the msmodelslim package would patch torch (msmodelslim/__init__.py)."""
    spec = importlib.util.find_spec("msmodelslim")  # finds the package without running its __init__
    if spec is None:
        pytest.skip("msmodelslim (test extra) is not installed")
    root = Path(spec.submodule_search_locations[0])
    path = root / "core" / "quant_service" / "modelslim_v1" / "save" / "utils" / "pack.py"
    spec = importlib.util.spec_from_file_location("_msmodelslim_pack", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_msmodelslim_saver_helpers_produce_the_stored_int4_and_scale_bias(written) -> None:
    pack = _msmodelslim_pack_module()
    stored = load_state_dict(
        written["msmodelslim", "w4a8"], index_file=f"{ms_format.FILE_PREFIX}.safetensors.index.json"
    )
    reference = _reference_weights(written["glm5-hal", "w4a8"])
    int4 = {n: r for n, r in reference.items() if r[2] == W4A8}
    assert len(int4) == 3 * CFG.n_routed_experts * (CFG.num_hidden_layers - CFG.first_k_dense_replace)
    for name, (codes, scale, _) in int4.items():
        base = name.removesuffix(".weight")
        # AscendV1Saver.on_w4a8_dynamic, step by step, on glm5-hal's codes and scales.
        expected = pack.w4a8_pack_int4(codes.to(torch.int8))
        deq_weight = codes.to(torch.float32).T * scale[:, 0]
        expected_bias = pack.process_scale(base, deq_weight.T, ms_format.SCALE_BIAS_SPLITS)
        assert stored[name].dtype == torch.int8 and torch.equal(stored[name], expected), name
        assert torch.equal(stored[f"{base}.weight_scale"], scale[:, :1]), name
        assert torch.equal(stored[f"{base}.weight_offset"], torch.zeros_like(scale[:, :1])), name
        assert stored[f"{base}.scale_bias"].dtype == torch.float32, name
        torch.testing.assert_close(stored[f"{base}.scale_bias"], expected_bias, rtol=0, atol=0, msg=name)
        assert torch.equal(ms_format.unpack_int4_along_n(stored[name]), codes.to(torch.int8)), name
    for name, (codes, scale, kind) in reference.items():
        if kind == W8A8:
            assert torch.equal(stored[name], codes) and torch.equal(
                stored[name[: -len("weight")] + "weight_scale"], scale
            )


@pytest.mark.parametrize("scheme", SCHEMES)
def test_msmodelslim_description_names_every_tensor(written, scheme: str) -> None:
    directory = written["msmodelslim", scheme]
    description = json.loads((directory / ms_format.DESCRIPTION_FILE).read_text())
    stored = load_state_dict(directory, index_file=f"{ms_format.FILE_PREFIX}.safetensors.index.json")
    meta = {k: description.pop(k) for k in ("version", "model_quant_type", "metadata", "group_size", "optional")}
    assert meta == {
        "version": "1.0.0",
        "model_quant_type": "W8A8_DYNAMIC",
        "metadata": {},
        "group_size": 0,
        "optional": {},
    }
    assert set(description) == set(stored)
    for site, kind in _call_site_kinds(scheme=scheme).items():
        expected = {None: "FLOAT", W8A8: "W8A8_DYNAMIC", W4A8: "W4A8_DYNAMIC"}[kind]
        suffixes = ["weight"] if kind is None else ["weight", "weight_scale", "weight_offset"]
        suffixes += ["scale_bias"] if kind == W4A8 else []
        assert {description[f"{site}.{s}"] for s in suffixes} == {expected}, site
    index = json.loads((directory / f"{ms_format.FILE_PREFIX}.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(stored)


def test_msmodelslim_refuses_grouped_int4_before_writing(source: Path, tmp_path: Path) -> None:
    message = r"group_size: the msModelSlim format stores per-channel int4 only.*got 32"
    layout = layout_for("msmodelslim")
    with pytest.raises(ValueError, match=message):
        quantize_checkpoint_streaming(source, tmp_path / "out", CFG, "w4a8", group_size=GROUP_SIZE, layout=layout)
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------ round trip


@pytest.mark.usefixtures("model_backend")
@pytest.mark.parametrize("scheme", SCHEMES)
def test_every_format_loads_back_to_bit_identical_logits(written, scheme: str) -> None:
    ids = torch.arange(12) * 37 % CFG.vocab_size
    logits = {fmt: load_checkpoint(written[fmt, scheme]).prefill(ids).logits for fmt in FORMATS}
    for fmt in ENGINE_FORMATS:
        assert detect_format(written[fmt, scheme]) == fmt
        torch.testing.assert_close(logits[fmt], logits["glm5-hal"], rtol=0, atol=0, msg=fmt)
    assert torch.isfinite(logits["glm5-hal"]).all()


@pytest.mark.usefixtures("model_backend")
def test_grouped_int4_compressed_tensors_loads_back_to_bit_identical_logits(written) -> None:
    ids = torch.arange(9) * 11 % CFG.vocab_size
    ours = load_checkpoint(written["glm5-hal", "w4a8-g32"]).prefill(ids).logits
    theirs = load_checkpoint(written["compressed-tensors", "w4a8-g32"]).prefill(ids).logits
    torch.testing.assert_close(theirs, ours, rtol=0, atol=0)


@pytest.mark.parametrize("scheme", [*SCHEMES, "w4a8-g32"])
def test_from_pretrained_reads_every_format_to_bit_identical_logits(written, scheme: str, model_backend: str) -> None:
    """CausalLM.from_pretrained finds each format through its glm5_hal.checkpoint_formats entry point (the same
    detection rule as detect_format) and gives the glm5-hal format's logits bit for bit; dtype reaches the reader."""
    from glm5_hal.model import CausalLM

    assert set(formats_module.registered_formats()) >= set(FORMATS)  # the pyproject.toml entry points
    ids = torch.arange(12) * 37 % CFG.vocab_size
    directories = {fmt: written[fmt, s] for (fmt, s) in written if s == scheme}
    want = load_checkpoint(directories["glm5-hal"]).prefill(ids).logits
    for fmt, directory in directories.items():
        model = CausalLM.from_pretrained(directory, backend=model_backend)
        assert model.backend == model_backend
        torch.testing.assert_close(model.prefill(ids).logits, want, rtol=0, atol=0, msg=fmt)
    as_fp32 = {fmt: CausalLM.from_pretrained(directory, dtype=torch.float32) for fmt, directory in directories.items()}
    fp32_logits = {fmt: model.prefill(ids).logits for fmt, model in as_fp32.items()}
    for fmt, logits in fp32_logits.items():
        assert as_fp32[fmt].dtype == torch.float32 and logits.dtype == torch.float32, fmt
        torch.testing.assert_close(logits, fp32_logits["glm5-hal"], rtol=0, atol=0, msg=fmt)


@pytest.mark.parametrize("fmt", ENGINE_FORMATS)
def test_in_memory_writer_equals_the_streaming_one(source: Path, written, tmp_path: Path, fmt: str) -> None:
    """The GPTQ path writes through save_quantized: with RTN it must store what streaming stores, bit for bit."""
    state = {n: v for n, v in load_state_dict(source).items()}
    rotated = quarot.quarot(state, CFG, seed=SEED)[0]
    from glm5_hal.model import CausalLM

    quantized = quantize_model(CausalLM(CFG, rotated), "w4a8")
    save_quantized(
        tmp_path / fmt,
        rotated,
        quantized,
        config=CFG,
        scheme="w4a8",
        method="rtn",
        quarot_seed=SEED,
        layout=layout_for(fmt),
    )
    index = f"{layout_for(fmt).file_prefix}.safetensors.index.json"
    ours, theirs = load_state_dict(tmp_path / fmt, index), load_state_dict(written[fmt, "w4a8"], index)
    assert set(ours) == set(theirs)
    for name in ours:
        assert ours[name].dtype == theirs[name].dtype and torch.equal(ours[name], theirs[name]), name
    for meta in {CONFIG_FILE, ms_format.DESCRIPTION_FILE} & {p.name for p in (tmp_path / fmt).iterdir()}:
        assert (tmp_path / fmt / meta).read_text() == (written[fmt, "w4a8"] / meta).read_text(), meta


def test_quantize_command_writes_the_format_it_is_asked_for(source: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "cli"
    assert glm5_cli.main(["quantize", str(source), str(out), "--format", "msmodelslim", "--eval-tokens", "4"]) == 0
    assert detect_format(out) == "msmodelslim"
    assert "logits SQNR" in capsys.readouterr().out  # the report loaded it back through load_checkpoint
    with pytest.raises(SystemExit):  # argparse: an unknown format is a usage error listing the choices
        glm5_cli.main(["quantize", str(source), str(tmp_path / "x"), "--format", "gguf"])
    assert "--format: invalid choice: 'gguf'" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ errors


def test_detect_format_names_what_it_found(written, tmp_path: Path) -> None:
    for (fmt, _), directory in written.items():
        assert detect_format(directory) == fmt
    with pytest.raises(ValueError, match=r"found none .*files: \[\]"):
        detect_format(tmp_path)
    other = tmp_path / "other"  # a quantization.json another tool wrote is not the glm5-hal format's
    other.mkdir()
    (other / "quantization.json").write_text('{"format": "some-other-tool"}')
    with pytest.raises(ValueError, match=r"found none .*files: \['quantization.json'\]"):
        detect_format(other)
    both = tmp_path / "both"
    both.mkdir()
    (both / "quantization.json").write_text('{"format": "glm5-hal-quantized"}')
    (both / ms_format.DESCRIPTION_FILE).write_text("{}")
    with pytest.raises(ValueError, match=r"found \['glm5-hal', 'msmodelslim'\]"):
        detect_format(both)
    with pytest.raises(
        ValueError, match=r"format: expected one of \['glm5-hal', 'compressed-tensors', 'msmodelslim'\]"
    ):
        layout_for("gguf")


def _copy_with(directory: Path, tmp_path: Path, edit) -> Path:
    """A copy of a checkpoint (weights symlinked) whose config.json / description went through edit(dict)."""
    copy = tmp_path / "copy"
    copy.mkdir()
    for p in directory.iterdir():
        if p.suffix == ".json" and p.name != ms_format.FILE_PREFIX + ".safetensors.index.json":
            data = json.loads(p.read_text())
            edit(p.name, data)
            (copy / p.name).write_text(json.dumps(data))
        else:
            (copy / p.name).symlink_to(p)
    return copy


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda qc: qc.update(transform_config={"config_groups": {"u": {}}}), "transform_config asks for online"),
        (lambda qc: qc.update(kv_cache_scheme={"num_bits": 8}), "kv_cache_scheme"),
        (
            lambda qc: qc["config_groups"]["group_1"]["input_activations"].update(dynamic=False, strategy="tensor"),
            r"group_1.input_activations: expected dynamic symmetric int8 per token",
        ),
        (lambda qc: qc["config_groups"]["group_0"]["weights"].update(symmetric=False), "static symmetric int"),
        (lambda qc: qc["config_groups"]["group_1"].update(format="pack-quantized"), "group_1.format"),
        (
            lambda qc: qc["config_groups"]["group_1"]["targets"].append(r"re:.*\.kv_b_proj$") or qc["ignore"].clear(),
            r"self_attn.kv_b_proj is quantized by quantization_config but .*kv_b_proj.weight_scale is missing",
        ),
    ],
    ids=["transform", "kv-cache", "static-acts", "asymmetric", "packed", "kv_b-targeted"],
)
def test_compressed_tensors_reader_refuses_what_the_hal_cannot_run(written, tmp_path: Path, edit, message) -> None:
    def edit_config(name: str, data: dict) -> None:
        if name == CONFIG_FILE:
            edit(data["quantization_config"])

    copy = _copy_with(written["compressed-tensors", "w4a8"], tmp_path, edit_config)
    with pytest.raises(ValueError, match=message):
        load_checkpoint(copy)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.update(version="0.1.0"), r"'version': expected '1.0.0'"),
        (lambda d: d.update(group_size=256), r"'group_size': expected 0"),
        (lambda d: d.update({"model.layers.0.self_attn.o_proj.weight": "W8A8"}), r"quant types \['W8A8'\]"),
        (lambda d: d.pop("model.norm.weight"), r"undescribed \['model.norm.weight'\]"),
    ],
    ids=["version", "grouped", "static-w8a8", "undescribed"],
)
def test_msmodelslim_reader_refuses_what_it_cannot_read(written, tmp_path: Path, edit, message) -> None:
    def edit_description(name: str, data: dict) -> None:
        if name == ms_format.DESCRIPTION_FILE:
            edit(data)

    copy = _copy_with(written["msmodelslim", "w4a8"], tmp_path, edit_description)
    with pytest.raises(ValueError, match=message):
        load_checkpoint(copy)


def test_loading_frees_each_experts_gate_and_up_once_stacked(written, monkeypatch) -> None:
    """build_quantized_model consumes what the reader read: when an expert's gate|up GEMM is built, the gate and up
    codes read for the experts before it are already freed, so loading peaks at the model plus one stacked pair
    rather than holding every routed expert's gate and up codes twice."""
    import weakref

    from glm5_hal.model.checkpoint import CheckpointReader
    from quantization import checkpoint as checkpoint_module

    originals: list[weakref.ref] = []  # the expert gate / up codes as read
    every_read: list[weakref.ref] = []  # a QuantLinear on none of these holds a stacked pair
    real_read = CheckpointReader.read

    def read(reader: CheckpointReader, name: str, **kwargs) -> torch.Tensor:
        tensor = real_read(reader, name, **kwargs)
        every_read.append(weakref.ref(tensor))
        if ".mlp.experts." in name and name.endswith(("gate_proj.weight", "up_proj.weight")):
            originals.append(weakref.ref(tensor))
        return tensor

    alive_at_stacking: list[int] = []  # originals still alive as each expert's gate|up QuantLinear is built
    real_linear = checkpoint_module.QuantLinear

    def linear(weight: torch.Tensor, *args, **kwargs):
        if not any(ref() is weight for ref in every_read):
            alive_at_stacking.append(sum(ref() is not None for ref in originals))
        return real_linear(weight, *args, **kwargs)

    monkeypatch.setattr(CheckpointReader, "read", read)
    monkeypatch.setattr(checkpoint_module, "QuantLinear", linear)
    load_checkpoint(written["glm5-hal", "w4a8"])
    pairs = len(originals) // 2
    assert pairs == CFG.n_routed_experts * (CFG.num_hidden_layers - CFG.first_k_dense_replace) > 1
    # The j-th pair is built while its own two codes and those of the pairs after it are alive; the earlier are freed.
    assert alive_at_stacking == [2 * (pairs - j) for j in range(pairs)]


def test_a_quantized_router_gate_is_refused() -> None:
    weight = StoredQuantWeight(torch.zeros(16, 256, dtype=torch.int8), torch.ones(16), W8A8)
    with pytest.raises(ValueError, match=r"mlp.gate.weight'\] are quantized.*floating point only"):
        build_quantized_model(CFG, {}, {"model.layers.1.mlp.gate.weight": weight}, "ckpt")


# ------------------------------------------------------------------------------------------ the engines' loaders

_VLLM_REASON = (
    "vLLM is not importable (its wheels need a CUDA build of torch, so it is not a test dependency); put the files "
    "of a vLLM wheel on PYTHONPATH to run this (docs/quantization.md)"
)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_vllm_selects_the_int8_schemes_and_ignores_the_float_layers(written, scheme: str, monkeypatch) -> None:
    """vLLM's own CompressedTensorsConfig on our config.json: the scheme class of every layer of its DeepSeek-V3.2 /
    GLM-5 model (fused names included), and the MoE method of the routed experts. Stubbed: the MoE kernel-backend
    selection and FusedMoEMethodBase.__init__ (they probe the device), nothing on the config path."""
    ctc = pytest.importorskip(
        "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors", reason=_VLLM_REASON
    )
    import importlib

    moe_pkg = "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe"
    ctm = importlib.import_module(f"{moe_pkg}.compressed_tensors_moe")
    from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase

    qc = json.loads((written["compressed-tensors", scheme] / CONFIG_FILE).read_text())["quantization_config"]
    config = ctc.CompressedTensorsConfig.from_config(qc)
    # DeepseekV2ForCausalLM.packed_modules_mapping, GlmMoeDsaForCausalLM's too (vllm/.../models/deepseek_v2.py)
    config.packed_modules_mapping = {
        "gate_up_proj": ["gate_proj", "up_proj"],
        "fused_qkv_a_proj": ["q_a_proj", "kv_a_proj_with_mqa"],
    }
    expected = {
        "model.layers.0.self_attn.fused_qkv_a_proj": "CompressedTensorsW8A8Int8",
        "model.layers.0.self_attn.q_b_proj": "CompressedTensorsW8A8Int8",
        "model.layers.0.self_attn.o_proj": "CompressedTensorsW8A8Int8",
        "model.layers.0.self_attn.indexer.wq_b": "CompressedTensorsW8A8Int8",
        "model.layers.0.self_attn.kv_b_proj": None,
        "model.layers.0.mlp.gate_up_proj": "CompressedTensorsW8A8Int8",
        "model.layers.0.mlp.down_proj": "CompressedTensorsW8A8Int8",
        "model.layers.1.mlp.shared_experts.gate_up_proj": "CompressedTensorsW8A8Int8",
        "model.layers.1.mlp.shared_experts.down_proj": "CompressedTensorsW8A8Int8",
        "model.layers.1.mlp.gate": None,
        "model.layers.1.self_attn.indexer.wk": None,
        "lm_head": None,
    }
    for name, scheme_class in expected.items():
        parts = config.get_scheme_dict(torch.nn.Module(), name)
        got = None
        if parts is not None:
            got = type(
                config._get_scheme_from_parts(
                    parts["weights"], parts["input_activations"], parts.get("output_activations"), parts["format"], name
                )
            ).__name__
        assert got == scheme_class, name
    for module, fn in (
        ("compressed_tensors_moe_w4a8_int8", "select_w4a8_int8_moe_backend"),
        ("compressed_tensors_moe_w8a8_int8", "select_int8_moe_backend"),
    ):
        backends = importlib.import_module(f"{moe_pkg}.{module}")
        monkeypatch.setattr(backends, fn, lambda *args, **kwargs: (None, None))
    monkeypatch.setattr(FusedMoEMethodBase, "__init__", lambda self, moe: setattr(self, "moe", moe))
    moe = types.SimpleNamespace(
        hidden_dim=CFG.hidden_size,
        intermediate_size_per_partition=CFG.moe_intermediate_size,
        has_bias=False,
        is_act_and_mul=True,
    )
    layer = types.SimpleNamespace(
        ckpt_gate_proj_name="gate_proj", ckpt_up_proj_name="up_proj", ckpt_down_proj_name="down_proj", moe_config=moe
    )
    method = ctm.CompressedTensorsMoEMethod.get_moe_method(config, layer, "model.layers.1.mlp.experts")
    expected_moe = "CompressedTensorsW4A8Int8MoEMethod" if scheme == "w4a8" else "CompressedTensorsW8A8Int8MoEMethod"
    assert type(method).__name__ == expected_moe
    # Its parameters take our tensors as they are: same dtypes, gate and up stacked along N.
    params = torch.nn.Module()
    method.create_weights(
        params, CFG.n_routed_experts, CFG.hidden_size, CFG.moe_intermediate_size, torch.bfloat16, weight_loader=None
    )
    stored = load_state_dict(written["compressed-tensors", scheme])
    expert = "model.layers.1.mlp.experts.0"
    gate, down = stored[f"{expert}.gate_proj.weight"], stored[f"{expert}.down_proj.weight"]
    assert params.w13_weight.dtype == gate.dtype and params.w13_weight.shape[1:] == (2 * gate.shape[0], gate.shape[1])
    assert params.w2_weight.dtype == down.dtype and params.w2_weight.shape[1:] == down.shape
    gate_scale = stored[f"{expert}.gate_proj.weight_scale"]
    assert params.w13_weight_scale.dtype == gate_scale.dtype and params.w13_weight_scale.shape[1:] == (
        2 * gate_scale.shape[0],
        gate_scale.shape[1],
    )


_ASCEND_REASON = (
    "set GLM5_HAL_VLLM_ASCEND_SRC to an unpacked vllm-ascend sdist (and make vLLM importable) to run vllm-ascend's "
    "AscendModelSlimConfig on the description (docs/quantization.md)"
)


def _vllm_ascend_modelslim_config():
    """vllm-ascend's vllm_ascend/quantization/modelslim_config.py from an unpacked sdist. Stubbed (they import
    torch_npu / CANN): the vllm_ascend package __init__ (patches), vllm_ascend.utils (five names), and the scheme
    classes, replaced by placeholders registered under the (quant_type, layer_type) keys that the real
    methods/*.py declare with @register_scheme (read with ast)."""
    src = os.environ.get("GLM5_HAL_VLLM_ASCEND_SRC")
    if not src:
        pytest.skip(_ASCEND_REASON)
    pytest.importorskip("vllm.model_executor.layers.linear", reason=_VLLM_REASON)
    if "vllm_ascend.quantization.modelslim_config" in sys.modules:  # stubbed and loaded by an earlier case
        return sys.modules["vllm_ascend.quantization.modelslim_config"]
    root = Path(src) / "vllm_ascend"
    package = types.ModuleType("vllm_ascend")
    package.__path__ = [str(root)]
    utils = types.ModuleType("vllm_ascend.utils")
    utils.ASCEND_QUANTIZATION_METHOD = "ascend"
    utils.AscendDeviceType = types.SimpleNamespace(A5="A5")
    utils.calc_split_factor = lambda dims: dims
    utils.get_ascend_device_type = lambda: None
    utils.vllm_version_is = lambda version: False
    methods = types.ModuleType("vllm_ascend.quantization.methods")
    methods.__path__ = [str(root / "quantization" / "methods")]
    sys.modules.update(
        {"vllm_ascend": package, "vllm_ascend.utils": utils, "vllm_ascend.quantization.methods": methods}
    )
    registry = importlib.import_module("vllm_ascend.quantization.methods.registry")
    methods.get_scheme_class = registry.get_scheme_class
    for path in sorted((root / "quantization" / "methods").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                for deco in node.decorator_list:
                    if isinstance(deco, ast.Call) and getattr(deco.func, "id", "") == "register_scheme":
                        key = tuple(arg.value for arg in deco.args)
                        registry.register_scheme(*key)(type(node.name, (), {}))
    return importlib.import_module("vllm_ascend.quantization.modelslim_config")


@pytest.mark.parametrize("scheme", SCHEMES)
def test_vllm_ascend_modelslim_config_reads_the_description(written, scheme: str) -> None:
    """vllm-ascend's AscendModelSlimConfig on our quant_model_description.json: for every layer of vLLM's GLM-5 model
    (the generic deepseek_v2 one vllm-ascend patches), skipped (float) or the registered scheme class."""
    modelslim = _vllm_ascend_modelslim_config()
    description = json.loads((written["msmodelslim", scheme] / ms_format.DESCRIPTION_FILE).read_text())
    config = modelslim.AscendModelSlimConfig(description)
    mapping = modelslim.get_packed_modules_mapping("glm_moe_dsa")
    experts = "AscendW4A8DynamicFusedMoEMethod" if scheme == "w4a8" else "AscendW8A8DynamicFusedMoEMethod"
    expected = {
        ("model.layers.0.self_attn.fused_qkv_a_proj", "linear"): "AscendW8A8DynamicLinearMethod",
        ("model.layers.0.self_attn.q_b_proj", "linear"): "AscendW8A8DynamicLinearMethod",
        ("model.layers.0.self_attn.o_proj", "linear"): "AscendW8A8DynamicLinearMethod",
        ("model.layers.0.self_attn.indexer.wq_b", "linear"): "AscendW8A8DynamicLinearMethod",
        ("model.layers.0.self_attn.kv_b_proj", "linear"): None,
        ("model.layers.0.mlp.gate_up_proj", "linear"): "AscendW8A8DynamicLinearMethod",
        ("model.layers.0.mlp.down_proj", "linear"): "AscendW8A8DynamicLinearMethod",
        ("model.layers.1.mlp.shared_experts.gate_up_proj", "linear"): "AscendW8A8DynamicLinearMethod",
        ("model.layers.1.mlp.gate", "linear"): None,
        ("model.layers.1.mlp.experts", "moe"): experts,
        ("lm_head", "linear"): None,
        ("model.embed_tokens", "linear"): None,
    }
    for (prefix, layer_type), scheme_class in expected.items():
        if config.is_layer_skipped_ascend(prefix, mapping):
            got = None
        else:
            got = type(
                modelslim.create_scheme_for_layer(config.quant_description, prefix, layer_type, mapping)
            ).__name__
        assert got == scheme_class, prefix
