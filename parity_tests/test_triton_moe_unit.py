"""Unit tests of the Triton MoE, quantization and Hadamard kernels, for what the parity cases do not reach.

The parity cases are small enough that every kernel runs as one block; these tests force the multi-block paths:
- dispatch across many assignment blocks and expert chunks (the cross-block scan that keeps the sort stable),
  with repeated experts in a token's row;
- the device-built tile index with several tiles per expert, zero-token experts and more slots than one loop
  step; the grouped W8A8 / W4A8 GEMMs (not public ops yet) against the reference per expert, including K-groups
  that are not a multiple of the K tile;
- the router's tie-breaking, non-power-of-two groups and experts per group;
- dynamic_quant rows longer than one K tile and strided inputs; combine with more rows than one inversion block;
- the Hadamard transform at every base size K and on strided inputs; bf16 stores that round to nearest even.

Runs natively on a GPU, else under TRITON_INTERPRET=1 on the CPU (shapes chosen to take seconds there).
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

from backends.triton.runtime import use_interpreter_if_no_gpu

use_interpreter_if_no_gpu()  # before triton's first import (the conftest does it too; this file may run alone)
pytest.importorskip("triton", reason="triton is not installed: pip install glm5-hal[triton]")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import ops_reference as ref  # noqa: E402
from backends.triton import hadamard as triton_hadamard  # noqa: E402
from backends.triton import moe as triton_moe  # noqa: E402
from backends.triton import quant as triton_quant  # noqa: E402
from glm5_hal.parity.compare import compare_float, compare_int8_codes, to_numpy  # noqa: E402
from glm5_hal.parity.inputs import randn  # noqa: E402
from glm5_hal.parity.runner import session_seed  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def gen(request: pytest.FixtureRequest) -> torch.Generator:
    """Fresh inputs every run, reproducible with GLM5_HAL_PARITY_SEED (printed with a failing test's output)."""
    seed = (session_seed() * 1_000_003 + zlib.crc32(request.node.name.encode())) % 2**63
    print(f"{request.node.name}: GLM5_HAL_PARITY_SEED={session_seed()} (generator seed {seed})")
    return torch.Generator().manual_seed(seed)


def _on_device(*tensors: torch.Tensor | None) -> list[torch.Tensor | None]:
    return [None if t is None else t.to(DEVICE) for t in tensors]


def _assert_close(name: str, out: torch.Tensor, want: np.ndarray, dtype: torch.dtype) -> None:
    verdict = compare_float(name, out.cpu(), want, dtype)
    assert verdict.passed, f"{name}: {verdict.detail}"


def _offsets(group_sizes: list[int]) -> torch.Tensor:
    offsets = torch.zeros(len(group_sizes) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.tensor(group_sizes), 0)
    return offsets


# --------------------------------------------------------------------------------------------------- router
@pytest.mark.parametrize(
    ("num_experts", "top_k", "n_group", "topk_group", "scoring"),
    [
        (48, 6, 3, 2, "sigmoid"),  # 16 experts per group, 3 groups: a padded group axis
        (20, 3, 5, 2, "sigmoid"),  # 4 per group, 5 groups
        (24, 5, 4, 3, "softmax"),  # 6 per group: a padded member axis
        (256, 8, 8, 4, "sigmoid"),  # DeepSeek-V3.2
    ],
)
def test_moe_gate_group_shapes(num_experts, top_k, n_group, topk_group, scoring, gen) -> None:
    logits = randn((45, num_experts), gen, std=2.0)
    bias = randn((num_experts,), gen, std=0.1)
    kw = dict(
        top_k=top_k,
        n_group=n_group,
        topk_group=topk_group,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        scoring=scoring,
    )
    weights, ids = triton_moe.moe_gate(*_on_device(logits, bias), **kw)
    want_weights, want_ids = ref.moe_gate(to_numpy(logits), to_numpy(bias), **kw)
    np.testing.assert_array_equal(to_numpy(ids), want_ids)  # same order too: best biased score first
    _assert_close("topk_weights", weights, want_weights, torch.float32)


def test_moe_gate_ties_pick_the_lowest_expert_ids(gen) -> None:
    # Logits from a handful of values: most rows have ties at the k-th place, inside and across groups.
    logits = torch.randint(-2, 3, (64, 32), generator=gen).float()
    kw = dict(top_k=6, n_group=4, topk_group=2, routed_scaling_factor=1.0, norm_topk_prob=False, scoring="sigmoid")
    weights, ids = triton_moe.moe_gate(*_on_device(logits, None), **kw)
    want_weights, want_ids = ref.moe_gate(to_numpy(logits), None, **kw)
    np.testing.assert_array_equal(to_numpy(ids), want_ids)
    _assert_close("topk_weights", weights, want_weights, torch.float32)


# ------------------------------------------------------------------------------------------------- dispatch
@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
def test_dispatch_across_blocks_is_a_stable_sort(ids_dtype, gen) -> None:
    num_tokens, top_k, num_experts = 300, 8, 100  # 2400 assignments: many blocks; 100 experts: two chunks
    ids = torch.randint(0, num_experts, (num_tokens, top_k), generator=gen)  # repeats within a row too
    ids[:40] = 7  # one crowded expert
    x = randn((num_tokens, 40), gen, dtype=torch.bfloat16)
    # A strided ids view: the kernels read through strides, never a hidden copy.
    ids_strided = ids.to(ids_dtype).t().contiguous().t()
    routed = triton_moe.dispatch_assignments(*_on_device(x, ids_strided), num_experts)
    want_x, want_offsets, want_src = ref.moe_dispatch(to_numpy(x), to_numpy(ids), num_experts)
    np.testing.assert_array_equal(to_numpy(routed.expert_offsets), want_offsets)
    np.testing.assert_array_equal(to_numpy(routed.src_index), want_src)
    np.testing.assert_array_equal(to_numpy(routed.x_sorted), want_x)  # a copy: bit exact
    # row_of is the inverse permutation of src_index.
    np.testing.assert_array_equal(to_numpy(routed.row_of)[want_src], np.arange(num_tokens * top_k))


def test_combine_inverts_many_blocks(gen) -> None:
    num_tokens, top_k, width = 200, 6, 600  # 1200 rows: two inversion blocks; 600 columns: two column tiles
    y = randn((num_tokens * top_k, width), gen, dtype=torch.bfloat16)
    src_index = torch.randperm(num_tokens * top_k, generator=gen)
    weights = torch.rand((num_tokens, top_k), generator=gen) + 0.1
    out = triton_moe.moe_combine(*_on_device(y, src_index, weights))
    _assert_close("out", out, ref.moe_combine(to_numpy(y), to_numpy(src_index), to_numpy(weights)), torch.bfloat16)


# --------------------------------------------------------------------------------------------- tile index
def test_tile_index_covers_every_row_once_with_its_expert(gen) -> None:
    sizes = torch.randint(150, 400, (40,), generator=gen)  # >= 4050 rows: more than 256 tiles of 16
    sizes[::3] = 0  # zero-token experts
    offsets = _offsets(sizes.tolist())
    num_rows, block_m = int(offsets[-1]), 16
    tiles = triton_moe.expert_tiles(offsets.to(DEVICE), num_rows, block_m)
    tile_expert, tile_row = to_numpy(tiles.tile_expert), to_numpy(tiles.tile_row)
    assert tiles.num_slots > 256  # more slots than one step of the kernel's slot loop
    owner = np.full(num_rows, -1)
    for expert, first in zip(tile_expert, tile_row):
        if expert < 0:
            continue
        rows = np.arange(first, min(first + block_m, int(offsets[expert + 1])))
        assert (owner[rows] == -1).all(), "a row in two tiles"
        owner[rows] = expert
    np.testing.assert_array_equal(owner, np.repeat(np.arange(len(sizes)), sizes.numpy()))
    live = tile_expert >= 0
    assert live[: live.sum()].all(), "dead slots must all come after the live tiles"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_grouped_matmul_several_tiles_per_expert(dtype, gen) -> None:
    sizes = [300, 0, 17, 129, 0]
    x = randn((sum(sizes), 96), gen, dtype=dtype)
    w = randn((len(sizes), 72, 96), gen, std=96**-0.5, dtype=dtype)
    offsets = _offsets(sizes)
    y = triton_moe.grouped_matmul(*_on_device(x, w, offsets))
    _assert_close("y", y, ref.grouped_matmul(to_numpy(x), to_numpy(w), to_numpy(offsets)), dtype)


# -------------------------------------------------------------------------------------- grouped W8A8 / W4A8
def _int8(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    return torch.randint(-127, 128, shape, generator=gen, dtype=torch.int8)


def _scales(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    return torch.rand(shape, generator=gen) * 0.02 + 1e-3


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_grouped_quant_matmul_per_expert(out_dtype, gen) -> None:
    sizes, n, k = [37, 0, 5, 80], 48, 160
    x_q, x_scale = _int8((sum(sizes), k), gen), _scales((sum(sizes),), gen)
    w_q, w_scale = _int8((len(sizes), n, k), gen), _scales((len(sizes), n), gen)
    offsets = _offsets(sizes)
    y = triton_moe.grouped_quant_matmul(*_on_device(x_q, x_scale, w_q, w_scale, offsets), out_dtype=out_dtype)
    want = np.zeros((sum(sizes), n))
    for e in range(len(sizes)):
        rows = slice(int(offsets[e]), int(offsets[e + 1]))
        want[rows] = ref.quant_matmul(
            to_numpy(x_q[rows]), to_numpy(x_scale[rows]), to_numpy(w_q[e]), to_numpy(w_scale[e])
        )
    _assert_close("y", y, want, out_dtype)


def test_grouped_quant_matmul_accumulator_is_exact(gen) -> None:
    # Unit scales and fp32 output: y is the int32 accumulator itself (|acc| < 2^24 here, so fp32 holds it).
    sizes, n, k = [9, 0, 23], 40, 512
    x_q, w_q = _int8((sum(sizes), k), gen), _int8((len(sizes), n, k), gen)
    offsets = _offsets(sizes)
    y = triton_moe.grouped_quant_matmul(
        *_on_device(x_q, torch.ones(sum(sizes)), w_q, torch.ones(len(sizes), n), offsets), out_dtype=torch.float32
    )
    for e in range(len(sizes)):
        rows = slice(int(offsets[e]), int(offsets[e + 1]))
        want = ref.int_matmul(to_numpy(x_q[rows]), to_numpy(w_q[e]))
        np.testing.assert_array_equal(to_numpy(y[rows]).astype(np.int64), want)


@pytest.mark.parametrize("group_size", [None, 64, 6])  # 6: groups end inside a K tile
def test_grouped_w4a8_matmul_per_expert(group_size, gen) -> None:
    sizes, n, k = [21, 0, 40], 40, 192
    x_q, x_scale = _int8((sum(sizes), k), gen), _scales((sum(sizes),), gen)
    w_packed = torch.randint(0, 256, (len(sizes), n, k // 2), generator=gen, dtype=torch.uint8)
    w_scale = _scales((len(sizes), n) if group_size is None else (len(sizes), n, k // group_size), gen)
    offsets = _offsets(sizes)
    y = triton_moe.grouped_w4a8_matmul(
        *_on_device(x_q, x_scale, w_packed, w_scale, offsets), group_size=group_size, out_dtype=torch.float32
    )
    want = np.zeros((sum(sizes), n))
    for e in range(len(sizes)):
        rows = slice(int(offsets[e]), int(offsets[e + 1]))
        want[rows] = ref.w4a8_matmul(
            to_numpy(x_q[rows]), to_numpy(x_scale[rows]), to_numpy(w_packed[e]), to_numpy(w_scale[e]), group_size
        )
    _assert_close("y", y, want, torch.float32)


def test_grouped_quant_inputs_are_checked() -> None:
    x_q, x_scale, offsets = torch.zeros(4, 32, dtype=torch.int8), torch.ones(4), _offsets([4])
    with pytest.raises(TypeError, match="w_q"):
        triton_moe.grouped_quant_matmul(x_q, x_scale, torch.zeros(1, 8, 32), torch.ones(1, 8), offsets)
    with pytest.raises(ValueError, match="group_size"):
        triton_moe.grouped_w4a8_matmul(
            x_q, x_scale, torch.zeros(1, 8, 16, dtype=torch.uint8), torch.ones(1, 8, 5), offsets, group_size=5
        )


# -------------------------------------------------------------------------------------------- dense quant
def test_dynamic_quant_long_strided_rows(gen) -> None:
    x = randn((19, 2 * 2500), gen, std=3.0, dtype=torch.bfloat16)[:, ::2]  # 2500 > one K tile; stride 2
    x[5] = 0
    q, scale = triton_quant.dynamic_quant(x.to(DEVICE))
    want_q, want_scale = ref.dynamic_quant(to_numpy(x))
    verdict = compare_int8_codes("q", q.cpu(), want_q, to_numpy(x), want_scale)
    assert verdict.passed, verdict.detail
    _assert_close("scale", scale, want_scale, torch.float32)


@pytest.mark.parametrize("group_size", [None, 6])
def test_w4a8_matmul_accumulator_is_exact(group_size, gen) -> None:
    m, n, k = 11, 24, 96
    x_q = _int8((m, k), gen)
    w_packed = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
    w_scale = torch.ones(n) if group_size is None else torch.ones(n, k // group_size)
    y = triton_quant.w4a8_matmul(*_on_device(x_q, torch.ones(m), w_packed, w_scale), group_size, torch.float32)
    want = ref.int_matmul(to_numpy(x_q), ref.unpack_int4(to_numpy(w_packed)))
    np.testing.assert_array_equal(to_numpy(y).astype(np.int64), want)


# ------------------------------------------------------------------------------------------------ fused MoE
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_moe_several_tiles_per_expert(dtype, gen) -> None:
    num_tokens, width, inter, top_k, num_experts = 150, 96, 48, 4, 8
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)]).int()
    weights = torch.rand((num_tokens, top_k), generator=gen) + 0.1
    x = randn((num_tokens, width), gen, dtype=dtype)
    w13 = randn((num_experts, 2 * inter, width), gen, std=width**-0.5, dtype=dtype)
    w2 = randn((num_experts, width, inter), gen, std=inter**-0.5, dtype=dtype)
    out = triton_moe.fused_moe(*_on_device(x, weights, ids, w13, w2))
    want = ref.fused_moe(*(to_numpy(t) for t in (x, weights, ids, w13, w2)))
    _assert_close("out", out, want, dtype)


# ------------------------------------------------------------------------------------------------ Hadamard
# The parity cases cover every base size K at n = 2K; these are the widths the models rotate (hidden sizes, the
# expert intermediate), where the butterflies run 8 to 11 stages.
@pytest.mark.parametrize("n", [2048, 6144, 7168])
def test_hadamard_model_widths(n, gen) -> None:
    x = randn((2, n), gen)
    _assert_close(
        "y", triton_hadamard.hadamard_transform(x.to(DEVICE)), ref.hadamard_transform(to_numpy(x)), torch.float32
    )


def test_hadamard_strided_3d_input(gen) -> None:
    x = randn((2, 3, 2 * 48), gen, dtype=torch.bfloat16)[..., ::2]  # last-dim stride 2
    y = triton_hadamard.hadamard_transform(x.to(DEVICE), scale=0.25)
    _assert_close("y", y, ref.hadamard_transform(to_numpy(x), scale=0.25), torch.bfloat16)


# ------------------------------------------------------------------------------------------ bf16 rounding
@triton.jit
def _store_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(y_ptr + offs, triton_quant.cast_for_store(x, y_ptr.dtype.element_ty), mask=offs < n)


def test_bf16_stores_round_to_nearest_even(gen) -> None:
    x = torch.randn(1000, generator=gen) * torch.logspace(-20, 20, 1000)
    x[:4] = torch.tensor([1.0 + 2**-8, 1.0 + 3 * 2**-8, -(1.0 + 2**-8), 3.0e38])  # exact ties, and an overflow to inf
    y = torch.empty(1000, dtype=torch.bfloat16, device=DEVICE)
    _store_kernel[(1,)](x.to(DEVICE), y, n=1000, BLOCK=1024)
    torch.testing.assert_close(y.cpu(), x.to(torch.bfloat16), rtol=0, atol=0)
