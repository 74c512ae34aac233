"""The bad-input matrix: every op x every class of bad input that applies to it, on random valid configs.

Each entry corrupts one argument of a random valid config (fuzz.strategies.VALID_CASES) in one way and expects a
ValueError or TypeError whose message names that argument, says what was expected and what came (validation runs
before any backend, so this needs no backend). The classes:

  none            a required tensor given as None
  not_a_tensor    a Python list where a tensor goes
  rank            one dim too many or too few
  shape           a size that disagrees with another argument's
  dtype           a float / integer dtype the op does not take for that argument
  contract_dtype  a tensor that is fp32 by contract (RoPE tables, head weights, scales, routing weights) in bf16
  index_dtype     an index tensor (slots, block table, ids, offsets) in the wrong integer or a float dtype
  device          one argument on the meta device, the others on the CPU
  index_range     index values outside their range (slots, key positions, expert ids, rows)
  paged_layout    seq_lens_k beyond what the block table holds, or a block id outside the cache
  cu_seqlens      prefix sums that do not start at 0, decrease, or miss T
  scalar          a non-finite, negative, zero, bool or str scalar where a number goes
  degenerate      a zero size the op cannot work with (block_size 0, DI 0, K 0, n 0)
  structure       values that break the argument's structure (offsets not a prefix sum, src_index not a
                  permutation, w13 with an odd row count, groups that do not divide E, an odd K for int4)
  option          an option outside its set (scoring, out_dtype, a non-bool flag, a kv_cache_dtype of the other
                  cache or of no cache, a kv_cache_dtype that is not a str)

The cache ops also get the bad inputs of a quantized cache, on random valid configs whose cache is quantized
(fuzz.strategies.QUANTIZED_CASES): the format options above, a uint8 cache passed as "auto", a float or int8 cache
with a format, a row of the wrong byte count, and other arguments whose width is not the format's.

Not every class applies to every op: an op without index arguments has no index_range, an op of one tensor no
device mismatch (dynamic_quant and hadamard_transform take one tensor and get 5 and 7 classes; the session
summary prints every op's count). No op refuses a non-contiguous view (every layout is valid, docs/ops.md), so
that class of the issue's list has no entries.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings

import glm5_hal
from fuzz.strategies import FUZZ_CLASSES, FUZZ_COUNTS, QUANTIZED_CASES, VALID_CASES, FuzzCase, examples
from glm5_hal.kv_formats import CACHE_ARGUMENT, FORMATS, OP_CACHE
from glm5_hal.ops.quant import hadamard_base_size
from glm5_hal.registry import OP_NAMES

Corrupt = Callable[[dict], "dict | None"]  # valid inputs -> bad inputs, or None when this config has no such spot


@dataclass(frozen=True)
class Bad:
    """One cell of the matrix: a class of bad input for one argument of one op."""

    kind: str
    op: str
    arg: str
    corrupt: Corrupt
    exc: type[Exception]
    quantized: bool = False  # corrupts a config whose cache is quantized (QUANTIZED_CASES)

    @property
    def id(self) -> str:
        return f"{self.op}-{self.kind}-{self.arg}" + ("-quantized" if self.quantized else "")


def _set(arg: str, make: Callable[[dict], object], when: Callable[[dict], bool] = lambda a: True) -> Corrupt:
    def corrupt(inputs: dict) -> dict | None:
        if not when(inputs):
            return None
        return {**inputs, arg: make(inputs)}

    return corrupt


def _grow(t: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """t with one more element along `dim` (zeros): a size no other argument agrees with."""
    pad = list(t.shape)
    pad[dim] = 1
    return torch.cat([t, torch.zeros(pad, dtype=t.dtype)], dim=dim)


def _has(arg: str) -> Callable[[dict], bool]:
    return lambda a: isinstance(a.get(arg), torch.Tensor) and a[arg].numel() > 0


def _tokens(a: dict) -> int:
    return int(a["cu_seqlens_q"][-1])


def _common(op: str, *, activation: str, weight: str | None = None) -> list[Bad]:
    """Classes every op with two or more tensors has: none, not_a_tensor, rank, dtype, device."""
    other = weight or activation
    return [
        Bad("none", op, activation, _set(activation, lambda a: None), TypeError),
        Bad("not_a_tensor", op, other, _set(other, lambda a: a[other].tolist()), TypeError),
        Bad("rank", op, other, _set(other, lambda a: a[other].unsqueeze(0)), ValueError),
        Bad("dtype", op, other, _set(other, lambda a: a[other].to(torch.int32)), TypeError),
        Bad("device", op, other, _set(other, lambda a: a[other].to("meta")), ValueError),
    ]


def _paged(op: str, cache: str) -> list[Bad]:
    """The paged-batch classes of the ops that read a paged cache."""
    return [
        Bad("index_dtype", op, "block_table", _set("block_table", lambda a: a["block_table"].long()), TypeError),
        Bad(
            "paged_layout",
            op,
            "seq_lens_k",
            _set("seq_lens_k", lambda a: a["seq_lens_k"] + a["block_table"].shape[1] * a[cache].shape[1] + 1),
            ValueError,
        ),
        Bad(
            "paged_layout",
            op,
            "block_table",
            _set(
                "block_table",
                lambda a: torch.full_like(a["block_table"], a[cache].shape[0]),
                lambda a: bool((a["seq_lens_k"] > 0).any()),
            ),
            ValueError,
        ),
        Bad(
            "cu_seqlens",
            op,
            "cu_seqlens_q",
            _set("cu_seqlens_q", lambda a: a["cu_seqlens_q"] + 1),  # does not start at 0
            ValueError,
        ),
        Bad(
            "cu_seqlens",
            op,
            "cu_seqlens_q",
            _set("cu_seqlens_q", lambda a: a["cu_seqlens_q"].flip(0), lambda a: _tokens(a) > 0),  # decreasing
            ValueError,
        ),
        Bad(
            "degenerate",
            op,
            cache,
            _set(cache, lambda a: a[cache][:, :0]),  # block_size 0
            ValueError,
        ),
    ]


def _scalar(op: str, arg: str, *bad_values: tuple[object, type[Exception]]) -> list[Bad]:
    return [Bad("scalar", op, arg, _set(arg, lambda a, v=v: v), exc) for v, exc in bad_values]


# Bad scalars: a wrong type is a TypeError, a wrong value a ValueError.
_BAD_POSITIVE_FLOAT = (
    (0.0, ValueError),
    (-1e-5, ValueError),
    (float("inf"), ValueError),
    (float("nan"), ValueError),
    ("1e-5", TypeError),
    (True, TypeError),
)
_BAD_POSITIVE_INT = ((0, ValueError), (-3, ValueError), (1.5, TypeError), (True, TypeError), ("4", TypeError))
_BAD_FINITE_FLOAT = ((float("inf"), ValueError), (float("nan"), ValueError), ("2.5", TypeError), (True, TypeError))


def _prolog(op: str, cache: str, weight: str) -> list[Bad]:
    return [
        *_common(op, activation="x", weight=weight),
        Bad("shape", op, weight, _set(weight, lambda a: _grow(a[weight])), ValueError),
        Bad("contract_dtype", op, "cos", _set("cos", lambda a: a["cos"].to(torch.bfloat16)), TypeError),
        Bad("index_dtype", op, "slot_mapping", _set("slot_mapping", lambda a: a["slot_mapping"].int()), TypeError),
        Bad(
            "index_range",
            op,
            "slot_mapping",
            _set("slot_mapping", lambda a: a["slot_mapping"] + a[cache].shape[0] * a[cache].shape[1] + 1, _has("x")),
            ValueError,
        ),
        Bad(
            "index_range",
            op,
            "slot_mapping",
            _set("slot_mapping", lambda a: torch.full_like(a["slot_mapping"], -2), _has("x")),
            ValueError,
        ),
        Bad("degenerate", op, cache, _set(cache, lambda a: a[cache][:, :0]), ValueError),
        *_scalar(op, "eps", *_BAD_POSITIVE_FLOAT),
    ]


def _scoring(op: str) -> list[Bad]:
    return [
        *_common(op, activation="q_idx", weight="index_k_cache"),
        Bad("shape", op, "weights", _set("weights", lambda a: _grow(a["weights"])), ValueError),
        Bad("contract_dtype", op, "weights", _set("weights", lambda a: a["weights"].bfloat16()), TypeError),
        Bad(
            "degenerate", op, "index_k_cache", _set("index_k_cache", lambda a: a["index_k_cache"][..., :0]), ValueError
        ),
        *_paged(op, "index_k_cache"),
    ]


def _moe_ids(op: str, experts: Callable[[dict], int]) -> list[Bad]:
    return [
        Bad("index_dtype", op, "topk_ids", _set("topk_ids", lambda a: a["topk_ids"].float()), TypeError),
        Bad(
            "index_range",
            op,
            "topk_ids",
            _set("topk_ids", lambda a: a["topk_ids"] + experts(a), _has("topk_ids")),
            ValueError,
        ),
        Bad(
            "index_range", op, "topk_ids", _set("topk_ids", lambda a: a["topk_ids"] - 100, _has("topk_ids")), ValueError
        ),
    ]


def _int8_gemm(op: str, weight: str) -> list[Bad]:
    return [
        *_common(op, activation="x_q", weight=weight),
        Bad("shape", op, "x_scale", _set("x_scale", lambda a: _grow(a["x_scale"], 0)), ValueError),
        Bad("contract_dtype", op, "x_scale", _set("x_scale", lambda a: a["x_scale"].bfloat16()), TypeError),
        Bad("dtype", op, "x_q", _set("x_q", lambda a: a["x_q"].float()), TypeError),
        Bad("degenerate", op, "x_q", lambda a: {**a, "x_q": a["x_q"][:, :0], weight: a[weight][:, :0]}, ValueError),
        Bad("option", op, "out_dtype", _set("out_dtype", lambda a: torch.int32), TypeError),
        Bad("option", op, "out_dtype", _set("out_dtype", lambda a: torch.float64), TypeError),
    ]


def _quantized(op: str, narrower: Corrupt, named: str) -> list[Bad]:
    """The bad inputs of a quantized cache. narrower: the other arguments, consistent among themselves, one value
    narrower than the format's row (575 latent values, 127 index key values); `named`: the argument whose message
    says so (the first one validation finds disagreeing)."""
    cache = CACHE_ARGUMENT[OP_CACHE[op]]
    other_format = next(name for name, fmt in FORMATS.items() if fmt.cache != OP_CACHE[op])

    def as_float(a: dict) -> torch.Tensor:
        fmt = FORMATS[a["kv_cache_dtype"]]
        return torch.zeros((*a[cache].shape[:-1], fmt.width), dtype=a["x" if "x" in a else READ_BY[op]].dtype)

    def bad(kind: str, arg: str, corrupt: Corrupt, exc: type[Exception]) -> Bad:
        return Bad(kind, op, arg, corrupt, exc, quantized=True)

    return [
        bad("option", "kv_cache_dtype", _set("kv_cache_dtype", lambda a: other_format), ValueError),
        bad("option", "kv_cache_dtype", _set("kv_cache_dtype", lambda a: "fp8"), ValueError),
        bad("option", "kv_cache_dtype", _set("kv_cache_dtype", lambda a: 8), TypeError),
        bad("dtype", cache, _set("kv_cache_dtype", lambda a: "auto"), TypeError),  # uint8 rows called "auto"
        bad("dtype", cache, _set(cache, as_float), TypeError),  # a float cache with a format
        bad("dtype", cache, _set(cache, lambda a: a[cache].view(torch.int8)), TypeError),
        bad("shape", cache, _set(cache, lambda a: a[cache][..., :-1]), ValueError),  # row_bytes - 1
        bad("shape", named, narrower, ValueError),
    ]


READ_BY = {"indexer_logits": "q_idx", "lightning_indexer": "q_idx", "sparse_flash_attention": "q"}


def _narrower_reader(op: str) -> Corrupt:
    return _set(READ_BY[op], lambda a: a[READ_BY[op]][..., :-1])


def _narrower_latent(a: dict) -> dict:
    """kv_lora 511: w_uk, w_dkv_kr and gamma_ckv one latent dim narrower (the RoPE dims stay 64)."""
    return {**a, "w_uk": a["w_uk"][..., 1:], "w_dkv_kr": a["w_dkv_kr"][1:], "gamma_ckv": a["gamma_ckv"][1:]}


BAD_INPUTS: list[Bad] = [
    # ------------------------------------------------------------------------------------------- prologs
    *_prolog("mla_prolog", "kv_cache", "w_dq"),
    Bad("rank", "mla_prolog", "w_uk", _set("w_uk", lambda a: a["w_uk"][0]), ValueError),
    *_prolog("indexer_prolog", "index_k_cache", "w_ik"),
    Bad("option", "indexer_prolog", "rope_interleaved", _set("rope_interleaved", lambda a: 1), TypeError),
    Bad(
        "structure",
        "indexer_prolog",
        "w_iq",
        _set("w_iq", lambda a: _grow(a["w_iq"], 0)),  # HI * DI + 1 rows: no whole number of heads
        ValueError,
    ),
    # ------------------------------------------------------------------------------------------- indexer
    *_scoring("indexer_logits"),
    *_scoring("lightning_indexer"),
    *_scalar("lightning_indexer", "topk", *_BAD_POSITIVE_INT, (2**31, ValueError)),
    # ---------------------------------------------------------------------------------- sparse attention
    *_common("sparse_flash_attention", activation="q", weight="kv_cache"),
    Bad("shape", "sparse_flash_attention", "kv_cache", _set("kv_cache", lambda a: _grow(a["kv_cache"])), ValueError),
    Bad("index_dtype", "sparse_flash_attention", "indices", _set("indices", lambda a: a["indices"].long()), TypeError),
    Bad(
        "index_range",
        "sparse_flash_attention",
        "indices",
        _set("indices", lambda a: torch.full_like(a["indices"], -5), _has("indices")),
        ValueError,
    ),
    *_paged("sparse_flash_attention", "kv_cache"),
    *_scalar("sparse_flash_attention", "sm_scale", *_BAD_POSITIVE_FLOAT),
    *_scalar("sparse_flash_attention", "d_v", *_BAD_POSITIVE_INT, (10**6, ValueError)),
    # ------------------------------------------------------------------------------------------------ MoE
    Bad("none", "moe_gate", "router_logits", _set("router_logits", lambda a: None), TypeError),
    Bad("not_a_tensor", "moe_gate", "bias", _set("bias", lambda a: [0.0] * a["router_logits"].shape[1]), TypeError),
    Bad("rank", "moe_gate", "router_logits", _set("router_logits", lambda a: a["router_logits"][None]), ValueError),
    Bad("shape", "moe_gate", "bias", _set("bias", lambda a: torch.zeros(a["router_logits"].shape[1] + 1)), ValueError),
    Bad(
        "dtype",
        "moe_gate",
        "bias",
        _set("bias", lambda a: torch.zeros(a["router_logits"].shape[1]).double()),
        TypeError,
    ),
    Bad(
        "contract_dtype",
        "moe_gate",
        "router_logits",
        _set("router_logits", lambda a: a["router_logits"].bfloat16()),
        TypeError,
    ),
    Bad(
        "device",
        "moe_gate",
        "bias",
        _set("bias", lambda a: torch.zeros(a["router_logits"].shape[1], device="meta")),
        ValueError,
    ),
    *_scalar("moe_gate", "top_k", *_BAD_POSITIVE_INT, (10**6, ValueError)),
    *_scalar("moe_gate", "routed_scaling_factor", *_BAD_FINITE_FLOAT),
    Bad("option", "moe_gate", "norm_topk_prob", _set("norm_topk_prob", lambda a: 1), TypeError),
    Bad("option", "moe_gate", "scoring", _set("scoring", lambda a: "relu"), ValueError),
    Bad(
        "structure",
        "moe_gate",
        "n_group",
        _set("n_group", lambda a: a["router_logits"].shape[1] + 1),  # does not divide E
        ValueError,
    ),
    Bad("structure", "moe_gate", "topk_group", _set("topk_group", lambda a: a["n_group"] + 1), ValueError),
    Bad(
        "degenerate",
        "moe_gate",
        "top_k",  # no expert: nothing to pick, and top_k says so
        lambda a: {**a, "router_logits": a["router_logits"][:, :0], "bias": None},
        ValueError,
    ),
    *_common("moe_dispatch", activation="x"),
    Bad("shape", "moe_dispatch", "topk_ids", _set("topk_ids", lambda a: _grow(a["topk_ids"], 0)), ValueError),
    *_moe_ids("moe_dispatch", lambda a: a["num_experts"]),
    *_scalar("moe_dispatch", "num_experts", *_BAD_POSITIVE_INT),
    *_common("grouped_matmul", activation="x_sorted", weight="w"),
    Bad("shape", "grouped_matmul", "w", _set("w", lambda a: _grow(a["w"])), ValueError),
    Bad(
        "index_dtype",
        "grouped_matmul",
        "expert_offsets",
        _set("expert_offsets", lambda a: a["expert_offsets"].int()),
        TypeError,
    ),
    Bad(
        "structure",
        "grouped_matmul",
        "expert_offsets",
        _set("expert_offsets", lambda a: a["expert_offsets"] + 1),  # does not start at 0
        ValueError,
    ),
    Bad(
        "structure",
        "grouped_matmul",
        "expert_offsets",
        _set("expert_offsets", lambda a: a["expert_offsets"].flip(0), _has("x_sorted")),  # decreasing
        ValueError,
    ),
    Bad(
        "index_range",
        "grouped_matmul",
        "expert_offsets",
        _set("expert_offsets", lambda a: torch.cat([a["expert_offsets"][:-1], a["expert_offsets"][-1:] + 3])),
        ValueError,  # the last expert's rows run past M
    ),
    *_common("moe_combine", activation="y_sorted", weight="topk_weights"),
    Bad("shape", "moe_combine", "y_sorted", _set("y_sorted", lambda a: _grow(a["y_sorted"], 0)), ValueError),
    Bad(
        "contract_dtype",
        "moe_combine",
        "topk_weights",
        _set("topk_weights", lambda a: a["topk_weights"].bfloat16()),
        TypeError,
    ),
    Bad("index_dtype", "moe_combine", "src_index", _set("src_index", lambda a: a["src_index"].int()), TypeError),
    Bad(
        "index_range",
        "moe_combine",
        "src_index",
        _set("src_index", lambda a: a["src_index"] + a["src_index"].numel(), _has("src_index")),
        ValueError,
    ),
    Bad(
        "structure",
        "moe_combine",
        "src_index",
        _set("src_index", lambda a: torch.zeros_like(a["src_index"]), lambda a: a["src_index"].numel() > 1),
        ValueError,
    ),
    *_common("fused_moe", activation="x", weight="w13"),
    Bad("shape", "fused_moe", "w2", _set("w2", lambda a: _grow(a["w2"])), ValueError),
    Bad(
        "contract_dtype",
        "fused_moe",
        "topk_weights",
        _set("topk_weights", lambda a: a["topk_weights"].bfloat16()),
        TypeError,
    ),
    *_moe_ids("fused_moe", lambda a: a["w13"].shape[0]),
    Bad("structure", "fused_moe", "w13", _set("w13", lambda a: _grow(a["w13"], 1)), ValueError),  # 2I + 1 rows
    # -------------------------------------------------------------------------------------- quantization
    Bad("none", "dynamic_quant", "x", _set("x", lambda a: None), TypeError),
    Bad("not_a_tensor", "dynamic_quant", "x", _set("x", lambda a: a["x"].tolist()), TypeError),
    Bad("rank", "dynamic_quant", "x", _set("x", lambda a: torch.tensor(1.0)), ValueError),
    Bad("dtype", "dynamic_quant", "x", _set("x", lambda a: a["x"].to(torch.int32)), TypeError),
    Bad("dtype", "dynamic_quant", "x", _set("x", lambda a: a["x"].double()), TypeError),  # no float64 mode
    Bad("degenerate", "dynamic_quant", "x", _set("x", lambda a: a["x"][..., :0]), ValueError),
    *_int8_gemm("quant_matmul", "w_q"),
    Bad("shape", "quant_matmul", "bias", _set("bias", lambda a: torch.zeros(a["w_q"].shape[0] + 1)), ValueError),
    *_int8_gemm("w4a8_matmul", "w_packed"),
    Bad(
        "structure",
        "w4a8_matmul",
        "x_q",
        lambda a: {**a, "x_q": _grow(a["x_q"])},  # odd K: int4 pairs cannot pack it
        ValueError,
    ),
    *_scalar(
        "w4a8_matmul",
        "group_size",
        (0, ValueError),
        (3, ValueError),
        (-4, ValueError),
        (True, TypeError),
        (2.0, TypeError),
    ),
    Bad("none", "hadamard_transform", "x", _set("x", lambda a: None), TypeError),
    Bad("not_a_tensor", "hadamard_transform", "x", _set("x", lambda a: a["x"].tolist()), TypeError),
    Bad("rank", "hadamard_transform", "x", _set("x", lambda a: torch.tensor(1.0)), ValueError),
    Bad("dtype", "hadamard_transform", "x", _set("x", lambda a: a["x"].to(torch.int32)), TypeError),
    Bad(
        "shape",
        "hadamard_transform",
        "x",
        _set("x", lambda a: _grow(a["x"]), lambda a: hadamard_base_size(a["x"].shape[-1] + 1) is None),  # n + 1
        ValueError,
    ),
    Bad("degenerate", "hadamard_transform", "x", _set("x", lambda a: a["x"][..., :0]), ValueError),
    *_scalar("hadamard_transform", "scale", *_BAD_FINITE_FLOAT),
    # ------------------------------------------------------------------------------------- quantized caches
    *_quantized("mla_prolog", _narrower_latent, "kv_cache"),
    *_quantized("indexer_prolog", _set("w_ik", lambda a: a["w_ik"][1:]), "w_ik"),  # the cache sets DI first
    *_quantized("indexer_logits", _narrower_reader("indexer_logits"), "index_k_cache"),
    *_quantized("lightning_indexer", _narrower_reader("lightning_indexer"), "index_k_cache"),
    *_quantized("sparse_flash_attention", _narrower_reader("sparse_flash_attention"), "kv_cache"),
]

CLASSES_PER_OP: dict[str, set[str]] = {op: {b.kind for b in BAD_INPUTS if b.op == op} for op in OP_NAMES}
assert all(CLASSES_PER_OP.values()), "every op has bad inputs in the matrix"


def _message_names(message: str, arg: str) -> bool:
    """The message names `arg` (as `arg:` or `arg on <device>`) and says what came."""
    return bool(re.search(rf"\b{re.escape(arg)}(:| on )", message)) and "got" in message


@pytest.mark.parametrize("bad", BAD_INPUTS, ids=[f"{b.id}-{i}" for i, b in enumerate(BAD_INPUTS)])
def test_bad_input_is_refused_naming_the_argument(bad: Bad) -> None:
    @settings(max_examples=examples(4), suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow])
    @given(case=QUANTIZED_CASES[bad.op] if bad.quantized else VALID_CASES[bad.op])
    def refused(case: FuzzCase) -> None:
        inputs = bad.corrupt({k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in case.inputs.items()})
        assume(inputs is not None)
        with pytest.raises((ValueError, TypeError)) as raised:
            getattr(glm5_hal, bad.op)(**inputs)
        FUZZ_COUNTS[("bad inputs", bad.op, "validation")] += 1
        FUZZ_CLASSES.setdefault(bad.op, set()).add(bad.kind)
        message = str(raised.value)
        assert isinstance(raised.value, bad.exc), f"{type(raised.value).__name__} ({message}), expected {bad.exc}"
        assert _message_names(message, bad.arg), f"the message does not name {bad.arg!r}: {message}"

    refused()
