"""For every op: how to call it, and how to judge its outputs against ops_reference.

An `OpSpec` turns one case's inputs (a dict keyed by the public op's argument names) into named outputs, and
judges those outputs with glm5_hal.parity.compare against the reference run on the same (pre-call) inputs.
Cache-writing ops report the cache after the call as an output, so the write itself is checked.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

import glm5_hal
import ops_reference as ref
from glm5_hal.kv_formats import AUTO
from glm5_hal.parity.compare import Verdict, compare_exact, compare_float, compare_int8_codes, compare_topk, to_numpy
from glm5_hal.parity.quantized_cache import compare_quantized_cache

Inputs = dict[str, object]
Outputs = dict[str, torch.Tensor]


@dataclass(frozen=True)
class OpSpec:
    """run(inputs) -> outputs through the public API; judge(inputs, outputs, dtype) -> verdicts."""

    name: str
    output_names: tuple[str, ...]
    mutated: tuple[str, ...] = ()
    exact_outputs: tuple[str, ...] = ()

    def run(self, inputs: Inputs) -> Outputs:
        result = getattr(glm5_hal, self.name)(**inputs)
        result = result if isinstance(result, tuple) else (result,)
        outputs = dict(zip(self.output_names, result))
        outputs.update({name: inputs[name] for name in self.mutated})  # type: ignore[misc]
        return outputs

    def reference(self, inputs: Inputs) -> dict[str, np.ndarray]:
        args = _numpy_inputs(inputs)
        result = _REFERENCE_CALLS[self.name](args)
        return dict(zip(self.output_names + self.mutated, result))

    def judge(self, inputs: Inputs, outputs: Outputs, dtype: torch.dtype) -> list[Verdict]:
        if self.name in _CUSTOM_JUDGES:
            return _CUSTOM_JUDGES[self.name](self, inputs, outputs, dtype)
        want = self.reference(inputs)
        scales = _ERROR_SCALES[self.name](inputs, want) if self.name in _ERROR_SCALES else {}
        verdicts = []
        for name, value in outputs.items():
            scale = scales.get(name)  # a cache's: per written row [T, width]
            if name in self.mutated and inputs.get("kv_cache_dtype", AUTO) != AUTO:
                verdicts.append(_judge_quantized_write(self, inputs, name, value, want[name], dtype, scale))
            elif name in self.exact_outputs or not value.is_floating_point():
                verdicts.append(compare_exact(name, value, want[name]))
            else:
                if name in self.mutated and scale is not None:  # the written rows' scales, the others' values
                    scale = ref.write_cache(np.abs(want[name]), to_numpy(inputs["slot_mapping"]), scale)
                verdicts.append(compare_float(name, value, want[name], dtype, scale=scale))
        return verdicts


def _numpy_inputs(inputs: Inputs) -> dict[str, object]:
    """The case's inputs with every tensor as a NumPy array, as the reference takes them."""
    return {k: (to_numpy(v) if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}


def _ref_call(fn: Callable, *names: str, **kw_names: str) -> Callable[[dict], tuple]:
    """Call `fn` with the named inputs positionally, then the keyword ones that the inputs have (the others keep
    fn's defaults, e.g. kv_cache_dtype="auto" for a float cache)."""
    return lambda a: _as_tuple(fn(*(a[n] for n in names), **{k: a[v] for k, v in kw_names.items() if v in a}))


def _as_tuple(result: object) -> tuple:
    return result if isinstance(result, tuple) else (result,)


_PAGED = ("block_table", "seq_lens_k", "cu_seqlens_q")
_REFERENCE_CALLS: dict[str, Callable[[dict], tuple]] = {
    "mla_prolog": _ref_call(
        ref.mla_prolog,
        "x",
        "w_dq",
        "gamma_cq",
        "w_uq_qr",
        "w_uk",
        "w_dkv_kr",
        "gamma_ckv",
        "cos",
        "sin",
        "kv_cache",
        "slot_mapping",
        "eps",
        kv_cache_dtype="kv_cache_dtype",
    ),
    "indexer_prolog": _ref_call(
        ref.indexer_prolog,
        "x",
        "q_norm",
        "w_iq",
        "w_ik",
        "k_norm_weight",
        "k_norm_bias",
        "w_iw",
        "cos",
        "sin",
        "index_k_cache",
        "slot_mapping",
        rope_interleaved="rope_interleaved",
        kv_cache_dtype="kv_cache_dtype",
    ),
    "indexer_logits": _ref_call(
        ref.indexer_logits, "q_idx", "weights", "index_k_cache", *_PAGED, kv_cache_dtype="kv_cache_dtype"
    ),
    "lightning_indexer": _ref_call(
        ref.lightning_indexer, "q_idx", "weights", "index_k_cache", *_PAGED, "topk", kv_cache_dtype="kv_cache_dtype"
    ),
    "sparse_flash_attention": _ref_call(
        ref.sparse_flash_attention,
        "q",
        "kv_cache",
        "indices",
        *_PAGED,
        "sm_scale",
        "d_v",
        kv_cache_dtype="kv_cache_dtype",
    ),
    "moe_gate": _ref_call(
        ref.moe_gate,
        "router_logits",
        "bias",
        top_k="top_k",
        n_group="n_group",
        topk_group="topk_group",
        routed_scaling_factor="routed_scaling_factor",
        norm_topk_prob="norm_topk_prob",
        scoring="scoring",
    ),
    "moe_dispatch": _ref_call(ref.moe_dispatch, "x", "topk_ids", "num_experts"),
    "grouped_matmul": _ref_call(ref.grouped_matmul, "x_sorted", "w", "expert_offsets"),
    "moe_combine": _ref_call(ref.moe_combine, "y_sorted", "src_index", "topk_weights"),
    "fused_moe": _ref_call(ref.fused_moe, "x", "topk_weights", "topk_ids", "w13", "w2"),
    "dynamic_quant": _ref_call(ref.dynamic_quant, "x"),
    "quant_matmul": _ref_call(ref.quant_matmul, "x_q", "x_scale", "w_q", "w_scale", "bias"),
    "w4a8_matmul": _ref_call(ref.w4a8_matmul, "x_q", "x_scale", "w_packed", "w_scale", "group_size"),
    "hadamard_transform": _ref_call(ref.hadamard_transform, "x", scale="scale"),
}


def _judge_quantized_write(
    spec: OpSpec,
    inputs: Inputs,
    name: str,
    value: torch.Tensor,
    reference_cache: np.ndarray,
    dtype: torch.dtype,
    row_scales: np.ndarray | None = None,
) -> Verdict:
    """A quantized cache after a prolog's write, against the reference's unquantized rows (quantized_cache.py);
    row_scales [T, width]: the written values' error scales, where not the values themselves."""
    fmt = ref.FORMATS[str(inputs["kv_cache_dtype"])]
    blocks, block_size, _ = inputs[name].shape  # type: ignore[union-attr]
    # The reference's float64 rows: the same call writing a float cache (slots it does not write stay 0).
    float_cache = torch.zeros(blocks, block_size, fmt.width, dtype=torch.float64)
    rows = spec.reference({**inputs, name: float_cache, "kv_cache_dtype": AUTO})[name].reshape(-1, fmt.width)
    slots = to_numpy(inputs["slot_mapping"]).astype(np.int64)  # type: ignore[arg-type]
    written = rows[np.clip(slots, 0, None)]
    before = to_numpy(inputs[name])  # type: ignore[arg-type]
    return compare_quantized_cache(name, value, before, written, reference_cache, slots, fmt, dtype, row_scales)


def _indexer_scores_and_scales(inputs: Inputs) -> tuple[np.ndarray, np.ndarray]:
    """The reference logits [T, width] (-inf where not visible), and what each logit's rounding is relative to. A
    logit sum_j w_j ReLU(q_j . k) sums heads whose weights have both signs, and each q_j . k sums products of both
    signs: both levels cancel, so a logit is judged against its terms' root-sum-square, sqrt(sum_j w_j^2 d_j^2) with
    d_j = max(|q_j . k|, sqrt(sum_i q_ji^2 k_i^2)) (docs/ops.md "What an error is relative to"), and at least
    against itself. Each head counts, active or not: its dot product's rounding decides which side of ReLU it is."""
    args = _numpy_inputs(inputs)
    paged = [args[n] for n in _PAGED]
    fmt = args.get("kv_cache_dtype", AUTO)
    logits = ref.indexer_logits(args["q_idx"], args["weights"], args["index_k_cache"], *paged, fmt)
    keys = ref.dequantize_cache(args["index_k_cache"], fmt)
    sequences = ref.token_sequences(args["cu_seqlens_q"])
    terms_sq = np.zeros_like(logits)
    with np.errstate(invalid="ignore", over="ignore"):  # inf * 0 where inputs hold inf: those logits are not judged
        for t, row in enumerate(logits):
            visible = np.flatnonzero(row != -np.inf)
            token_keys = ref.gather_keys(keys, args["block_table"], sequences[t], visible)  # [S, DI]
            q = np.asarray(args["q_idx"][t], np.float64)  # [HI, DI]
            head_sq = np.maximum((q @ token_keys.T) ** 2, q**2 @ (token_keys**2).T)  # [HI, S]
            terms_sq[t, visible] = np.asarray(args["weights"][t], np.float64) ** 2 @ head_sq
    return logits, sum_scale(terms_sq, logits)


def _judge_indexer_logits(spec: OpSpec, inputs: Inputs, outputs: Outputs, dtype: torch.dtype) -> list[Verdict]:
    logits, scales = _indexer_scores_and_scales(inputs)
    return [compare_float("logits", outputs["logits"], logits, dtype, scale=scales)]


def _judge_lightning_indexer(spec: OpSpec, inputs: Inputs, outputs: Outputs, dtype: torch.dtype) -> list[Verdict]:
    logits, scales = _indexer_scores_and_scales(inputs)
    indices = outputs["indices"]
    verdicts = [compare_topk("indices", indices, logits, int(inputs["topk"]), dtype, scales=scales)]
    if "scores" in outputs:
        # The scores a backend returns are the reference scores of the keys it picked.
        idx = to_numpy(indices).astype(np.int64)
        picked = np.where(idx >= 0, np.take_along_axis(logits, np.clip(idx, 0, None), axis=1), -np.inf)
        scale = np.where(idx >= 0, np.take_along_axis(scales, np.clip(idx, 0, None), axis=1), 0.0)
        verdicts.append(compare_float("scores", outputs["scores"], picked, dtype, scale=scale))
    return verdicts


def _sparse_flash_attention_scales(inputs: Inputs, want: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """lse = log(sum exp): an fp32 sum's relative rounding is an absolute error in its log, so lse near 0 is judged
    against 1, not against itself (the long fuzz profile failed such cases); large lse relative to itself. out =
    sum_i p_i v_i sums value rows of both signs: judged as a sum, against sqrt(sum_i p_i^2 v_i^2) and itself.

    That root-sum-square comes from the reference itself, so the same keys count (valid, addressed, the cache's
    decoded values): over rows [v^2 | row] with q [0 | q] and twice sm_scale it returns sum_i softmax(2s)_i v_i^2
    and log sum_i exp(2 s_i), and sum_i p_i^2 v_i^2 = that sum times exp(lse(2s) - 2 lse(s))."""
    args = _numpy_inputs(inputs)
    d_v = int(args["d_v"])
    rows = ref.dequantize_cache(args["kv_cache"], args.get("kv_cache_dtype", AUTO))
    q = np.asarray(args["q"], np.float64)
    with np.errstate(invalid="ignore", over="ignore"):  # inf / nan inputs: those outputs are not judged
        squared_rows = np.concatenate([rows[..., :d_v] ** 2, rows], axis=-1)
        padded_q = np.concatenate([np.zeros((*q.shape[:2], d_v)), q], axis=-1)
        paged = [args[n] for n in _PAGED]
        v_sq, lse_2s = ref.sparse_flash_attention(
            padded_q, squared_rows, args["indices"], *paged, 2 * args["sm_scale"], d_v
        )
        terms_sq = v_sq * np.exp(lse_2s - 2 * want["lse"])[..., None]
    return {"out": sum_scale(terms_sq, want["out"]), "lse": np.maximum(1.0, np.abs(_finite_or_zero(want["lse"])))}


def _judge_moe_gate(spec: OpSpec, inputs: Inputs, outputs: Outputs, dtype: torch.dtype) -> list[Verdict]:
    want = spec.reference(inputs)
    # The picked experts form a set; compare ids and weights after sorting each row by id.
    got_ids, want_ids = to_numpy(outputs["topk_ids"]), want["topk_ids"]
    got_order, want_order = np.argsort(got_ids, axis=1), np.argsort(want_ids, axis=1)
    got_w = np.take_along_axis(to_numpy(outputs["topk_weights"]), got_order, axis=1)
    want_w = np.take_along_axis(want["topk_weights"], want_order, axis=1)
    return [
        compare_exact(
            "topk_ids",
            torch.from_numpy(np.take_along_axis(got_ids, got_order, 1)),
            np.take_along_axis(want_ids, want_order, 1),
        ),
        compare_float("topk_weights", torch.from_numpy(got_w), want_w, torch.float32 if dtype is None else dtype),
    ]


def _judge_dynamic_quant(spec: OpSpec, inputs: Inputs, outputs: Outputs, dtype: torch.dtype) -> list[Verdict]:
    want = spec.reference(inputs)
    x = to_numpy(inputs["x"])  # type: ignore[arg-type]
    return [
        compare_int8_codes("q", outputs["q"], want["q"], x, want["scale"]),
        compare_float("scale", outputs["scale"], want["scale"], torch.float32),
    ]


def _moe_combine_scales(inputs: Inputs, want: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """out relative to the sum of its terms' magnitudes, sum_j |w_tj| |y(t, j)|: the expert outputs have both signs
    and cancel, and a backend whose kernel takes the weights in the tokens' dtype (Ascend's npu_moe_token_unpermute)
    rounds each term at that dtype's resolution (the long fuzz profile failed such an fp16 case at 1.04x the bound
    relative to the output)."""
    y, src, weights = (to_numpy(inputs[name]) for name in ("y_sorted", "src_index", "topk_weights"))
    with np.errstate(invalid="ignore"):  # inf * 0 where inputs hold inf: those outputs are not finite, not judged
        return {"out": _finite_or_zero(ref.moe_combine(np.abs(y), src, np.abs(weights)))}


def _grouped_matmul_scales(inputs: Inputs, want: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """y against its terms' root-sum-square per expert, sqrt(x^2 @ (w^2)^T), and at least against itself: a
    product of both signs' terms is as accurate in fp32 as the rounding of those terms allows (the long fuzz profile
    failed an output of three cancelling terms at 1.1e-4 of itself on the torch backend's code)."""
    x, w = to_numpy(inputs["x_sorted"]).astype(np.float64), to_numpy(inputs["w"]).astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):  # inf * 0: those outputs are not finite, not judged
        terms_sq = ref.grouped_matmul(x**2, w**2, to_numpy(inputs["expert_offsets"]))
    return {"y": sum_scale(terms_sq, want["y"])}


def _fused_moe_scales(inputs: Inputs, want: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """out against the rounding its chain carries: gate and up are projections (scales s_g, s_u as grouped_matmul's
    y); the activation a = silu(g) up carries |a|, silu'(g) s_g |up| and |silu(g)| s_u (first order); the down
    projection and the weighted combine sum that activation's terms. A random case is judged against about 1.5x its
    own size; outputs whose down projection or combine cancel, against their terms."""
    x, w13, w2, weights = (to_numpy(inputs[name]).astype(np.float64) for name in ("x", "w13", "w2", "topk_weights"))
    x_sorted, offsets, src_index = ref.moe_dispatch(x, to_numpy(inputs["topk_ids"]), w13.shape[0])
    with np.errstate(invalid="ignore", over="ignore"):  # inf * 0: those outputs are not finite, not judged
        h = ref.grouped_matmul(x_sorted, w13, offsets)
        h_scale = sum_scale(ref.grouped_matmul(x_sorted**2, w13**2, offsets), h)
        inter = h.shape[1] // 2
        gate, up, gate_scale, up_scale = h[:, :inter], h[:, inter:], h_scale[:, :inter], h_scale[:, inter:]
        sigmoid = 1.0 / (1.0 + np.exp(-gate))
        silu_slope = sigmoid * (1.0 + gate * (1.0 - sigmoid))
        act = ref.silu(gate) * up
        act_sq = act**2 + (silu_slope * gate_scale * up) ** 2 + (ref.silu(gate) * up_scale) ** 2
        y_scale = sum_scale(ref.grouped_matmul(act_sq, w2**2, offsets), ref.grouped_matmul(act, w2, offsets))
        terms_sq = ref.moe_combine(y_scale**2, src_index, weights**2)
    return {"out": sum_scale(terms_sq, want["out"])}


def sum_scale(terms_sq: np.ndarray, value: np.ndarray) -> np.ndarray:
    """What a sum's error is relative to: the root-sum-square of its terms' scales (sqrt(terms_sq)), whose rounding
    errors add like a random walk, and at least the sum itself, as any output (a sum of K aligned terms is sqrt(K)
    times their root-sum-square). Not finite where the inputs are not: 0 there (those outputs are not judged)."""
    return np.maximum(_finite_or_zero(np.sqrt(terms_sq)), np.abs(_finite_or_zero(value)))


def _mla_prolog_scales(inputs: Inputs, want: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """q_norm, q_lat and q_pe against the rounding their chain carries, as sums (at least against themselves): the
    down projection c = x @ w_dq^T (its terms' root-sum-square s_c), q_norm = RMSNorm(c) gamma as s_c |gamma| / rms(c)
    (the mean square sums squares, which do not cancel), the up projection q = q_norm @ w_uq^T over q_norm's scales,
    q_lat = q_nope @ w_uk per head over q_nope's, and q_pe = RoPE(q_rope) as sqrt(s_a^2 cos^2 + s_b^2 sin^2). The
    latent cache rows [RMSNorm(c_kv) gamma_ckv | RoPE(k_pe)], per written token [T, kv_lora + rope], as q_norm and
    q_pe are."""
    names = ("x", "w_dq", "gamma_cq", "w_uq_qr", "w_uk", "w_dkv_kr", "gamma_ckv", "cos", "sin")
    a = {name: to_numpy(inputs[name]).astype(np.float64) for name in names}
    heads, nope, latent = a["w_uk"].shape
    eps = float(inputs["eps"])  # type: ignore[arg-type]
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):  # inf / nan inputs: those outputs not judged
        q_norm_scale = _rms_norm_scale(a["x"], a["w_dq"], a["gamma_cq"], eps)
        q_sq = q_norm_scale**2 @ (a["w_uq_qr"] ** 2).T
        q_scale = sum_scale(q_sq, want["q_norm"] @ a["w_uq_qr"].T).reshape(-1, heads, a["w_uq_qr"].shape[0] // heads)
        lat_sq = np.einsum("thn,hnc->thc", q_scale[..., :nope] ** 2, a["w_uk"] ** 2)
        pe_sq = _rope_squares(q_scale[..., nope:] ** 2, a["cos"] ** 2, a["sin"] ** 2, interleaved=True)
        # the latent cache rows [RMSNorm(c_kv) | RoPE(k_pe)]
        k_pe = a["x"] @ a["w_dkv_kr"][latent:].T
        k_pe_scale = sum_scale(a["x"] ** 2 @ (a["w_dkv_kr"][latent:] ** 2).T, k_pe)
        k_pe_sq = _rope_squares(k_pe_scale**2, a["cos"] ** 2, a["sin"] ** 2, interleaved=True)
        rows = np.concatenate(
            [
                _rms_norm_scale(a["x"], a["w_dkv_kr"][:latent], a["gamma_ckv"], eps),
                sum_scale(k_pe_sq, ref.rope(k_pe, a["cos"], a["sin"], interleaved=True)),
            ],
            axis=-1,
        )
    return {
        "q_norm": q_norm_scale,
        "q_lat": sum_scale(lat_sq, want["q_lat"]),
        "q_pe": sum_scale(pe_sq, want["q_pe"]),
        "kv_cache": rows,
    }


def _rms_norm_scale(x: np.ndarray, w: np.ndarray, gamma: np.ndarray, eps: float) -> np.ndarray:
    """The scale of RMSNorm(x @ w^T) gamma: the projection c's scales s_c (as grouped_matmul's y) over
    r = sqrt(mean(c^2) + eps), times |gamma| (first order; the mean square sums squares, which do not cancel), and
    at least the output itself. Where c sits near or below sqrt(eps), that is c's rounding over sqrt(eps)."""
    c = x @ w.T
    r = np.sqrt(np.mean(c * c, axis=-1, keepdims=True) + eps)
    return sum_scale((sum_scale(x**2 @ (w**2).T, c) / r * gamma) ** 2, ref.rms_norm(c, gamma, eps))


def _indexer_prolog_scales(inputs: Inputs, want: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """q_idx = RoPE(q_norm @ w_iq^T) and weights = x @ w_iw^T * HI^-0.5 * DI^-0.5 against their terms' root-sum-
    squares (as grouped_matmul's y), RoPE's a cos - b sin over the projection's scales as sqrt(s_a^2 cos^2 +
    s_b^2 sin^2); at least against themselves. Projections and RoPE cancel, so an fp32 result is as accurate as its
    terms' rounding allows: the long fuzz profile drew one token, one head and 36 hidden dims whose weight was
    3.9e-4 from terms of 4.3 in magnitude, 3.0e-4 of itself off on the torch backend (3.2e-5 on triton), as a plain
    fp32 matmul of the same inputs is. The index-key rows RoPE(LayerNorm(x @ w_ik^T)), per written token [T, DI],
    below."""
    names = ("x", "q_norm", "w_iq", "w_iw", "w_ik", "k_norm_weight", "k_norm_bias", "cos", "sin")
    a = {name: to_numpy(inputs[name]).astype(np.float64) for name in names}
    heads, head_dim = a["w_iw"].shape[0], a["w_ik"].shape[0]
    rope_dim, interleaved = 2 * a["cos"].shape[1], bool(inputs["rope_interleaved"])
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):  # inf / nan inputs: those outputs not judged
        q = sum_scale(a["q_norm"] ** 2 @ (a["w_iq"] ** 2).T, a["q_norm"] @ a["w_iq"].T).reshape(-1, heads, head_dim)
        q[..., :rope_dim] = np.sqrt(_rope_squares(q[..., :rope_dim] ** 2, a["cos"] ** 2, a["sin"] ** 2, interleaved))
        weights_sq = a["x"] ** 2 @ (a["w_iw"] ** 2).T * (heads**-0.5 * head_dim**-0.5) ** 2
        # the index-key rows RoPE(LayerNorm(x @ w_ik^T)): the centring subtracts too, so a row whose projections
        # nearly agree is as accurate as their rounding over sqrt(var + eps) (first order, as RMSNorm's), the
        # mean's own rounding included
        c = a["x"] @ a["w_ik"].T
        c_scale = sum_scale(a["x"] ** 2 @ (a["w_ik"] ** 2).T, c)
        eps = float(inputs.get("eps", _INDEXER_PROLOG_EPS))  # type: ignore[arg-type]
        sigma = np.sqrt(np.var(c, axis=-1, keepdims=True) + eps)
        k = ref.layer_norm(c, a["k_norm_weight"], a["k_norm_bias"], eps)
        centring_sq = np.mean(c_scale**2, axis=-1, keepdims=True) / c.shape[-1]  # the mean of D rounding errors
        k_scale = sum_scale((c_scale**2 + centring_sq) / sigma**2 * a["k_norm_weight"] ** 2, k)
        k[..., :rope_dim] = ref.rope(k[..., :rope_dim], a["cos"], a["sin"], interleaved=interleaved)
        k_sq = k_scale**2
        k_sq[..., :rope_dim] = _rope_squares(k_sq[..., :rope_dim], a["cos"] ** 2, a["sin"] ** 2, interleaved)
    return {
        "q_idx": sum_scale(q**2, want["q_idx"]),
        "weights": sum_scale(weights_sq, want["weights"]),
        "index_k_cache": sum_scale(k_sq, k),
    }


# the LayerNorm eps of indexer_prolog where a case does not pass one (the op's default is the reference's)
_INDEXER_PROLOG_EPS = inspect.signature(ref.indexer_prolog).parameters["eps"].default


def _rope_squares(x_sq: np.ndarray, cos_sq: np.ndarray, sin_sq: np.ndarray, interleaved: bool) -> np.ndarray:
    """RoPE's rotated pairs (a cos - b sin, a sin + b cos) as sums of their terms' squares, for a^2, b^2, cos^2,
    sin^2: a^2 cos^2 + b^2 sin^2 and a^2 sin^2 + b^2 cos^2. The reference's rotation with sin^2 negated gives the
    first of each pair, with sin^2 as it is the second, and each is the larger of the two there, whatever the pair
    layout."""
    return np.maximum(
        ref.rope(x_sq, cos_sq, -sin_sq, interleaved=interleaved),
        ref.rope(x_sq, cos_sq, sin_sq, interleaved=interleaved),
    )


def _finite_or_zero(values: np.ndarray) -> np.ndarray:
    return np.nan_to_num(values, nan=0.0, posinf=0.0, neginf=0.0)


# What an output's error is relative to where that is not the output itself (docs/ops.md "Edge rules"): by op, the
# scales of those outputs from the case's inputs and the reference's outputs.
_ERROR_SCALES: dict[str, Callable[[Inputs, dict[str, np.ndarray]], dict[str, np.ndarray]]] = {
    "mla_prolog": _mla_prolog_scales,
    "indexer_prolog": _indexer_prolog_scales,
    "sparse_flash_attention": _sparse_flash_attention_scales,
    "moe_combine": _moe_combine_scales,
    "grouped_matmul": _grouped_matmul_scales,
    "fused_moe": _fused_moe_scales,
}

_CUSTOM_JUDGES = {
    "indexer_logits": _judge_indexer_logits,
    "lightning_indexer": _judge_lightning_indexer,
    "moe_gate": _judge_moe_gate,
    "dynamic_quant": _judge_dynamic_quant,
}

SPECS: dict[str, OpSpec] = {
    spec.name: spec
    for spec in (
        OpSpec("mla_prolog", ("q_lat", "q_pe", "q_norm"), mutated=("kv_cache",)),
        OpSpec("indexer_prolog", ("q_idx", "weights"), mutated=("index_k_cache",)),
        OpSpec("indexer_logits", ("logits",)),
        OpSpec("lightning_indexer", ("indices", "scores")),
        OpSpec("sparse_flash_attention", ("out", "lse")),
        OpSpec("moe_gate", ("topk_weights", "topk_ids")),
        OpSpec("moe_dispatch", ("x_sorted", "expert_offsets", "src_index"), exact_outputs=("x_sorted",)),
        OpSpec("grouped_matmul", ("y",)),
        OpSpec("moe_combine", ("out",)),
        OpSpec("fused_moe", ("out",)),
        OpSpec("dynamic_quant", ("q", "scale")),
        OpSpec("quant_matmul", ("y",)),
        OpSpec("w4a8_matmul", ("y",)),
        OpSpec("hadamard_transform", ("y",)),
    )
}
