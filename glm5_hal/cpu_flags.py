"""The CPU's model name and ISA flags, from /proc/cpuinfo (Linux): what the capability probe and the native kernels
read before they use an instruction set (running an instruction the CPU lacks kills the process, it raises nothing).
"""

from __future__ import annotations

import functools
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")


def parse_cpuinfo(cpuinfo: str) -> tuple[str, frozenset[str] | None]:
    """(model name with its family, the ISA flags or None where the text has none) from the first processor of
    /proc/cpuinfo's text (x86 `flags`, Arm `Features`)."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip().lower(), value.strip())
    model = fields.get("model name") or fields.get("hardware") or "CPU"
    if "cpu family" in fields:
        model += f" (family {fields['cpu family']}, model {fields.get('model', '?')})"
    flags = fields.get("flags", fields.get("features"))
    return model, None if flags is None else frozenset(flags.split())


def read_cpuinfo() -> str:
    """/proc/cpuinfo's text, or "" where there is none (not Linux)."""
    return CPUINFO.read_text(errors="replace") if CPUINFO.exists() else ""


@functools.cache
def this_cpu() -> tuple[str, frozenset[str] | None]:
    """parse_cpuinfo of this machine, read once per process."""
    return parse_cpuinfo(read_cpuinfo())


CACHE_SYSFS = Path("/sys/devices/system/cpu/cpu0/cache")
FLUSH_FALLBACK_BYTES = 256 * 2**20  # where sysfs lists no cache size


def largest_cache_bytes(cache_dir: Path = CACHE_SYSFS) -> int | None:
    """The size of the largest CPU cache sysfs lists (the last level), or None where it lists none."""
    sizes = []
    for path in cache_dir.glob("index*/size"):
        text = path.read_text().strip()  # e.g. "32768K"
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        sizes.append(int(text.rstrip("KMG")) * scale)
    return max(sizes) if sizes else None


def cache_flush_bytes() -> int:
    """Bytes to overwrite between timed calls to evict the CPU's last-level cache: twice the largest cache sysfs
    lists, FLUSH_FALLBACK_BYTES where it lists none (perf.timing, the capability probe's streaming check)."""
    largest = largest_cache_bytes()
    return 2 * largest if largest else FLUSH_FALLBACK_BYTES
