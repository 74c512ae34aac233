"""`glm5-hal bench --plot`: latency against context length for the sparse path and dense MLA attention.

Curves (one set per backend): sparse attention alone, the lightning indexer, indexer + sparse attention (the whole
sparse path of a decode step), and dense MLA attention over the full context (the baseline). matplotlib is an
optional dependency (the `perf` extra); without it --plot is a clear error, never an import failure of perf.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class _ContextRow(Protocol):
    op: str
    backend: str
    context: int | None
    median_ms: float


CURVES = {
    "sparse_flash_attention": "sparse attention (topk {topk})",
    "lightning_indexer": "lightning indexer",
    "indexer+sparse": "indexer + sparse attention",
    "dense_mla_attention": "dense MLA attention (full context)",
}


def context_series(rows: Sequence[_ContextRow]) -> dict[tuple[str, str], dict[int, float]]:
    """(curve, backend) -> {context: median ms}, with the indexer + sparse attention sum added where both ran."""
    series: dict[tuple[str, str], dict[int, float]] = {}
    for r in rows:
        if r.context is not None and r.op in CURVES:
            series.setdefault((r.op, r.backend), {})[r.context] = r.median_ms
    for (op, backend), sparse in list(series.items()):
        if op == "sparse_flash_attention":
            indexer = series.get(("lightning_indexer", backend), {})
            both = {c: sparse[c] + indexer[c] for c in sparse if c in indexer}
            if both:
                series[("indexer+sparse", backend)] = both
    return series


def plot_context(rows: Sequence[_ContextRow], path: str, *, title: str = "", topk: int = 2048) -> None:
    """Draw the context curves of `rows` into the PNG `path` (log-log: linear growth is a slope of one)."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, no display
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise SystemExit(f"--plot needs matplotlib: pip install 'glm5-hal[perf]' ({exc})") from exc
    series = context_series(rows)
    if not series:
        raise SystemExit("--plot: no rows with a context length (run the `context` scenarios)")
    compared = {backend for curve, backend in series if curve != "dense_mla_attention"}  # the baseline runs once
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for (curve, backend), points in sorted(series.items(), key=lambda item: list(CURVES).index(item[0][0])):
        xs = sorted(points)
        label = CURVES[curve].format(topk=topk)
        if len(compared) > 1 and curve != "dense_mla_attention":
            label += f" [{backend}]"
        ax.plot([x / 1024 for x in xs], [points[x] for x in xs], marker="o", label=label)
    ax.set(xscale="log", yscale="log", xlabel="context (K keys)", ylabel="latency per call (ms, median)")
    contexts = sorted({c for points in series.values() for c in points})
    ax.set_xticks([c / 1024 for c in contexts], [f"{c // 1024}K" for c in contexts])
    ax.minorticks_off()
    ax.set_title(title or "GLM-5 decode: sparse path vs dense MLA attention")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
