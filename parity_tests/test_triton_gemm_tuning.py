"""How the GEMM kernels get their tiles (backends/triton/gemm_tuning.py): fixed under the interpreter, autotuned
on a GPU over shape lists that start with the shape each kernel ran with before.

The GPU side cannot run here; these tests check what the launcher hands the autotuner (the kernel, its key, a
grid that reads the tuned BLOCK_N, no tile sizes of its own), with the autotuner replaced by a recorder. The
compile check (parity_tests/test_triton_compile.py) compiles the first shape of each list for sm_90; every shape
of every list compiled for sm_90 and sm_89 with Triton 3.9 and 3.6 when the lists were written.
"""

from __future__ import annotations

import pytest
import torch

from backends.triton.runtime import use_interpreter_if_no_gpu

use_interpreter_if_no_gpu()
pytest.importorskip("triton", reason="triton is not installed: pip install glm5-hal[triton]")

from backends.triton import gemm_tuning, moe, quant  # noqa: E402
from backends.triton import matmul as triton_matmul  # noqa: E402


def test_each_list_starts_with_the_old_fixed_shape():
    """BLOCK_N 128, BLOCK_K 64 (32 for fp32 activations), Triton's default 4 warps and 3 stages: what every GEMM
    kernel ran with before, so the autotuner always has it to compare with."""
    assert gemm_tuning.TILE_SHAPES["half"][0] == (128, 64, 4, 3)
    assert gemm_tuning.TILE_SHAPES["float32"][0] == (128, 32, 4, 3)
    assert gemm_tuning.TILE_SHAPES["int8"][0] == (128, 64, 4, 3)
    for shapes in gemm_tuning.TILE_SHAPES.values():
        assert len(set(shapes)) == len(shapes)
    assert all(n >= 32 and k >= 32 for n, k, *_ in gemm_tuning.TILE_SHAPES["int8"])  # int8 dots' minimum


def test_autotuned_kernels_key_on_their_sizes():
    """Keyed on N, K, BLOCK_M, and the group size of a W4A8 kernel; one autotuner per kernel and list."""
    tuned = gemm_tuning._autotuned(moe._grouped_w4a8_matmul_kernel, "int8")
    assert tuned.keys == ["N", "K", "BLOCK_M", "group_size"]
    assert gemm_tuning._autotuned(quant._quant_matmul_kernel, "int8").keys == ["N", "K", "BLOCK_M"]
    assert gemm_tuning._autotuned(moe._grouped_w4a8_matmul_kernel, "int8") is tuned
    shapes = [(c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.num_warps, c.num_stages) for c in tuned.configs]
    assert shapes == gemm_tuning.TILE_SHAPES["int8"]


class _Recorder:
    """Stands in for an autotuned kernel: records the grid (called with a tuned BLOCK_N) and the arguments."""

    def __init__(self) -> None:
        self.calls: list[tuple[tuple[int, ...], dict]] = []

    def __getitem__(self, grid):
        def launch(**arguments):
            self.calls.append((grid({"BLOCK_N": 256, "BLOCK_K": 128}), arguments))

        return launch


@pytest.mark.parametrize(
    ("call", "kernel", "shapes", "grid"),
    [
        # linear: M 200 in tiles of 64 (a GPU's largest BLOCK_M here), N 300 in tiles of the tuned 256, 1 batch.
        (lambda: triton_matmul.linear(torch.zeros(200, 40), torch.zeros(300, 40)), "_matmul_kernel", "float32",
         (4, 2, 1)),
        (lambda: triton_matmul.linear(torch.zeros(200, 40).bfloat16(), torch.zeros(300, 40).bfloat16()),
         "_matmul_kernel", "half", (4, 2, 1)),
        # quant_matmul: M 200 in tiles of 128.
        (lambda: quant.quant_matmul(torch.zeros(200, 64, dtype=torch.int8), torch.ones(200),
                                    torch.zeros(300, 64, dtype=torch.int8), torch.ones(300)),
         "_quant_matmul_kernel", "int8", (2, 2)),
        # The grouped W8A8 GEMM: the expert tile index's slots, then N.
        (lambda: moe.grouped_quant_matmul(torch.zeros(48, 64, dtype=torch.int8), torch.ones(48),
                                          torch.zeros(4, 300, 64, dtype=torch.int8), torch.ones(4, 300),
                                          torch.tensor([0, 16, 16, 40, 48])),
         "_grouped_quant_matmul_kernel", "int8", None),
    ],
)  # fmt: skip
def test_on_a_gpu_the_launch_leaves_the_tiles_to_the_autotuner(monkeypatch, call, kernel, shapes, grid):
    recorder, asked = _Recorder(), []

    def autotuned(jit_kernel, shape_list):
        asked.append((jit_kernel.fn.__name__, shape_list))
        return recorder

    for module in (gemm_tuning, triton_matmul, quant, moe):  # the tiles' rows are picked for a GPU too
        monkeypatch.setattr(module, "interpreting", lambda: False)
    monkeypatch.setattr(gemm_tuning, "_autotuned", autotuned)
    monkeypatch.setattr(moe, "expert_tiles", lambda offsets, rows, block_m: moe.ExpertTiles(
        torch.zeros(5, dtype=torch.int32), torch.zeros(5, dtype=torch.int32), block_m))  # fmt: skip
    call()
    assert asked == [(kernel, shapes)]
    ((launched_grid, arguments),) = recorder.calls
    assert launched_grid == (grid or (5, 2))
    assert "BLOCK_N" not in arguments and "BLOCK_K" not in arguments and "BLOCK_M" in arguments


def test_under_the_interpreter_the_caller_picks_the_tiles(monkeypatch):
    """The interpreter takes the caller's wide fixed tiles (its cost is per program), never the autotuner."""
    monkeypatch.setattr(gemm_tuning, "_autotuned", None)
    y = quant.quant_matmul(torch.ones(3, 64, dtype=torch.int8), torch.ones(3), torch.ones(5, 64, dtype=torch.int8),
                           torch.full((5,), 0.5))  # fmt: skip
    assert torch.equal(y.float(), torch.full((3, 5), 32.0))


def test_chosen_shapes_name_each_kernel_key_and_shape(monkeypatch):
    """What perf/triton_gpu.py prints after a GPU run: per kernel and key, the shape the autotuner kept."""
    monkeypatch.setattr(gemm_tuning, "_made", {})
    tuned = gemm_tuning._autotuned(quant._quant_matmul_kernel, "int8")
    tuned.cache[(256, 512, 16, "torch.int8", "torch.bfloat16")] = tuned.configs[2]
    tuned.cache[(256, 512, 64, "torch.int8", "torch.bfloat16")] = tuned.configs[0]
    assert gemm_tuning.chosen_shapes() == [
        "_quant_matmul_kernel [int8] N=256, K=512, BLOCK_M=16 (int8, bfloat16): (128, 128, 8, 3)",
        "_quant_matmul_kernel [int8] N=256, K=512, BLOCK_M=64 (int8, bfloat16): (128, 64, 4, 3) (the old fixed shape)",
    ]
