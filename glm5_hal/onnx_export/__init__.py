"""ONNX export of every glm5_hal op, in the standard opset, checked with onnxruntime against ops_reference.

[OpGraph (signature, dims, arguments)] -> GraphBuilder -> standard-opset nodes | glm5_hal custom node
    -> ModelProto (opset 18, symbolic token / cache dims, config in metadata_props) -> onnx.checker

Why graphs are written node by node with onnx.helper rather than traced from PyTorch: the ops are PyTorch custom
ops whose backends hold Python loops and data-dependent shapes (ragged batches, per-expert row ranges). Tracing
(`torch.onnx.export`, TorchScript or dynamo) would either capture one backend's loop unrolled for the example's
batch, or need a hand-written decomposition per op anyway, and would tie the graph to torch's exporter version.
Writing each op once from its OPS.md definition gives small graphs of standard operators (Gemm, MatMul,
MatMulInteger, Gather, ScatterND, TopK, Where, Loop, ...) whose token and cache dims stay symbolic, and needs
only `onnx` (onnxscript is not required).

`onnx` and `onnxruntime` are optional dependencies (`pip install glm5-hal[onnx]`): importing this package does
not import them; the first export or run does, and says how to install them if they are missing.

    from glm5_hal.onnx_export import export_op, check
    model = export_op("sparse_flash_attention", glm5_hal.GLM5)
    check(model)

docs/onnx.md lists each op's graph, what is exact and what is not, and the custom-node schema.
"""

from glm5_hal.onnx_export.catalog import OP_GRAPHS
from glm5_hal.onnx_export.export import check, contract_outputs, default_options, export_like, export_op, write_preset
from glm5_hal.onnx_export.graph import CUSTOM_DOMAIN, INSTALL_HINT, OPSET

__all__ = [
    "CUSTOM_DOMAIN",
    "INSTALL_HINT",
    "OPSET",
    "OP_GRAPHS",
    "check",
    "contract_outputs",
    "default_options",
    "export_like",
    "export_op",
    "write_preset",
]
