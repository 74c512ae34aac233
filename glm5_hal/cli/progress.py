"""A dependency-free progress bar for long runs (written to stderr, only when it is a terminal or forced)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class ProgressBar:
    """Call it with (done, total, label); draws `[#####.....] 12/80 label` in place, ends with a newline."""

    def __init__(self, stream: TextIO = sys.stderr, *, enabled: bool | None = None, width: int = 30) -> None:
        self.stream = stream
        self.enabled = stream.isatty() if enabled is None else enabled
        self.width = width
        self.start = time.monotonic()

    def __call__(self, done: int, total: int, label: str) -> None:
        if not self.enabled:
            return
        filled = self.width * done // max(total, 1)
        elapsed = time.monotonic() - self.start
        line = f"\r[{'#' * filled}{'.' * (self.width - filled)}] {done}/{total} {elapsed:5.0f}s {label[:60]:<60}"
        self.stream.write(line)
        if done >= total:
            self.stream.write("\n")
        self.stream.flush()
