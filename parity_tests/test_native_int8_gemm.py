"""backends.torch_eager.native.int8_gemm: the W8A8 and W4A8 kernels against exact integer math, for every build that
runs here (AVX-512 VNNI where the CPU has it, and the portable one on any CPU with a compiler).

- The integer sums equal float64 (exact for these sizes) products bit for bit, on hypothesis shapes that cross the
  row-block, panel, K-step, K-block and vector edges, with extreme codes, for the weight as stored (strided too) and
  in panels.
- The fused epilogue (scales, bias, rounding to bf16) gives the bits of the torch route's separate ops, subnormal,
  tie, overflow and NaN values included.
- W4A8: per channel (any even K, tails included) and grouped; the groups summed in order as the torch route does.
- A result does not depend on the thread count; bad arguments name what was expected.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.torch_eager.native import int8_gemm
from backends.torch_eager.quant import unpack_int4

ISAS = ("avx512_vnni", "portable")
SETTINGS = settings(max_examples=30, deadline=None, derandomize=True)


def _runs(isa: str) -> None:
    ok, why = int8_gemm.availability(isa)
    if not ok:
        pytest.skip(f"{isa} build does not run here: {why}")


def _codes(gen: torch.Generator, rows: int, cols: int, extreme: bool) -> torch.Tensor:
    if extreme:  # -128 / 127 only: sums past int16 and past fp32's exact integers
        return torch.tensor([-128, 127], dtype=torch.int8)[torch.randint(0, 2, (rows, cols), generator=gen)]
    return torch.randint(-128, 128, (rows, cols), generator=gen, dtype=torch.int8)


def _exact(x_q: torch.Tensor, w_q: torch.Tensor) -> torch.Tensor:
    """fp32 of the exact integer product (float64 holds every such sum: |sum| <= 2^14 K < 2^53)."""
    return (x_q.double() @ w_q.double().T).float()


def _non_contiguous(panels: torch.Tensor) -> torch.Tensor:
    """The same [panels, steps, 64, 4] values in another memory order (a view the kernels must not misread)."""
    return panels.transpose(1, 2).contiguous().transpose(1, 2)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN where the other has NaN (the payload of a NaN is not compared)."""
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and torch.equal(a.isnan(), b.isnan())
        and torch.equal(a[~a.isnan()], b[~b.isnan()])
    )


@pytest.mark.parametrize("isa", ISAS)
@SETTINGS
@given(
    rows=st.integers(0, 14),
    cols=st.sampled_from([0, 1, 13, 16, 17, 64, 70]),
    depth=st.sampled_from([0, 1, 3, 4, 5, 63, 64, 65, 200, 4096, 4097, 4099, 8300]),
    layout=st.sampled_from(["stored", "strided", "panels", "panels view"]),
    extreme=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_w8a8_sums_are_exact(isa, rows, cols, depth, layout, extreme, seed):
    _runs(isa)
    gen = torch.Generator().manual_seed(seed)
    x_q, w_q = _codes(gen, rows, depth, extreme), _codes(gen, cols, depth + 5, extreme)[:, :depth]
    w = {"stored": w_q.contiguous(), "strided": w_q, "panels": int8_gemm.panel_weight(w_q)}.get(layout)
    if layout == "panels view":
        w = _non_contiguous(int8_gemm.panel_weight(w_q))
    got = int8_gemm.w8a8_mm(x_q, w, cols, isa=isa, threads=1)
    assert got.dtype == torch.float32 and torch.equal(got, _exact(x_q, w_q))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("rows", [5, int8_gemm.ROW_BLOCK, 7, 13])
def test_w8a8_sums_are_exact_across_k_blocks_and_row_blocks(isa, rows):
    # Three K blocks (the int32 sums kept between them for every row block), the last ending in a partial step;
    # whole and ragged row blocks; two panels, the second ragged.
    _runs(isa)
    gen = torch.Generator().manual_seed(rows)
    depth = 2 * int8_gemm.INT8_K_BLOCK + 3
    x_q, w_q = _codes(gen, rows, depth, True), _codes(gen, 70, depth, True)
    for weight in (w_q, int8_gemm.panel_weight(w_q)):
        assert torch.equal(int8_gemm.w8a8_mm(x_q, weight, 70, isa=isa, threads=1), _exact(x_q, w_q))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 4, 9])
