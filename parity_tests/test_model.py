"""The glm5_hal.model causal LM against Hugging Face transformers' GLM-5 (`glm_moe_dsa`), and its cache logic.

transformers is a test-only dependency (its modules are the independent implementation); these tests skip when
it is missing. Everything runs at the glm5-mini preset (2 layers: one dense MLP layer, one MoE layer) on the
torch and reference backends (or GLM5_HAL_BACKEND's alone).
"""

from __future__ import annotations

import pytest
import torch

from glm5_hal.config import DEEPSEEK_V32, GLM5_MINI, ModelConfig, YarnScaling
from glm5_hal.model import CausalLM, LayerChoices, Linear, PagedKVCache, random_state_dict, rope_inv_freq
from glm5_hal.model.weights import parameter_shapes
from glm5_hal.parity.compare import compare_float, to_numpy
from glm5_hal.parity.runner import session_seed
from hf_models import hf_config, hf_model, hf_state_dict

# Every test on each backend of the model tests (torch and reference, or GLM5_HAL_BACKEND's): conftest.py.
pytestmark = pytest.mark.usefixtures("model_backend")

SEQ_LEN = 24
# glm5-mini with 16 indexer heads instead of 4. The indexer score sum_j w_j ReLU(q_j . k) is exactly 0 whenever
# every head's dot product is negative: with 4 heads that is 1 key in 16, so exact ties at the top-k boundary
# are common, any top-k set is then correct (OPS.md), and which one an implementation keeps changes the layer
# output. With 16 heads such ties have probability 2^-16 per key, so the sparse comparisons are well posed.
MINI = GLM5_MINI.with_overrides(index_n_heads=16)
# DeepSeek-V3.2's structure at the same size: half-split indexer RoPE, YaRN (factor 40, theta 1e4) in the RoPE
# tables and the softmax scale, group-limited routing (4 groups, best 2), 128/64/128 head split.
DSV32_MINI = DEEPSEEK_V32.with_overrides(
    name="deepseek-v32-mini",
    hidden_size=256,
    num_attention_heads=4,
    q_lora_rank=128,
    index_n_heads=16,
    index_topk=64,
    n_routed_experts=16,
    num_experts_per_tok=4,
    n_group=4,
    topk_group=2,
    moe_intermediate_size=64,
    intermediate_size=512,
    first_k_dense_replace=1,
    num_hidden_layers=2,
    vocab_size=1024,
)


def _seed(offset: int) -> int:
    """A fresh seed per test run (the suite's session seed, printed with the parity table; rerun a failure with
    GLM5_HAL_PARITY_SEED), offset so each draw of a test differs."""
    return (session_seed() + offset) % 2**31


