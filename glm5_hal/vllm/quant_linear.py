"""W8A8 compressed-tensors linear layers through glm5-hal (GLM5_HAL_VLLM_QUANT_LINEAR=1).

vLLM's CPU build runs these itself (oneDNN / its own int8 kernels), so by default the plugin leaves them alone.
With the switch, every linear layer whose compressed-tensors scheme is int8 weights per channel with int8
activations quantized per token at run time runs glm5-hal's `int_linear` (dynamic_quant + quant_matmul), as
glm5-hal's own quantized model (quantization.QuantLinear) does: together with the MoE method (moe.py), vLLM then
serves exactly what `CausalLM.from_pretrained` of the same checkpoint computes. vLLM's activation quantization
rounds differently, which on a near-flat distribution is enough to flip greedy tokens.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn
from vllm.logger import init_logger
from vllm.model_executor.layers.quantization.compressed_tensors.schemes.compressed_tensors_w8a8_int8 import (
    CompressedTensorsW8A8Int8,
)

from glm5_hal.quant_layers import int_linear
from glm5_hal.vllm.moe import int_scheme
from glm5_hal.vllm.settings import LOGGER

logger = init_logger(LOGGER)


class Glm5HalW8A8Linear(CompressedTensorsW8A8Int8):
    """compressed-tensors' W8A8 int8 scheme (its parameters and loading), computed by glm5_hal.int_linear."""

    def __init__(self) -> None:
        super().__init__(strategy="channel", is_static_input_scheme=False, input_symmetric=True)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        # [N, 1] per-channel scales as loaded -> [N], quant_matmul's shape; the weight stays [N, K] int8
        layer.weight_scale = nn.Parameter(layer.weight_scale.data[:, 0].contiguous(), requires_grad=False)
        layer.weight = nn.Parameter(layer.weight.data.contiguous(), requires_grad=False)

    def apply_weights(self, layer: nn.Module, x: Tensor, bias: Tensor | None) -> Tensor:
        rows = x.reshape(-1, x.shape[-1])
        y = int_linear(rows, layer.weight, layer.weight_scale, bias=bias)
        return y.reshape(*x.shape[:-1], y.shape[-1])


def register_quant_linear() -> None:
    """Route compressed-tensors' W8A8 int8 (per channel, dynamic per-token activations) linear scheme to
    Glm5HalW8A8Linear."""
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig

    if getattr(CompressedTensorsConfig, "_glm5_hal_wrapped", False):
        return
    choose = CompressedTensorsConfig._get_scheme_from_parts

    def _get_scheme_from_parts(self: Any, weight_quant: Any, input_quant: Any, *args: Any, **kwargs: Any) -> Any:
        fmt = kwargs.get("format", args[1] if len(args) > 1 else None) or self.quant_format
        if int_scheme(weight_quant, input_quant, fmt) == (8, None):
            logger.info_once("glm5-hal vLLM plugin: W8A8 linear layers through glm5-hal")
            return Glm5HalW8A8Linear()
        return choose(self, weight_quant, input_quant, *args, **kwargs)

    CompressedTensorsConfig._get_scheme_from_parts = _get_scheme_from_parts
    CompressedTensorsConfig._glm5_hal_wrapped = True
