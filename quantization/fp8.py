"""FP8 block-scaled source checkpoints: the reader lives in glm5_hal.model.fp8 (reading a checkpoint is a model
concern, and glm5_hal may not import quantization/); its names stay importable from here."""

from glm5_hal.model.fp8 import (
    ACTIVATION_SCHEMES,
    DEFAULT_BLOCK_SIZE,
    FMTS,
    FP8_DTYPE,
    QUANT_METHOD,
    SCALE_DTYPE,
    SCALE_FMTS,
    SCALE_SUFFIX,
    dequantize_fp8_block,
    dequantize_fp8_state_dict,
    fp8_block_size,
    is_float8_dtype,
    is_fp8_scale_name,
    scale_name_for,
    weight_name_for,
)

__all__ = [
    "ACTIVATION_SCHEMES",
    "DEFAULT_BLOCK_SIZE",
    "FMTS",
    "FP8_DTYPE",
    "QUANT_METHOD",
    "SCALE_DTYPE",
    "SCALE_FMTS",
    "SCALE_SUFFIX",
    "dequantize_fp8_block",
    "dequantize_fp8_state_dict",
    "fp8_block_size",
    "is_float8_dtype",
    "is_fp8_scale_name",
    "scale_name_for",
    "weight_name_for",
]
