"""The `ascend` backend without an NPU: detection, selection, and the parity suite on a strict torch_npu fake.

The fake (parity_tests/fakes/ascend) defines every torch_npu op the backend calls from the real torch-npu 2.14.0
schema, rejects what the torch_npu documentation forbids and computes with ops_reference; see docs/ascend.md for
what this does and does not prove. Tests needing the wheel are skipped, with the reason, when it cannot be fetched.

    pytest parity_tests/test_ascend.py parity_tests/test_ascend_adapters.py [--quick]
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch

import glm5_hal
from backends.ascend import detect as ascend_probe
from backends.ascend.layouts import rope_table_pairs
from fakes.ascend.common import FakeNpuError
from fakes.ascend.fixture import fake_torch_npu_fixture, torch_npu_schemas_fixture  # noqa: F401 (pytest fixtures)
from glm5_hal import weight_cache
from glm5_hal.cli.info import op_table
from glm5_hal.parity import CASES, run_case
from glm5_hal.registry import registry
from glm5_hal.selection import resolve, use_backend

BF16, FP32, BOTH = ("bfloat16",), ("float32",), ("float32", "bfloat16")
# The fused kernel each op's parity cases must reach, and in which dtypes; other dtypes run the portable path.
FUSED_KERNEL = {
    "mla_prolog": (BF16, "npu_kv_rmsnorm_rope_cache"),
    "indexer_prolog": (BOTH, "npu_rotary_mul"),
    "lightning_indexer": (BF16, "npu_lightning_indexer"),
    "sparse_flash_attention": (BF16, "npu_sparse_flash_attention"),
    "moe_gate": (FP32, "npu_moe_gating_top_k"),
    "moe_dispatch": (BOTH, "npu_moe_init_routing_v2"),
    "grouped_matmul": (BOTH, "npu_grouped_matmul"),
    "moe_combine": (BOTH, "npu_moe_token_unpermute"),
    "fused_moe": (BOTH, "npu_swiglu"),
    "dynamic_quant": (BF16, "npu_dynamic_quant"),
    "quant_matmul": (BF16, "npu_quant_matmul"),
    "w4a8_matmul": (BF16, "npu_weight_quant_batchmatmul"),
}
# Cases whose route differs from their op's row above, and why.
ROUTE_EXCEPTIONS = {
    "mla_prolog/deepseek_v32_dims": "npu_mla_prolog_v3",  # inside npu_mla_prolog_v3's documented shape range
    "lightning_indexer/fewer_visible_than_topk": None,  # block size 8: the kernel takes multiples of 16
    "lightning_indexer/topk_wider_than_cache": None,  # block size 8 as well
    "moe_gate/mini_groups_softmax": None,  # softmax + renormalisation: torch_npu 2.14 takes renorm=0 only
    "moe_gate/no_bias_unnormalised": None,  # the kernel always renormalises sigmoid weights
}


# Quantized-cache cases (named <float case>_<format>): their route where it differs from their op's row above.
QUANTIZED_ROUTES = {
    "int8_mla": {"sparse_flash_attention": "npu_kv_quant_sparse_flash_attention"},
    "fp8_ds_mla": {"sparse_flash_attention": None},  # no A2/A3 kernel reads an e4m3 cache
    "fp8_index": {"lightning_indexer": None},  # npu_quant_lightning_indexer needs int8 queries and split keys
    "int8_index": {"lightning_indexer": None},
}


def expected_kernel(case, dtype_name: str) -> str | None:
    """The fused kernel `case` must run in `dtype_name`, or None if it must run the portable torch path."""
    dtypes, kernel = FUSED_KERNEL.get(case.op, ((), None))
    if dtype_name not in dtypes:
        return None
    for fmt, routes in QUANTIZED_ROUTES.items():
        if case.name.endswith(fmt) and case.op in routes:
            return routes[case.op]
    return ROUTE_EXCEPTIONS.get(case.id, kernel)


def _parity_params():
    for case in CASES:
        for dtype in case.dtypes:
            marks = [pytest.mark.slow] if case.slow else []
            yield pytest.param(case, dtype, id=f"{case.id}-{str(dtype).removeprefix('torch.')}", marks=marks)


@pytest.mark.parametrize(("case", "dtype"), list(_parity_params()))
def test_ascend_parity(fake_torch_npu, case, dtype: torch.dtype, request, record_parity) -> None:
    if case.slow and request.config.getoption("--quick"):
        pytest.skip("real-dims case skipped by --quick")
    result = run_case(case, "ascend", dtype)
    record_parity(result)
    assert result.passed, f"{result.status}: {result.detail} (worst rel err {result.rel_err:.3g})"
    kernel = expected_kernel(case, result.dtype)
    if kernel is None:
        assert not fake_torch_npu.calls, f"expected the portable path, but ran {dict(fake_torch_npu.calls)}"
    else:
        assert fake_torch_npu.calls[kernel] > 0, f"expected {kernel} to run, ran {dict(fake_torch_npu.calls)}"


# ------------------------------------------------------------------------------------------- detection (probe)
def test_fake_is_available_on_its_cpu_stand_in(fake_torch_npu) -> None:
    avail = registry().availability("ascend")
    assert avail.available and avail.device_types == ("npu", "cpu")
    assert "fake" in avail.reason and "stand-in" in avail.reason


def test_probe_without_torch_npu(monkeypatch) -> None:
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    if importlib.util.find_spec("torch_npu") is not None:
        pytest.skip("torch_npu is installed here")
    avail = ascend_probe.probe()
    assert not avail.available and avail.reason.startswith("torch_npu is not installed")


def _module(is_available: bool, count: int) -> types.ModuleType:
    module = types.ModuleType("torch_npu")
    module.__version__ = "9.9.9"
    module.npu = types.SimpleNamespace(is_available=lambda: is_available, device_count=lambda: count)
    return module


def test_probe_without_a_visible_npu(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "torch_npu", _module(False, 0))
    avail = ascend_probe.probe()
    assert not avail.available
    assert "no NPU is visible" in avail.reason and "ASCEND_RT_VISIBLE_DEVICES" in avail.reason


def test_probe_with_visible_npus_runs_on_npu_only(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "torch_npu", _module(True, 2))
    avail = ascend_probe.probe()
    assert avail.available and avail.device_types == ("npu",) and "2 NPU(s)" in avail.reason


BROKEN_TORCH_NPU = """
    import os
    open(os.environ["TORCH_NPU_IMPORT_MARKER"], "w").close()
    raise {error}(
        "libhccl.so: cannot open shared object file: No such file or directory. Please check that the cann "
        "package is installed. Please run 'source set_env.sh' in the CANN installation path."
    )
