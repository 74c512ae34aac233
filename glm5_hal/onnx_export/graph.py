"""A small builder for ONNX graphs: named values, initializer constants, nodes, sub-graphs, and the model.

It is the only module of glm5_hal.onnx_export that touches the `onnx` package, and it imports it lazily
(`require_onnx`), so `import glm5_hal.onnx_export` works where onnx is not installed and the first export says
how to install it. The op graphs (attention.py, moe.py, quant.py) only call `GraphBuilder` methods.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType

import numpy as np

# ONNX operator set of the default domain the graphs are written against. 18 is the first where every Reduce*
# op takes `axes` as an input, it has LayerNormalization (17), BitwiseAnd (18) and ScatterND reductions, and
# every runtime and vendor toolchain current in 2025 reads it.
OPSET = 18
CUSTOM_DOMAIN = "glm5_hal"
CUSTOM_DOMAIN_VERSION = 1
# IR version 8 (onnx 1.13) is the one that introduced opset 18; writing it instead of the installed onnx's newest
# keeps the files readable by older runtimes.
IR_VERSION = 8
INSTALL_HINT = "pip install glm5-hal[onnx]  (or: pip install onnx onnxruntime)"

# Element types by the NumPy-style name the graphs use.
_ELEM_TYPES = {
    "float32": "FLOAT",
    "float16": "FLOAT16",
    "bfloat16": "BFLOAT16",
    "float64": "DOUBLE",
    "int64": "INT64",
    "int32": "INT32",
    "int16": "INT16",
    "int8": "INT8",
    "uint8": "UINT8",
    "bool": "BOOL",
}

Dim = int | str  # a fixed size, or the name of a symbolic dimension


def require_onnx() -> ModuleType:
    """The `onnx` module, or an ImportError that says how to install it."""
    try:
        import onnx
    except ImportError as exc:
        raise ImportError(f"ONNX export needs the `onnx` package, which is not installed: {INSTALL_HINT}") from exc
    return onnx


def elem_type(dtype: str) -> int:
    """The TensorProto element type of a dtype name ('float32', 'int64', ...)."""
    onnx = require_onnx()
    if dtype not in _ELEM_TYPES:
        raise ValueError(f"dtype: expected one of {sorted(_ELEM_TYPES)}, got {dtype!r}")
    return getattr(onnx.TensorProto, _ELEM_TYPES[dtype])


@dataclass(frozen=True)
class TensorSig:
    """One graph input or output: its name (an OPS.md argument or output name), dtype name and shape."""

    name: str
    dtype: str
    shape: tuple[Dim, ...]


class GraphBuilder:
    """Appends nodes to one graph; `op(...)` returns the name(s) of the new node's output(s).

    Values get unique generated names unless `out=` names them (graph outputs are named this way). Constants
    become initializers; small integer constants are shared. Sub-graphs (Loop bodies) share the name counter,
    because ONNX wants every value name unique across a graph and its sub-graphs.
    """

    def __init__(
        self, name: str, *, custom_ops: frozenset[str] = frozenset(), _counter: itertools.count | None = None
    ) -> None:
        self.onnx = require_onnx()
        self.name = name
        self.custom_ops = custom_ops  # ops to emit as one glm5_hal-domain node wherever they occur (custom.py)
        self.nodes: list = []
        self.initializers: list = []
        self.inputs: list = []
        self.outputs: list = []
        self.uses_custom_domain = False
        self._counter = _counter if _counter is not None else itertools.count()
        self._constants: dict[tuple, str] = {}

    # ------------------------------------------------------------------------------------------ values
    def fresh(self, hint: str) -> str:
        return f"{hint}_{next(self._counter)}"

    def value_info(self, sig: TensorSig):
        return self.onnx.helper.make_tensor_value_info(sig.name, elem_type(sig.dtype), list(sig.shape))

    def add_input(self, sig: TensorSig) -> str:
        self.inputs.append(self.value_info(sig))
        return sig.name

    def add_output(self, value: str, sig: TensorSig) -> None:
        """Declare `value` a graph output named `sig.name` (through an Identity if it has another name)."""
        if value != sig.name:
            self.op("Identity", value, out=sig.name)
        self.outputs.append(self.value_info(sig))

    def const(self, value: object, dtype: str = "int64") -> str:
        """An initializer holding `value` (a scalar gives a 0-d tensor; a list or array keeps its shape)."""
        array = np.asarray(value, dtype=np.dtype(dtype))
        key = (dtype, array.shape, array.tobytes()) if array.size <= 16 else None
        if key is not None and key in self._constants:
            return self._constants[key]
        name = self.fresh("const")
        self.initializers.append(self.onnx.numpy_helper.from_array(array, name))
        if key is not None:
            self._constants[key] = name
        return name

    # ------------------------------------------------------------------------------------------- nodes
    def op(
        self,
        op_type: str,
        *inputs: str,
        n_out: int = 1,
        out: str | Sequence[str] | None = None,
        domain: str = "",
        **attrs: object,
    ) -> str | tuple[str, ...]:
        """Append one node; returns its output name (a tuple of names if n_out > 1). '' skips an optional input."""
        if out is None:
            outputs = [self.fresh(op_type.lower()) for _ in range(n_out)]
        else:
            outputs = [out] if isinstance(out, str) else list(out)
        if domain:
            self.uses_custom_domain = True
        node = self.onnx.helper.make_node(op_type, list(inputs), outputs, name=self.fresh(op_type), domain=domain)
        node.attribute.extend(self.onnx.helper.make_attribute(k, v) for k, v in attrs.items() if v is not None)
        self.nodes.append(node)
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

    def subgraph(self, name: str) -> GraphBuilder:
        """A builder for a sub-graph (Loop body) whose value names cannot clash with this graph's."""
        return GraphBuilder(name, custom_ops=self.custom_ops, _counter=self._counter)

    def graph(self):
        return self.onnx.helper.make_graph(self.nodes, self.name, self.inputs, self.outputs, self.initializers)


def make_model(
    builder: GraphBuilder, *, doc: str, metadata: Mapping[str, object], opset: int = OPSET
):  # -> onnx.ModelProto (onnx is imported lazily, so no annotation)
    """The ModelProto of a finished graph: default-domain opset `opset`, the glm5_hal domain if a custom node is
    used, and `metadata` as JSON-encoded metadata_props (strings are stored as they are)."""
    onnx = builder.onnx
    opsets = [onnx.helper.make_opsetid("", opset)]
    if builder.uses_custom_domain:
        opsets.append(onnx.helper.make_opsetid(CUSTOM_DOMAIN, CUSTOM_DOMAIN_VERSION))
    model = onnx.helper.make_model(builder.graph(), opset_imports=opsets, producer_name="glm5-hal", doc_string=doc)
    model.ir_version = IR_VERSION
    for key, value in metadata.items():
        entry = model.metadata_props.add()
        entry.key = key
        entry.value = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
    return model
