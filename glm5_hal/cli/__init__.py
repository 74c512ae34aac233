"""The `glm5-hal` command line: one module per subcommand, each with `register(subparsers)`.

    glm5-hal info                   hardware, backends (available or why not), per-op implementation
    glm5-hal parity [--quick]       parity of the selected backends against the float64 reference
    glm5-hal bench ...              per-op latency against the roofline (registered by the `perf` package)
    glm5-hal export-onnx ...        one ONNX model per op
    glm5-hal kv-cache ...           cache bytes per token per layer and memory at a context, per cache format
    glm5-hal generate CKPT ...      continue token-id prompts with a checkpoint (from_pretrained + generate)
    glm5-hal quantize ...           QuaRot + W8A8 / W4A8 a checkpoint (registered by `quantization`)

A subcommand is a callable `register(subparsers) -> None` that adds its parser and sets `func` (a callable
taking the parsed args and returning the exit code). Built-in ones are the modules named in SUBCOMMANDS.
Packages above glm5_hal in the layout (perf, quantization) and out-of-tree tools add theirs through the
`glm5_hal.commands` entry-point group, the same way backends register, so glm5_hal never imports them.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import sys
from collections.abc import Sequence

SUBCOMMANDS = ("info", "parity", "export-onnx", "kv-cache", "generate")
COMMAND_ENTRY_POINT_GROUP = "glm5_hal.commands"


def _plugin_registrars() -> list[tuple[str, object]]:
    """(name, register) of every `glm5_hal.commands` entry point; one that fails to load is reported, not fatal."""
    found = []
    for ep in sorted(importlib.metadata.entry_points(group=COMMAND_ENTRY_POINT_GROUP), key=lambda e: e.name):
        try:
            found.append((ep.name, ep.load()))
        except Exception as exc:  # a broken plugin must not take the other commands down
            print(f"glm5-hal: command {ep.name!r} ({ep.value}) failed to load: {exc!r}", file=sys.stderr)
    return found


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="glm5-hal", description="Portable GLM-5 / DeepSeek-V3.2 operators: backends, parity, performance."
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in SUBCOMMANDS:
        importlib.import_module(f"glm5_hal.cli.{name.replace('-', '_')}").register(subparsers)
    for _name, register in _plugin_registrars():
        register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
