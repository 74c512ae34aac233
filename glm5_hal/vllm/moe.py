"""Routed experts through glm5-hal: vLLM's router chooses the experts, glm5-hal runs them.

Two MoE methods, each a drop-in for the vLLM method it replaces (same weights, same call):
- `Glm5HalUnquantizedMoEMethod`: bf16 / fp16 / fp32 experts through `glm5_hal.fused_moe` (vLLM's w13 [E, 2I, D]
  with gate rows first and w2 [E, D, I] are fused_moe's layout). Only with GLM5_HAL_VLLM_MOE=1: vLLM's CPU build
  has its own kernels for these.
- `Glm5HalIntMoEMethod`: the compressed-tensors W8A8 (int8 weights per channel) and W4A8 (int4 weights per channel
  or group, stored as int8 values) experts with int8 activations quantized per token, which vLLM's x86 CPU build
  cannot run ("No Int8 MoE backend supports the deployment configuration"). Each expert runs glm5-hal's
  `int_linear` (dynamic_quant + quant_matmul / w4a8_matmul) as glm5-hal's own quantized model does
  (glm5_hal.quant_layers). Taken wherever vLLM has no kernel for the scheme, and always with GLM5_HAL_VLLM_MOE=1.

Expert parallelism (an expert map), biases, other activations and router weights applied on the input stay
vLLM's: the unquantized method then runs vLLM's own kernel; the int8 method refuses with the reason.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from vllm.logger import init_logger
from vllm.model_executor.custom_op import CustomOp, op_registry_oot
from vllm.model_executor.layers.fused_moe import FusedMoEMethodBase, UnquantizedFusedMoEMethod
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.routed_experts import FusedMoeWeightScaleSupported
from vllm.model_executor.utils import set_weight_attrs

from glm5_hal.ops import fused_moe
from glm5_hal.quant_layers import int_linear, routed_expert_mlps, swiglu
from glm5_hal.vllm.settings import LOGGER

logger = init_logger(LOGGER)


def unsupported_features(layer: nn.Module) -> list[str]:
    """What of a vLLM RoutedExperts layer glm5-hal's MoE ops do not express (empty: glm5-hal can run it)."""
    config = layer.moe_config
    features = {
        f"activation {config.activation.value}": config.activation != MoEActivation.SILU,
        "expert parallelism (an expert map)": getattr(layer, "expert_map", None) is not None,
        "router weights applied on the input": bool(getattr(layer, "apply_router_weight_on_input", False)),
        "expert biases": bool(config.has_bias),
    }
    return [name for name, used in features.items() if used]


def _routing(topk_weights: Tensor, topk_ids: Tensor) -> tuple[Tensor, Tensor]:
    """vLLM's router output in glm5-hal's dtypes (fp32 weights, int32 ids)."""
    return topk_weights.to(torch.float32), topk_ids.to(torch.int32)


