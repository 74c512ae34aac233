"""Reading FP8 block-scaled source checkpoints (DeepSeek-V3 / V3.1 / V3.2's release format; the FP8 GLM-5 releases).

glm5-hal's model and quantizer take floating weights; this module turns such a checkpoint's FP8 linears back into
them (`CausalLM.from_pretrained` and `glm5-hal quantize` dequantize on read, one tensor at a time). The format,
as documented and implemented upstream:

    X.weight            float8_e4m3fn [N, K]
    X.weight_scale_inv  float32 [ceil(N / bn), ceil(K / bk)], one scale per bn x bk block (bn = bk = 128)
    W[n, k] = float(X.weight[n, k]) * X.weight_scale_inv[n // bn, k // bk]      (computed in fp32)

The last block row / column is ragged when N or K is not a multiple of the block: it has a scale of its own and
no padding is stored. Tensors without a `_scale_inv` companion (embeddings, norms, the router gate, ...) are stored
in their floating dtype. config.json carries

    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "weight_block_size": [128, 128]}

and DeepSeek-V3.1 / V3.2 add "scale_fmt": "ue8m0".

Sources (facts only; the code here is our own):
- deepseek-ai/DeepSeek-V3 README_WEIGHTS.md, "FP8 Weight Documentation": the quantization_config above; "e4m3"
  corresponds to torch.float8_e4m3fn; `weight_scale_inv` is an fp32 tensor stored alongside the weight, one scale
  per 128x128 block; a block not aligned to 128 is zero-padded to compute its scale and the padding removed after
  quantization; dequantization is "(128x128 weight block) * weight_scale_inv".
- deepseek-ai/DeepSeek-V3 inference/kernel.py: `weight_quant` allocates the scales as
  fp32 [cdiv(M, 128), cdiv(N, 128)] with scale = amax / 448 per block (448 = float8_e4m3fn's max);
  `weight_dequant_kernel` loads the fp8 block, converts it to fp32, multiplies by the block's scale (masked at the
  ragged edges) and stores in the default dtype (bf16). inference/fp8_cast_bf16.py pairs `{name}_scale_inv` with
  every 1-byte weight, skips `*_scale_inv` entries and drops them from the index of the converted checkpoint.
- deepseek-ai/DeepSeek-V3.2-Exp inference/model.py: FP8 `Linear` keeps `weight.scale` as float32
  [ceil(out / 128), ceil(in / 128)] and takes the FP8 path only for `torch.float8_e4m3fn` weights; `scale_fmt`
  is passed to the activation quantizer only. DeepSeek-V3 issue #961: V3.1's stored `weight_scale_inv` are fp32
  (mostly, not all, powers of two) although its config says "scale_fmt": "ue8m0"; so that key does not change
  how a weight is dequantized.
- transformers 5.23 (integrations/finegrained_fp8.py, utils/quantization_config.py FineGrainedFP8Config):
  FP8Linear allocates a float8_e4m3fn weight and a `weight_scale_inv` of [ceil(out / bn), ceil(in / bk)];
  activation_scheme is "dynamic" or "static" (static adds an `activation_scale` tensor); weight_block_size is two
  positive ints, None meaning per-tensor scaling; scale_fmt "float" (fp32) or "ue8m0" (1-byte float8_e8m0fnu
  scales, DeepSeek-V4-style).
- vLLM model_executor/layers/quantization/fp8.py (Fp8Config): activation schemes "static" / "dynamic",
  weight_block_size must have 2 dimensions. On ROCm vLLM converts float8_e4m3fn weights to float8_e4m3fnuz at
  load time (normalize_e4m3fn_to_e4m3fnuz: the same bits read as fnuz are half the value, so it doubles the
  scales): e4m3fnuz is a runtime layout, not the checkpoint format.

What is read, and why the rest is refused:
- weights must be float8_e4m3fn: "fmt": "e4m3" names that dtype. A float8_e4m3fnuz weight means the file was
  rewritten for a runtime whose scale convention we cannot tell from the file (converted scales are doubled), so
  it is an error rather than a guess; so is any other dtype.
- scales must be float32: what V3 / V3.1 / V3.2 store. 1-byte UE8M0 scales (DeepSeek-V4) are not read.
- activation_scheme "static" is refused: its `input_scale` tensors would otherwise be carried along silently.
- a quantization_config without weight_block_size (per-tensor FP8) or with another quant_method / fmt is refused.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

FP8_DTYPE = torch.float8_e4m3fn
SCALE_DTYPE = torch.float32
DEFAULT_BLOCK_SIZE: tuple[int, int] = (128, 128)
SCALE_SUFFIX = "_scale_inv"  # DeepSeek's fp8_cast_bf16.py: the scale of `name` is f"{name}_scale_inv"

# What quantization_config may say for a checkpoint this module reads (see the module docstring's sources).
QUANT_METHOD = "fp8"
FMTS = ("e4m3",)
ACTIVATION_SCHEMES = ("dynamic",)
# "float": fp32 scales (transformers' default). "ue8m0": declared by DeepSeek-V3.1 / V3.2, whose stored weight scales
# are still fp32 (DeepSeek-V3 issue #961). The scale tensors' dtype is checked per tensor either way.
SCALE_FMTS = ("float", "ue8m0")


def is_float8_dtype(dtype: torch.dtype) -> bool:
    """True for every 1-byte floating dtype (float8_e4m3fn, float8_e5m2, the fnuz variants, float8_e8m0fnu): the
    test DeepSeek's converter uses (`element_size() == 1`), so an FP8 weight of an unexpected kind is noticed."""
    return dtype.is_floating_point and dtype.itemsize == 1


