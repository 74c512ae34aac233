"""The `glm5_hal` custom ONNX domain: an op exported as ONE node, for toolchains that map it to a fused kernel.

Every op of OPS.md is exactly expressible in the standard opset (docs/onnx.md says how), so no export needs
this domain. It exists for toolchains whose graph compilers reject what the standard form needs (a Loop with a
data-dependent trip count in grouped_matmul / fused_moe; large gathers in the paged attention ops) but that ship
a fused kernel for the op: `export_op(..., custom_ops={"grouped_matmul"})` emits `glm5_hal::GroupedMatmul`
wherever a grouped GEMM occurs (alone, and twice inside fused_moe, whose dispatch and combine stay standard).

Schema of `glm5_hal::<OpType>` (domain version 1), for every op (OpType = the op name in CamelCase):
- inputs: the op's tensor arguments in OPS.md order, same names, dtypes and shapes as the standard graph's
  inputs; an absent optional argument (a bias) is the empty name.
- outputs: the op's outputs in OPS.md order, then the updated cache for cache-writing ops (`<cache>_out`).
- attributes: the op's non-tensor arguments under their OPS.md names: floats (eps, sm_scale,
  routed_scaling_factor, scale), ints (topk, d_v, top_k, n_group, topk_group, num_experts, group_size;
  booleans rope_interleaved and norm_topk_prob as 0 / 1), strings (scoring; out_dtype as "float32" ...).
  An argument that is None is left out.
- semantics: exactly the op's reference in ops_reference (custom_reference.reference_ops runs it so).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from glm5_hal.onnx_export.graph import CUSTOM_DOMAIN, GraphBuilder

# Options that shape the export but are not op arguments (never attributes).
EXPORT_ONLY_OPTIONS = frozenset({"leading_dims", "return_scores"})


def op_type(op: str) -> str:
    """The custom node type of an op: mla_prolog -> MlaProlog, w4a8_matmul -> W4a8Matmul."""
    return "".join(part.capitalize() for part in op.split("_"))


def attribute_value(value: object) -> object:
    """An op argument as an ONNX attribute value: bool -> 0/1, dtype -> its name; None stays None (left out)."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, (int, float, str)) or value is None:
        return value
    return str(value).removeprefix("torch.")


def custom_node(
    g: GraphBuilder,
    op: str,
    inputs: Sequence[str],
    *,
    n_out: int,
    options: Mapping[str, object],
    out: Sequence[str] | None = None,
) -> str | tuple[str, ...]:
    """Append one glm5_hal::<OpType> node computing `op` (schema in the module docstring)."""
    attrs = {k: attribute_value(v) for k, v in options.items() if k not in EXPORT_ONLY_OPTIONS}
    return g.op(op_type(op), *inputs, n_out=n_out, out=out, domain=CUSTOM_DOMAIN, **attrs)