class Glm5HalUnquantizedMoEMethod(UnquantizedFusedMoEMethod):
    """vLLM's unquantized MoE method, with glm5_hal.fused_moe running the experts (GLM5_HAL_VLLM_MOE=1)."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        reasons = unsupported_features(layer)
        self.glm5_hal = not reasons
        if reasons:
            logger.info_once("glm5-hal vLLM plugin: vLLM's own MoE kernel runs (%s)", ", ".join(reasons))
            super().process_weights_after_loading(layer)
        # else: the weights stay as loaded (vLLM's CPU kernel would repack them into its own layout)

    @property
    def is_monolithic(self) -> bool:
        return False if getattr(self, "glm5_hal", False) else super().is_monolithic

    def apply(
        self,
        layer: nn.Module,
        x: Tensor,
        topk_weights: Tensor,
        topk_ids: Tensor,
        shared_experts: Any,
        shared_experts_input: Tensor | None,
    ) -> Tensor:
        if not self.glm5_hal:
            return super().apply(layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input)
        weights, ids = _routing(topk_weights, topk_ids)
        return fused_moe(x, weights, ids, layer.w13_weight, layer.w2_weight)


class Glm5HalIntMoEMethod(FusedMoEMethodBase):
    """W8A8 / W4A8 compressed-tensors experts through glm5-hal's quantized ops (module docstring).

    Parameters (the names and shapes vLLM's loader fills for compressed-tensors "int-quantized" experts):
        w13_weight: [E, 2I, D] int8, w2_weight: [E, D, I] int8 (int4 values in [-8, 7] for W4A8).
        w13_weight_scale: [E, 2I, G13], w2_weight_scale: [E, D, G2] fp32 (G = 1 per channel, K / group_size).
    After loading, W4A8 weights are packed two codes per byte along K (glm5-hal's w4a8_matmul layout).
    """

    def __init__(self, moe: Any, bits: int, group_size: int | None) -> None:
        super().__init__(moe)
        if bits not in (4, 8):
            raise ValueError(f"glm5-hal int MoE: bits: expected 4 or 8, got {bits}")
        if bits == 8 and group_size is not None:
            raise ValueError(f"glm5-hal int MoE: W8A8 takes per-channel scales, got group_size {group_size}")
        self.bits, self.group_size = bits, group_size

    def create_weights(
        self,
        layer: nn.Module,
        num_experts: int,
        hidden_size: int,
        intermediate_size_per_partition: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        inter = intermediate_size_per_partition
        shapes = {"w13": (num_experts, 2 * inter, hidden_size), "w2": (num_experts, hidden_size, inter)}
        for name, shape in shapes.items():
            weight = nn.Parameter(torch.empty(shape, dtype=torch.int8), requires_grad=False)
            layer.register_parameter(f"{name}_weight", weight)
            set_weight_attrs(weight, extra_weight_attrs)
        scale_kind = (
            FusedMoeWeightScaleSupported.CHANNEL if self.group_size is None else FusedMoeWeightScaleSupported.GROUP
        )
        scale_attrs = {**extra_weight_attrs, "quant_method": scale_kind.value}
        for name, (experts, rows, k) in shapes.items():
            groups = 1 if self.group_size is None else k // self.group_size
            scale = nn.Parameter(torch.ones(experts, rows, groups, dtype=torch.float32), requires_grad=False)
            layer.register_parameter(f"{name}_weight_scale", scale)
            set_weight_attrs(scale, scale_attrs)
        layer.w13_input_scale = layer.w2_input_scale = None  # activations are quantized per token at run time

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        reasons = unsupported_features(layer)
        if reasons:
            raise NotImplementedError(f"glm5-hal int MoE: {', '.join(reasons)} not supported")
        for name in ("w13", "w2"):
            weight = getattr(layer, f"{name}_weight")
            scale = getattr(layer, f"{name}_weight_scale")
            codes = weight.data if self.bits == 8 else _pack_int4(weight.data)
            # per channel: [E, N, 1] -> [E, N], the shape quant_matmul / w4a8_matmul take
            scales = scale.data[..., 0] if self.group_size is None else scale.data
            setattr(layer, f"{name}_weight", nn.Parameter(codes.contiguous(), requires_grad=False))
            setattr(layer, f"{name}_weight_scale", nn.Parameter(scales.contiguous(), requires_grad=False))

    def get_fused_moe_quant_config(self, layer: nn.Module) -> None:
        return None  # no vLLM kernel runs these experts

    def apply(
        self,
        layer: nn.Module,
        x: Tensor,
        topk_weights: Tensor,
        topk_ids: Tensor,
        shared_experts: Any,
        shared_experts_input: Tensor | None,
    ) -> Tensor:
        weights, ids = _routing(topk_weights, topk_ids)
        w13, s13, w2, s2 = layer.w13_weight, layer.w13_weight_scale, layer.w2_weight, layer.w2_weight_scale
        group = self.group_size

        def expert_mlp(e: int, rows: Tensor) -> Tensor:
            hidden = int_linear(rows, w13[e], s13[e], group_size=group)
            return int_linear(swiglu(hidden), w2[e], s2[e], group_size=group)

        return routed_expert_mlps(x, weights, ids, w13.shape[0], expert_mlp)


def _pack_int4(codes: Tensor) -> Tensor:
    """[..., N, K] int8 codes in [-8, 7] -> [..., N, K / 2] uint8, even k in the low nibble (OPS.md section 5)."""
    if codes.numel() and (codes.min() < -8 or codes.max() > 7):
        raise ValueError("glm5-hal int MoE: W4A8 weights: expected int4 values in [-8, 7]")
    nibbles = codes.to(torch.uint8) & 0x0F
    return nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)


def int_scheme(weight_quant: Any, input_quant: Any, fmt: str | None) -> tuple[int, int | None] | None:
    """(bits, group_size) when compressed-tensors' scheme is one Glm5HalIntMoEMethod runs: symmetric int8 or int4
    weights per channel (int4 also per group), stored unpacked ("int-quantized"), and symmetric int8 activations
    quantized per token at run time; None otherwise."""
    if weight_quant is None or input_quant is None or fmt not in (None, "int-quantized"):
        return None
    weights_ok = (
        weight_quant.type == "int"
        and weight_quant.symmetric
        and (
            (weight_quant.num_bits == 8 and weight_quant.strategy == "channel")
            or (weight_quant.num_bits == 4 and weight_quant.strategy in ("channel", "group"))
        )
    )
    inputs_ok = (
        input_quant.type == "int"
        and input_quant.num_bits == 8
        and input_quant.symmetric
        and input_quant.dynamic
        and input_quant.strategy == "token"
    )
    if not (weights_ok and inputs_ok):
        return None
    return weight_quant.num_bits, weight_quant.group_size if weight_quant.strategy == "group" else None


def register_moe(enabled: bool) -> None:
    """Install glm5-hal's MoE methods: the compressed-tensors int schemes where vLLM has no kernel (always), and
    with `enabled` (GLM5_HAL_VLLM_MOE=1) the unquantized experts and every int scheme glm5-hal can run."""
    _wrap_compressed_tensors(prefer_glm5_hal=enabled)
    if not enabled:
        return
    name = UnquantizedFusedMoEMethod.__name__
    current = op_registry_oot.get(name)
    if current is None:
        CustomOp.register_oot(Glm5HalUnquantizedMoEMethod, name=name)
    elif current is not Glm5HalUnquantizedMoEMethod:
        logger.warning(
            "glm5-hal vLLM plugin: %s is already replaced by %s; unquantized experts stay with it",
            name,
            current.__qualname__,
        )


def _wrap_compressed_tensors(prefer_glm5_hal: bool) -> None:
    """Let compressed-tensors' MoE method choice fall back to (or, preferred, take) Glm5HalIntMoEMethod."""
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import (
        compressed_tensors_moe as ct_moe,
    )

    methods = ct_moe.CompressedTensorsMoEMethod
    if getattr(methods, "_glm5_hal_wrapped", False):
        return
    choose = methods.get_moe_method

    def get_moe_method(quant_config: Any, layer: nn.Module, layer_name: str) -> FusedMoEMethodBase:
        scheme = _layer_int_scheme(quant_config, layer, layer_name)
        if scheme is not None and prefer_glm5_hal:
            return Glm5HalIntMoEMethod(layer.moe_config, *scheme)
        try:
            return choose(quant_config, layer, layer_name)
        except (NotImplementedError, RuntimeError, ValueError) as exc:
            if scheme is None:
                raise
            logger.info_once("glm5-hal vLLM plugin: int%d experts through glm5-hal (vLLM: %s)", scheme[0], exc)
            return Glm5HalIntMoEMethod(layer.moe_config, *scheme)

    methods.get_moe_method = staticmethod(get_moe_method)
    methods._glm5_hal_wrapped = True


def _layer_int_scheme(quant_config: Any, layer: nn.Module, layer_name: str) -> tuple[int, int | None] | None:
    """int_scheme of a MoE layer's experts, read as compressed-tensors reads them (the first expert's gate_proj;
    vLLM checks that every projection shares it)."""
    quant_config._add_fused_moe_to_target_scheme_map()
    scheme = quant_config.get_scheme_dict(layer, f"{layer_name}.0.{layer.ckpt_gate_proj_name}")
    if scheme is None:
        return None
    return int_scheme(scheme.get("weights"), scheme.get("input_activations"), scheme.get("format"))
