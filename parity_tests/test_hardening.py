"""Regression tests of the defects found by fuzzing (issue 11): each failed before its fix.

1. triton wrappers assumed unit strides on arguments validation accepts as views;
2. torch sparse attention gathered rows for invalid indices (IndexError) and leaked NaN of unread slots;
3. moe_combine accepted a src_index with duplicates (undefined output, a segfault on triton);
4. validation formatted messages eagerly with symbolic sizes, breaking torch.compile(fullgraph=True);
5. vendor probes: an import calling sys.exit(), hanging SMI commands and imports, misleading reasons;
6. edge shapes: T = 0, 1-D dynamic_quant, degenerate sizes, unbounded topk, non-finite scalars;
7. NaN was lost or picked differently per backend (docs/ops.md "NaN" now defines it);
8. fake (meta) and real outputs disagreed on strides for column-major inputs;
9. the triton cache writers refused a padded-block cache view.
The property-based suite in parity_tests/fuzz/ keeps looking for more of the same.
"""

from __future__ import annotations

import pytest
import torch

import glm5_hal
from glm5_hal.parity import cases as C

_COMPILE_TOKEN_COUNTS = (3, 5, 7)  # the second distinct count is where automatic dynamic shapes kick in


def _compiled_inputs(op: str, tokens: int) -> dict:
    gen = torch.Generator().manual_seed(tokens)
    if op == "mla_prolog":
        return C.mla_prolog_inputs(C.MINI, [C.SeqSpec(tokens, tokens + 4)], 8)(gen, torch.float32)
    if op == "indexer_prolog":
        return C.indexer_prolog_inputs(C.MINI, [C.SeqSpec(tokens, tokens + 4)], 8)(gen, torch.float32)
    return C.w4a8_matmul_inputs(tokens, 16, 64, 32)(gen, torch.float32)


@pytest.mark.parametrize(("op", "dynamic"), [("mla_prolog", None), ("indexer_prolog", None), ("w4a8_matmul", True)])
def test_defect4_compile_fullgraph_over_changing_token_counts(op: str, dynamic: bool | None) -> None:
    torch._dynamo.reset()
    fn = getattr(glm5_hal, op)
    compiled = torch.compile(lambda kw: fn(**kw), fullgraph=True, dynamic=dynamic, backend="aot_eager")
    for tokens in _COMPILE_TOKEN_COUNTS:
        inputs = _compiled_inputs(op, tokens)
        eager_inputs = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}
        got, want = compiled(inputs), fn(**eager_inputs)
        for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
            torch.testing.assert_close(g, w, rtol=0, atol=0)
