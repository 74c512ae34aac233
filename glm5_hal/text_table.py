"""Aligned text or Markdown tables for the command line's reports (`glm5-hal bench`, its EP scenarios)."""

from __future__ import annotations

from collections.abc import Sequence


def render_table(head: Sequence[str], body: Sequence[Sequence[str]], *, markdown: bool = False) -> str:
    """`head` and the rows of `body` (strings) as a Markdown table, or as text with columns padded to align."""
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in body])
    widths = [max(len(cell) for cell in column) for column in zip(head, *body)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*head), fmt.format(*("-" * w for w in widths))] + [fmt.format(*row) for row in body])
