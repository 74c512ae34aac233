"""Quantize a glm5_hal.model.CausalLM in place with a named scheme, by RTN or GPTQ, through its swap hooks.

    scheme "w8a8": every quantized linear W8A8 (int8 per-channel weights, int8 per-token activations)
    scheme "w4a8": the GLM-5 Ascend mix: W8A8 for attention and dense / shared-expert MLPs, W4A8 (int4
                   per-channel) for the routed experts

Kept in floating point (the shipped recipe): embed_tokens, lm_head, the norms, kv_b_proj (absorbed per head),
the router gate and the indexer's wk / weights_proj.

GPTQ calibration is one pass of the floating model over the calibration tokens: every target linear records
the Hessian of its inputs (routed experts per expert, from the tokens routed to them), then each weight is
quantized from its own Hessian.

Calibration size matters most for the routed experts, which each see only top_k / n_routed_experts of the
tokens. A Hessian estimated from fewer rows than its width K is rank-deficient: GPTQ then fits the calibration
rows and can do worse than RTN on held-out tokens (measured on glm5-mini, K = 256: 8 x 128 calibration tokens,
~256 rows per expert, lost 1-2 dB to RTN on the W4A8 experts; 32 x 128 tokens, ~1024 rows, gained 0.2-0.6 dB;
docs/quantization.md). `quantize_model` warns when that happens.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
from torch import Tensor, nn

import glm5_hal
from glm5_hal.model import CausalLM, Linear
from glm5_hal.model.linear import RoutedExperts
from quantization.experts import QuantRoutedExperts
from quantization.gptq import HessianAccumulator, gptq_quantize
from quantization.linear import W4A8, W8A8, QuantLinear
from quantization.quantizers import QuantizedWeight, WeightQuantSpec, rtn_quantize

SCHEMES = ("w8a8", "w4a8")
METHODS = ("rtn", "gptq")

# Linear module names (suffixes) kept in floating point by every scheme.
FLOAT_LINEARS = ("kv_b_proj", "mlp.gate", "indexer.wk", "indexer.weights_proj", "lm_head")


def linear_scheme(name: str, scheme: str) -> str | None:
    """The quantization of the linear (or routed-expert) module `name` under `scheme`: "w8a8", "w4a8" or None
    (kept in floating point)."""
    if scheme not in SCHEMES:
        raise ValueError(f"scheme: expected one of {SCHEMES}, got {scheme!r}")
    if name.endswith(FLOAT_LINEARS):
        return None
    if name.endswith("mlp.experts"):
        return W4A8 if scheme == "w4a8" else W8A8
    return W8A8


class _HessianRecorder(Linear):
    """A dense Linear that accumulates the Hessian of its inputs (a subclass, so the model's prologs run
    decomposed and call it)."""

    def __init__(self, weight: Tensor) -> None:
        super().__init__(weight)
        self.hessian = HessianAccumulator(weight.shape[1])

    def forward(self, x: Tensor) -> Tensor:
        self.hessian.add(x)
        return super().forward(x)


class _RecordingExperts(nn.Module):
    """Routed experts computed per expert in float, accumulating each expert's gate/up and down Hessians."""

    def __init__(self, experts: RoutedExperts) -> None:
        super().__init__()
        self.w13, self.w2 = experts.w13, experts.w2
        num, two_inter, hidden = self.w13.shape
        self.gate_up = [HessianAccumulator(hidden) for _ in range(num)]
        self.down = [HessianAccumulator(two_inter // 2) for _ in range(num)]

    def forward(self, x: Tensor, topk_weights: Tensor, topk_ids: Tensor) -> Tensor:
        x_sorted, expert_offsets, src_index = glm5_hal.moe_dispatch(x, topk_ids, self.w13.shape[0])
        y_sorted = torch.zeros_like(x_sorted)
        offsets = expert_offsets.tolist()
        inter = self.w2.shape[2]
        for e in range(self.w13.shape[0]):
            rows = slice(offsets[e], offsets[e + 1])
            if rows.start == rows.stop:
                continue
            self.gate_up[e].add(x_sorted[rows])
            h = x_sorted[rows] @ self.w13[e].T.to(x.dtype)
            act = nn.functional.silu(h[:, :inter]) * h[:, inter:]
            self.down[e].add(act)
            y_sorted[rows] = act @ self.w2[e].T.to(x.dtype)
        return glm5_hal.moe_combine(y_sorted, src_index, topk_weights)


def weight_spec(kind: str, mse_clip: bool, group_size: int | None) -> WeightQuantSpec:
    """The WeightQuantSpec quantize_model uses for a call site of kind "w8a8" / "w4a8"."""
    if kind == W8A8:
        return WeightQuantSpec(bits=8, mse_clip=mse_clip)
    return WeightQuantSpec(bits=4, mse_clip=mse_clip, group_size=group_size)


def _set_prologs_fused(model: CausalLM, fused: bool) -> None:
    for layer in model.model.layers:
        layer.self_attn.fused = fused
        layer.self_attn.indexer.fused = fused


def calibrate(model: CausalLM, targets: Sequence[str], calibration: Sequence[Tensor]) -> dict[str, object]:
    """Hessians of every target module's inputs over the calibration sequences (each a [T] int64 token tensor).

    Returns {linear name: HessianAccumulator} and, for routed experts, {experts name: (gate_up list, down list)}.
    The model is restored as it was.
    """
    modules = dict(model.named_modules())
    recorders: dict[str, nn.Module] = {}
    for name in targets:
        module = modules[name]
        recorder = _RecordingExperts(module) if isinstance(module, RoutedExperts) else _HessianRecorder(module.weight)
        recorders[name] = recorder
        model.replace_module(name, recorder)
    _set_prologs_fused(model, False)
    try:
        for ids in calibration:
            model.prefill(ids)
    finally:
        for name in targets:
            model.replace_module(name, modules[name])
        _set_prologs_fused(model, True)
    return {
        name: (r.gate_up, r.down) if isinstance(r, _RecordingExperts) else r.hessian for name, r in recorders.items()
    }


def quantize_model(
    model: CausalLM,
    scheme: str,
    method: str = "rtn",
    *,
    calibration: Sequence[Tensor] = (),
    mse_clip: bool = False,
    group_size: int | None = None,
    act_order: bool = False,
) -> dict[str, QuantizedWeight]:
    """Quantize `model` in place: each target Linear becomes a QuantLinear, each RoutedExperts a
    QuantRoutedExperts.

    Args:
        model: the floating model (e.g. built from a QuaRot-rotated state dict).
        scheme: "w8a8" or "w4a8" (see the module docstring).
        method: "rtn" or "gptq" (needs `calibration`).
        calibration: token sequences [T] int64 for GPTQ's Hessians.
        mse_clip: MSE clip search for the weight scales.
        group_size: int4 group size for the W4A8 experts (None = per channel, the shipped recipe).
        act_order: GPTQ column order by decreasing Hessian diagonal.

    Returns:
        {checkpoint weight name ("...q_a_proj.weight", "...mlp.experts.3.down_proj.weight"): QuantizedWeight},
        what a quantized checkpoint stores.
    """
    if method not in METHODS:
        raise ValueError(f"method: expected one of {METHODS}, got {method!r}")
    if method == "gptq" and not calibration:
        raise ValueError("calibration: GPTQ needs at least one calibration sequence")
    candidates = {**model.linears(), **{n: m for n, m in model.named_modules() if isinstance(m, RoutedExperts)}}
    targets = [name for name in candidates if linear_scheme(name, scheme) is not None]
    hessians = calibrate(model, targets, calibration) if method == "gptq" else {}
    _warn_if_underdetermined(hessians)

    def quantize(w: Tensor, spec: WeightQuantSpec, hessian: HessianAccumulator | None) -> QuantizedWeight:
        if hessian is None:
            return rtn_quantize(w, spec)
        return gptq_quantize(w, hessian.hessian, spec, act_order=act_order)

    stored: dict[str, QuantizedWeight] = {}
    for name in targets:
        module = candidates[name]
        spec = weight_spec(linear_scheme(name, scheme), mse_clip, group_size)
        if isinstance(module, RoutedExperts):
            gate_up_h, down_h = hessians.get(name, (None, None))
            inter = module.w2.shape[2]
            gate_up, down = [], []
            for e in range(module.num_experts):
                # gate and up read the same input: one quantization of their stacked rows (rows are independent
                # for RTN and for GPTQ with a shared Hessian), stored as the two checkpoint tensors.
                h13, h2 = (None, None) if gate_up_h is None else (gate_up_h[e], down_h[e])
                both = quantize(module.w13[e], spec, h13)
                stored[f"{name}.{e}.gate_proj.weight"] = _rows(both, slice(0, inter))
                stored[f"{name}.{e}.up_proj.weight"] = _rows(both, slice(inter, 2 * inter))
                stored[f"{name}.{e}.down_proj.weight"] = quantize(module.w2[e], spec, h2)
                gate_up.append(QuantLinear.from_quantized(both))
                down.append(QuantLinear.from_quantized(stored[f"{name}.{e}.down_proj.weight"]))
            model.replace_module(name, QuantRoutedExperts(gate_up, down))
        else:
            stored[f"{name}.weight"] = quantize(module.weight, spec, hessians.get(name))
            model.replace_module(name, QuantLinear.from_quantized(stored[f"{name}.weight"]))
    return stored


def _warn_if_underdetermined(hessians: dict[str, object]) -> None:
    """Warn when some Hessian saw fewer calibration rows than its width (see the module docstring)."""
    short = []
    for name, entry in hessians.items():
        named = [(name, entry)] if isinstance(entry, HessianAccumulator) else []
        if not named:  # routed experts: (gate_up list, down list), one accumulator per expert
            gate_up, down = entry
            named = [(f"{name}.{e}", h) for e, h in enumerate(gate_up)] + [
                (f"{name}.{e}.down_proj", h) for e, h in enumerate(down)
            ]
        short += [(n, h.samples, h.hessian.shape[0]) for n, h in named if h.samples < h.hessian.shape[0]]
    if short:
        worst = min(short, key=lambda item: item[1] / item[2])
        warnings.warn(
            f"GPTQ: {len(short)} Hessian(s) saw fewer calibration rows than their input width (worst: {worst[0]}, "
            f"{worst[1]} rows for K = {worst[2]}); they are rank-deficient and GPTQ may do worse than RTN there. "
            "Give more calibration tokens (routed experts see top_k / n_routed_experts of them).",
            stacklevel=3,
        )


def _rows(weight: QuantizedWeight, rows: slice) -> QuantizedWeight:
    """Some output rows of a quantized weight (per-row scales make the split exact)."""
    return QuantizedWeight(weight.codes[rows].clone(), weight.scale[rows].clone(), weight.spec)
