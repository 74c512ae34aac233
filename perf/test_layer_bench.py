"""The whole-layer benchmark (perf/layer.py): both layers compute the same layer on the same weights and cache,
the command runs end to end with the ratio column, transformers is skipped (with the reason) where it would not
fit, and the layer's cost model adds up the op cost models."""

from __future__ import annotations

import json

import pytest
import torch

from glm5_hal import cli as glm5_cli
from glm5_hal.parity import cases as builders
from glm5_hal.parity.compare import compare_float, to_numpy
from glm5_hal.parity.inputs import SeqSpec
from glm5_hal.parity.runner import session_seed
from perf import costs, layer
from perf.scenarios import MINI_LAYER_BASE

pytest.importorskip("transformers", reason="transformers (test-only dependency) not installed")

CFG = layer.layer_config(MINI_LAYER_BASE)


@pytest.mark.parametrize(("new_tokens", "context"), [(1, 48), (16, 48), (1, 256), (16, 256)])
def test_both_layers_compute_the_same_layer(new_tokens: int, context: int) -> None:
    """Same weights (shared tensors), same cached context (latent rows and index keys in each one's layout), same
    new tokens: the outputs agree within the fp32 policy, dense (48 keys <= index_topk 64) and sparse (256)."""
    seed = session_seed() % 2**31
    ours = layer.glm5_layer_inputs(CFG, new_tokens, context)(torch.Generator().manual_seed(seed), torch.float32)
    hf = layer.transformers_layer_inputs(CFG, new_tokens, context)(torch.Generator().manual_seed(seed), torch.float32)
    got = layer.run_glm5_layer(**ours)
    want = layer.run_transformers_layer(**hf)[0]
    assert torch.equal(layer.run_transformers_layer(**hf)[0], want)  # the cache is reset: every call is the same
    verdict = compare_float("layer output", got, to_numpy(want), torch.float32)
    assert verdict.passed, f"{verdict.detail} (rel err {verdict.rel_err:.3g})"
    hf_layer = hf["inputs"].layer
    assert hf_layer.mlp.experts.gate_up_proj.data_ptr() == ours["inputs"].layer.mlp.experts.w13.data_ptr()


def test_inputs_move_to_a_device_whole() -> None:
    """to_device leaves no tensor behind (checked on the meta device: no accelerator here)."""
    gen = torch.Generator().manual_seed(0)
    ours = layer.glm5_layer_inputs(CFG, 4, 48)(gen, torch.float32)["inputs"]
    hf = layer.transformers_layer_inputs(CFG, 4, 48)(gen, torch.float32)["inputs"]
    meta = torch.device("meta")
    try:
        moved_ours, moved_hf = ours.to_device(meta), hf.to_device(meta)
        tensors = [moved_ours.h, moved_ours.cos, moved_ours.sin, *moved_ours.cache.kv, *moved_ours.cache.index_k]
        tensors += [getattr(moved_ours.step, f) for f in ("positions", "slot_mapping", "block_table", "seq_lens_k")]
        tensors += [*moved_ours.layer.parameters(), *moved_hf.layer.parameters(), *moved_hf.cached, moved_hf.mask]
        tensors += [moved_hf.h, moved_hf.position_ids, *moved_hf.position_embeddings]
        assert all(t.is_meta for t in tensors)
    finally:  # the cached layers moved with them: the next test builds new ones
        layer.glm5_layer.cache_clear()
        layer._transformers_layer_cached.cache_clear()


@pytest.fixture
def quick_peaks(monkeypatch) -> None:
    """Fixed peaks instead of measuring GEMMs up to 8192^3 (these tests check the plumbing, not the numbers)."""
    from perf import cli as bench_cli
    from perf.peaks import Peaks

    monkeypatch.setattr(bench_cli, "measure_peaks", lambda *a, **k: Peaks("test cpu", 1e11, 1e11, 1e10, "test"))