"""


@pytest.fixture(params=["ImportError", "OSError"])
def broken_torch_npu(request, tmp_path: Path, monkeypatch) -> Path:
    """A torch_npu on sys.path whose import fails the way it does without CANN; returns the file its import creates."""
    package = tmp_path / "site" / "torch_npu"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(textwrap.dedent(BROKEN_TORCH_NPU).format(error=request.param))
    marker = tmp_path / "imported"
    monkeypatch.setenv("TORCH_NPU_IMPORT_MARKER", str(marker))
    monkeypatch.syspath_prepend(str(package.parent))
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    return marker


def test_missing_cann_is_a_readable_reason(broken_torch_npu: Path, monkeypatch) -> None:
    monkeypatch.delenv(ascend_probe.ENV_AUTOLOAD, raising=False)
    avail = ascend_probe.probe()
    assert not avail.available
    assert avail.reason.startswith("torch_npu import failed: libhccl.so not found; is CANN installed?")
    assert "set_env.sh" in avail.reason


def test_autoload_disabled_means_no_implicit_import(broken_torch_npu: Path, monkeypatch) -> None:
    monkeypatch.setenv(ascend_probe.ENV_AUTOLOAD, "0")
    avail = ascend_probe.probe()
    assert not avail.available and "TORCH_DEVICE_BACKEND_AUTOLOAD=0" in avail.reason
    assert not broken_torch_npu.exists(), "the probe imported torch_npu although autoload is disabled"


@pytest.mark.parametrize("broken_torch_npu", ["ImportError"], indirect=True)  # one subprocess is enough
def test_import_and_info_survive_a_broken_torch_npu(broken_torch_npu: Path) -> None:
    """`import glm5_hal` (and the backend package) never imports torch_npu; `glm5-hal info` shows the reason."""
    code = textwrap.dedent(
        """
        import os, sys
        import glm5_hal, backends.ascend
        assert "torch_npu" not in sys.modules and not os.path.exists(os.environ["TORCH_NPU_IMPORT_MARKER"])
        from glm5_hal.cli import main
        sys.exit(main(["info"]))
        """
    )
    env = {k: v for k, v in os.environ.items() if k not in ("GLM5_HAL_BACKEND", ascend_probe.ENV_AUTOLOAD)}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    line = next(line for line in done.stdout.splitlines() if line.strip().startswith("ascend"))
    assert "UNAVAILABLE" in line and "torch_npu import failed: libhccl.so not found; is CANN installed?" in line


# ------------------------------------------------------------------------------------------------- selection
def test_auto_picks_ascend_and_delegates_what_torch_npu_cannot_express(fake_torch_npu, monkeypatch) -> None:
    monkeypatch.delenv("GLM5_HAL_BACKEND", raising=False)
    monkeypatch.delenv("GLM5_HAL_OP_BACKENDS", raising=False)
    assert resolve("sparse_flash_attention", "cpu").backend == "ascend"  # ahead of torch (auto_priority 30 > 0)
    with use_backend("ascend", strict=True):
        delegated = resolve("indexer_logits", "cpu")
    assert delegated.backend == "torch" and "through 'torch'" in delegated.reason
    table = op_table("ascend")
    assert table["indexer_logits"] == "via torch" and table["hadamard_transform"] == "via torch"
    assert all(how == "native" for op, how in table.items() if op not in ("indexer_logits", "hadamard_transform"))


# ----------------------------------------------------------------------------------- the fake is strict
def _indexer_inputs(block_size: int = 16):
    q = torch.randn(3, 4, 128, dtype=torch.bfloat16)
    key = torch.randn(2, block_size, 1, 128, dtype=torch.bfloat16)
    weights = torch.randn(3, 4, dtype=torch.bfloat16)
    lengths = dict(
        actual_seq_lengths_query=torch.tensor([3], dtype=torch.int32),
        actual_seq_lengths_key=torch.tensor([block_size + 1], dtype=torch.int32),
        block_table=torch.tensor([[1, 0]], dtype=torch.int32),
    )
    return q, key, weights, lengths


def test_pytorch_enforces_the_real_schemas(fake_torch_npu) -> None:
    """Wrong keyword, missing argument, wrong type: refused by PyTorch's schema check, before any fake kernel."""
    q, key, weights, lengths = _indexer_inputs()
    bad_calls = [
        lambda: fake_torch_npu.npu_lightning_indexer(q, key, weights, sparse_cnt=4, **lengths),  # misspelt
        lambda: fake_torch_npu.npu_sparse_flash_attention(q, key, key, torch.zeros(3, 1, 4, dtype=torch.int32)),
        lambda: fake_torch_npu.npu_moe_gating_top_k(torch.randn(4, 16), 2.5),  # k is an int
    ]
    for call in bad_calls:
        with pytest.raises((TypeError, RuntimeError)) as err:
            call()
        assert not isinstance(err.value, FakeNpuError), err.value
    assert not fake_torch_npu.calls, "a kernel ran although the schema should have refused the call"
    indices, _ = fake_torch_npu.npu_lightning_indexer(
        q, key, weights, layout_query="TND", layout_key="PA_BSND", sparse_count=4, **lengths
    )
    assert indices.shape == (3, 1, 4) and indices.dtype == torch.int32


