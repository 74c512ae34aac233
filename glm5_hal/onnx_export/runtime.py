"""Running exported graphs with onnxruntime on the CPU (imported lazily, like onnx)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from glm5_hal.onnx_export.graph import INSTALL_HINT


def require_onnxruntime():
    try:
        import onnxruntime
    except ImportError as exc:
        raise ImportError(
            f"running exported graphs needs `onnxruntime`, which is not installed: {INSTALL_HINT}"
        ) from exc
    return onnxruntime


def session(model, *, threads: int | None = None):  # -> onnxruntime.InferenceSession
    """A CPU InferenceSession of `model` with full graph optimisation; threads: intra-op threads (default: as
    many as torch uses, so timings compare like with like)."""
    ort = require_onnxruntime()
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads or torch.get_num_threads()
    opts.inter_op_num_threads = 1
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def as_array(value: object) -> np.ndarray:
    """A graph feed: tensors become NumPy arrays; floating tensors become float32 (the graphs' activation dtype)."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        value = value.to(torch.float32) if value.is_floating_point() else value
        return value.contiguous().numpy()
    return np.asarray(value)


def feeds(sess, inputs: Mapping[str, object]) -> dict[str, np.ndarray]:
    """The session's inputs picked from `inputs` (keyed by argument name; non-tensor arguments are ignored)."""
    return {i.name: as_array(inputs[i.name]) for i in sess.get_inputs()}


def run(sess, inputs: Mapping[str, object]) -> dict[str, np.ndarray]:
    """Outputs by graph output name."""
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feeds(sess, inputs))))
