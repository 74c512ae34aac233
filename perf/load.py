"""How much of the CPU other processes used while a benchmark ran (Linux /proc; unknown elsewhere).

CPU timings on a shared machine are only as good as the machine was quiet: the bench reports the share of all CPU
time that went to other processes during its run, so a reader (and the bench's own warning) can tell a clean
measurement from a contended one.
"""

from __future__ import annotations

import os
import time


def _system_busy_seconds() -> tuple[float, float] | None:
    """(busy, total) CPU seconds of the whole machine since boot, from /proc/stat; None off Linux."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except OSError:
        return None
    ticks = os.sysconf("SC_CLK_TCK")
    idle = fields[3] + fields[4]  # idle + iowait
    total = sum(fields[:8])  # user nice system idle iowait irq softirq steal
    return (total - idle) / ticks, total / ticks


def _own_seconds() -> float:
    t = os.times()  # this process and its finished children (e.g. the local ranks of an EP bench)
    return t.user + t.system + t.children_user + t.children_system


class LoadMonitor:
    """Start it before a run; `others_share()` afterwards is the fraction of all CPU time (every core) that other
    processes used meanwhile, or None where /proc/stat is missing."""

    def __init__(self) -> None:
        self.start_system = _system_busy_seconds()
        self.start_own = _own_seconds()
        self.start_wall = time.monotonic()

    def busy_share(self) -> float | None:
        """The fraction of all CPU time (every core) anything used meanwhile, this process and its ranks included."""
        end = _system_busy_seconds()
        if end is None or self.start_system is None:
            return None
        total = end[1] - self.start_system[1]
        return (end[0] - self.start_system[0]) / total if total > 0 else 0.0

    def others_share(self) -> float | None:
        end = _system_busy_seconds()
        if end is None or self.start_system is None:
            return None
        busy = end[0] - self.start_system[0]
        total = end[1] - self.start_system[1]
        own = _own_seconds() - self.start_own
        return max(0.0, busy - own) / total if total > 0 else 0.0