def test_the_fake_rejects_what_the_docs_forbid(fake_torch_npu) -> None:
    q, key, weights, lengths = _indexer_inputs(block_size=8)
    with pytest.raises(FakeNpuError, match="multiple of 16"):
        fake_torch_npu.npu_lightning_indexer(q, key, weights, layout_query="TND", layout_key="PA_BSND", **lengths)
    gate = torch.randn(4, 16)
    with pytest.raises(FakeNpuError, match="renorm"):
        fake_torch_npu.npu_moe_gating_top_k(gate, 2, renorm=1, norm_type=0)
    latent = torch.randn(2, 16, 1, 512, dtype=torch.bfloat16)
    sfa = dict(
        query_rope=torch.randn(2, 4, 64, dtype=torch.bfloat16),
        key_rope=torch.randn(2, 16, 1, 64, dtype=torch.bfloat16),
        actual_seq_lengths_query=torch.tensor([2], dtype=torch.int32),
        actual_seq_lengths_kv=torch.tensor([20], dtype=torch.int32),
        block_table=torch.tensor([[0, 1]], dtype=torch.int32),
        layout_query="TND",
        layout_kv="PA_BSND",
        attention_mode=2,
    )
    query = torch.randn(2, 4, 512, dtype=torch.bfloat16)
    ok = torch.tensor([[[3, 1, -1]], [[0, 2, 5]]], dtype=torch.int32)
    fake_torch_npu.npu_sparse_flash_attention(query, latent, latent, ok, 0.1, **sfa)
    with pytest.raises(FakeNpuError, match="PA_BSND"):
        fake_torch_npu.npu_sparse_flash_attention(query, latent, latent, ok, 0.1, return_softmax_lse=True, **sfa)
    with pytest.raises(FakeNpuError, match="valid indices first"):
        holes = torch.tensor([[[3, -1, 1]], [[0, 2, 5]]], dtype=torch.int32)
        fake_torch_npu.npu_sparse_flash_attention(query, latent, latent, holes, 0.1, **sfa)
    with pytest.raises(FakeNpuError, match="share one tensor"):
        fake_torch_npu.npu_sparse_flash_attention(query, latent, latent.clone(), ok, 0.1, **sfa)


