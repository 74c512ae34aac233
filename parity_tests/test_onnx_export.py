"""ONNX export of every op: valid standard-opset graphs, and onnxruntime reproducing the float64 reference.

- every op has a graph whose inputs / outputs are the public op's arguments / outputs, in order;
- every preset's graphs pass onnx.checker with full shape inference, use only the default ONNX domain, keep
  token and cache dims symbolic, and carry the preset config in metadata_props;
- onnxruntime (CPU, fp32) matches ops_reference on every parity case (glm5_hal.parity inputs and compare
  policy), plus the ONNX-specific corner of a cache narrower than topk; a preset's graph runs batches of
  several sizes; wrong arguments are caught (the comparison can fail);
- glm5_hal custom nodes: valid graphs, and the standard part around them is right (onnx.reference);
- `glm5-hal export-onnx` writes, checks and verifies; a missing onnx is a clear error.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import subprocess
import sys

import pytest
import torch

onnx = pytest.importorskip("onnx", reason="the onnx extra is not installed: pip install glm5-hal[onnx]")
pytest.importorskip("onnxruntime", reason="the onnx extra is not installed: pip install glm5-hal[onnx]")

import glm5_hal  # noqa: E402
from glm5_hal.config import PRESETS  # noqa: E402
from glm5_hal.onnx_export import CUSTOM_DOMAIN, OP_GRAPHS, OPSET, check, contract_outputs, export_like, export_op  # noqa: E402
from glm5_hal.onnx_export.custom import op_type  # noqa: E402
from glm5_hal.onnx_export.custom_reference import reference_ops  # noqa: E402
from glm5_hal.onnx_export.export import read_example  # noqa: E402
from glm5_hal.onnx_export.opgraph import CACHE_OUT_SUFFIX, is_runtime  # noqa: E402
from glm5_hal.onnx_export.runtime import run, session  # noqa: E402
from glm5_hal.onnx_export.verify import run_case  # noqa: E402
from glm5_hal.parity.cases import Case, cases_for  # noqa: E402
from glm5_hal.parity.runner import case_generator, session_seed  # noqa: E402
from glm5_hal.parity.specs import SPECS  # noqa: E402
from glm5_hal.registry import OP_NAMES  # noqa: E402

FP32 = torch.float32
# ONNX-specific corner: a block table addressing fewer key positions (16) than topk (32), so the graph must pad
# before TopK and report the missing entries as -1.


def _all_nodes(graph):
    """Every node of a graph and of its sub-graphs (Loop bodies)."""
    for node in graph.node:
        yield node
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from _all_nodes(attr.g)


def _inputs(case: Case, seed: int | None = None) -> dict:
    return case.build(case_generator(case, FP32, session_seed() if seed is None else seed), FP32)


def _judge(case: Case, model, inputs: dict) -> list:
    produced = contract_outputs(run(session(model), inputs))
    spec = SPECS[case.op]
    return spec.judge(inputs, {n: torch.from_numpy(produced[n]) for n in spec.output_names + spec.mutated}, FP32)


# ------------------------------------------------------------------------------------------------ signatures
def test_every_op_of_the_contract_has_a_graph():
    assert tuple(OP_GRAPHS) == OP_NAMES


@pytest.mark.parametrize("op", OP_NAMES)
def test_graph_names_are_the_public_op_arguments_and_outputs(op):
    params = inspect.signature(getattr(glm5_hal, op)).parameters.values()
    tensor_args = [p.name for p in params if "Tensor" in str(p.annotation)]
    graph = OP_GRAPHS[op]
    assert list(graph.tensor_names) == tensor_args
    spec = SPECS[op]
    assert [s.name for s in graph.outputs] == [*spec.output_names, *(m + CACHE_OUT_SUFFIX for m in spec.mutated)]


# ---------------------------------------------------------------------------------------------- preset models
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_preset_graphs_are_valid_standard_opset_with_symbolic_dims(preset):
    cfg = PRESETS[preset]
    for op in OP_NAMES:
        model = export_op(op, cfg)
        check(model)  # onnx.checker, full shape inference
        assert [(o.domain, o.version) for o in model.opset_import] == [("", OPSET)]
        assert all(n.domain == "" for n in _all_nodes(model.graph)), f"{op}: a node outside the standard opset"
        shapes = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in model.graph.input}
        symbolic = {d for dims in shapes.values() for d in dims if isinstance(d, str)}
        assert symbolic and all(is_runtime(d) for d in symbolic), f"{op}: symbolic dims {symbolic}"
        assert "T" in symbolic or "M" in symbolic or "T*k" in symbolic, f"{op}: tokens must be symbolic"
        meta = {p.key: p.value for p in model.metadata_props}
        assert meta["glm5_hal.op"] == op
        assert json.loads(meta["glm5_hal.config"]) == json.loads(json.dumps(dataclasses.asdict(cfg)))
    for op in ("mla_prolog", "indexer_logits", "sparse_flash_attention"):
        cache = next(v for v in export_op(op, cfg).graph.input if v.name.endswith("cache"))
        assert [d.dim_param for d in cache.type.tensor_type.shape.dim[:2]] == ["num_blocks", "block_size"]


# ------------------------------------------------------------------------------------------ runtime parity
def _case_params():
    for case in cases_for():
        yield pytest.param(case, id=case.id, marks=[pytest.mark.slow] if case.slow else [])


@pytest.mark.parametrize("case", list(_case_params()))
def test_onnxruntime_matches_reference(case, request):
    if case.slow and request.config.getoption("--quick"):
        pytest.skip("real-dims case skipped by --quick")
    result = run_case(case)
    assert result.passed, f"{result.status}: {result.detail} (seed {session_seed()})"


def test_one_preset_graph_serves_batches_of_every_size():
    """The files `export-onnx` writes: one model per (op, preset), run on every case with its dims and arguments."""
    served, models = set(), {}
    for case in cases_for(quick=True):
        graph, inputs = OP_GRAPHS[case.op], _inputs(case)
        dims, options, absent = read_example(graph, inputs)
        for name, cfg in sorted(PRESETS.items()):
            # A preset's graph takes a float cache (kv_cache_dtype "auto", the default) and the preset's arguments.
            preset_options = {"kv_cache_dtype": "auto", **graph.options_from_config(cfg)}
            if (
                absent
                or dims != graph.dims_from_config(cfg)
                or any(options.get(k, v) != v for k, v in preset_options.items())
            ):
                continue
            model = models.setdefault((case.op, name), export_op(case.op, cfg))
            failed = [v for v in _judge(case, model, inputs) if not v.passed]
            assert not failed, f"{case.id} on the {name} graph: {failed}"
            served.add(case.op)
    assert {"mla_prolog", "indexer_prolog", "indexer_logits", "moe_gate"} <= served, served


@pytest.mark.parametrize(
    ("case_id", "wrong"),
    [
        ("sparse_flash_attention/decode", {"sm_scale": 0.07}),
        ("moe_gate/deepseek_v32_groups", {"n_group": 1, "topk_group": 1}),
        ("indexer_prolog/mini_interleaved", {"rope_interleaved": False}),
        ("mla_prolog/padding_slots_skipped", {"eps": 1.0}),
    ],
)
def test_a_graph_with_wrong_arguments_fails_the_comparison(case_id, wrong):
    case = next(c for c in cases_for() if c.id == case_id)
    inputs = _inputs(case)
    verdicts = _judge(case, export_like(case.op, {**inputs, **wrong}), inputs)
    assert not all(v.passed for v in verdicts)


# ------------------------------------------------------------------------------------------------ custom nodes
@pytest.mark.parametrize("op", OP_NAMES)
def test_whole_op_custom_node_is_a_valid_graph(op):
    standard, custom = export_op(op, PRESETS["glm5"]), export_op(op, PRESETS["glm5"], custom_ops=[op])
    check(custom)
    assert [(n.domain, n.op_type) for n in custom.graph.node] == [(CUSTOM_DOMAIN, op_type(op))]
    assert (CUSTOM_DOMAIN, 1) in [(o.domain, o.version) for o in custom.opset_import]
    assert custom.graph.input == standard.graph.input and custom.graph.output == standard.graph.output


@pytest.mark.parametrize("case", cases_for("fused_moe", quick=True) + cases_for("grouped_matmul", quick=True), ids=str)
def test_standard_graph_around_custom_grouped_matmul_is_right(case):
    """fused_moe keeps dispatch and combine standard around two glm5_hal::GroupedMatmul nodes; onnx.reference runs
    it with those nodes computed by ops_reference, which checks everything around them."""
    from onnx.reference import ReferenceEvaluator

    inputs = _inputs(case)
    model = export_like(case.op, inputs, custom_ops=["grouped_matmul"])
    check(model)
    assert sum(n.domain == CUSTOM_DOMAIN for n in model.graph.node) == (2 if case.op == "fused_moe" else 1)
    evaluator = ReferenceEvaluator(model, new_ops=reference_ops(["grouped_matmul"]))
    values = evaluator.run(None, {v.name: inputs[v.name].numpy() for v in model.graph.input})
    (name,) = SPECS[case.op].output_names
    verdicts = SPECS[case.op].judge(inputs, {name: torch.from_numpy(values[0])}, FP32)
    assert all(v.passed for v in verdicts), verdicts


# -------------------------------------------------------------------------------------------- command line
def _cli(argv: list[str]) -> int:
    from glm5_hal.cli import export_onnx

    parser = argparse.ArgumentParser(prog="glm5-hal")
    export_onnx.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_export_onnx_command_writes_checks_and_verifies(tmp_path, capsys):
    ops = ["moe_gate", "dynamic_quant", "sparse_flash_attention"]
    assert _cli(["export-onnx", "--preset", "glm5", "--out", str(tmp_path), "--ops", ",".join(ops), "--verify"]) == 0
    out = capsys.readouterr().out
    assert "3 models checked" in out and "onnxruntime" in out
    for op in ops:
        model = onnx.load(tmp_path / f"{op}.onnx")
        check(model)
        assert {p.key: p.value for p in model.metadata_props}["glm5_hal.preset"] == "glm5"


def test_export_onnx_command_rejects_unknown_names(tmp_path, capsys):
    assert _cli(["export-onnx", "--preset", "glm9", "--out", str(tmp_path)]) == 2
    assert "glm5-mini" in capsys.readouterr().err
    assert _cli(["export-onnx", "--preset", "glm5", "--out", str(tmp_path), "--ops", "attention"]) == 2
    assert "unknown ['attention']" in capsys.readouterr().err


def test_missing_onnx_is_a_clear_error_and_never_breaks_import():
    code = (
        "import sys; sys.modules['onnx'] = None; sys.modules['onnxruntime'] = None\n"
        "import glm5_hal.onnx_export, glm5_hal.cli.export_onnx\n"
        "try:\n"
        "    glm5_hal.onnx_export.export_op('moe_gate', glm5_hal.GLM5)\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "pip install glm5-hal[onnx]" in out.stdout