def test_w8a8_epilogue_gives_the_bits_of_the_torch_route(isa, out_dtype, rows):
    _runs(isa)
    gen = torch.Generator().manual_seed(rows)
    x_q, w_q = _codes(gen, rows, 4100, False), _codes(gen, 37, 4100, False)
    x_scale, w_scale, bias = torch.rand(rows, generator=gen), torch.rand(37, generator=gen), torch.randn(37)
    x_scale[-1] = float("nan")  # a row whose activations held NaN (dynamic_quant gives it scale NaN)
    want = _exact(x_q, w_q).mul_(x_scale[:, None]).mul_(w_scale[None, :]).add_(bias).to(out_dtype)
    panels = int8_gemm.panel_weight(w_q)  # 37 columns: two 16-lane vectors and a tail of 5
    got = int8_gemm.w8a8_mm(x_q, panels, 37, x_scale, w_scale, bias, out_dtype, isa=isa, threads=1)
    assert _same(got, want)
    unbiased = _exact(x_q, w_q).mul_(x_scale[:, None]).mul_(w_scale[None, :]).to(out_dtype)
    assert _same(int8_gemm.w8a8_mm(x_q, w_q, None, x_scale, w_scale, None, out_dtype, isa=isa, threads=1), unbiased)


def _w4a8_reference(x_q, w_packed, scales, group, x_scale):
    """The torch route's arithmetic: per group the exact sum times its scale, added in order, times x_scale."""
    w_q = unpack_int4(w_packed)
    y = None
    for g in range(scales.shape[1]):
        cols = slice(g * group, (g + 1) * group)
        scaled = _exact(x_q[:, cols], w_q[:, cols]).mul_(scales[:, g])
        y = scaled if y is None else y.add_(scaled)
    return y if x_scale is None else y.mul_(x_scale[:, None])


