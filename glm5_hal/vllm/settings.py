"""What every module of the plugin shares and nothing else: the vLLM versions it is tested with and its logger.

Its own module so that the plugin's modules sit below the package (the package's `register` imports them).
"""

from __future__ import annotations

# The vLLM minor versions the plugin was written against and is tested with (major, minor).
TESTED_VLLM: tuple[tuple[int, int], ...] = ((0, 32),)

# The plugin's log lines go through vLLM's logging (its "vllm" logger tree, so they show with vLLM's own).
LOGGER = "vllm.glm5_hal"