def _ids(n: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def _assert_close(name: str, got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    verdict = compare_float(name, got, to_numpy(want), dtype)
    assert verdict.passed, f"{name}: {verdict.detail} (rel err {verdict.rel_err:.3g})"


# --- transformers side -----------------------------------------------------------------------------------------


def _hf_forward(model, input_ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor], tuple[list, list]]:
    """(logits [T, vocab], per-layer outputs [T, hidden], (per MoE layer (router_logits [T, E] fp32,
    e_score_correction_bias [E], topk_weights [T, k] fp32, topk_ids [T, k]), per layer the indexer's top-k key
    positions [T, min(topk, T)] (GLM-5 only; empty for DeepSeek-V3.2, whose layers do not return them))) of one
    sequence."""
    layer_outputs: list[torch.Tensor] = []
    routing: list[tuple] = []
    key_choices: list[torch.Tensor] = []

    def record_layer(_module, _inputs, out) -> None:
        # GLM-5 layers return (hidden, topk_indices [1, T, k]), DeepSeek-V3.2 layers the hidden states [1, T, hidden].
        layer_outputs.append((out[0] if isinstance(out, tuple) else out)[0])
        if isinstance(out, tuple):
            key_choices.append(out[1][0])

    hooks = [layer.register_forward_hook(record_layer) for layer in model.model.layers]
    hooks += [
        layer.mlp.gate.register_forward_hook(
            lambda m, _i, out: routing.append((out[0], m.e_score_correction_bias, out[1], out[2]))
        )
        for layer in model.model.layers
        if hasattr(layer.mlp, "gate")
    ]
    try:
        with torch.no_grad():
            logits = model(input_ids[None], use_cache=False).logits[0]
    finally:
        for hook in hooks:
            hook.remove()
    return logits, layer_outputs, (routing, key_choices)


# A token's expert set may legitimately differ from the reference's when its k-th and (k+1)-th biased router
# scores are closer than the error in our scores (a tie, as in any top-k): a flip needs some score to move by at
# least half the margin. fp32 rounding noise is the floor; in bf16 the router reads a residual stream that has
# been through whole bf16 layers, so the measured difference between our router scores and transformers' fp32
# ones is what explains a flip (the replayed numeric comparison bounds that stream's error by the bf16 policy).
ROUTING_NOISE_FLOOR = 1e-4


def _record_router_logits(model: CausalLM) -> list[torch.Tensor]:
    """router_logits [T, E] of every MoE layer of `model`'s next forward call, in layer order (hooks on the MoE
    blocks' inputs: with replayed choices the block does not call its router)."""
    logits: list[torch.Tensor] = []
    for layer in model.model.layers:
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None:
            layer.mlp.register_forward_hook(lambda m, inputs, _out: logits.append(m.gate(inputs[0])))
    return logits


def _check_routing(ours: list[LayerChoices], our_logits: list[torch.Tensor], hf_routing: list[tuple]) -> int:
    """Our free-running expert choice against transformers': fails unless every token routed differently in some
    MoE layer is a tie: its routing margin in transformers' fp32 run is below twice the largest difference
    between our router scores and transformers' for that token (or the fp32 noise floor). Returns how many
    (token, layer) routings differ."""
    moe = [c.routing[1] for c in ours if c.routing is not None]
    flips = 0
    for ids, mine, (logits, bias, _weights, hf_ids) in zip(moe, our_logits, hf_routing, strict=True):
        k = ids.shape[1]
        differs = (ids.long().sort(-1).values != hf_ids.long().sort(-1).values).any(-1)
        scores = logits.sigmoid()
        biased = (scores + bias).sort(-1, descending=True).values
        margin = biased[:, k - 1] - biased[:, k]
        moved = (mine.double().sigmoid() - scores.double()).abs().amax(-1)
        clear = differs & (margin >= torch.clamp(2 * moved, min=ROUTING_NOISE_FLOOR))
        assert not clear.any(), (
            f"tokens {clear.nonzero().flatten().tolist()} routed differently with margins {margin[clear].tolist()}, "
            f"our scores off by at most {moved[clear].tolist()}"
        )
        flips += int(differs.sum())
    return flips


def _hf_key_choice(hf_keys: torch.Tensor, width: int) -> torch.Tensor:
    """transformers' top-k key positions [T, min(topk, T)] in our layout [T, width] int32: a position after the
    token's own is not a choice (transformers' causal mask removes it), so it becomes -1, as does the padding."""
    num_tokens = hf_keys.shape[0]
    keys = hf_keys.long().masked_fill(hf_keys.long() > torch.arange(num_tokens)[:, None], -1)
    out = torch.full((num_tokens, width), -1, dtype=torch.int32)
    out[:, : keys.shape[1]] = keys.sort(-1, descending=True).values.to(torch.int32)
    return out


def _with_hf_choices(ours: list[LayerChoices], hf_choices: tuple[list, list]) -> list[LayerChoices]:
    """transformers' expert choice (ids and weights) in every MoE layer and, where its layers return it, its key
    choice: replayed in our model, it makes the numeric comparison cover every token, ties included."""
    hf_routing, hf_keys = hf_choices
    routing = iter(hf_routing)
    replayed = []
    for layer, c in enumerate(ours):
        keys = _hf_key_choice(hf_keys[layer], c.topk_indices.shape[1]) if hf_keys else c.topk_indices
        if c.routing is not None:
            _logits, _bias, weights, ids = next(routing)
            c = LayerChoices(keys, (weights.float(), ids.to(torch.int32)))
        else:
            c = LayerChoices(keys, None)
        replayed.append(c)
    return replayed


# --- parity with transformers ----------------------------------------------------------------------------------


def test_parameter_names_match_transformers() -> None:
    for cfg in (MINI, DSV32_MINI):
        model_class, hf_cfg = hf_config(cfg)
        hf_shapes = {name: tuple(t.shape) for name, t in model_class(hf_cfg).state_dict().items()}
        ours = {name: tuple(t.shape) for name, t in hf_state_dict(cfg, random_state_dict(cfg, seed=0)).items()}
        assert ours == hf_shapes
        assert set(parameter_shapes(cfg)) == set(random_state_dict(cfg, seed=0))


PARITY_CASES = [
    pytest.param(MINI, 64, torch.float32, id="glm5-topk>=context(dense)-fp32"),
    pytest.param(MINI, 8, torch.float32, id="glm5-topk<context(sparse)-fp32"),
    pytest.param(MINI, 64, torch.bfloat16, id="glm5-dense-bf16"),
    pytest.param(MINI, 8, torch.bfloat16, id="glm5-sparse-bf16"),
    pytest.param(DSV32_MINI, 64, torch.float32, id="deepseek-v32-dense-fp32"),
    pytest.param(DSV32_MINI, 8, torch.float32, id="deepseek-v32-sparse-fp32"),
]


@pytest.mark.parametrize(("base", "topk", "dtype"), PARITY_CASES)
def test_prefill_matches_transformers(base: ModelConfig, topk: int, dtype: torch.dtype) -> None:
    """Per-layer outputs and logits of one prefill equal transformers' within the dtype's tolerance.

    transformers always runs in fp32 on the same (dtype-rounded) weights: it is the accurate side, as the fp64
    reference is for single ops. (transformers itself in bf16 is not a usable reference: its bf16 rounding of
    the residual stream flips MoE routing decisions of some tokens, e.g. 2 of 24 here, 20-26% off for them.)
    """
    cfg = base.with_overrides(index_topk=topk)
    state = random_state_dict(cfg, seed=_seed(11), dtype=dtype)
    input_ids = _ids(SEQ_LEN, cfg.vocab_size, seed=_seed(12))
    hf = hf_model(cfg, {name: t.float() for name, t in state.items()}, torch.float32)
    want_logits, want_layers, hf_choices = _hf_forward(hf, input_ids)
    model = CausalLM(cfg, state)
    our_logits = _record_router_logits(model)
    free = model.prefill(input_ids, block_size=8)
    # Our own expert choice may differ from transformers' only at ties (see ROUTING_NOISE_FLOOR), and rarely.
    assert _check_routing(free.choices, our_logits, hf_choices[0]) <= SEQ_LEN // 4
    # The numbers, every token included: with transformers' key and expert choices replayed (where ours tied
    # differently; the indexer's key choice has ties too, in bf16).
    model = CausalLM(cfg, state)  # fresh, without the hooks of the free run
    replayed_logits = _record_router_logits(model)
    out = model.prefill(input_ids, block_size=8, choices=_with_hf_choices(free.choices, hf_choices))
    # Our router itself (not only the choice replayed past it) agrees with transformers'.
    for layer, (mine, hf_routing) in enumerate(zip(replayed_logits, hf_choices[0], strict=True)):
        _assert_close(f"MoE layer {layer} router logits", mine, hf_routing[0], dtype)
    for layer, (got, want) in enumerate(zip(out.layer_outputs, want_layers, strict=True)):
        assert got.dtype == dtype
        _assert_close(f"layer {layer} output", got, want, dtype)
    _assert_close("logits", out.logits, want_logits, dtype)


def test_sparse_selection_really_drops_keys() -> None:
    """With topk < context the late tokens attend to topk keys only, and that changes the output."""
    state = random_state_dict(MINI, seed=_seed(3))
    input_ids = _ids(SEQ_LEN, MINI.vocab_size, seed=_seed(4))
    sparse = CausalLM(MINI.with_overrides(index_topk=8), state)
    dense = CausalLM(MINI, state)
    out_sparse, out_dense = sparse.prefill(input_ids), dense.prefill(input_ids)
    indices = out_sparse.choices[0].topk_indices
    assert indices.shape == (SEQ_LEN, 8)
    assert bool((indices[8:] >= 0).all()) and bool((indices[:7, -1] == -1).all())
    late = slice(8, None)
    assert not torch.allclose(out_sparse.logits[late], out_dense.logits[late], rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(out_sparse.logits[:8], out_dense.logits[:8], rtol=1e-5, atol=1e-5)


# --- cache correctness -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("topk", [64, 8], ids=["dense", "sparse"])
def test_prefill_then_decode_equals_full_prefill(topk: int) -> None:
    """Two ragged sequences: chunked prefill, then batched decode steps, on a shuffled paged cache, give the
    logits the one-shot prefill of each whole sequence gives."""
    cfg = MINI.with_overrides(index_topk=topk)
    model = CausalLM(cfg, random_state_dict(cfg, seed=_seed(5)))
    seqs = {"a": _ids(21, cfg.vocab_size, seed=_seed(6)), "b": _ids(13, cfg.vocab_size, seed=_seed(7))}
    want = {name: model.prefill(ids, block_size=4).logits for name, ids in seqs.items()}

    cache = PagedKVCache(cfg, num_blocks=16, block_size=4, dtype=torch.float32, shuffle_seed=_seed(8))
    got: dict[str, list[torch.Tensor]] = {"a": [], "b": []}
    cuts = {"a": [0, 10, 17], "b": [0, 6, 9]}  # prefill, then a second chunk; then decode one token at a time
    for chunk in range(2):
        step = {n: seqs[n][cuts[n][chunk] : cuts[n][chunk + 1]] for n in seqs}
        logits = model.step(cache, step).logits
        got["a"].append(logits[: len(step["a"])])
        got["b"].append(logits[len(step["a"]) :])
    for pos in range(4):
        step = {n: seqs[n][cuts[n][2] + pos : cuts[n][2] + pos + 1] for n in seqs}
        logits = model.step(cache, step).logits
        got["a"].append(logits[:1])
        got["b"].append(logits[1:])
    assert cache.seq_len("a") == 21 and cache.seq_len("b") == 13
    for name in seqs:
        _assert_close(f"sequence {name}", torch.cat(got[name]), want[name], torch.float32)


def test_cache_planning_and_errors() -> None:
    cache = PagedKVCache(GLM5_MINI, num_blocks=4, block_size=4, dtype=torch.float32)
    step = cache.plan_step(["x", "y"], [6, 1])
    assert step.positions.tolist() == [0, 1, 2, 3, 4, 5, 0]
    assert step.block_table.tolist() == [[0, 1], [2, 0]]
    assert step.slot_mapping.tolist() == [0, 1, 2, 3, 4, 5, 8]
    assert step.seq_lens_k.tolist() == [6, 1] and step.cu_seqlens_q.tolist() == [0, 6, 7]
    step = cache.plan_step(["x"], [1])
    assert step.positions.tolist() == [6] and step.slot_mapping.tolist() == [6]
    with pytest.raises(RuntimeError, match="out of blocks"):
        cache.plan_step(["z"], [9])
    assert cache.seq_len("z") == 0  # the refused step allocated nothing
    cache.free("x")  # blocks 0 and 1 go back to the free list and are handed out again
    assert cache.plan_step(["z"], [8]).block_table.tolist() == [[0, 1]]
    with pytest.raises(ValueError, match="distinct"):
        cache.plan_step(["y", "y"], [1, 1])


# --- the quantization hook -------------------------------------------------------------------------------------


class _RecordingLinear(Linear):
    """A Linear subclass, as a calibration recorder or a quantized linear would be: forces decomposed prologs."""

    def __init__(self, inner: Linear) -> None:
        super().__init__(inner.weight)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return super().forward(x)


@pytest.mark.parametrize("topk", [64, 8], ids=["dense", "sparse"])
def test_swapped_linears_give_the_same_model(topk: int) -> None:
    """Replacing every linear call site (forcing the decomposed MLA and indexer prologs) changes nothing, and
    every replacement is called."""
    cfg = MINI.with_overrides(index_topk=topk)
    state = random_state_dict(cfg, seed=_seed(9))
    input_ids = _ids(SEQ_LEN, cfg.vocab_size, seed=_seed(10))
    model = CausalLM(cfg, state)
    want = model.prefill(input_ids)
    recorders = {}
    for name, module in model.linears().items():
        if type(module) is Linear:
            recorders[name] = _RecordingLinear(module)
            model.replace_module(name, recorders[name])
    got = model.prefill(input_ids)
    for layer, (g, w) in enumerate(zip(got.layer_outputs, want.layer_outputs, strict=True)):
        _assert_close(f"layer {layer} output", g, w, torch.float32)
    _assert_close("logits", got.logits, want.logits, torch.float32)
    uncalled = [name for name, rec in recorders.items() if rec.calls == 0 and not name.endswith("kv_b_proj")]
    assert not uncalled
    assert set(model.routed_experts()) == {"model.layers.1.mlp.experts"}
    # 8 attention linears per layer, + dense MLP 3 (layer 0) or router + shared expert 4 (layer 1), + lm_head
    assert len(model.linears()) == 8 + 3 + 8 + 4 + 1


def test_bad_state_dict_names_the_parameter() -> None:
    state = random_state_dict(GLM5_MINI, seed=0)
    missing = dict(state)
    del missing["model.layers.0.self_attn.q_b_proj.weight"]
    with pytest.raises(ValueError, match="missing 1 parameter.*q_b_proj"):
        CausalLM(GLM5_MINI, missing)
    wrong = dict(state)
    wrong["model.norm.weight"] = torch.ones(3)
    with pytest.raises(ValueError, match=r"model\.norm\.weight.*expected shape \(256,\), got \(3,\)"):
        CausalLM(GLM5_MINI, wrong)


# --- RoPE ------------------------------------------------------------------------------------------------------


def test_yarn_inv_freq_matches_transformers() -> None:
    """DeepSeek-V3.2's YaRN frequencies equal transformers' `yarn` RoPE initialisation."""
    pytest.importorskip("transformers", reason="transformers (test-only dependency) not installed")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = GLM5_MINI.with_overrides(rope_theta=1e4, rope_scaling=YarnScaling(40.0, 4096))
    _, hf_cfg = hf_config(cfg)
    hf_cfg.rope_parameters = {
        "rope_type": "yarn",
        "rope_theta": 1e4,
        "factor": 40.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    }
    hf_cfg.max_position_embeddings = 4096 * 40
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg, "cpu")
    torch.testing.assert_close(rope_inv_freq(cfg).float(), inv_freq.float(), rtol=1e-6, atol=0)
    assert attention_factor == pytest.approx(1.0)
