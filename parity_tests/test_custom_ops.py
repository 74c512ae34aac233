"""The ops are PyTorch custom ops with fake implementations: opcheck passes and torch.compile traces them."""

from __future__ import annotations

import pytest
import torch

import glm5_hal
from backends.torch_eager import capabilities as caps
from glm5_hal.kv_formats import OP_CACHE
from glm5_hal.ops import common
from glm5_hal.parity.cases import cases_for
from glm5_hal.parity.runner import case_generator, custom_op_arguments
from glm5_hal.registry import OP_NAMES


def _op_args(op: str, *, quantized: bool = False) -> tuple:
    """The arguments of the op's first quick case with a float cache (or, `quantized`, with a quantized one)."""
    built = (c.build(case_generator(c, torch.float32, seed=7), torch.float32) for c in cases_for(op, quick=True))
    inputs = next(i for i in built if ("kv_cache_dtype" in i) == quantized)
    return custom_op_arguments(op, inputs)


@pytest.mark.parametrize("op", OP_NAMES)
def test_opcheck(op: str) -> None:
    # Schema (declared mutations are the real ones), fake-tensor shapes and dispatcher registration.
    torch.library.opcheck(
        getattr(torch.ops.glm5_hal, op).default,
        _op_args(op),
        test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"),
    )


@pytest.mark.parametrize("op", sorted(OP_CACHE))
def test_opcheck_quantized_cache(op: str) -> None:
    # The same on uint8 caches of a quantized format: the fake shapes must not read the row width as DI / D.
    torch.library.opcheck(
        getattr(torch.ops.glm5_hal, op).default,
        _op_args(op, quantized=True),
        test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"),
    )


@pytest.mark.parametrize("shape", [(2, 2, 2), (2, 4, 4), (2, 12, 12)])
def test_opcheck_hadamard_of_a_column_major_input(shape: tuple[int, ...]) -> None:
    """The long fuzz profile drew x [2, 2, 2] column-major: the torch backend's butterflies kept the input's strides
    (4, 1, 2) while the fake (a new tensor) promised (4, 2, 1), and opcheck's fake-tensor test failed. The result is
    contiguous now, whatever x's layout."""
    x = torch.randn(shape).transpose(-1, -2).contiguous().transpose(-1, -2)
    assert not x.is_contiguous()
    torch.library.opcheck(
        torch.ops.glm5_hal.hadamard_transform.default, (x, None), test_utils=("test_schema", "test_faketensor")
    )
    assert glm5_hal.hadamard_transform(x).is_contiguous()


def test_torch_compile_fullgraph_matches_eager() -> None:
    case = cases_for("sparse_flash_attention", quick=True)[0]
    inputs = case.build(case_generator(case, torch.float32, seed=3), torch.float32)
    router = torch.randn(inputs["q"].shape[0], 16)

    def attention_then_gate(q, kv_cache, indices, block_table, seq_lens_k, cu_seqlens_q, router_logits):
        out, lse = glm5_hal.sparse_flash_attention(
            q, kv_cache, indices, block_table, seq_lens_k, cu_seqlens_q, 0.0625, 512
        )
        weights, ids = glm5_hal.moe_gate(
            router_logits,
            None,
            top_k=2,
            n_group=1,
            topk_group=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            scoring="sigmoid",
        )
        return out.sum(-1) * 2.0, lse, weights, ids

    args = (
        inputs["q"],
        inputs["kv_cache"],
        inputs["indices"],
        inputs["block_table"],
        inputs["seq_lens_k"],
        inputs["cu_seqlens_q"],
        router,
    )
    eager = attention_then_gate(*args)
    compiled = torch.compile(attention_then_gate, fullgraph=True, backend="aot_eager")(*args)
    for got, want in zip(compiled, eager):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_fake_tensor_shapes_without_data() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(5, 4, 576)
        cache = torch.empty(3, 16, 576)
        out, lse = glm5_hal.sparse_flash_attention(
            q,
            cache,
            torch.empty(5, 32, dtype=torch.int32),
            torch.empty(2, 3, dtype=torch.int32),
            torch.empty(2, dtype=torch.int32),
            torch.empty(3, dtype=torch.int32),
            0.0625,
        )
    assert out.shape == (5, 4, 512) and lse.shape == (5, 4) and lse.dtype == torch.float32


# --- call_op: plain eager mode runs the op's body directly; everything that looks at the dispatcher sees the op ---