@pytest.mark.parametrize("isa", ISAS)
@SETTINGS
@given(
    rows=st.integers(1, 14),
    cols=st.sampled_from([1, 13, 16, 17, 64, 70]),
    shape=st.sampled_from(
        [(2, None), (6, None), (8, None), (126, None), (128, None), (300, None), (48, 8), (256, 128), (512, 256)]
    ),
    layout=st.sampled_from(["stored", "panels", "panels view"]),
    scaled=st.booleans(),
    extreme=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_w4a8_is_the_torch_routes_arithmetic_on_exact_group_sums(isa, rows, cols, shape, layout, scaled, extreme, seed):
    _runs(isa)
    depth, group = shape
    group = depth if group is None else group
    gen = torch.Generator().manual_seed(seed)
    x_q = _codes(gen, rows, depth, extreme)
    w_packed = torch.randint(0, 256, (cols, depth // 2), generator=gen, dtype=torch.uint8)
    if extreme:
        w_packed.fill_(0x88)  # -8 in both nibbles: the largest products
    scales = torch.rand(cols, depth // group, generator=gen)
    x_scale = torch.rand(rows, generator=gen) if scaled else None
    weight = {"stored": w_packed, "panels": int8_gemm.panel_int4_weight(w_packed)}.get(layout)
    if layout == "panels view":
        weight = _non_contiguous(int8_gemm.panel_int4_weight(w_packed))
    got = int8_gemm.w4a8_mm(x_q, weight, scales, group, x_scale, isa=isa, threads=1)
    assert _same(got, _w4a8_reference(x_q, w_packed, scales, group, x_scale))
    rounded = int8_gemm.w4a8_mm(x_q, weight, scales, group, x_scale, torch.bfloat16, isa=isa, threads=1)
    assert _same(rounded, _w4a8_reference(x_q, w_packed, scales, group, x_scale).bfloat16())


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(
    ("depth", "groups"), [(int8_gemm.INT4_K_BLOCK + 200, 1), (2 * int8_gemm.INT4_K_BLOCK + 256, 2)]
)
def test_w4a8_sums_are_exact_across_k_blocks(isa, depth, groups):
    # Past INT4_K_BLOCK columns the int32 sums of a group wait between K blocks: one group of K, or two groups each
    # wider than a block; 7 rows (a whole and a ragged row block), 70 columns (two panels).
    _runs(isa)
    gen = torch.Generator().manual_seed(depth)
    group = depth // groups
    assert group > int8_gemm.INT4_K_BLOCK and group % int8_gemm.INT4_STEP == 0
    x_q = _codes(gen, 7, depth, True)
    w_packed = torch.randint(0, 256, (70, depth // 2), generator=gen, dtype=torch.uint8)
    scales = torch.rand(70, groups, generator=gen)
    want = _w4a8_reference(x_q, w_packed, scales, group, None)
    for weight in (w_packed, int8_gemm.panel_int4_weight(w_packed)):
        assert _same(int8_gemm.w4a8_mm(x_q, weight, scales, group, isa=isa, threads=1), want)


def _special_scales() -> torch.Tensor:
    """fp32 values where rounding to bf16 has edge cases: ties to even (both ways), subnormals (which VCVTNEPS2BF16
    would flush to zero), the largest finite value (rounds to inf), inf, -0, NaN; 37 of them (two 16-lane vectors
    and a tail)."""
    bits = torch.tensor(
        # As signed int32: 0x80400000 - 2^32 a negative subnormal; -1 (0xFFFFFFFF) a NaN that rounding without a NaN
        # check would carry into +0.
        [0x3F808000, 0x3F818000, 0x3F808001, 0x00000001, 0x00008000, 0x00018000, 0x80400000 - (1 << 32), -1],
        dtype=torch.int32,
    ).view(torch.float32)
    values = [float("inf"), float("-inf"), -0.0, float("nan"), 3.4028234663852886e38, 1.0, -1.5, 1e-38]
    return torch.cat([bits, torch.tensor(values), torch.linspace(-3, 3, 37 - 16)])


@pytest.mark.parametrize("isa", ISAS)
def test_the_epilogues_round_to_bf16_as_torch_does_on_edge_values(isa):
    _runs(isa)
    scales = _special_scales()
    n = scales.numel()
    x_q = torch.tensor([[1], [-1]], dtype=torch.int8)  # one column: every sum is +-1, so y = +-scale exactly
    w_q = torch.ones(n, 1, dtype=torch.int8)
    ones = torch.ones(2)
    want = (torch.tensor([[1.0], [-1.0]]) * scales).bfloat16()
    assert _same(int8_gemm.w8a8_mm(x_q, w_q, None, ones, scales, None, torch.bfloat16, isa=isa, threads=1), want)
    x4 = torch.tensor([[1, 0], [-1, 0]], dtype=torch.int8)
    w_packed = torch.ones(n, 1, dtype=torch.uint8)  # w = 1 at even k, 0 at odd k
    got = int8_gemm.w4a8_mm(x4, w_packed, scales[:, None], 2, ones, torch.bfloat16, isa=isa, threads=1)
    assert _same(got, want)


def _strided_view(t: torch.Tensor) -> torch.Tensor:
    """t's values as every other element of a buffer whose gaps hold NaN (read past a stride, they would show)."""
    buffer = torch.full((2 * t.numel(),), float("nan"))
    view = buffer[::2]
    view.copy_(t)
    return view


@pytest.mark.parametrize("isa", ISAS)
def test_strided_scale_and_bias_vectors_are_read_by_their_strides(isa):
    # A regression: the kernels read x_scale / w_scale / bias at unit stride, so a strided view (the fuzz suite's
    # layouts) gave NaN from the gaps.
    _runs(isa)
    gen = torch.Generator().manual_seed(5)
    x_q, w_q = _codes(gen, 3, 256, False), _codes(gen, 6, 256, False)
    x_scale, w_scale, bias = torch.rand(3, generator=gen), torch.rand(6, generator=gen), torch.randn(6, generator=gen)
    want = int8_gemm.w8a8_mm(x_q, w_q, None, x_scale, w_scale, bias, isa=isa, threads=1)
    strided = (_strided_view(x_scale), _strided_view(w_scale), _strided_view(bias))
    assert _same(int8_gemm.w8a8_mm(x_q, w_q, None, *strided, isa=isa, threads=1), want)
    w_packed = torch.randint(0, 256, (6, 128), generator=gen, dtype=torch.uint8)
    scales = torch.rand(6, 2, generator=gen)
    want = int8_gemm.w4a8_mm(x_q, w_packed, scales, 128, x_scale, isa=isa, threads=1)
    assert _same(int8_gemm.w4a8_mm(x_q, w_packed, scales, 128, strided[0], isa=isa, threads=1), want)


@pytest.mark.parametrize("isa", ISAS)
def test_results_do_not_depend_on_the_thread_count(isa):
    _runs(isa)
    gen = torch.Generator().manual_seed(3)
    x_q, w_q = _codes(gen, 5, 700, False), _codes(gen, 70, 700, False)
    w_packed = torch.randint(0, 256, (70, 350), generator=gen, dtype=torch.uint8)
    scales = torch.rand(70, 1, generator=gen)
    one = int8_gemm.w8a8_mm(x_q, w_q, isa=isa, threads=1)
    one_w4 = int8_gemm.w4a8_mm(x_q, w_packed, scales, 700, isa=isa, threads=1)
    for threads in (2, 3, 7):
        assert torch.equal(int8_gemm.w8a8_mm(x_q, w_q, isa=isa, threads=threads), one)
        assert torch.equal(int8_gemm.w4a8_mm(x_q, w_packed, scales, 700, isa=isa, threads=threads), one_w4)


def test_the_custom_ops_are_what_the_defaults_call():
    ok, why = int8_gemm.availability()
    if not ok:
        pytest.skip(f"the AVX-512 VNNI build does not run here: {why}")
    x_q, w_q = torch.ones(2, 64, dtype=torch.int8), torch.ones(3, 64, dtype=torch.int8)
    assert torch.equal(
        torch.ops.glm5_hal.native_w8a8_mm(x_q, w_q, 3, None, None, None, torch.float32), _exact(x_q, w_q)
    )
    with torch._subclasses.fake_tensor.FakeTensorMode():  # shape inference without running the kernel
        fake = torch.ops.glm5_hal.native_w8a8_mm(
            torch.empty(2, 64, dtype=torch.int8),
            torch.empty(3, 64, dtype=torch.int8),
            3,
            None,
            None,
            None,
            torch.bfloat16,
        )
        assert fake.shape == (2, 3) and fake.dtype == torch.bfloat16


def test_bad_arguments_name_what_was_expected():
    x_q, w_q = torch.zeros(2, 64, dtype=torch.int8), torch.zeros(3, 64, dtype=torch.int8)
    with pytest.raises(TypeError, match=r"w_q: expected torch.int8, got torch.float32"):
        int8_gemm.w8a8_mm(x_q, w_q.float())
    with pytest.raises(ValueError, match=r"w_q: expected \(3, 64\), got \(3, 32\)"):
        int8_gemm.w8a8_mm(x_q, w_q[:, :32], 3)
    with pytest.raises(ValueError, match=r"w_q: expected \(1, 16, 64, 4\)"):
        int8_gemm.w8a8_mm(x_q, int8_gemm.panel_weight(w_q)[:, :2], 3)
    with pytest.raises(ValueError, match=r"x_scale, w_scale: expected both or neither"):
        int8_gemm.w8a8_mm(x_q, w_q, None, torch.ones(2))
    with pytest.raises(ValueError, match=r"w_scale: expected \[3\], got \(4,\)"):
        int8_gemm.w8a8_mm(x_q, w_q, None, torch.ones(2), torch.ones(4))
    with pytest.raises(TypeError, match=r"out_dtype: expected one of"):
        int8_gemm.w8a8_mm(x_q, w_q, out_dtype=torch.float16)
    w_packed, scales = torch.zeros(3, 32, dtype=torch.uint8), torch.ones(3, 1)
    with pytest.raises(ValueError, match=r"group: expected K = 64 or a multiple of 8 dividing it, got 4"):
        int8_gemm.w4a8_mm(x_q, w_packed, torch.ones(3, 16), 4)
    with pytest.raises(ValueError, match=r"w_packed: expected \(3, 32\), got \(3, 31\)"):
        int8_gemm.w4a8_mm(x_q, w_packed[:, :31], scales, 64)
    with pytest.raises(ValueError, match=r"x_q: expected an even K"):
        int8_gemm.w4a8_mm(x_q[:, :63], w_packed, scales, 63)