def test_bench_command_runs_the_mini_layer(tmp_path, capsys, quick_peaks) -> None:
    """On both GEMM paths side by side (--fast-paths): our layer once per mode, transformers' (the baseline) once."""
    out = tmp_path / "layer.json"
    argv = ["bench", "--scenarios", "mini-layer", "--reps", "1", "--warmup", "0", "--input-sets", "1"]
    assert glm5_cli.main([*argv, "--fast-paths", "0,auto", "--no-progress", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    scenarios = {r["scenario"] for r in rows}
    assert len(scenarios) == 4 and {r["op"] for r in rows} == {"glm5_layer", "transformers_layer"}
    for scenario in scenarios:
        assert sorted(r["backend"] for r in rows if r["scenario"] == scenario) == [
            "baseline (torch)",
            "torch fast=0",
            "torch fast=auto",
        ]
    for r in rows:
        assert r["median_ms"] > 0 and 0 < r["roofline_fraction"]
        if r["op"] == "glm5_layer":
            twin = next(b for b in rows if b["scenario"] == r["scenario"] and b["op"] == "transformers_layer")
            assert r["vs_baseline"] == pytest.approx(twin["median_ms"] / r["median_ms"])
    assert "glm5_layer" in capsys.readouterr().out


def test_transformers_is_skipped_where_it_does_not_fit(monkeypatch, capsys, tmp_path, quick_peaks) -> None:
    """With memory for all but the largest case (prefill at 256 keys), that one is skipped, with the reason."""
    largest = layer.transformers_layer_bytes(CFG, 16, 256, 2)
    assert all(layer.transformers_layer_bytes(CFG, q, n, 2) < largest for q, n in [(1, 48), (16, 48), (1, 256)])
    monkeypatch.setattr(layer, "available_memory_bytes", lambda: 2 * largest - 2)  # half of it for transformers
    argv = ["bench", "--scenarios", "mini-layer", "--reps", "1", "--warmup", "0", "--input-sets", "1"]
    assert glm5_cli.main([*argv, "--no-progress", "--json", str(tmp_path / "r.json")]) == 0
    err = capsys.readouterr().err
    assert "bench: skipped transformers_layer at glm5-mini/layer-prefill16-256: transformers' eager layer needs" in err
    assert "GiB here (estimate: dense attention over 256 keys), more than 50% of the 0.0 GiB available" in err
    rows = json.loads((tmp_path / "r.json").read_text())["rows"]
    assert {r["op"] for r in rows if r["scenario"].endswith("prefill16-256")} == {"glm5_layer"}
    monkeypatch.setenv(layer.MEMORY_FRACTION_ENV, "2")
    with pytest.raises(ValueError, match="GLM5_HAL_BENCH_HF_MEMORY_FRACTION: expected a fraction in \\(0, 1\\]"):
        layer.memory_fraction()


@pytest.mark.parametrize(("new_tokens", "context"), [(1, 48), (16, 256), (1, 1000)])
def test_layer_cost_is_the_sum_of_its_ops(new_tokens: int, context: int) -> None:
    """decoder_layer's FLOPs = the op cost models' (mla_prolog, indexer_prolog, lightning_indexer,
    sparse_flash_attention, fused_moe) + the projections the model runs in torch (W_UV, o_proj, router, shared
    expert), counted from the layer's own weight shapes."""
    cfg = layer.layer_config(MINI_LAYER_BASE.with_overrides(index_topk=64))
    seqs = [SeqSpec(new_tokens, context)]
    gen, dtype = torch.Generator().manual_seed(0), torch.float32
    ops = {
        "mla_prolog": builders.mla_prolog_inputs(cfg, seqs, 16),
        "indexer_prolog": builders.indexer_prolog_inputs(cfg, seqs, 16),
        "lightning_indexer": builders.indexer_inputs(cfg, seqs, 16, cfg.index_topk),
        "sparse_flash_attention": builders.sparse_attention_inputs(cfg, seqs, 16, cfg.index_topk),
        "fused_moe": builders.fused_moe_inputs(
            new_tokens, cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok, cfg.n_routed_experts
        ),
    }
    flops = sum(costs.cost(op, build(gen, dtype)).flops for op, build in ops.items())
    ours = layer.glm5_layer(cfg, dtype)
    attn = ours.self_attn
    w_uv = attn.kv_b_proj.weight.numel() * cfg.v_head_dim // (cfg.qk_nope_head_dim + cfg.v_head_dim)
    in_torch = attn.o_proj.weight.numel() + w_uv
    in_torch += ours.mlp.gate.weight.numel() + sum(p.numel() for p in ours.mlp.shared_experts.parameters())
    flops += 2.0 * new_tokens * in_torch
    weights = sum(t.numel() * t.element_size() for t in [*ours.parameters(), *ours.buffers()])
    assert costs.decoder_layer(cfg, new_tokens, context, 4, weights).flops == pytest.approx(flops, rel=1e-12)