def _spy_on_bodies(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Replace every public op's body in call_op's table with a recorder: the list names each body call_op ran
    directly. The custom op itself keeps its own reference to the body, so calls through it are not recorded."""
    calls: list[str] = []
    for op, body in list(common._BODIES.items()):

        def spy(*args: object, _body=body, _name=op._qualname) -> object:
            calls.append(_name)
            return _body(*args)

        monkeypatch.setitem(common._BODIES, op, spy)
    return calls


def _quant_matmul_args() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(11)
    x_q = torch.randint(-127, 128, (3, 64), generator=g, dtype=torch.int8)
    w_q = torch.randint(-127, 128, (8, 64), generator=g, dtype=torch.int8)
    return x_q, torch.rand(3, generator=g), w_q, torch.rand(8, generator=g)


def test_every_public_op_is_registered_for_call_op() -> None:
    registered = {op._qualname for op in common._BODIES}
    assert {f"glm5_hal::{op}" for op in OP_NAMES} <= registered


def test_plain_eager_runs_the_body_with_the_ops_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _spy_on_bodies(monkeypatch)
    args = _quant_matmul_args()
    direct = glm5_hal.quant_matmul(*args)
    assert calls == ["glm5_hal::quant_matmul"]
    through_op = torch.ops.glm5_hal.quant_matmul(*args, None, torch.bfloat16)
    assert calls == ["glm5_hal::quant_matmul"]  # the op did not go through call_op's table
    assert torch.equal(direct, through_op)
    weight = torch.nn.Parameter(args[2], requires_grad=False)  # model weights arrive as Parameters
    glm5_hal.quant_matmul(args[0], args[1], weight, args[3])
    assert len(calls) == 2


class _RecordingMode(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("context", ["dispatch mode", "function mode", "autocast", "profiler", "needs grad"])
def test_interceptors_see_the_custom_op(context: str, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _spy_on_bodies(monkeypatch)
    x_q, x_scale, w_q, w_scale = _quant_matmul_args()
    want = torch.ops.glm5_hal.quant_matmul(x_q, x_scale, w_q, w_scale, None, torch.bfloat16)
    mode = _RecordingMode()
    if context == "needs grad":
        w_scale = w_scale.clone().requires_grad_()
    contexts = {
        "dispatch mode": mode,
        "function mode": torch.device("cpu"),
        "autocast": torch.autocast("cpu", dtype=torch.bfloat16),
        "profiler": torch.profiler.profile(),
        "needs grad": torch.enable_grad(),
    }
    with contexts[context] as entered:
        got = glm5_hal.quant_matmul(x_q, x_scale, w_q, w_scale)
    assert calls == []
    assert torch.equal(got.detach(), want)
    if context == "dispatch mode":
        assert mode.ops[0] == "glm5_hal.quant_matmul.default"
    if context == "profiler":
        assert "glm5_hal::quant_matmul" in {event.key for event in entered.key_averages()}
    if context == "needs grad":
        with pytest.raises(RuntimeError, match="no autograd formula"):
            got.float().sum().backward()


@pytest.mark.parametrize("op", OP_NAMES)
def test_autocast_changes_no_op_result(op: str) -> None:
    # The ops fix their own compute and output dtypes: under bf16 autocast every op (float32 inputs, the chunked-fp32
    # int8 route that every CPU has) returns the same tensors as without it. Autocast is on only around the call.
    args = _op_args(op)
    with caps.fast_paths("0"):
        want = getattr(torch.ops.glm5_hal, op)(*_cloned(args))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = getattr(torch.ops.glm5_hal, op)(*_cloned(args))
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def test_torch_compile_graph_holds_the_custom_op() -> None:
    targets: list[object] = []

    def capture(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> object:
        targets.extend(node.target for node in gm.graph.nodes if node.op == "call_function")
        return gm.forward

    args = _quant_matmul_args()
    compiled = torch.compile(lambda *a: glm5_hal.quant_matmul(*a) * 2, fullgraph=True, backend=capture)
    torch.testing.assert_close(compiled(*args), glm5_hal.quant_matmul(*args) * 2, rtol=0, atol=0)
    assert torch.ops.glm5_hal.quant_matmul.default in targets


def _cloned(args: tuple) -> tuple:
    return tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)


@pytest.mark.parametrize("op", OP_NAMES)
def test_body_and_custom_op_agree_bit_for_bit(op: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # The same function runs either way; this checks call_op hands it the op's arguments in the op's order, and
    # that declared mutations (the cache writes) land the same.
    calls = _spy_on_bodies(monkeypatch)
    args = _op_args(op)
    custom = getattr(torch.ops.glm5_hal, op).default
    body_args, op_args = _cloned(args), _cloned(args)
    by_body = common.call_op(next(o for o in common._BODIES if o._qualname == f"glm5_hal::{op}"), *body_args)
    by_op = custom(*op_args)
    assert calls == [f"glm5_hal::{op}"]
    flat_body, _ = torch.utils._pytree.tree_flatten((by_body, body_args))
    flat_op, _ = torch.utils._pytree.tree_flatten((by_op, op_args))
    for got, want in zip(flat_body, flat_op, strict=True):
        if isinstance(got, torch.Tensor):
            torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
