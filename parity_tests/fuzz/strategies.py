"""Hypothesis strategies: one random valid input config of every op, built in one place.

Each strategy draws the structure (ragged batch, cache geometry, model dims, experts, dtypes, the memory layout of
every tensor argument) and a seed; the values come from the parity cases' own builders (glm5_hal.parity.cases)
with a generator of that seed, so the fuzz suite and the parity suite build inputs the same way. Shapes stay tiny:
the triton backend runs them under its CPU interpreter.

What the draws cover (the issue's list): ragged, decode and prefill batches, q_len-0 sequences and empty
contexts, shuffled blocks, garbage in unused block-table entries, spare blocks and table columns, -1 and
past-the-end indices, rows with no valid index, -1 cache slots, zero-token experts, all tokens on few experts,
zero-size dims validation accepts (T = 0, empty expert groups), ties in the router, and a non-contiguous view of
every argument (every other element, padded rows / blocks, column-major). QUANTIZED_CASES: the cache ops with their
cache in every quantized format (kv_cache_dtype), zero tiles and NaN / inf tiles included.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from hypothesis import strategies as st

from glm5_hal.config import GLM5_MINI, ModelConfig
from glm5_hal.kv_formats import CACHE_ARGUMENT, FORMATS, INDEX, LATENT, OP_CACHE
from glm5_hal.ops.quant import HADAMARD_BASE_SIZES
from glm5_hal.parity import cases as C
from glm5_hal.parity.inputs import LAYOUTS, SeqSpec
from glm5_hal.parity.quantized_cache import WRITERS, encode_cache, formats_of, store_nonfinite_tiles

PROFILE = os.environ.get("GLM5_HAL_FUZZ_PROFILE", "ci").strip() or "ci"
_EXAMPLE_SCALE = {"ci": 1, "long": 10}

# (kind, op, backend) -> configs run; printed at the end of the session (fuzz/conftest.py).
FUZZ_COUNTS: Counter[tuple[str, str, str]] = Counter()
# op -> the bad-input classes it was refused in (test_fuzz_bad_inputs.py), for the same summary.
FUZZ_CLASSES: dict[str, set[str]] = {}

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def examples(ci_count: int) -> int:
    """Examples per test: `ci_count` in the CI profile, 10x that in the long one."""
    return ci_count * _EXAMPLE_SCALE.get(PROFILE, 1)


@dataclass(frozen=True)
class FuzzCase:
    """One drawn config: the public op's keyword arguments, the activation dtype it is judged in, the layout each
    tensor argument reaches the op in, and the drawn parameters (printed when it fails)."""

    op: str
    inputs: dict
    dtype: torch.dtype
    layouts: dict[str, str] = field(default_factory=dict)
    params: dict = field(default_factory=dict)

    def __repr__(self) -> str:
        shapes = {k: tuple(v.shape) for k, v in self.inputs.items() if isinstance(v, torch.Tensor)}
        return f"FuzzCase({self.op}, {self.dtype}, params={self.params}, shapes={shapes}, layouts={self.layouts})"


seeds = st.integers(0, 2**32 - 1)
float_dtypes = st.sampled_from(FLOAT_DTYPES)


@st.composite
def ragged_seqs(draw, max_seqs: int = 3, max_keys: int = 20, max_new: int = 4) -> list[SeqSpec]:
    """A ragged batch: per sequence a context of 0..max_keys keys, the last 0..max_new of them new (decode,
    chunked prefill, prefill of a short prompt, a sequence with no new token, an empty context)."""
    seqs = []
    for _ in range(draw(st.integers(1, max_seqs))):
        k_len = draw(st.integers(0, max_keys))
        seqs.append(SeqSpec(draw(st.integers(0, min(k_len, max_new))), k_len))
    return seqs


@st.composite
def batch_options(draw) -> dict:
    """How the paged cache is laid out: shuffled or in-order blocks, spare blocks, spare table columns, and -1 or
    random garbage in the table entries a sequence does not use."""
    return {
        "shuffle_blocks": draw(st.booleans()),
        "spare_blocks": draw(st.integers(0, 2)),
        "extra_columns": draw(st.integers(0, 2)),
        "garbage_padding": draw(st.booleans()),
    }


block_sizes = st.sampled_from([1, 2, 3, 4, 8, 16])


@st.composite
def model_dims(draw, fixed: dict | None = None) -> ModelConfig:
    """A GLM-5-shaped config with tiny, odd dims (RoPE width even; the indexer's RoPE fits its head width); `fixed`
    overrides some of them (the widths a quantized cache format needs)."""
    rope = draw(st.sampled_from([2, 4, 8]))
    drawn = {
        "hidden_size": draw(st.integers(1, 40)),
        "num_attention_heads": draw(st.integers(1, 4)),
        "q_lora_rank": draw(st.integers(1, 24)),
        "kv_lora_rank": draw(st.integers(1, 24)),
        # Both sides of 16, where Ascend's NPU prolog starts serving the op (glm5_hal.vendor_precision).
        "qk_nope_head_dim": draw(st.one_of(st.integers(1, 12), st.integers(16, 20))),
        "qk_rope_head_dim": rope,
        "index_n_heads": draw(st.integers(1, 4)),
        "index_head_dim": draw(st.integers(rope, rope + 20)),
        "indexer_rope_interleaved": draw(st.booleans()),
        "rms_norm_eps": draw(st.sampled_from([1e-6, 1e-5, 0.25])),
        "rope_theta": draw(st.sampled_from([1e4, 1e6])),
    }
    return GLM5_MINI.with_overrides(name="fuzz", **{**drawn, **(fixed or {})})


ANY_DIMS = model_dims()  # every dim drawn (the float cases)


def _with_layouts(draw, op: str, inputs: dict, dtype: torch.dtype, params: dict) -> FuzzCase:
    tensors = sorted(k for k, v in inputs.items() if isinstance(v, torch.Tensor))
    layouts = {name: draw(st.sampled_from(LAYOUTS)) for name in tensors}
    return FuzzCase(op, inputs, dtype, {k: v for k, v in layouts.items() if v != "contiguous"}, params)


def _built(build: Callable, seed: int, dtype: torch.dtype) -> dict:
    return build(torch.Generator().manual_seed(seed), dtype)


# ------------------------------------------------------------------------------------------------- prologs
@st.composite
def prolog_cases(draw, op: str, dims: st.SearchStrategy[ModelConfig] = ANY_DIMS) -> FuzzCase:
    cfg, seqs, block_size = draw(dims), draw(ragged_seqs()), draw(block_sizes)
    num_tokens = sum(s.q_len for s in seqs)
    pad = tuple(sorted(draw(st.sets(st.integers(0, num_tokens - 1)) if num_tokens else st.just(set()))))
    options, dtype, seed = draw(batch_options()), draw(float_dtypes), draw(seeds)
    builder = C.mla_prolog_inputs if op == "mla_prolog" else C.indexer_prolog_inputs
    inputs = _built(builder(cfg, seqs, block_size, pad, **options), seed, dtype)
    params = {"cfg": _dims(cfg), "seqs": seqs, "block_size": block_size, "pad": pad, **options, "seed": seed}
    return _with_layouts(draw, op, inputs, dtype, params)


def _dims(cfg: ModelConfig) -> dict:
    return {n: getattr(cfg, n) for n in _DIM_NAMES}


_DIM_NAMES = (
    "hidden_size",
    "num_attention_heads",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "index_n_heads",
    "index_head_dim",
    "indexer_rope_interleaved",
    "rms_norm_eps",
)


# ------------------------------------------------------------------------------------------ indexer, attention
@st.composite
def indexer_cases(draw, op: str, dims: st.SearchStrategy[ModelConfig] = ANY_DIMS) -> FuzzCase:
    cfg, seqs, block_size = draw(dims), draw(ragged_seqs()), draw(block_sizes)
    topk = draw(st.integers(1, 40)) if op == "lightning_indexer" else None  # may exceed the visible keys
    options, dtype, seed = draw(batch_options()), draw(float_dtypes), draw(seeds)
    inputs = _built(C.indexer_inputs(cfg, seqs, block_size, topk, **options), seed, dtype)
    params = {"cfg": _dims(cfg), "seqs": seqs, "block_size": block_size, "topk": topk, **options, "seed": seed}
    return _with_layouts(draw, op, inputs, dtype, params)


@st.composite
def sparse_attention_cases(draw, dims: st.SearchStrategy[ModelConfig] = ANY_DIMS) -> FuzzCase:
    cfg, seqs, block_size = draw(dims), draw(ragged_seqs()), draw(block_sizes)
    num_tokens = sum(s.q_len for s in seqs)
    topk = draw(st.integers(1, 24))
    invalid = draw(st.sampled_from([0.0, 0.25, 0.6]))
    empty = tuple(sorted(draw(st.sets(st.integers(0, num_tokens - 1)) if num_tokens else st.just(set()))))
    options, dtype, seed = draw(batch_options()), draw(float_dtypes), draw(seeds)
    build = C.sparse_attention_inputs(cfg, seqs, block_size, topk, invalid, empty, **options)
    inputs = _built(build, seed, dtype)
    params = {
        "cfg": _dims(cfg),
        "seqs": seqs,
        "block_size": block_size,
        "topk": topk,
        "invalid": invalid,
        "empty_rows": empty,
        **options,
        "seed": seed,
    }
    return _with_layouts(draw, "sparse_flash_attention", inputs, dtype, params)


# ------------------------------------------------------------------------------------------------------- MoE
@st.composite
def moe_gate_cases(draw) -> FuzzCase:
    n_group = draw(st.sampled_from([1, 1, 2, 4]))
    per_group = draw(st.integers(2 if n_group > 1 else 1, 8))
    topk_group = draw(st.integers(1, n_group))
    num_experts = n_group * per_group
    cfg = GLM5_MINI.with_overrides(
        n_routed_experts=num_experts,
        num_experts_per_tok=draw(st.integers(1, min(8, topk_group * per_group))),
        n_group=n_group,
        topk_group=topk_group,
        routed_scaling_factor=draw(st.sampled_from([1.0, 2.5, -0.5])),
    )
    tokens, seed = draw(st.integers(0, 12)), draw(seeds)
    scoring, bias, norm = draw(st.sampled_from(["sigmoid", "softmax"])), draw(st.booleans()), draw(st.booleans())
    inputs = _built(C.moe_gate_inputs(cfg, tokens, scoring=scoring, bias=bias, norm=norm), seed, torch.float32)
    ties = draw(st.booleans())
    if ties:  # logits on a coarse grid: equal scores, which every backend must break towards the lower id
        inputs["router_logits"] = (inputs["router_logits"] * 2).round() / 2
    params = {
        "E": num_experts,
        "n_group": n_group,
        "topk_group": topk_group,
        "top_k": cfg.num_experts_per_tok,
        "tokens": tokens,
        "scoring": scoring,
        "bias": bias,
        "norm": norm,
        "ties": ties,
        "seed": seed,
    }
    return _with_layouts(draw, "moe_gate", inputs, torch.float32, params)


@st.composite
def moe_dispatch_cases(draw) -> FuzzCase:
    num_experts = draw(st.integers(1, 12))
    used = draw(st.integers(1, num_experts))  # experts past `used` get no token
    k = draw(st.integers(1, used))
    tokens, width, dtype, seed = draw(st.integers(0, 12)), draw(st.integers(0, 12)), draw(float_dtypes), draw(seeds)
    inputs = _built(C.moe_dispatch_inputs(tokens, width, k, num_experts, used), seed, dtype)
    params = {"tokens": tokens, "width": width, "k": k, "E": num_experts, "used": used, "seed": seed}
    return _with_layouts(draw, "moe_dispatch", inputs, dtype, params)


@st.composite
def grouped_matmul_cases(draw) -> FuzzCase:
    groups = draw(st.lists(st.integers(0, 6), min_size=1, max_size=6))  # zero-token experts included
    n, k, dtype, seed = draw(st.integers(1, 20)), draw(st.integers(1, 20)), draw(float_dtypes), draw(seeds)
    inputs = _built(C.grouped_matmul_inputs(groups, n, k), seed, dtype)
    return _with_layouts(draw, "grouped_matmul", inputs, dtype, {"groups": groups, "n": n, "k": k, "seed": seed})


@st.composite
def moe_combine_cases(draw) -> FuzzCase:
    tokens, k, width = draw(st.integers(0, 12)), draw(st.integers(1, 4)), draw(st.integers(0, 12))
    dtype, seed = draw(float_dtypes), draw(seeds)
    inputs = _built(C.moe_combine_inputs(tokens, k, width), seed, dtype)
    return _with_layouts(draw, "moe_combine", inputs, dtype, {"tokens": tokens, "k": k, "width": width, "seed": seed})


@st.composite
def fused_moe_cases(draw) -> FuzzCase:
    num_experts = draw(st.integers(1, 6))
    used = draw(st.integers(1, num_experts))
    k = draw(st.integers(1, used))
    tokens, width, inter = draw(st.integers(0, 10)), draw(st.integers(1, 16)), draw(st.integers(1, 12))
    dtype, seed = draw(float_dtypes), draw(seeds)
    inputs = _built(C.fused_moe_inputs(tokens, width, inter, k, num_experts, used), seed, dtype)
    params = {"tokens": tokens, "width": width, "inter": inter, "k": k, "E": num_experts, "used": used, "seed": seed}
    return _with_layouts(draw, "fused_moe", inputs, dtype, params)


# ---------------------------------------------------------------------------------------------- quantization
@st.composite
def dynamic_quant_cases(draw) -> FuzzCase:
    shape = tuple(draw(st.lists(st.integers(0, 5), min_size=0, max_size=2))) + (draw(st.integers(1, 40)),)
    rows = 1
    for n in shape[:-1]:
        rows *= n
    zero_rows = tuple(sorted(draw(st.sets(st.integers(0, rows - 1))))) if rows else ()
    dtype, seed = draw(float_dtypes), draw(seeds)
    inputs = _built(C.dynamic_quant_inputs(shape, zero_rows), seed, dtype)
    return _with_layouts(draw, "dynamic_quant", inputs, dtype, {"shape": shape, "zero_rows": zero_rows, "seed": seed})


def _unit_scales(dtype: torch.dtype) -> st.SearchStrategy[bool]:
    """Unit scales make the output the raw int32 accumulator (exact in fp32); its magnitude (up to K * 127^2)
    would overflow an fp16 / bf16-range output, so only fp32 outputs get them."""
    return st.booleans() if dtype == torch.float32 else st.just(False)


@st.composite
def quant_matmul_cases(draw) -> FuzzCase:
    m, n, k = draw(st.integers(0, 12)), draw(st.integers(0, 12)), draw(st.integers(1, 48))
    bias, dtype, seed = draw(st.booleans()), draw(float_dtypes), draw(seeds)
    unit = draw(_unit_scales(dtype))
    inputs = _built(C.quant_matmul_inputs(m, n, k, bias=bias, unit_scales=unit), seed, dtype)
    params = {"m": m, "n": n, "k": k, "bias": bias, "unit_scales": unit, "seed": seed}
    return _with_layouts(draw, "quant_matmul", inputs, dtype, params)


@st.composite
def w4a8_matmul_cases(draw) -> FuzzCase:
    m, n, k = draw(st.integers(0, 12)), draw(st.integers(0, 12)), 2 * draw(st.integers(1, 24))
    group = draw(st.sampled_from([None, *(g for g in range(2, k + 1, 2) if k % g == 0)]))
    dtype, seed = draw(float_dtypes), draw(seeds)
    unit = draw(_unit_scales(dtype))
    inputs = _built(C.w4a8_matmul_inputs(m, n, k, group, unit_scales=unit), seed, dtype)
    params = {"m": m, "n": n, "k": k, "group_size": group, "unit_scales": unit, "seed": seed}
    return _with_layouts(draw, "w4a8_matmul", inputs, dtype, params)


# Supported last dims up to 256: K * 2^m for the base sizes the transform knows.
HADAMARD_SIZES = sorted({b << m for b in HADAMARD_BASE_SIZES for m in range(9) if b << m <= 256})


@st.composite
def hadamard_cases(draw) -> FuzzCase:
    shape = tuple(draw(st.lists(st.integers(0, 4), min_size=0, max_size=2))) + (draw(st.sampled_from(HADAMARD_SIZES)),)
    scale, dtype, seed = draw(st.sampled_from([None, 1.0, 0.3, -2.0])), draw(float_dtypes), draw(seeds)
    inputs = _built(C.hadamard_inputs(shape, scale), seed, dtype)
    return _with_layouts(draw, "hadamard_transform", inputs, dtype, {"shape": shape, "scale": scale, "seed": seed})


VALID_CASES: dict[str, st.SearchStrategy[FuzzCase]] = {
    "mla_prolog": prolog_cases("mla_prolog"),
    "indexer_prolog": prolog_cases("indexer_prolog"),
    "indexer_logits": indexer_cases("indexer_logits"),
    "lightning_indexer": indexer_cases("lightning_indexer"),
    "sparse_flash_attention": sparse_attention_cases(),
    "moe_gate": moe_gate_cases(),
    "moe_dispatch": moe_dispatch_cases(),
    "grouped_matmul": grouped_matmul_cases(),
    "moe_combine": moe_combine_cases(),
    "fused_moe": fused_moe_cases(),
    "dynamic_quant": dynamic_quant_cases(),
    "quant_matmul": quant_matmul_cases(),
    "w4a8_matmul": w4a8_matmul_cases(),
    "hadamard_transform": hadamard_cases(),
}


# ------------------------------------------------------------------------------------------- quantized caches
# The widths a quantized format fixes (docs/ops.md section 7): a latent row is kv_lora 512 + rope 64, an index key
# DI = 128. Every other dim of the config stays drawn.
FORMAT_WIDTHS = {LATENT: {"kv_lora_rank": 512, "qk_rope_head_dim": 64}, INDEX: {"index_head_dim": 128}}
_CACHE_CASES: dict[str, Callable[[st.SearchStrategy[ModelConfig]], st.SearchStrategy[FuzzCase]]] = {
    "mla_prolog": lambda dims: prolog_cases("mla_prolog", dims),
    "indexer_prolog": lambda dims: prolog_cases("indexer_prolog", dims),
    "indexer_logits": lambda dims: indexer_cases("indexer_logits", dims),
    "lightning_indexer": lambda dims: indexer_cases("lightning_indexer", dims),
    "sparse_flash_attention": lambda dims: sparse_attention_cases(dims),
}
_NONFINITE_EVERY = [None, None, (3, 5), (2, 7)]  # (NaN, inf) tiles in every n-th slot, or none


@st.composite
def quantized_cache_cases(draw, op: str, nonfinite_tiles: bool = True) -> FuzzCase:
    """A random valid config of a cache op (`_CACHE_CASES`, at the format's widths) with its cache in a quantized
    format drawn from the op's: the float cache encoded by the reference (glm5_hal.parity.quantized_cache), the
    first tile of every 7th slot zeroed first or not (scale 1, codes 0), and for a reader (with nonfinite_tiles)
    maybe the bytes of NaN / inf tiles in some slots (scale NaN / +inf, codes 0: what a writer stores for them).
    Every backend reads the same bytes; a writer's rows are judged by compare_quantized_cache."""
    kv_cache_dtype = draw(st.sampled_from(formats_of(op)))
    fmt = FORMATS[kv_cache_dtype]
    case = draw(_CACHE_CASES[op](model_dims(FORMAT_WIDTHS[fmt.cache])))
    name = CACHE_ARGUMENT[fmt.cache]
    zero_tiles = draw(st.booleans())
    nonfinite = draw(st.sampled_from(_NONFINITE_EVERY)) if nonfinite_tiles and op not in WRITERS else None
    cache = encode_cache(case.inputs[name], fmt, zero_tiles=zero_tiles)
    if nonfinite is not None:
        store_nonfinite_tiles(cache, fmt, nan_every=nonfinite[0], inf_every=nonfinite[1])
    inputs = {**case.inputs, name: cache, "kv_cache_dtype": kv_cache_dtype}
    params = {**case.params, "kv_cache_dtype": kv_cache_dtype, "zero_tiles": zero_tiles, "nonfinite": nonfinite}
    return FuzzCase(op, inputs, case.dtype, case.layouts, params)


QUANTIZED_CASES: dict[str, st.SearchStrategy[FuzzCase]] = {op: quantized_cache_cases(op) for op in OP_CACHE}