# ------------------------------------------------------------------- the fake catches a wrong adapter
def _case(case_id: str):
    return next(c for c in CASES if c.id == case_id)


def _keep(x):
    return x


def _keep_pair(q, scale):
    return q, scale


MLA = "mla_prolog/mini_decode"


MUTATIONS = [
    # (what the broken adapter does, module attribute replaced, replacement, case that catches it, in which output)
    ("RoPE pairs left as halves", "backends.ascend.mla_prolog.interleave_rope_pairs", _keep, MLA, "q_pe"),
    ("cos/sin as pairs, not halves", "backends.ascend.mla_prolog.rope_table_halves", rope_table_pairs, MLA, "q_pe"),
    ("src_index, not its inverse", "backends.ascend.moe.invert_permutation", _keep, "moe_combine/mini", "out"),
    ("no zero-row rule", "backends.ascend.quant.contract_quant_scale", _keep_pair, "dynamic_quant/zero_row_3d", "q"),
    (
        "invalid indices masked in place, not moved last",
        "backends.ascend.layouts.valid_first",
        lambda indices, valid: torch.where(valid, indices, -1),
        "sparse_flash_attention/ragged_with_invalid",
        "valid indices first",  # the fake refuses the call: the kernel needs them first
    ),
    (
        "int8_mla rows passed as stored (scales before RoPE)",
        "backends.ascend.quantized_cache.kernel_rows",
        lambda rows: rows.view(torch.int8),
        "sparse_flash_attention/decode_int8_mla",
        "out:",
    ),
]


@pytest.mark.parametrize(("bug", "target", "replacement", "case_id", "where"), MUTATIONS, ids=[m[0] for m in MUTATIONS])
def test_parity_on_the_fake_catches_a_broken_adapter(
    fake_torch_npu, monkeypatch, bug, target, replacement, case_id, where
) -> None:
    monkeypatch.setattr(target, replacement)
    result = run_case(_case(case_id), "ascend", torch.bfloat16)
    assert not result.passed, f"a backend with '{bug}' passed {case_id}"
    assert where in result.detail, f"'{bug}' was caught for another reason: {result.detail}"


# ---------------------------------------------------------------------------- weights prepared once
def test_weights_are_prepared_once_per_tensor_version(fake_torch_npu) -> None:
    gen = torch.Generator().manual_seed(0)
    x_q = torch.randint(-127, 128, (5, 64), generator=gen, dtype=torch.int8)
    w_q = torch.randint(-127, 128, (24, 64), generator=gen, dtype=torch.int8)
    w_packed = torch.randint(0, 256, (24, 32), generator=gen, dtype=torch.uint8)
    x_scale, w_scale = torch.rand(5) + 0.1, torch.rand(24) + 0.1
    with use_backend("ascend", strict=True):
        for _ in range(3):
            glm5_hal.quant_matmul(x_q, x_scale, w_q, w_scale)
            glm5_hal.w4a8_matmul(x_q, x_scale, w_packed, w_scale)
        assert fake_torch_npu.calls["npu_format_cast"] == 1
        assert fake_torch_npu.calls["npu_convert_weight_to_int4pack"] == 1
        w_q[0, 0] = -w_q[0, 0]  # an in-place update invalidates the prepared copy
        w_packed.add_(1)
        glm5_hal.quant_matmul(x_q, x_scale, w_q, w_scale)
        glm5_hal.w4a8_matmul(x_q, x_scale, w_packed, w_scale)
    assert fake_torch_npu.calls["npu_format_cast"] == 2
    assert fake_torch_npu.calls["npu_convert_weight_to_int4pack"] == 2
    del w_q, w_packed, w_scale
    assert weight_cache.cached_entries() == 0, "prepared copies must not outlive their weights"