def is_fp8_scale_name(name: str) -> bool:
    """True for a block-scale entry such as `X.weight_scale_inv` (any name ending in "_scale_inv", the test of
    DeepSeek's fp8_cast_bf16.py)."""
    return name.endswith(SCALE_SUFFIX) and len(name) > len(SCALE_SUFFIX)


def scale_name_for(weight_name: str) -> str:
    """The name of the block scales of `weight_name`: "X.weight" -> "X.weight_scale_inv"."""
    return weight_name + SCALE_SUFFIX


def weight_name_for(scale_name: str) -> str:
    """The weight a block-scale entry belongs to: "X.weight_scale_inv" -> "X.weight"."""
    if not is_fp8_scale_name(scale_name):
        raise ValueError(f"scale_name: expected a name ending in {SCALE_SUFFIX!r}, got {scale_name!r}")
    return scale_name[: -len(SCALE_SUFFIX)]


def _check_block_size(value: object, what: str) -> tuple[int, int]:
    """`value` as a (rows, cols) pair of positive ints, or a ValueError naming `what`."""
    if (
        not isinstance(value, (tuple, list))
        or len(value) != 2
        # bool is an int subclass; [True, True] is a malformed config, not a 1x1 block
        or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)
    ):
        raise ValueError(f"{what}: expected two positive ints [block_rows, block_cols], got {value!r}")
    return int(value[0]), int(value[1])


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def fp8_block_size(hf_config: Mapping[str, object]) -> tuple[int, int] | None:
    """The weight block size (block_rows, block_cols) of an FP8 block-scaled checkpoint, from its config.json.

    hf_config: the parsed config.json. Returns None when it has no `quantization_config` (a floating checkpoint).
    Raises ValueError when quantization_config describes something this module does not read: another quant_method
    (gptq, awq, compressed-tensors, ...), an fmt other than "e4m3", a static activation scheme, a scale_fmt other
    than "float" / "ue8m0", or a missing / malformed weight_block_size (per-tensor FP8).
    """
    if not isinstance(hf_config, Mapping):
        raise TypeError(f"hf_config: expected the parsed config.json (a dict), got {type(hf_config).__name__}")
    qc = hf_config.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, Mapping):
        raise ValueError(f"quantization_config: expected a dict, got {type(qc).__name__}: {qc!r}")
    method = qc.get("quant_method")
    if method != QUANT_METHOD:
        raise ValueError(
            f"quantization_config.quant_method: only {QUANT_METHOD!r} (block-scaled FP8) source checkpoints can be "
            f"read, got {method!r}; dequantize the checkpoint to bf16 first"
        )
    # transformers' FineGrainedFP8Config does not write `fmt`; DeepSeek's configs do. Absent means e4m3.
    fmt = qc.get("fmt", FMTS[0])
    if fmt not in FMTS:
        raise ValueError(f"quantization_config.fmt: expected one of {FMTS} (float8_e4m3fn), got {fmt!r}")
    scheme = qc.get("activation_scheme", ACTIVATION_SCHEMES[0])
    if scheme not in ACTIVATION_SCHEMES:
        raise ValueError(
            f"quantization_config.activation_scheme: expected one of {ACTIVATION_SCHEMES}, got {scheme!r} "
            "(static activation scales are not read)"
        )
    scale_fmt = qc.get("scale_fmt")
    if scale_fmt is not None and scale_fmt not in SCALE_FMTS:
        raise ValueError(f"quantization_config.scale_fmt: expected one of {SCALE_FMTS} or absent, got {scale_fmt!r}")
    if qc.get("weight_block_size") is None:
        raise ValueError(
            "quantization_config.weight_block_size: missing; only block-scaled FP8 is read, not per-tensor FP8"
        )
    return _check_block_size(qc["weight_block_size"], "quantization_config.weight_block_size")


