"""OP_GRAPHS: the ONNX form of the ops of glm5_hal.registry.OP_NAMES, in contract order."""

from __future__ import annotations

from glm5_hal.onnx_export import attention, moe, quant
from glm5_hal.onnx_export.opgraph import OpGraph
from glm5_hal.registry import OP_NAMES

_BY_NAME = {graph.name: graph for graph in (*attention.GRAPHS, *moe.GRAPHS, *quant.GRAPHS)}
# parity_tests/test_onnx_export.py checks that every op of the contract has its graph.
OP_GRAPHS: dict[str, OpGraph] = {op: _BY_NAME[op] for op in OP_NAMES if op in _BY_NAME}
