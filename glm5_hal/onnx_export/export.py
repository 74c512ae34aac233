"""The export driver: one ONNX model per op, from a model preset or from example inputs, checked on the way out.

    export_op(op, cfg)               the op at a preset's model dims and arguments (what `export-onnx` writes)
    export_like(op, inputs)          the op at the model dims of example inputs (as torch.onnx.export takes them)
    check(model)                     onnx.checker with full shape inference
    write_preset(cfg, out_dir, ops)  every requested op as <out_dir>/<op>.onnx

Model dims are fixed in the graph; tokens, sequences and cache geometry stay symbolic (opgraph.RUNTIME_DIMS).
A model's metadata_props hold the op, its arguments, its fixed dims, the preset config (JSON) and the package
version, so a consumer can tell what a file computes without this package.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

import glm5_hal
from glm5_hal.config import ModelConfig
from glm5_hal.kv_formats import AUTO, FAMILIES, OP_CACHE
from glm5_hal.onnx_export.catalog import OP_GRAPHS
from glm5_hal.onnx_export.custom import EXPORT_ONLY_OPTIONS, attribute_value, custom_node, op_type
from glm5_hal.onnx_export.graph import OPSET, GraphBuilder, make_model, require_onnx
from glm5_hal.onnx_export.opgraph import CACHE_OUT_SUFFIX, LEADING, OpGraph, is_runtime, leading_names

METADATA_PREFIX = "glm5_hal."


def _graph(op: str) -> OpGraph:
    if op not in OP_GRAPHS:
        raise ValueError(f"op: expected one of {list(OP_GRAPHS)}, got {op!r}")
    return OP_GRAPHS[op]


def _check_custom_ops(custom_ops: Iterable[str]) -> frozenset[str]:
    chosen = frozenset(custom_ops)
    unknown = sorted(chosen - set(OP_GRAPHS))
    if unknown:
        raise ValueError(f"custom_ops: expected ops from {list(OP_GRAPHS)}, got unknown {unknown}")
    return chosen


def default_options(op: str) -> dict[str, object]:
    """The defaults of the public op's non-tensor arguments (e.g. indexer_prolog's eps=1e-6)."""
    tensors = set(_graph(op).tensor_names)
    params = inspect.signature(getattr(glm5_hal, op)).parameters.values()
    return {p.name: p.default for p in params if p.default is not inspect.Parameter.empty and p.name not in tensors}


def export_op(
    op: str,
    cfg: ModelConfig,
    *,
    options: Mapping[str, object] | None = None,
    custom_ops: Iterable[str] = (),
):  # -> onnx.ModelProto
    """The ONNX model of `op` at the model dims and arguments of `cfg` (options override arguments)."""
    graph = _graph(op)
    chosen = {**default_options(op), **graph.options_from_config(cfg), **(options or {})}
    absent = frozenset(name for name in graph.optional if name in graph.preset_absent)
    return _assemble(graph, graph.dims_from_config(cfg), chosen, absent, _check_custom_ops(custom_ops), cfg)


def export_like(
    op: str,
    example_inputs: Mapping[str, object],
    *,
    cfg: ModelConfig | None = None,
    custom_ops: Iterable[str] = (),
):  # -> onnx.ModelProto
    """The ONNX model of `op` at the model dims of example inputs (keyed by the op's argument names).

    Model dims (widths, head counts) come from the example tensors' shapes; token and cache dims stay symbolic.
    Non-tensor entries (eps, topk, ...) become the op's baked arguments; an optional tensor given as None
    (a bias) is left out of the graph. cfg only goes into the metadata.
    """
    graph = _graph(op)
    dims, options, absent = read_example(graph, example_inputs)
    return _assemble(graph, dims, options, absent, _check_custom_ops(custom_ops), cfg)


def read_example(
    graph: OpGraph, example_inputs: Mapping[str, object]
) -> tuple[dict[str, int], dict[str, object], frozenset[str]]:
    """(model dims, op arguments, absent optional inputs) that example inputs imply for `graph`."""
    tensors = {k: v for k, v in example_inputs.items() if k in graph.tensor_names and v is not None}
    missing = sorted(set(graph.tensor_names) - set(example_inputs) - set(graph.optional))
    if missing:
        raise ValueError(f"example_inputs: {graph.name} needs tensors {missing}")
    options = {**default_options(graph.name)}
    options.update({k: v for k, v in example_inputs.items() if k not in graph.tensor_names})
    absent = frozenset(name for name in graph.optional if name not in tensors)
    if any(LEADING in s.shape for s in graph.inputs):
        options["leading_dims"] = tensors[graph.inputs[0].name].dim() - 1
    return infer_dims(graph, options, tensors), options, absent


def infer_dims(graph: OpGraph, options: Mapping[str, object], tensors: Mapping[str, torch.Tensor]) -> dict[str, int]:
    """The model dims named by the op's input shapes, read off example tensors (conflicts are a ValueError)."""
    found: dict[str, int] = {}
    leading = leading_names(int(options.get("leading_dims", 1)))
    for sig in graph.input_sigs(options):
        if sig.name not in tensors:
            continue
        names = [n for name in sig.shape for n in (leading if name == LEADING else (name,))]
        shape = tuple(tensors[sig.name].shape)
        if len(shape) != len(names):
            raise ValueError(f"{sig.name}: expected shape [{', '.join(map(str, names))}], got {list(shape)}")
        for name, size in zip(names, shape):
            if isinstance(name, int) or is_runtime(name):
                continue
            if found.setdefault(name, size) != size:
                raise ValueError(f"{sig.name}: dim {name} is {size} here but {found[name]} in another input")
    return found


def _assemble(
    graph: OpGraph,
    dims: Mapping[str, int],
    options: Mapping[str, object],
    absent: frozenset[str],
    custom_ops: frozenset[str],
    cfg: ModelConfig | None,
):
    inputs, outputs = graph.signature(dims, options, absent=absent)
    g = GraphBuilder(graph.name, custom_ops=custom_ops)
    values = {sig.name: g.add_input(sig) for sig in inputs}
    if graph.name in custom_ops:
        names = ["" if s.name in absent else s.name for s in graph.input_sigs(options)]
        while names and not names[-1]:  # trailing absent optional inputs are simply left off
            names.pop()
        produced = custom_node(g, graph.name, names, n_out=len(outputs), options=options, out=[s.name for s in outputs])
        produced = dict(zip([s.name for s in outputs], produced if isinstance(produced, tuple) else (produced,)))
    else:
        produced = graph.build(g, values, dims, options)
    for sig in outputs:
        g.add_output(produced[sig.name], sig)
    arguments = {k: attribute_value(v) for k, v in options.items() if k not in EXPORT_ONLY_OPTIONS}
    metadata = {
        METADATA_PREFIX + "op": graph.name,
        METADATA_PREFIX + "arguments": arguments,
        METADATA_PREFIX + "dims": dict(dims),
        METADATA_PREFIX + "symbolic_dims": sorted({d for s in inputs + outputs for d in s.shape if isinstance(d, str)}),
        METADATA_PREFIX + "custom_ops": sorted(custom_ops & _ops_in(g)),
        METADATA_PREFIX + "version": glm5_hal.__version__,
    }
    if cfg is not None:
        metadata[METADATA_PREFIX + "preset"] = cfg.name
        metadata[METADATA_PREFIX + "config"] = dataclasses.asdict(cfg)
    doc = (getattr(glm5_hal, graph.name).__doc__ or graph.name).strip().splitlines()[0]
    return make_model(
        g, doc=f"glm5_hal.{graph.name}: {doc} (OPS.md; ops_reference is the specification)", metadata=metadata
    )


def _ops_in(g: GraphBuilder) -> set[str]:
    """The ops present as glm5_hal nodes in a built graph."""
    types = {n.op_type for n in g.nodes if n.domain}
    return {op for op in OP_GRAPHS if op_type(op) in types}


def check(model) -> None:
    """onnx.checker.check_model with full_check: the graph is valid and its shapes infer without conflict."""
    onnx = require_onnx()
    onnx.checker.check_model(model, full_check=True)


def contract_outputs(results: Mapping[str, object]) -> dict[str, object]:
    """Graph outputs renamed to the contract's names: `<cache>_out` becomes `<cache>` (the written cache)."""
    return {name.removesuffix(CACHE_OUT_SUFFIX): value for name, value in results.items()}


def write_preset(
    cfg: ModelConfig,
    out_dir: str | Path,
    ops: Iterable[str] | None = None,
    *,
    custom_ops: Iterable[str] = (),
    kv_cache: str = AUTO,
) -> list[Path]:
    """Export, check and save each op (default: all) as <out_dir>/<op>.onnx; returns the paths written.
    kv_cache: "auto" (float caches), "fp8" or "int8": the cache ops' kv_cache_dtype (glm5_hal.kv_formats.FAMILIES)."""
    onnx = require_onnx()
    if kv_cache not in FAMILIES:
        raise ValueError(f"kv_cache: expected one of {list(FAMILIES)}, got {kv_cache!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for op in ops if ops is not None else OP_GRAPHS:
        options = {"kv_cache_dtype": FAMILIES[kv_cache][OP_CACHE[op]]} if op in OP_CACHE else {}
        model = export_op(op, cfg, options=options, custom_ops=custom_ops)
        check(model)
        path = out / f"{op}.onnx"
        onnx.save(model, path)
        written.append(path)
    return written


__all__ = [
    "OPSET",
    "check",
    "contract_outputs",
    "default_options",
    "export_like",
    "export_op",
    "infer_dims",
    "read_example",
    "write_preset",
]
