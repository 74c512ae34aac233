"""Quantized KV and index-key caches (OPS.md section 7, glm5_hal.kv_formats), beyond the parity cases:

- the NumPy reference's e4m3 / bf16 roundings equal torch's casts bit for bit; the row layouts, byte by byte;
- the torch encoder agrees with the reference's bytes (up to fp32 boundary ties); its decoder is the reference's
  exact value rounded once to fp32;
- every reader of every backend here decodes every code exactly (read-out through one-hot queries / single keys);
- the Triton write kernel stores the reference's codes for every e4m3 value and every midpoint between two;
- validation names the argument; a backend that does not declare a format refuses it;
- the model's cache option (glm5-mini), the kv-cache command, the bench's cost model on stored bytes, the
  export-onnx --kv-cache option, and a small asserted version of the quality report (quantization/kv_cache_report.py).
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

import glm5_hal
import ops_reference as ref
from fakes.ascend.fixture import fake_torch_npu_fixture, torch_npu_schemas_fixture  # noqa: F401 (pytest fixtures)
from glm5_hal.cli import main
from glm5_hal.config import DEEPSEEK_V32, GLM5, GLM5_MINI
from glm5_hal.kv_formats import FORMATS, KVCacheFormatUnsupportedError, decode_rows, encode_rows
from glm5_hal.parity.cases import cases_for
from glm5_hal.parity.runner import case_generator
from glm5_hal.registry import Availability, Backend, registry
from ops_reference.kv_cache import E4M3_MAX, encode_bf16, encode_e4m3, round_e4m3

READER_BACKENDS = ("reference", "torch", "triton")
NAN_CODES = (0x7F, 0xFF)


def _backend(name: str) -> str:
    avail = registry().availability(name)
    if not avail.available:
        pytest.skip(f"backend {name} unavailable: {avail.reason}")
    return name


def _e4m3_values() -> np.ndarray:
    """Every finite e4m3 value (both zeros included)."""
    codes = np.array([c for c in range(256) if c not in NAN_CODES], np.uint8)
    return ref.decode_e4m3(codes).astype(np.float64)


# ------------------------------------------------------------------------------------------------ number sets
def test_numpy_e4m3_rounding_is_torchs_bit_for_bit():
    """Every e4m3 value, every midpoint between two neighbours (ties to even), values just either side of them,
    subnormals, saturation to 448, and a random sweep over 30 binades."""
    values = np.unique(_e4m3_values())
    midpoints = (values[1:] + values[:-1]) / 2
    nudged = np.concatenate([np.nextafter(midpoints.astype(np.float32), np.float32(np.inf)), midpoints * (1 - 2**-20)])
    rng = np.random.default_rng(3)
    sweep = rng.standard_normal(100_000) * np.exp2(rng.integers(-20, 10, 100_000))
    x = np.concatenate([values, midpoints, nudged, sweep, [449.0, 460.0, 464.0, 1e6, -1e6, 2.0**-12]])
    x32 = np.clip(x, -E4M3_MAX, E4M3_MAX).astype(np.float32)  # torch's cast is from fp32 and does not saturate
    want = torch.from_numpy(x32).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    assert np.array_equal(encode_e4m3(x32.astype(np.float64)), want)
    # Saturation is the reference's own rule: beyond 448 the nearest finite value.
    assert (round_e4m3(np.array([449.0, 470.0, 1e30])) == 448.0).all()
    assert np.array_equal(encode_e4m3(np.array([-0.0, 0.0])), [0x80, 0x00])


def test_numpy_bf16_rounding_is_torchs_bit_for_bit():
    rng = np.random.default_rng(4)
    x = (rng.standard_normal(200_000) * np.exp2(rng.integers(-60, 60, 200_000))).astype(np.float32)
    # ... and past bf16's largest value (3.3895e38): rounding to nearest even overflows to +-inf from the midpoint.
    edge = np.array([3.3895e38, 3.39e38, 3.3961e38, 3.3962e38, 3.4e38, np.finfo(np.float32).max, np.inf], np.float32)
    x = np.concatenate([x, edge, -edge])
    want = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(encode_bf16(x.astype(np.float64)), want)


# ------------------------------------------------------------------------------------------------ row layouts
def test_cpu_e4m3_decode_is_torchs_conversion_bit_for_bit():
    """decode_rows reads e4m3 codes on a CPU through a 256-entry table (torch's float8 conversion is scalar there):
    every code, NaN codes included, in strided and empty slices, decodes to the conversion's exact bits."""
    from glm5_hal.kv_formats import _e4m3_values

    every = torch.arange(256, dtype=torch.uint8)
    rows = torch.stack([every, every.flip(0)]).repeat(3, 1)  # [6, 256]
    for codes in (rows, rows[:, 1::3], rows.t(), rows[:0]):
        expected = codes.contiguous().view(torch.float8_e4m3fn).to(torch.float32)
        got = _e4m3_values(codes)
        assert got.shape == codes.shape and got.dtype == torch.float32
        assert torch.equal(got.view(torch.int32), expected.view(torch.int32))
    fmt = FORMATS["fp8_index"]
    data = encode_rows(torch.randn(5, 128), fmt)
    reference = data[:, :128].contiguous().view(torch.float8_e4m3fn).to(torch.float32)
    scales = data[:, 128:].contiguous().view(torch.float32)
    assert torch.equal(decode_rows(data, fmt), reference * scales)


def test_row_layouts_byte_by_byte():
    assert {n: (f.row_bytes, f.scales_offset, f.rope_offset) for n, f in FORMATS.items()} == {
        "fp8_ds_mla": (656, 512, 528),
        "int8_mla": (656, 512, 528),
        "fp8_index": (132, 128, 132),
        "int8_index": (132, 128, 132),
    }
    row = np.zeros((1, 576))
    row[0, :128] = np.linspace(-448, 448, 128)  # tile 0: max 448, scale exactly 1 for e4m3
    row[0, 128:256] = 0.0  # tile 1: all zero -> scale 1, codes 0
    row[0, 256:512] = 127.0  # tiles 2, 3: max 127 -> scale 127 / 448 (e4m3) or 1 (int8)
    row[0, 512:] = 1.5  # bf16 0x3FC0
    fp8 = ref.encode_rows(row, FORMATS["fp8_ds_mla"])[0]
    assert fp8[0] == 0xFE and fp8[127] == 0x7E  # -448, +448
    assert np.array_equal(fp8[128:256], np.zeros(128))
    assert np.array_equal(fp8[512:520], np.frombuffer(np.array([1.0, 1.0], "<f4").tobytes(), np.uint8))
    assert np.array_equal(fp8[528:532], [0xC0, 0x3F, 0xC0, 0x3F])  # little-endian bf16 1.5
    int8 = ref.encode_rows(row, FORMATS["int8_mla"])[0]
    assert int8[256] == 127 and np.frombuffer(int8[520:528].tobytes(), "<f4").tolist() == [1.0, 1.0]


def test_torch_encoder_matches_the_reference_and_decoders_are_exact():
    gen = torch.Generator().manual_seed(9)
    for fmt in FORMATS.values():
        rows = torch.randn(300, fmt.width, generator=gen) * torch.exp2(torch.randint(-10, 10, (300, 1), generator=gen))
        rows[::17, :128] = 0.0
        got = encode_rows(rows, fmt).numpy()
        want = ref.encode_rows(rows.double().numpy(), fmt)
        # The reference divides in float64, torch in fp32: codes may differ where x / scale is an fp32 rounding
        # away from a code boundary, by one code, and nowhere else.
        differing = np.argwhere(got != want)
        assert len(differing) <= 3, f"{fmt.name}: {len(differing)} bytes differ"
        assert (differing[:, 1] < fmt.scales_offset).all(), f"{fmt.name}: a scale or RoPE byte differs"
        # Decoding: torch's fp32 decoder is the reference's exact float64 value rounded once to fp32, on any bytes.
        data = torch.randint(0, 256, (64, fmt.row_bytes), dtype=torch.uint8, generator=gen)
        data[:, fmt.scales_offset : fmt.rope_offset] = torch.rand(64, fmt.num_scales, generator=gen).view(torch.uint8)
        if fmt.rope_dims:
            data[:, fmt.rope_offset :] = torch.randn(64, fmt.rope_dims, generator=gen).bfloat16().view(torch.uint8)
        if fmt.code == "e4m3":
            data[:, : fmt.scales_offset][torch.isin(data[:, : fmt.scales_offset], torch.tensor(NAN_CODES))] = 0
        want = ref.decode_rows(data.numpy(), fmt).astype(np.float32)
        assert np.array_equal(decode_rows(data, fmt).numpy(), want)


# ----------------------------------------------------------------------------------------- readers read exactly
def _every_code(fmt, rows: int, read_dims: int, gen: torch.Generator) -> torch.Tensor:
    """uint8 rows [rows, row_bytes] whose first `read_dims` codes of each row run through every non-NaN code, with
    scales of at most 16 significant bits (so code * scale is exact in fp32) and random bf16 RoPE values."""
    codes = torch.tensor([c for c in range(256) if not (fmt.code == "e4m3" and c in NAN_CODES)], dtype=torch.uint8)
    data = torch.randint(0, 127, (rows, fmt.row_bytes), dtype=torch.uint8, generator=gen)
    cycle = codes.repeat(rows * read_dims // len(codes) + 1)[: rows * read_dims]
    assert torch.isin(codes, cycle).all(), "too few rows to read every code"
    data[:, :read_dims] = cycle.view(rows, read_dims)
    mantissa = torch.randint(1 << 15, 1 << 16, (rows, fmt.num_scales), generator=gen).float()
    scales = mantissa * torch.exp2(torch.randint(-30, -10, (rows, fmt.num_scales), generator=gen).float())
    data[:, fmt.scales_offset : fmt.rope_offset] = scales.view(torch.uint8)
    if fmt.rope_dims:
        data[:, fmt.rope_offset :] = torch.randn(rows, fmt.rope_dims, generator=gen).bfloat16().view(torch.uint8)
    return data


@pytest.mark.parametrize("backend", READER_BACKENDS)
@pytest.mark.parametrize("kv_cache_dtype", ["fp8_index", "int8_index"])
def test_indexer_reads_every_code_exactly(backend, kv_cache_dtype):
    """Two heads with q = +e_d and -e_d and weights +1 and -1 score a key by relu(k_d) - relu(-k_d) = k_d: token d's
    logits row is dim d of every key. 64 keys x dims 0..3 hold every code."""
    fmt, keys, dims = FORMATS[kv_cache_dtype], 64, 4
    data = _every_code(fmt, keys, dims, torch.Generator().manual_seed(1))
    eye = torch.eye(128)[:dims]
    cache = torch.cat([data, torch.zeros(dims, fmt.row_bytes, dtype=torch.uint8)]).view(-1, 4, fmt.row_bytes)
    inputs = {
        "q_idx": torch.stack([eye, -eye], dim=1),  # [4 tokens, 2 heads, 128]
        "weights": torch.tensor([[1.0, -1.0]]).repeat(dims, 1),
        "index_k_cache": cache,
        "block_table": torch.arange(cache.shape[0], dtype=torch.int32)[None],
        "seq_lens_k": torch.tensor([keys + dims], dtype=torch.int32),  # queries at positions 64..67 see every key
        "cu_seqlens_q": torch.tensor([0, dims], dtype=torch.int32),
    }
    with glm5_hal.use_backend(_backend(backend), strict=True):
        logits = glm5_hal.indexer_logits(**inputs, kv_cache_dtype=kv_cache_dtype)
    want = ref.decode_rows(data.numpy(), fmt)[:, :dims]  # [64 keys, 4]
    assert np.array_equal(logits[:, :keys].double().numpy(), want.T)


@pytest.mark.parametrize("backend", READER_BACKENDS)
@pytest.mark.parametrize("kv_cache_dtype", ["fp8_ds_mla", "int8_mla"])
def test_sparse_attention_reads_every_code_exactly(backend, kv_cache_dtype):
    """One selected key per token: out = that key's whole row (d_v = 576, RoPE dims included), lse = its score."""
    fmt, rows = FORMATS[kv_cache_dtype], 2
    data = _every_code(fmt, rows, fmt.quantized_dims, torch.Generator().manual_seed(2))
    inputs = {
        "q": torch.zeros(rows, 4, 576),
        "kv_cache": data.view(1, rows, fmt.row_bytes),
        "indices": torch.arange(rows, dtype=torch.int32)[:, None],
        "block_table": torch.zeros(1, 1, dtype=torch.int32),
        "seq_lens_k": torch.tensor([rows], dtype=torch.int32),
        "cu_seqlens_q": torch.tensor([0, rows], dtype=torch.int32),
        "sm_scale": 0.0625,
        "d_v": 576,
    }
    with glm5_hal.use_backend(_backend(backend), strict=True):
        out, lse = glm5_hal.sparse_flash_attention(**inputs, kv_cache_dtype=kv_cache_dtype)
    want = ref.decode_rows(data.numpy(), fmt)  # [rows, 576]
    assert np.array_equal(out.double().numpy(), np.repeat(want[:, None], 4, axis=1))
    assert (lse == 0).all()


def test_triton_write_kernel_stores_the_reference_codes():
    """Rows whose tile maximum is 448 have scale 1, so the kernel's e4m3 encoder sees the values themselves:
    every e4m3 value and every midpoint (ties to even) must give the reference's code."""
    _backend("triton")
    from backends.triton.quantized_cache import quantize_into_cache

    values = np.unique(_e4m3_values())
    payload = np.concatenate([values, (values[1:] + values[:-1]) / 2])  # every value and every midpoint
    padded = np.zeros(-(-payload.size // 127) * 127)
    padded[: payload.size] = payload
    rows = np.concatenate([padded.reshape(-1, 127), np.full((padded.size // 127, 1), E4M3_MAX)], axis=1)  # scale 1
    fmt = FORMATS["fp8_index"]
    cache = torch.zeros(rows.shape[0], 1, fmt.row_bytes, dtype=torch.uint8)
    quantize_into_cache(torch.from_numpy(rows).float(), cache, torch.arange(rows.shape[0]), fmt)
    assert np.array_equal(cache[:, 0].numpy(), ref.encode_rows(rows, fmt))


# ------------------------------------------------------------------------------------------------- validation
def _inputs(case_id: str) -> dict:
    case = next(c for c in cases_for() if c.id == case_id)
    return case.build(case_generator(case, torch.float32, seed=5), torch.float32)


def _raises(exc, *fragments):
    return pytest.raises(exc, match=".*".join(re.escape(f) for f in fragments))


def test_bad_cache_arguments_name_the_argument():
    quantized = _inputs("sparse_flash_attention/mini_prefill_fp8_ds_mla")
    with _raises(ValueError, "kv_cache_dtype: expected one of ('auto', 'fp8_ds_mla', 'int8_mla')", "'fp8_index'"):
        glm5_hal.sparse_flash_attention(**{**quantized, "kv_cache_dtype": "fp8_index"})
    with _raises(TypeError, "kv_cache_dtype: expected a str, got int"):
        glm5_hal.sparse_flash_attention(**{**quantized, "kv_cache_dtype": 8})
    with _raises(TypeError, "kv_cache: a uint8 cache holds a quantized format", "kv_cache_dtype="):
        glm5_hal.sparse_flash_attention(**{**quantized, "kv_cache_dtype": "auto"})
    with _raises(TypeError, "kv_cache: expected dtype uint8, got float32"):
        glm5_hal.sparse_flash_attention(
            **{**_inputs("sparse_flash_attention/mini_prefill"), "kv_cache_dtype": "int8_mla"}
        )
    with _raises(ValueError, "kv_cache: expected shape [num_blocks, block_size, 656]", "got"):
        glm5_hal.sparse_flash_attention(**{**quantized, "kv_cache": quantized["kv_cache"][..., :576]})
    with _raises(ValueError, "kv_cache: kv_cache_dtype 'fp8_ds_mla' stores rows of 576 values", "D = 512"):
        glm5_hal.sparse_flash_attention(**{**quantized, "q": quantized["q"][..., :512], "d_v": 256})
    index = _inputs("indexer_logits/mini_prefill_int8_index")
    with _raises(ValueError, "index_k_cache: expected shape [num_blocks, block_size, 132]", "got"):
        glm5_hal.indexer_logits(**{**index, "index_k_cache": index["index_k_cache"][..., :128]})
    prolog = _inputs("mla_prolog/mini_prefill_int8_mla")
    with _raises(ValueError, "kv_cache_dtype: expected one of ('auto', 'fp8_ds_mla', 'int8_mla')", "'int8_index'"):
        glm5_hal.mla_prolog(**{**prolog, "kv_cache_dtype": "int8_index"})


def test_a_backend_without_the_format_refuses_it():
    torch_ops = registry().ops("torch")
    registry().register(
        Backend("no-formats", "test", lambda: Availability(True, "test", ("cpu",)), lambda: dict(torch_ops))
    )
    try:
        inputs = _inputs("lightning_indexer/mini_decode_int8_index")
        with glm5_hal.use_backend("no-formats"):
            glm5_hal.lightning_indexer(**{**_inputs("lightning_indexer/mini_decode"), "kv_cache_dtype": "auto"})
            with _raises(KVCacheFormatUnsupportedError, "'int8_index' is not supported", "'no-formats'", "'torch'"):
                glm5_hal.lightning_indexer(**inputs)
    finally:
        registry().unregister("no-formats")


# ------------------------------------------------------------------------------------------------ the model
def test_model_cache_option_writes_and_reads_quantized_rows():
    from glm5_hal.model import CausalLM, random_state_dict

    model = CausalLM(GLM5_MINI, random_state_dict(GLM5_MINI, seed=2))
    ids = torch.randint(0, GLM5_MINI.vocab_size, (80,), generator=torch.Generator().manual_seed(3))
    cache = model.new_cache(96, kv_cache_dtype="int8_mla", index_cache_dtype="fp8_index", shuffle_seed=1)
    assert cache.kv[0].dtype == torch.uint8 and cache.kv[0].shape[-1] == 656 and cache.index_k[0].shape[-1] == 132
    assert cache.bytes_per_token() == (656 + 132) * GLM5_MINI.num_hidden_layers
    float_cache = model.new_cache(96)
    assert float_cache.bytes_per_token() == (576 + 128) * 4 * GLM5_MINI.num_hidden_layers
    with glm5_hal.use_backend("torch"):
        prefill = model.step(cache, {0: ids[:60]})
        decode = model.step(cache, {0: ids[60:]})  # decode-style continuation reads the stored rows
        base = model.prefill(ids)
    logits = torch.cat([prefill.logits, decode.logits])
    assert 15.0 < _sqnr(base.logits, logits) < 80.0  # close to the float cache, and really quantized
    # The decomposed prologs (taken when a projection is replaced) encode their rows the same way.
    with glm5_hal.use_backend("torch"):
        fused = model.prefill(ids, kv_cache_dtype="int8_mla", index_cache_dtype="fp8_index")
        for layer in model.model.layers:
            layer.self_attn.fused = layer.self_attn.indexer.fused = False
        decomposed = model.prefill(ids, kv_cache_dtype="int8_mla", index_cache_dtype="fp8_index")
    assert _sqnr(fused.logits, decomposed.logits) > 60.0


def _sqnr(reference: torch.Tensor, test: torch.Tensor) -> float:
    noise = (reference.double() - test.double()).norm()
    return float(20 * torch.log10(reference.double().norm() / noise))


# --------------------------------------------------------------------------------- sizes, bench, ONNX, quality
def test_kv_cache_command_bytes_and_memory(capsys):
    assert main(["kv-cache", "--preset", "glm5", "--json"]) == 0
    rows = {r["cache"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert [rows[c]["bytes_per_token_layer"] for c in ("auto", "fp8", "int8")] == [1408, 788, 788]
    assert rows["fp8"]["context_bytes"] == 788 * 78 * 131072
    assert main(["kv-cache", "--preset", "deepseek-v32", "--dtype", "float32"]) == 0
    assert "2816" in capsys.readouterr().out  # (576 + 128) * 4 bytes
    assert main(["kv-cache", "--preset", "nope"]) == 2


def test_bench_cost_model_counts_the_stored_bytes():
    from perf.costs import cost
    from perf.scenarios import select

    scenarios = {(s.op, s.name.rsplit("/", 1)[1]): s for s in select(["mini-kv-cache"])}
    for op in ("lightning_indexer", "sparse_flash_attention", "mla_prolog", "indexer_prolog"):
        build = {family: scenarios[(op, f"{family}-cache")].build for family in ("auto", "fp8", "int8")}
        costs = {family: cost(op, b(torch.Generator().manual_seed(0), torch.bfloat16)) for family, b in build.items()}
        assert costs["fp8"].flops == costs["auto"].flops == costs["int8"].flops, op
        assert costs["fp8"].bytes == costs["int8"].bytes != costs["auto"].bytes, op
    inputs = scenarios[("sparse_flash_attention", "fp8-cache")].build(torch.Generator().manual_seed(0), torch.bfloat16)
    float_inputs = scenarios[("sparse_flash_attention", "auto-cache")].build(
        torch.Generator().manual_seed(0), torch.bfloat16
    )
    saved = cost("sparse_flash_attention", float_inputs).bytes - cost("sparse_flash_attention", inputs).bytes
    selected = int((inputs["indices"] >= 0).sum())
    assert saved == selected * (1152 - 656)  # bf16 rows of 576 -> 656 stored bytes


def test_export_onnx_kv_cache_option(tmp_path, capsys):
    pytest.importorskip("onnx", reason="the onnx extra is not installed: pip install glm5-hal[onnx]")
    assert main(["export-onnx", "--preset", "glm5-mini", "--out", str(tmp_path), "--ops",
                 "sparse_flash_attention,indexer_prolog", "--kv-cache", "int8"]) == 0  # fmt: skip
    import onnx

    model = onnx.load(tmp_path / "sparse_flash_attention.onnx")
    cache = next(v for v in model.graph.input if v.name == "kv_cache")
    assert cache.type.tensor_type.elem_type == onnx.TensorProto.UINT8
    assert cache.type.tensor_type.shape.dim[2].dim_value == 656
    meta = {p.key: p.value for p in model.metadata_props}
    assert json.loads(meta["glm5_hal.arguments"])["kv_cache_dtype"] == "int8_mla"
    written = onnx.load(tmp_path / "indexer_prolog.onnx").graph.output
    assert next(v for v in written if v.name == "index_k_cache_out").type.tensor_type.shape.dim[2].dim_value == 132


@pytest.mark.parametrize("cfg", [GLM5, DEEPSEEK_V32], ids=lambda c: c.name)
def test_quality_at_real_dims_small_context(cfg):
    """The quality report's measurement at real model dims over 4K keys (docs/kv_cache.md has 16K and 64K): the
    public stacks' bar of 2000 / 2048 for the indexer's top-k, and attention errors of the formats' precision."""
    from quantization.kv_cache_report import TOPK, op_quality

    rows = {r.format: r for r in op_quality(cfg, 4096, 4, seed=1)}
    for name in ("fp8_index", "int8_index"):
        assert rows[name].topk_overlap_min * TOPK >= 2000, (name, rows[name])
    assert rows["int8_index"].topk_overlap_mean >= rows["fp8_index"].topk_overlap_mean
    assert rows["int8_mla"].out_rel_err < 0.03 and rows["fp8_ds_mla"].out_rel_err < 0.1
    assert rows["int8_mla"].out_rel_err < rows["fp8_ds_mla"].out_rel_err / 2  # 7 bits per tile vs 3 mantissa bits


def test_the_write_judge_catches_wrong_bytes():
    """compare_quantized_cache passes the reference's own bytes and fails a code off by two steps, a scale off by
    1%, a row written where no token writes, and RoPE values shifted by one place."""
    from glm5_hal.parity.quantized_cache import compare_quantized_cache

    fmt = FORMATS["int8_mla"]
    gen = np.random.default_rng(6)
    rows = gen.standard_normal((5, fmt.width))
    slots = np.array([3, -1, 0, 7, 5])
    before = gen.integers(0, 256, (2, 4, fmt.row_bytes), dtype=np.uint8)
    after = before.copy().reshape(-1, fmt.row_bytes)
    keep = slots >= 0
    after[slots[keep]] = ref.encode_rows(rows[keep], fmt)

    def judge(stored: np.ndarray) -> bool:
        out = torch.from_numpy(stored.reshape(before.shape))
        return compare_quantized_cache("kv_cache", out, before, rows, after, slots, fmt, torch.float32).passed

    assert judge(after)
    code_off = after.copy()
    code_off[3, 10] = np.uint8((int(code_off[3, 10].view(np.int8)) + 2) % 256)  # two int8 steps
    assert not judge(code_off)
    scale_off = after.copy()
    scale_off[0, 512:516] = np.frombuffer(
        (np.frombuffer(after[0, 512:516].tobytes(), "<f4") * 1.01).tobytes(), np.uint8
    )
    assert not judge(scale_off)
    stray = after.copy()
    stray[1] = after[0]  # slot 1 belongs to no token
    assert not judge(stray)
    rope_off = after.copy()
    rope_off[7, 528:] = np.roll(after[7, 528:].reshape(-1, 2), 1, axis=0).reshape(-1)  # RoPE values shifted
    assert not judge(rope_off)


# ----------------------------------------------------------------------------------------------- NaN and inf
def _rows_with_nan_and_inf(fmt, gen: torch.Generator) -> torch.Tensor:
    """fp32 rows [4, width]: row 0's first tile holds a NaN, row 1's an inf, row 2's a -inf and a NaN, row 3 is
    finite; a latent row 0 also holds +inf / -inf in its second / third tile and NaN, +-inf and a value past
    bf16's range (rounds to inf) in its RoPE dims."""
    rows = torch.randn(4, fmt.width, generator=gen)
    rows[0, 5] = float("nan")
    rows[1, 100] = float("inf")
    rows[2, 7], rows[2, 8] = float("-inf"), float("nan")
    if fmt.num_scales > 1:
        rows[0, 130], rows[0, 300] = float("inf"), float("-inf")
        rows[0, fmt.quantized_dims : fmt.quantized_dims + 4] = torch.tensor([float("nan"), float("inf"), -1e39, 3.4e38])
    return rows


def _encoders() -> dict:
    encoders = {
        "reference": lambda rows, fmt: torch.from_numpy(ref.encode_rows(rows.double().numpy(), fmt)),
        "torch": encode_rows,
    }
    if registry().availability("triton").available:
        from backends.triton.quantized_cache import quantize_into_cache

        def triton_encode(rows, fmt):
            cache = torch.zeros(rows.shape[0], 1, fmt.row_bytes, dtype=torch.uint8)
            quantize_into_cache(rows, cache, torch.arange(rows.shape[0]), fmt)
            return cache[:, 0]

        encoders["triton"] = triton_encode
    return encoders


@pytest.mark.parametrize("encoder", ["reference", "torch", "triton"])
@pytest.mark.parametrize("fmt", FORMATS.values(), ids=lambda f: f.name)
def test_a_nan_or_inf_tile_stores_codes_0_and_a_nan_or_inf_scale(encoder, fmt):
    """ops_reference.kv_cache "NaN and inf": scale NaN (a tile with NaN) or +inf (with +-inf), codes 0, so the
    whole tile reads NaN; RoPE values keep their bf16 rounding (NaN, +-inf, and +-inf past bf16's range)."""
    if encoder not in _encoders():
        pytest.skip("triton unavailable")
    rows = _rows_with_nan_and_inf(fmt, torch.Generator().manual_seed(11))
    stored = _encoders()[encoder](rows, fmt).numpy()
    codes = stored[:, : fmt.scales_offset].reshape(4, fmt.num_scales, 128)
    scales = np.ascontiguousarray(stored[:, fmt.scales_offset : fmt.rope_offset]).view("<f4")
    nan_tiles = [(0, 0), (2, 0)]
    inf_tiles = [(1, 0)] + ([(0, 1), (0, 2)] if fmt.num_scales > 1 else [])
    for row, tile in nan_tiles + inf_tiles:
        assert (codes[row, tile] == 0).all(), f"row {row} tile {tile}: codes {np.unique(codes[row, tile])}"
    assert all(np.isnan(scales[r, t]) for r, t in nan_tiles)
    assert all(scales[r, t] == np.inf for r, t in inf_tiles)
    values = ref.decode_rows(stored, fmt)
    for row, tile in nan_tiles + inf_tiles:
        assert np.isnan(values[row, tile * 128 : (tile + 1) * 128]).all()
    assert np.isfinite(values[3]).all()
    if fmt.rope_dims:
        rope = values[0, fmt.quantized_dims : fmt.quantized_dims + 4]
        assert np.isnan(rope[0]) and rope[1:].tolist() == [np.inf, -np.inf, np.inf]
    # The finite parts are the reference's bytes (up to a code at an fp32 boundary tie).
    want = ref.encode_rows(rows.double().numpy(), fmt)
    finite_tiles = np.isfinite(scales)
    assert (codes[finite_tiles] != want[:, : fmt.scales_offset].reshape(4, -1, 128)[finite_tiles]).sum() <= 2


def test_the_write_judge_holds_nan_and_inf_tiles_to_the_rule():
    from glm5_hal.parity.quantized_cache import compare_quantized_cache

    fmt = FORMATS["fp8_ds_mla"]
    rows = _rows_with_nan_and_inf(fmt, torch.Generator().manual_seed(12)).double().numpy()
    slots = np.arange(4)
    before = np.zeros((4, 1, fmt.row_bytes), np.uint8)
    stored = ref.encode_rows(rows, fmt)

    def judge(data: np.ndarray) -> bool:
        out = torch.from_numpy(data.reshape(before.shape))
        return compare_quantized_cache("kv_cache", out, before, rows, stored, slots, fmt, torch.float32).passed

    assert judge(stored)
    nan_code = stored.copy()
    nan_code[0, 3] = 0x7F  # a NaN code in the NaN tile instead of 0
    assert not judge(nan_code)
    finite_scale = stored.copy()
    finite_scale[1, 512:516] = np.frombuffer(np.float32(1.0).tobytes(), np.uint8)  # the inf tile's scale
    assert not judge(finite_scale)
    rope = stored.copy()
    rope[0, 528:530] = 0  # the NaN RoPE value stored as 0.0
    assert not judge(rope)


def _nan_and_inf_writes(op: str, inputs: dict) -> None:
    """NaN into one tile of every written row and inf into another: through the norm weight, which scales one dim
    of every token's normalised row (a latent row: dim 5 NaN, dim 200 inf; an index key: dim 100 inf)."""
    if op == "mla_prolog":
        inputs["gamma_ckv"][5], inputs["gamma_ckv"][200] = float("nan"), float("inf")
    else:
        inputs["k_norm_weight"][100] = float("inf")


@pytest.mark.parametrize("backend", [*READER_BACKENDS, "ascend"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kv_cache_dtype", list(FORMATS))
def test_prologs_write_nan_and_inf_tiles_by_the_rule(backend, dtype, kv_cache_dtype, request):
    """Every backend's writer (ascend on the strict torch_npu fake: its kernels' rows, then the shared encoder)."""
    from glm5_hal.parity.quantized_cache import with_quantized_cache
    from glm5_hal.parity.runner import run_inputs

    if backend == "ascend":
        request.getfixturevalue("fake_torch_npu")
    _backend(backend)
    op = "mla_prolog" if FORMATS[kv_cache_dtype].cache == "latent" else "indexer_prolog"
    case = with_quantized_cache(next(c for c in cases_for(quick=True) if c.op == op), kv_cache_dtype)
    inputs = case.build(case_generator(case, dtype, seed=13), dtype)
    _nan_and_inf_writes(op, inputs)
    result = run_inputs(op, inputs, backend, dtype, name=case.name)
    assert result.passed, result.detail


@pytest.mark.parametrize("kv_cache_dtype", list(FORMATS))
def test_onnx_graphs_write_nan_and_inf_tiles_by_the_rule(kv_cache_dtype):
    """The exported writer, run by onnxruntime, stores the rule's bytes."""
    pytest.importorskip("onnxruntime", reason="the onnx extra is not installed: pip install glm5-hal[onnx]")
    from glm5_hal.onnx_export import contract_outputs, export_like
    from glm5_hal.onnx_export.runtime import run, session
    from glm5_hal.parity.quantized_cache import with_quantized_cache
    from glm5_hal.parity.specs import SPECS

    fmt = FORMATS[kv_cache_dtype]
    op = "mla_prolog" if fmt.cache == "latent" else "indexer_prolog"
    case = with_quantized_cache(next(c for c in cases_for(quick=True) if c.op == op), kv_cache_dtype)
    inputs = case.build(case_generator(case, torch.float32, seed=14), torch.float32)
    _nan_and_inf_writes(op, inputs)
    produced = contract_outputs(run(session(export_like(op, inputs)), inputs))
    spec = SPECS[op]
    verdicts = spec.judge(
        inputs, {n: torch.from_numpy(produced[n]) for n in spec.output_names + spec.mutated}, torch.float32
    )
    assert all(v.passed for v in verdicts), [v for v in verdicts if not v.passed]


@pytest.mark.parametrize("backend", [*READER_BACKENDS, "onnxruntime"])
@pytest.mark.parametrize("op", ["indexer_logits", "lightning_indexer", "sparse_flash_attention"])
def test_readers_propagate_nan_and_inf_scales_as_the_reference(backend, op):
    """A NaN / inf scale (a tile written with NaN / inf) reads NaN where its codes are 0 and +-inf elsewhere: every
    backend's outputs are the reference's, NaN positions included (docs/ops.md "NaN")."""
    from glm5_hal.parity.quantized_cache import store_nonfinite_tiles, with_quantized_cache
    from glm5_hal.parity.runner import run_inputs
    from glm5_hal.parity.specs import SPECS

    kv_cache_dtype = "int8_mla" if op == "sparse_flash_attention" else "fp8_index"
    fmt = FORMATS[kv_cache_dtype]
    case = with_quantized_cache(next(c for c in cases_for(quick=True) if c.op == op), kv_cache_dtype)
    inputs = case.build(case_generator(case, torch.float32, seed=15), torch.float32)
    name = "kv_cache" if fmt.cache == "latent" else "index_k_cache"
    store_nonfinite_tiles(inputs[name], fmt, nan_every=3, inf_every=5)
    outputs = SPECS[op].reference({k: v for k, v in inputs.items()})
    assert any(np.isnan(v).any() for v in outputs.values()), "no output reads a NaN scale: the test is void"
    if backend != "onnxruntime":
        result = run_inputs(op, inputs, _backend(backend), torch.float32, name=case.name)
        assert result.passed, result.detail
        return
    pytest.importorskip("onnxruntime", reason="the onnx extra is not installed: pip install glm5-hal[onnx]")
    from glm5_hal.onnx_export import contract_outputs, export_like
    from glm5_hal.onnx_export.runtime import run, session

    produced = contract_outputs(run(session(export_like(op, inputs)), inputs))
    spec = SPECS[op]
    got = {n: torch.from_numpy(produced[n]) for n in spec.output_names + spec.mutated if n in produced}
    verdicts = spec.judge(inputs, got, torch.float32)
    assert all(v.passed for v in verdicts), [v for v in verdicts if not v.passed]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_index"])
@pytest.mark.parametrize("layout", ["contiguous", "pages longer than blocks", "rows wider than the cache"])
@pytest.mark.parametrize("slots", [[5, 22, 0], [5, -1, 22, 0, -1], [-1, -1], []])
def test_write_rows_equals_the_reference_on_every_layout(kv_cache_dtype, layout, slots):
    """glm5_hal.kv_formats.write_rows (the engines' and decomposed prologs' cache write) writes what
    ops_reference.paged_cache.write_cache does, and nothing beside it: every slot written (one flat copy where the
    blocks are one run of rows), padding slots (-1) skipped, a cache whose pages are longer than its blocks or whose
    rows sit inside wider rows (a strided view, written by block and offset)."""
    from glm5_hal.kv_formats import write_rows

    gen = torch.Generator().manual_seed(len(slots) * 7 + len(layout))
    num_blocks, block_size = 6, 4
    width = 128 if kv_cache_dtype == "auto" else FORMATS[kv_cache_dtype].row_bytes
    pages, columns = (block_size + 3 if layout == "pages longer than blocks" else block_size), width
    columns += 40 if layout == "rows wider than the cache" else 0
    if kv_cache_dtype == "auto":
        storage = torch.randn(num_blocks, pages, columns, generator=gen)
    else:
        storage = torch.randint(0, 256, (num_blocks, pages, columns), generator=gen, dtype=torch.int32).to(torch.uint8)
    original = storage.clone()
    cache = storage[:, :block_size, 8 : 8 + width] if columns > width else storage[:, :block_size]
    before = cache.clone()
    slot_mapping = torch.tensor(slots, dtype=torch.int64)
    rows = torch.randn(len(slots), 128, generator=gen)
    write_rows(cache, slot_mapping, rows, kv_cache_dtype)
    want = ref.write_cache(before.numpy(), slot_mapping.numpy(), rows.numpy(), kv_cache_dtype)
    assert torch.equal(cache, torch.from_numpy(want).to(cache.dtype))
    outside = torch.ones_like(storage, dtype=torch.bool)
    if columns > width:
        outside[:, :block_size, 8 : 8 + width] = False
    else:
        outside[:, :block_size] = False
    assert torch.equal(storage[outside], original[outside]), "write_rows wrote outside the cache's rows"
