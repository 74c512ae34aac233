"""onnx.reference implementations of the `glm5_hal` custom domain's nodes (custom.py), computed by ops_reference.

It sits above the catalog (it reads each op's graph for its input and output names) while the graph builders
below the catalog emit custom nodes through custom.py, so the two halves live in separate modules.
"""

from __future__ import annotations

from collections.abc import Sequence

from glm5_hal.onnx_export.catalog import OP_GRAPHS
from glm5_hal.onnx_export.custom import op_type
from glm5_hal.onnx_export.graph import CUSTOM_DOMAIN
from glm5_hal.onnx_export.opgraph import CACHE_OUT_SUFFIX
from glm5_hal.parity.specs import SPECS


def reference_ops(ops: Sequence[str]) -> list[type]:
    """onnx.reference implementations of glm5_hal::<OpType> nodes for `ops`, computed by ops_reference.

    With them, `onnx.reference.ReferenceEvaluator(model, new_ops=reference_ops(...))` runs a graph containing
    custom nodes, which checks that the standard part around them is right.
    """
    import numpy as np  # onnx is optional (the package docstring): imported when the runtime is wanted
    from onnx.helper import get_attribute_value
    from onnx.reference.op_run import OpRun

    def make(op: str) -> type:
        graph, spec = OP_GRAPHS[op], SPECS[op]

        def _run(self, *args, **_attributes):
            options = {a.name: get_attribute_value(a) for a in self.onnx_node.attribute}
            options = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in options.items()}
            # None-valued arguments are left out of a node (a bias input; group_size, scale attributes).
            for name in ("group_size", "scale", "bias"):
                options.setdefault(name, None)
            names = [s.name for s in graph.input_sigs(options)]
            arguments = {**options, **{n: a for n, a in zip(names, args)}}
            result = spec.reference(arguments)
            out_dtype = str(options.get("out_dtype", "float32"))
            return tuple(
                np.asarray(result[s.name.removesuffix(CACHE_OUT_SUFFIX)]).astype(
                    out_dtype if s.dtype == "out_dtype" else s.dtype
                )
                for s in graph.outputs
            )[: len(self.onnx_node.output)]

        return type(op_type(op), (OpRun,), {"op_domain": CUSTOM_DOMAIN, "_run": _run})

    return [make(op) for op in ops]
