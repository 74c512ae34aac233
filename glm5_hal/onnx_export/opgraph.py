"""`OpGraph`: what the exporter knows about one op: its ONNX signature, its model dims and arguments, its builder.

Shapes are written with dimension names. Names in RUNTIME_DIMS (tokens, sequences, cache blocks, ...) stay
symbolic in the exported graph; every other name is a model dim (a head count, a width) that the export fixes,
from a preset (`dims_from_config`) or from example tensors (glm5_hal.onnx_export.export.export_like).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from glm5_hal.config import ModelConfig
from glm5_hal.onnx_export.graph import Dim, GraphBuilder, TensorSig

# Symbolic in every graph: what changes from one call to the next. "S" = max_blocks * block_size (the key
# positions a block table addresses); "T*k" = token-expert assignments; "M" = rows of a grouped GEMM;
# "T", "T1", "T2", ... = leading (token) dims of the ops that accept any number of them.
RUNTIME_DIMS = frozenset({"T", "B", "B+1", "num_blocks", "block_size", "max_blocks", "S", "T*k", "M"})
LEADING = "..."  # in a shape: any number of leading token dims (dynamic_quant, hadamard_transform)

# Suffix of the graph output that carries an updated cache (ONNX values are immutable: no in-place writes).
CACHE_OUT_SUFFIX = "_out"

Options = Mapping[str, object]
Dims = Mapping[str, int]
Build = Callable[[GraphBuilder, Mapping[str, str], Dims, Options], dict[str, str]]


def leading_names(count: int) -> tuple[str, ...]:
    """Names of `count` leading token dims: ("T",), ("T", "T1"), ..."""
    return tuple("T" if i == 0 else f"T{i}" for i in range(count))


def is_runtime(name: str) -> bool:
    return name in RUNTIME_DIMS or (name.startswith("T") and name[1:].isdigit())


@dataclass(frozen=True)
class OpGraph:
    """The ONNX form of one op.

    inputs, outputs: the graph's signature in contract order (OPS.md argument and output names; an updated
        cache is output `<cache>_out`). dtype "out_dtype" means the dtype named by the option `out_dtype`.
    optional: tensor arguments that may be None; a graph exported without one has no such input.
    preset_absent: optional arguments a preset's graph leaves out (GLM-5's linears have no bias).
    options_from_config: the op's non-tensor arguments (eps, topk, sm_scale, ...) for a model preset.
    dims_from_config: the model dims its shapes name, for a preset.
    derived_dims: dims only the outputs name, from the other dims and the options (e.g. topk, E+1).
    adjust_inputs: (inputs, options) -> inputs, for an input whose shape depends on an option (w4a8's w_scale, a
        quantized cache).
    adjust_outputs: the same for outputs (a quantized cache written by a prolog).
    build: (builder, input values by name, dims, options) -> output values by name.
    """

    name: str
    inputs: tuple[TensorSig, ...]
    outputs: tuple[TensorSig, ...]
    options_from_config: Callable[[ModelConfig], dict[str, object]]
    dims_from_config: Callable[[ModelConfig], dict[str, int]]
    build: Build
    derived_dims: Callable[[Dims, Options], dict[str, int]] = lambda dims, options: {}
    optional: tuple[str, ...] = field(default=())
    preset_absent: tuple[str, ...] = field(default=())
    adjust_inputs: Callable[[tuple[TensorSig, ...], Options], tuple[TensorSig, ...]] = lambda inputs, options: inputs
    adjust_outputs: Callable[[tuple[TensorSig, ...], Options], tuple[TensorSig, ...]] = lambda outputs, options: outputs

    @property
    def tensor_names(self) -> tuple[str, ...]:
        """The op's tensor arguments, in contract order (optional ones included)."""
        return tuple(s.name for s in self.inputs)

    def input_sigs(self, options: Options) -> tuple[TensorSig, ...]:
        """The inputs with dim names (before sizes are filled in) for these options."""
        return self.adjust_inputs(self.inputs, options)

    def signature(
        self, dims: Dims, options: Options, *, absent: frozenset[str] = frozenset()
    ) -> tuple[list[TensorSig], list[TensorSig]]:
        """(inputs, outputs) with model dims replaced by their sizes, leading dims expanded, optional ones dropped."""
        known = {**dims, **self.derived_dims(dims, options)}
        leading = leading_names(int(options.get("leading_dims", 1)))

        def concrete(sig: TensorSig) -> TensorSig:
            shape: list[Dim] = []
            for name in sig.shape:
                if name == LEADING:
                    shape.extend(leading)
                elif isinstance(name, int) or is_runtime(name):
                    shape.append(name)
                elif name in known:
                    shape.append(int(known[name]))
                else:
                    raise ValueError(f"{self.name}: dim {name!r} of {sig.name!r} has no size (known: {sorted(known)})")
            dtype = _dtype_name(options["out_dtype"]) if sig.dtype == "out_dtype" else sig.dtype
            return TensorSig(sig.name, dtype, tuple(shape))

        inputs = [concrete(s) for s in self.adjust_inputs(self.inputs, options) if s.name not in absent]
        return inputs, [concrete(s) for s in self.adjust_outputs(self.outputs, options)]


def _dtype_name(dtype: object) -> str:
    """'float32' for torch.float32, 'float32', or numpy's float32."""
    return str(dtype).removeprefix("torch.")


def sig(name: str, dtype: str, *shape: Dim) -> TensorSig:
    return TensorSig(name, dtype, tuple(shape))


def require(condition: bool, message: str) -> None:
    """Raise ValueError(message) unless condition: dims that must agree with each other (e.g. HQ = H*(nope+rope))."""
    if not condition:
        raise ValueError(message)
