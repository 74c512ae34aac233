"""What every module of the plugin shares and nothing else: the vLLM versions it is tested with, its logger and how
its 0 / 1 settings are read.

Its own module so that the plugin's modules sit below the package (the package's `register` imports them).
"""

from __future__ import annotations

from glm5_hal.environment import setting

# The vLLM minor versions the plugin was written against and is tested with (major, minor).
TESTED_VLLM: tuple[tuple[int, int], ...] = ((0, 32),)

# The plugin's log lines go through vLLM's logging (its "vllm" logger tree, so they show with vLLM's own).
LOGGER = "vllm.glm5_hal"

ON, OFF = "1", "0"


def switch(name: str, default: bool = False) -> bool:
    """A 0 / 1 setting (unset or empty: `default`); a ValueError names any other value."""
    value = setting(name).strip() or (ON if default else OFF)
    if value not in (ON, OFF):
        raise ValueError(f"{name}: expected '0' or '1', got {value!r}")
    return value == ON
