"""FP8 block-scaled source checkpoints (glm5_hal/model/fp8.py, re-exported by quantization/fp8.py): dequantization
against an independent NumPy fp32 reference (ops_reference's float8_e4m3fn decoder, not torch's cast), a
hand-checked example, ragged shapes, the quantize -> dequantize round-trip bound of the format, every error, the
config.json reader and the state-dict conversion."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ops_reference.kv_cache import decode_e4m3 as decode_e4m3fn
from quantization.checkpoint import load_state_dict
from quantization.fp8 import (
    dequantize_fp8_block,
    dequantize_fp8_state_dict,
    fp8_block_size,
    is_float8_dtype,
    is_fp8_scale_name,
    scale_name_for,
    weight_name_for,
)

E4M3_MAX = 448.0
NAN_CODES = (0x7F, 0xFF)  # float8_e4m3fn: S.1111.111 is NaN; there is no infinity

# DeepSeek-V3's config.json (README_WEIGHTS.md, "FP8 Configuration").
DEEPSEEK_QC = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}


def reference_dequant(bits: np.ndarray, scales: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """W[n, k] = decode(bits[n, k]) * scales[n // bn, k // bk], one float32 multiply per element."""
    n, k = bits.shape
    expanded = np.repeat(np.repeat(scales.astype(np.float32), block[0], axis=0), block[1], axis=1)[:n, :k]
    return decode_e4m3fn(bits) * expanded


def random_codes(shape: tuple[int, int], gen: torch.Generator) -> torch.Tensor:
    """Random float8_e4m3fn codes over the whole code space (subnormals, both zeros, +-448) except NaN."""
    bits = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
    for code in NAN_CODES:
        bits[bits == code] = code - 1  # +-448
    return bits.view(torch.float8_e4m3fn)


def random_scales(grid: tuple[int, int], gen: torch.Generator) -> torch.Tensor:
    """Positive fp32 block scales spanning several orders of magnitude, as real checkpoints have."""
    return torch.exp2(torch.empty(grid).uniform_(-20, 2, generator=gen)).to(torch.float32)


def fp32_bits(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)


def test_decoder_hand_values():
    """The NumPy decoder (ops_reference.kv_cache), on values read off the format's definition."""
    codes = np.array([0x00, 0x80, 0x38, 0xB8, 0x7E, 0xFE, 0x01, 0x08, 0x3C, 0x7F, 0xFF], dtype=np.uint8)
    want = [0.0, -0.0, 1.0, -1.0, 448.0, -448.0, 2.0**-9, 2.0**-6, 1.5]
    got = decode_e4m3fn(codes)
    assert got[:-2].tolist() == want
    assert np.signbit(got[1]) and np.isnan(got[-2:]).all()
    # and it agrees with torch's cast on every non-NaN code (so the reference below is independent yet consistent)
    every = np.array([c for c in range(256) if c not in NAN_CODES], dtype=np.uint8)
    torch_values = torch.from_numpy(every).view(torch.float8_e4m3fn).to(torch.float32).numpy()
    assert np.array_equal(fp32_bits(decode_e4m3fn(every)), fp32_bits(torch_values))


def test_hand_checked_2x2_blocks():
    """A 4x4 weight in 2x2 blocks with scales [[1, 2], [0.5, 4]]: each quadrant scaled by its own scale."""
    weight = torch.tensor(
        [[1.0, -2.0, 0.5, 3.0], [4.0, 0.0, -1.0, 0.25], [2.0, 8.0, 1.0, -0.5], [-4.0, 1.5, 6.0, 2.0]]
    ).to(torch.float8_e4m3fn)  # all exactly representable
    scales = torch.tensor([[1.0, 2.0], [0.5, 4.0]])
    want = torch.tensor([[1.0, -2.0, 1.0, 6.0], [4.0, 0.0, -2.0, 0.5], [1.0, 4.0, 4.0, -2.0], [-2.0, 0.75, 24.0, 8.0]])
    out = dequantize_fp8_block(weight, scales, (2, 2), torch.float32)
    assert out.dtype == torch.float32 and out.shape == (4, 4)
    assert torch.equal(out, want)
    assert torch.equal(dequantize_fp8_block(weight, scales, (2, 2)), want.to(torch.bfloat16))  # default bf16


@pytest.mark.parametrize(
    "shape, block",
    [
        ((256, 384), (128, 128)),  # whole blocks
        ((300, 260), (128, 128)),  # ragged rows and columns
        ((129, 127), (128, 128)),  # one element past a block; one short of a block
        ((1, 1), (128, 128)),  # a single ragged block
        ((576, 7168), (128, 128)),  # DeepSeek-V3.2 kv_a_proj_with_mqa: 576 = 4.5 blocks
        ((5, 7), (2, 3)),  # non-square block, both edges ragged
    ],
)
def test_fp32_bit_exact_against_numpy(shape: tuple[int, int], block: tuple[int, int]):
    gen = torch.Generator().manual_seed(shape[0] * 1000 + shape[1])
    weight = random_codes(shape, gen)
    grid = (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
    scales = random_scales(grid, gen)
    want = reference_dequant(weight.view(torch.uint8).numpy(), scales.numpy(), block)

    out = dequantize_fp8_block(weight, scales, block, torch.float32)
    assert out.shape == shape and out.dtype == torch.float32 and out.is_contiguous()
    assert np.array_equal(fp32_bits(out.numpy()), fp32_bits(want))  # every bit, signed zeros included

    # Other dtypes: the fp32 product rounded once (round to nearest even) to the output dtype.
    for dtype in (torch.bfloat16, torch.float16, torch.float64):
        got = dequantize_fp8_block(weight, scales, block, dtype)
        assert got.dtype == dtype
        assert torch.equal(got, torch.from_numpy(want).to(dtype))


def test_a_wrong_block_mapping_is_caught():
    """The reference check can fail: scales applied per transposed block (or unscaled) differ from the output."""
    gen = torch.Generator().manual_seed(3)
    weight = random_codes((6, 6), gen)
    scales = torch.tensor([[1.0, 2.0, 4.0], [8.0, 16.0, 32.0], [64.0, 128.0, 256.0]])
    out = dequantize_fp8_block(weight, scales, (2, 2), torch.float32).numpy()
    bits = weight.view(torch.uint8).numpy()
    assert np.array_equal(out, reference_dequant(bits, scales.numpy(), (2, 2)))
    assert not np.array_equal(out, reference_dequant(bits, scales.numpy().T, (2, 2)))
    assert not np.array_equal(out, decode_e4m3fn(bits))


def quantize_reference(w: np.ndarray, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's weight_quant in NumPy: per block scale = amax / 448 (ragged blocks over their real elements),
    codes = round-to-nearest-even float8_e4m3fn of w / scale (torch's cast rounds to nearest even)."""
    n, k = w.shape
    grid = (-(-n // block[0]), -(-k // block[1]))
    scales = np.zeros(grid, dtype=np.float32)
    for i in range(grid[0]):
        for j in range(grid[1]):
            tile = w[i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]]
            scales[i, j] = np.abs(tile).max() / np.float32(E4M3_MAX)
    expanded = np.repeat(np.repeat(scales, block[0], axis=0), block[1], axis=1)[:n, :k]
    codes = torch.from_numpy(w / expanded).to(torch.float8_e4m3fn)
    return codes, torch.from_numpy(scales)


def test_round_trip_within_the_formats_bound():
    """quantize -> dequantize returns every weight within half an e4m3 step: 2^-4 relative for normal codes
    (3 mantissa bits), 2^-10 * scale absolute for subnormal ones (step 2^-9), plus fp32 rounding (2^-20 relative)."""
    rng = np.random.default_rng(7)
    shape, block = (300, 260), (128, 128)
    # Blocks of very different magnitude, so a scale applied to the wrong block would be far outside the bound.
    magnitude = np.exp2(rng.integers(-12, 4, size=(3, 3))).astype(np.float32)
    w = rng.standard_normal(shape).astype(np.float32)
    w *= np.repeat(np.repeat(magnitude, 128, axis=0), 128, axis=1)[: shape[0], : shape[1]]

    codes, scales = quantize_reference(w, block)
    out = dequantize_fp8_block(codes, scales, block, torch.float32).numpy()
    s = np.repeat(np.repeat(scales.numpy(), 128, axis=0), 128, axis=1)[: shape[0], : shape[1]]
    bound = (2.0**-4 + 2.0**-20) * np.abs(w) + 2.0**-10 * s
    err = np.abs(out.astype(np.float64) - w)
    assert (err <= bound).all(), f"worst excess {np.max(err - bound)}"
    assert err.max() > 0  # fp8 is lossy: a test that compared w with itself would not get here
    # the block maxima come back exactly (amax / 448 * 448 codes to 448)
    assert np.allclose(np.abs(out).max(), np.abs(w).max(), rtol=2.0**-20, atol=0)


def test_float32_bit_exact_on_a_large_weight():
    """The padded-view computation at a real size: GLM-5-like [2048, 6144] with a ragged [.., 6144 + 64] edge."""
    gen = torch.Generator().manual_seed(11)
    weight = random_codes((2048 + 32, 6144 + 64), gen)
    scales = random_scales((17, 49), gen)
    out = dequantize_fp8_block(weight, scales, dtype=torch.float32)
    want = reference_dequant(weight.view(torch.uint8).numpy(), scales.numpy(), (128, 128))
    assert np.array_equal(fp32_bits(out.numpy()), fp32_bits(want))


# ---------------------------------------------------------------------------------------------------------------
# errors


def _good() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.ones(4, 6).to(torch.float8_e4m3fn), torch.ones(2, 3)


@pytest.mark.parametrize(
    "weight, scale, match",
    [
        (torch.ones(4, 6), torch.ones(2, 3), r"weight: expected dtype torch\.float8_e4m3fn, got torch\.float32"),
        (torch.ones(4, 6).to(torch.float8_e4m3fnuz), torch.ones(2, 3), r"weight: .*got torch\.float8_e4m3fnuz"),
        (torch.ones(4, 6).to(torch.float8_e5m2), torch.ones(2, 3), r"weight: .*got torch\.float8_e5m2"),
        (torch.ones(24).to(torch.float8_e4m3fn), torch.ones(2, 3), r"weight: expected a 2-D tensor, got shape \(24,\)"),
        (torch.ones(4, 6).to(torch.float8_e4m3fn), torch.ones(2, 3, dtype=torch.float64), r"scale_inv: .*float64"),
        (torch.ones(4, 6).to(torch.float8_e4m3fn), torch.ones(2, 3, dtype=torch.bfloat16), r"scale_inv: .*bfloat16"),
        (torch.ones(4, 6).to(torch.float8_e4m3fn), torch.ones(6), r"scale_inv: expected a 2-D tensor"),
        (
            torch.ones(4, 6).to(torch.float8_e4m3fn),
            torch.ones(3, 2),
            r"scale_inv: expected shape \(2, 3\).*got \(3, 2\)",
        ),
        (torch.ones(5, 7).to(torch.float8_e4m3fn), torch.ones(2, 3), r"expected shape \(3, 4\).*got \(2, 3\)"),  # floor
        (torch.ones(4, 6).to(torch.float8_e4m3fn), torch.tensor([[1.0, float("nan"), 1.0], [1.0] * 3]), "finite"),
        (torch.ones(4, 6).to(torch.float8_e4m3fn), torch.tensor([[1.0, float("inf"), 1.0], [1.0] * 3]), "finite"),
        (torch.ones(4, 6).to(torch.float8_e4m3fn), torch.tensor([[1.0, -2.0, 1.0], [1.0] * 3]), r">= 0.*-2\.0"),
        ("not a tensor", torch.ones(2, 3), "weight: expected a torch.Tensor, got str"),
    ],
)
def test_bad_tensors(weight, scale, match: str):
    with pytest.raises((ValueError, TypeError), match=match):
        dequantize_fp8_block(weight, scale, (2, 2))


@pytest.mark.parametrize("block", [(0, 2), (2,), (2, 2, 2), (True, True), (2.0, 2), "22", None, (-2, 2)])
def test_bad_block_size(block):
    weight, scale = _good()
    with pytest.raises(ValueError, match=r"block_size: expected two positive ints"):
        dequantize_fp8_block(weight, scale, block)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.int8, torch.int32, "bfloat16"])
def test_bad_output_dtype(dtype):
    weight, scale = _good()
    with pytest.raises(ValueError, match=r"dtype: expected a floating torch dtype"):
        dequantize_fp8_block(weight, scale, (2, 2), dtype)


def test_nan_code_and_overflow():
    weight, scale = _good()
    bits = weight.view(torch.uint8).clone()
    bits[1, 4] = 0x7F
    with pytest.raises(ValueError, match=r"weight: contains NaN codes"):
        dequantize_fp8_block(bits.view(torch.float8_e4m3fn), scale, (2, 2))
    big = torch.full((4, 6), E4M3_MAX).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"weight: dequantized values overflow torch\.float16"):
        dequantize_fp8_block(big, torch.full((2, 3), 1000.0), (2, 2), torch.float16)  # 448000 > 65504
    assert dequantize_fp8_block(big, torch.full((2, 3), 1000.0), (2, 2)).eq(448000.0).all()  # fits bf16


def test_errors_name_the_tensor():
    weight, _ = _good()
    with pytest.raises(ValueError, match=r"^model\.layers\.3\.mlp\.up_proj\.weight_scale_inv: expected shape"):
        dequantize_fp8_block(weight, torch.ones(1, 1), (2, 2), name="model.layers.3.mlp.up_proj.weight")
    with pytest.raises(ValueError, match=r"^lm_head\.weight: expected dtype"):
        dequantize_fp8_block(torch.ones(4, 6), torch.ones(2, 3), (2, 2), name="lm_head.weight")


# ---------------------------------------------------------------------------------------------------------------
# config.json


@pytest.mark.parametrize(
    "qc, want",
    [
        (DEEPSEEK_QC, (128, 128)),
        ({**DEEPSEEK_QC, "scale_fmt": "ue8m0"}, (128, 128)),  # DeepSeek-V3.1 / V3.2
        ({"quant_method": "fp8", "weight_block_size": [128, 128]}, (128, 128)),  # transformers: fmt, scheme absent
        ({**DEEPSEEK_QC, "weight_block_size": (64, 32), "scale_fmt": "float"}, (64, 32)),
    ],
)
def test_config_fp8(qc: dict, want: tuple[int, int]):
    assert fp8_block_size({"model_type": "deepseek_v32", "quantization_config": qc}) == want


def test_config_not_quantized():
    assert fp8_block_size({"model_type": "glm_moe_dsa", "hidden_size": 6144}) is None
    assert fp8_block_size({"quantization_config": None}) is None


@pytest.mark.parametrize(
    "qc, match",
    [
        ({**DEEPSEEK_QC, "quant_method": "gptq"}, r"quant_method: only 'fp8' .* got 'gptq'"),
        ({**DEEPSEEK_QC, "quant_method": "compressed-tensors"}, r"quant_method: .*'compressed-tensors'"),
        ({k: v for k, v in DEEPSEEK_QC.items() if k != "quant_method"}, r"quant_method: .*got None"),
        ({**DEEPSEEK_QC, "fmt": "e5m2"}, r"fmt: expected one of \('e4m3',\).*got 'e5m2'"),
        ({**DEEPSEEK_QC, "activation_scheme": "static"}, r"activation_scheme: .*got 'static'"),
        ({**DEEPSEEK_QC, "scale_fmt": "e8m0"}, r"scale_fmt: .*got 'e8m0'"),
        ({k: v for k, v in DEEPSEEK_QC.items() if k != "weight_block_size"}, r"weight_block_size: missing"),
        ({**DEEPSEEK_QC, "weight_block_size": None}, r"weight_block_size: missing.*per-tensor"),
        ({**DEEPSEEK_QC, "weight_block_size": [128]}, r"weight_block_size: expected two positive ints .*, got \[128\]"),
        ({**DEEPSEEK_QC, "weight_block_size": [128, 0]}, r"weight_block_size: expected two positive ints"),
        ({**DEEPSEEK_QC, "weight_block_size": [128.0, 128]}, r"weight_block_size: expected two positive ints"),
        ("fp8", r"quantization_config: expected a dict, got str"),
    ],
)
def test_config_unsupported(qc, match: str):
    with pytest.raises(ValueError, match=match):
        fp8_block_size({"quantization_config": qc})


def test_config_not_a_dict():
    with pytest.raises(TypeError, match=r"hf_config: expected the parsed config\.json \(a dict\), got list"):
        fp8_block_size([("quantization_config", DEEPSEEK_QC)])


# ---------------------------------------------------------------------------------------------------------------
# state dicts


def test_names():
    assert (
        scale_name_for("model.layers.0.self_attn.o_proj.weight") == "model.layers.0.self_attn.o_proj.weight_scale_inv"
    )
    assert (
        weight_name_for("model.layers.0.self_attn.o_proj.weight_scale_inv") == "model.layers.0.self_attn.o_proj.weight"
    )
    assert is_fp8_scale_name("a.weight_scale_inv") and not is_fp8_scale_name("a.weight")
    assert not is_fp8_scale_name("_scale_inv") and not is_fp8_scale_name("a.weight_scale")
    with pytest.raises(ValueError, match=r"scale_name: expected a name ending in '_scale_inv', got 'a\.weight'"):
        weight_name_for("a.weight")
    assert is_float8_dtype(torch.float8_e4m3fn) and is_float8_dtype(torch.float8_e5m2)
    assert not is_float8_dtype(torch.bfloat16) and not is_float8_dtype(torch.uint8)


def _fp8_state(gen: torch.Generator) -> dict[str, torch.Tensor]:
    """A DeepSeek-style fragment: two FP8 linears (one ragged), a bf16 norm and embedding, an fp32 router bias."""
    q = random_codes((300, 256), gen)
    o = random_codes((256, 300), gen)
    return {
        "model.embed_tokens.weight": torch.randn(10, 256, generator=gen).to(torch.bfloat16),
        "model.layers.0.self_attn.q_a_proj.weight": q,
        "model.layers.0.self_attn.q_a_proj.weight_scale_inv": random_scales((3, 2), gen),
        "model.layers.0.input_layernorm.weight": torch.randn(256, generator=gen).to(torch.bfloat16),
        "model.layers.0.self_attn.o_proj.weight_scale_inv": random_scales((2, 3), gen),  # scale before its weight
        "model.layers.0.self_attn.o_proj.weight": o,
        "model.layers.0.mlp.gate.e_score_correction_bias": torch.randn(8, generator=gen),
    }


def test_state_dict_dequantizes_pairs_and_drops_scales():
    state = _fp8_state(torch.Generator().manual_seed(5))
    out = dequantize_fp8_state_dict(state, (128, 128), torch.bfloat16)
    assert list(out) == [n for n in state if not n.endswith("_scale_inv")]  # order kept, scales gone
    for name, tensor in out.items():
        if state[name].dtype == torch.float8_e4m3fn:
            want = reference_dequant(
                state[name].view(torch.uint8).numpy(), state[scale_name_for(name)].numpy(), (128, 128)
            )
            assert tensor.dtype == torch.bfloat16 and tensor.shape == state[name].shape
            assert torch.equal(tensor, torch.from_numpy(want).to(torch.bfloat16))
        else:
            assert tensor is state[name]  # floating tensors pass through untouched
    assert all(state[n].dtype == torch.float8_e4m3fn for n in state if n.endswith("proj.weight"))  # input unchanged


def test_state_dict_errors():
    gen = torch.Generator().manual_seed(6)
    state = _fp8_state(gen)
    orphan = {k: v for k, v in state.items() if k != "model.layers.0.self_attn.o_proj.weight"}
    with pytest.raises(ValueError, match=r"^model\.layers\.0\.self_attn\.o_proj\.weight_scale_inv: block scales "):
        dequantize_fp8_state_dict(orphan)
    unscaled = {k: v for k, v in state.items() if k != "model.layers.0.self_attn.q_a_proj.weight_scale_inv"}
    with pytest.raises(ValueError, match=r"^model\.layers\.0\.self_attn\.q_a_proj\.weight: torch\.float8_e4m3fn "):
        dequantize_fp8_state_dict(unscaled)
    bad_shape = {**state, "model.layers.0.self_attn.q_a_proj.weight_scale_inv": torch.ones(2, 2)}
    with pytest.raises(ValueError, match=r"^model\.layers\.0\.self_attn\.q_a_proj\.weight_scale_inv: expected shape"):
        dequantize_fp8_state_dict(bad_shape)
    with pytest.raises(ValueError, match=r"^block_size: "):
        dequantize_fp8_state_dict(state, (128,))


def test_safetensors_checkpoint_round_trip(tmp_path):
    """float8_e4m3fn and its fp32 scales survive safetensors (F8_E4M3 / F32) and quantization.checkpoint's
    load_state_dict, then dequantize as in memory."""
    import safetensors.torch

    state = _fp8_state(torch.Generator().manual_seed(9))
    safetensors.torch.save_file(state, str(tmp_path / "model.safetensors"))
    loaded = load_state_dict(tmp_path)
    assert loaded["model.layers.0.self_attn.q_a_proj.weight"].dtype == torch.float8_e4m3fn
    got = dequantize_fp8_state_dict(loaded, fp8_block_size({"quantization_config": DEEPSEEK_QC}))
    want = dequantize_fp8_state_dict(state)
    assert sorted(got) == sorted(want)  # safetensors returns the tensors sorted by name
    assert all(torch.equal(got[n], want[n]) for n in want)


# --------------------------------------------------- glm5-hal quantize on an FP8 source checkpoint (end to end)


def _fp8_checkpoint(directory, state: dict[str, torch.Tensor], block: tuple[int, int]) -> dict[str, torch.Tensor]:
    """Write state as an FP8 source checkpoint (every 2-D projection / expert weight as float8 + scales, the rest
    as it is, config.json with quantization_config); returns the bf16 state its dequantization gives."""
    import json

    import safetensors.torch

    from glm5_hal.config import GLM5_MINI
    from glm5_hal.model.hf_config import config_to_hf

    stored, expected = {}, {}
    for name, value in state.items():
        is_projection = name.endswith(".weight") and value.dim() == 2 and "embed_tokens" not in name
        if not is_projection or name.endswith("lm_head.weight"):
            stored[name] = expected[name] = value
            continue
        codes, scales = quantize_reference(value.float().numpy(), block)
        stored[name], stored[scale_name_for(name)] = codes, scales
        expected[name] = dequantize_fp8_block(codes, scales, block, torch.bfloat16)
    directory.mkdir()
    safetensors.torch.save_file(stored, str(directory / "model.safetensors"))
    hf = {**config_to_hf(GLM5_MINI), "quantization_config": {**DEEPSEEK_QC, "weight_block_size": list(block)}}
    (directory / "config.json").write_text(json.dumps(hf))
    return expected


@pytest.mark.filterwarnings("ignore:GPTQ:UserWarning")  # 2 calibration sequences: enough for equality
@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_quantize_command_reads_an_fp8_checkpoint(tmp_path, method: str) -> None:
    """An FP8 source (config.json quantization_config + weight_scale_inv tensors) quantizes exactly as its bf16
    dequantization does, by the streaming (rtn) and the in-memory (gptq) paths; no scale tensor is carried over."""
    from glm5_hal import cli as glm5_cli
    from glm5_hal.config import GLM5_MINI
    from glm5_hal.model import random_state_dict
    from quantization.checkpoint import load_state_dict as load

    state = random_state_dict(GLM5_MINI, seed=3, dtype=torch.bfloat16)
    expected = _fp8_checkpoint(tmp_path / "fp8", state, (16, 32))
    import safetensors.torch

    (tmp_path / "bf16").mkdir()
    safetensors.torch.save_file(expected, str(tmp_path / "bf16" / "model.safetensors"))
    (tmp_path / "bf16" / "config.json").write_text((tmp_path / "fp8" / "config.json").read_text())

    def run(source: str, out: str) -> None:
        argv = ["quantize", str(tmp_path / source), str(tmp_path / out), "--scheme", "w4a8", "--method", method]
        assert glm5_cli.main([*argv, "--eval-tokens", "0", "--calibration-sequences", "2"]) == 0

    run("fp8", "from_fp8")
    run("bf16", "from_bf16")
    got, want = load(tmp_path / "from_fp8"), load(tmp_path / "from_bf16")
    assert set(got) == set(want) and not any(is_fp8_scale_name(n) for n in got)
    for name in want:
        assert torch.equal(got[name], want[name]), name
    assert "quantization_config" not in (tmp_path / "from_fp8" / "config.json").read_text()
