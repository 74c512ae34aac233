"""Operand layouts the native kernels read."""

from __future__ import annotations

from torch import Tensor

HEAD_LANES = 16  # heads are the lanes of a 512-bit fp32 vector in the kernels that put heads in lanes


def head_pairs(q: Tensor) -> Tensor:
    """q [T, H, D] bf16 as [T, ceil(D / 2), Hp, 2]: for each pair of dims, every head's two values (the layout
    VDPBF16PS multiplies against one broadcast pair of a key row), zero past H and D; Hp = H rounded up to
    HEAD_LANES."""
    tokens, heads, dims = q.shape
    padded_heads = -(-heads // HEAD_LANES) * HEAD_LANES
    packed = q.new_zeros(tokens, (dims + 1) // 2, padded_heads, 2)
    for half in (0, 1):  # dims 2p and 2p + 1 (an odd D's last pair has no second one: it stays 0)
        source = q[:, :, half::2]  # [T, H, ceil((D - half) / 2)]
        packed[:, : source.shape[2], :heads, half].copy_(source.transpose(1, 2))
    return packed