def dequantize_fp8_block(
    weight: Tensor,
    scale_inv: Tensor,
    block_size: tuple[int, int] = DEFAULT_BLOCK_SIZE,
    dtype: torch.dtype = torch.bfloat16,
    *,
    name: str | None = None,
) -> Tensor:
    """Dequantize one block-scaled FP8 weight: W[n, k] = float32(weight[n, k]) * scale_inv[n // bn, k // bk].

    weight: float8_e4m3fn [N, K]. scale_inv: float32 [ceil(N / bn), ceil(K / bk)], finite and >= 0 (the last block
    row / column covers the ragged remainder). block_size: (bn, bk). dtype: the floating dtype returned.
    name: the weight's checkpoint name; when given, errors name the tensors (`name`, `scale_name_for(name)`)
    instead of the arguments. Returns `dtype` [N, K] on weight's device: the fp32 product rounded once to `dtype`
    (bit-identical to it for dtype=float32), as DeepSeek's weight_dequant computes it.
    Raises ValueError on a wrong dtype, rank or scale shape, a non-finite or negative scale, a NaN weight code, or
    a value that overflows `dtype`.
    """
    weight_label = name if name is not None else "weight"
    scale_label = scale_name_for(name) if name is not None else "scale_inv"
    bn, bk = _check_block_size(block_size, "block_size")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point or is_float8_dtype(dtype):
        raise ValueError(f"dtype: expected a floating torch dtype of 16 bits or more, got {dtype!r}")
    for label, t, want in ((weight_label, weight, FP8_DTYPE), (scale_label, scale_inv, SCALE_DTYPE)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{label}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dtype != want:
            raise ValueError(f"{label}: expected dtype {want}, got {t.dtype}")
        if t.dim() != 2:
            raise ValueError(f"{label}: expected a 2-D tensor, got shape {tuple(t.shape)}")
    n, k = weight.shape
    grid = (_cdiv(n, bn), _cdiv(k, bk))
    if tuple(scale_inv.shape) != grid:
        raise ValueError(
            f"{scale_label}: expected shape {grid} (ceil of {weight_label}'s shape {(n, k)} by block {(bn, bk)}), "
            f"got {tuple(scale_inv.shape)}"
        )
    if not bool(torch.isfinite(scale_inv).all()) or bool((scale_inv < 0).any()):
        bad = scale_inv[~torch.isfinite(scale_inv) | (scale_inv < 0)]
        raise ValueError(f"{scale_label}: expected finite scales >= 0, got {bad.numel()} others, e.g. {bad[0].item()}")

    # One fp32 buffer padded to whole blocks, so each block scale broadcasts over a [bn, bk] view without expanding
    # the scales to the weight's size; the padding (zeros) is cut off before returning.
    padded = torch.zeros(grid[0] * bn, grid[1] * bk, dtype=torch.float32, device=weight.device)
    padded[:n, :k] = weight  # float8_e4m3fn -> float32 is exact
    padded.view(grid[0], bn, grid[1], bk).mul_(scale_inv.to(weight.device)[:, None, :, None])
    out = padded[:n, :k].to(dtype) if dtype != torch.float32 else padded[:n, :k].contiguous()
    if not bool(torch.isfinite(out).all()):
        # Diagnose only on failure: a finite scale times a finite code is finite in fp32, so either a code is NaN
        # (e4m3fn has no infinity) or the value does not fit `dtype` (e.g. float16 beyond 65504).
        if bool(torch.isnan(weight.to(torch.float32)).any()):
            raise ValueError(f"{weight_label}: contains NaN codes (a corrupt or mis-typed tensor)")
        raise ValueError(f"{weight_label}: dequantized values overflow {dtype}; pass dtype=torch.bfloat16 or float32")
    return out


def dequantize_fp8_state_dict(
    state: Mapping[str, Tensor],
    block_size: tuple[int, int] = DEFAULT_BLOCK_SIZE,
    dtype: torch.dtype = torch.bfloat16,
) -> dict[str, Tensor]:
    """A floating copy of a block-scaled FP8 state dict.

    Every `X.weight` that has an `X.weight_scale_inv` is dequantized to `dtype` (dequantize_fp8_block) and the
    scale entry dropped; every other tensor is passed through unchanged (same object), in the original order.
    block_size: from fp8_block_size(config). Raises ValueError naming the tensor for a `*.weight_scale_inv`
    without its weight, a 1-byte float weight without its scale, or any check of dequantize_fp8_block.
    A streaming reader does the same per tensor with is_fp8_scale_name / scale_name_for / weight_name_for and
    dequantize_fp8_block(..., name=weight_name).
    """
    _check_block_size(block_size, "block_size")
    out: dict[str, Tensor] = {}
    for name, tensor in state.items():
        if is_fp8_scale_name(name):
            if weight_name_for(name) not in state:
                raise ValueError(f"{name}: block scales without their weight {weight_name_for(name)!r}")
            continue  # consumed with its weight
        scale_name = scale_name_for(name)
        if scale_name in state:
            out[name] = dequantize_fp8_block(tensor, state[scale_name], block_size, dtype, name=name)
        elif is_float8_dtype(tensor.dtype):
            raise ValueError(f"{name}: {tensor.dtype} tensor without its block scales {scale_name!r}")
        else:
            out[name] = tensor
    return out
