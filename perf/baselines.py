"""Comparison baselines the ops are measured against (plain torch, not HAL ops, never dispatched to a backend).

- `dense_mla_attention`: every query over its whole visible context (perf/dense.py): what sparse attention and the
  indexer replace.
- `fp32_matmul`, `bf16_matmul`: x [M, K] @ w [N, K]^T, both fp32 or both bf16 (torch's bf16 GEMM, fp32
  accumulation): the unquantized projection W8A8 / W4A8 replace.
- `transformers_layer`: transformers' eager glm_moe_dsa decoder layer on the weights of the `glm5_layer` it is
  compared with (perf/layer.py).

Each takes keyword inputs like an op (a scenario's build) and comes with its cost model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from glm5_hal.parity.inputs import linear_weight, randn
from perf import costs
from perf.costs import Cost, visible_keys
from perf.dense import dense_mla_attention
from perf.layer import TRANSFORMERS_LAYER


def fp32_matmul(x: Tensor, w: Tensor) -> Tensor:
    """x: [M, K]; w: [N, K] (nn.Linear layout), both fp32 (or both bf16: `bf16_matmul`). Returns x @ w^T, [M, N] in
    their dtype."""
    return x @ w.T


def _dense_cost(a: dict) -> Cost:
    q = a["q"]
    visible = visible_keys(a["seq_lens_k"], a["cu_seqlens_q"])
    context = int(a["seq_lens_k"].long().sum())
    return costs.dense_mla_attention(q.shape[0], q.shape[1], visible, context, q.element_size(), a.get("d_v", 512))


def _matmul_cost(a: dict) -> Cost:
    x, w = a["x"], a["w"]
    (m, k), n = x.shape, w.shape[0]
    return Cost(2.0 * m * n * k, (m * k + n * k + m * n) * x.element_size())


@dataclass(frozen=True)
class Baseline:
    run: Callable[..., object]  # keyword inputs -> outputs
    cost: Callable[[dict], Cost]


BASELINES: dict[str, Baseline] = {
    "dense_mla_attention": Baseline(dense_mla_attention, _dense_cost),
    "fp32_matmul": Baseline(fp32_matmul, _matmul_cost),
    "bf16_matmul": Baseline(fp32_matmul, _matmul_cost),  # the same product, on bf16 inputs
    "transformers_layer": Baseline(TRANSFORMERS_LAYER.run, TRANSFORMERS_LAYER.cost),
}


def float_matmul_inputs(
    m: int, n: int, k: int, dtype: torch.dtype = torch.float32
) -> Callable[[torch.Generator, torch.dtype], dict]:
    """Build for `fp32_matmul` (or `bf16_matmul`) at [M, K] x [N, K], in `dtype` whatever the benchmark dtype."""

    def build(gen: torch.Generator, _: torch.dtype) -> dict:
        return {"x": randn((m, k), gen, dtype=dtype), "w": linear_weight(n, k, gen, dtype)}

    return build
