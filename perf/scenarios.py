"""Named benchmark scenarios: (op, model dims, batch shape) -> fresh inputs built by the parity builders.

`quick`: one mini-dims case of every op (what the test of `glm5-hal bench --quick` runs).
`decode`: GLM-5 decode (batch 4, one token each, 16K context) for the attention side; MoE decode with 4 tokens
over 8 experts at GLM-5 expert dims; W8A8 / W4A8 at GLM-5 projection shapes.
`context`: sparse attention, the indexer and dense MLA attention at GLM-5 dims over 4K..128K keys.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from glm5_hal.config import GLM5
from glm5_hal.parity import cases as builders
from glm5_hal.parity.inputs import SeqSpec

DENSE_MLA = "dense_mla_attention"  # the comparison baseline of the context scenarios (perf/dense.py), not an op
CONTEXTS = (4096, 8192, 16384, 32768, 65536, 131072)
DECODE_BATCH = 4
BLOCK = 64


@dataclass(frozen=True)
class Scenario:
    name: str
    op: str
    build: Callable[[torch.Generator, torch.dtype], dict]
    context: int | None = None  # keys in context, for the latency-vs-context plot


def _quick() -> list[Scenario]:
    first = {}
    for case in builders.CASES:
        if not case.slow:
            first.setdefault(case.op, case)
    return [Scenario(f"mini/{c.name}", c.op, c.build) for c in first.values()]


def _decode_seqs(context: int) -> list[SeqSpec]:
    return [SeqSpec(1, context)] * DECODE_BATCH


def _context(context: int) -> list[Scenario]:
    seqs = _decode_seqs(context)
    return [
        Scenario(
            f"glm5/decode-{context // 1024}k",
            "sparse_flash_attention",
            builders.sparse_attention_inputs(GLM5, seqs, BLOCK, topk=GLM5.index_topk),
            context,
        ),
        Scenario(
            f"glm5/decode-{context // 1024}k",
            "lightning_indexer",
            builders.indexer_inputs(GLM5, seqs, BLOCK, topk=GLM5.index_topk),
            context,
        ),
        Scenario(
            f"glm5/decode-{context // 1024}k",
            DENSE_MLA,
            builders.sparse_attention_inputs(GLM5, seqs, BLOCK, topk=1),
            context,
        ),
    ]


def _decode() -> list[Scenario]:
    proj = (DECODE_BATCH * 16, GLM5.q_lora_rank, GLM5.hidden_size)  # M, N, K of q_a_proj at a 64-token batch
    return [
        *_context(16384)[:2],
        Scenario(
            "glm5/moe-decode-4tok",
            "fused_moe",
            builders.fused_moe_inputs(DECODE_BATCH, GLM5.hidden_size, GLM5.moe_intermediate_size, 8, 8),
        ),
        Scenario("glm5/q_a_proj-64tok", "quant_matmul", builders.quant_matmul_inputs(*proj)),
        Scenario("glm5/q_a_proj-64tok", "w4a8_matmul", builders.w4a8_matmul_inputs(*proj, group_size=None)),
        Scenario("glm5/q_a_proj-64tok", "dynamic_quant", builders.dynamic_quant_inputs((proj[0], proj[2]))),
        Scenario("glm5/hidden-64tok", "hadamard_transform", builders.hadamard_inputs((proj[0], GLM5.hidden_size))),
    ]


SCENARIOS: dict[str, Callable[[], list[Scenario]]] = {
    "quick": _quick,
    "decode": _decode,
    "context": lambda: [s for c in CONTEXTS for s in _context(c)],
}
