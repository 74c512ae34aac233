"""The KV caches the plugin's ops read, backed by huge pages the first time an op sees each one.

vLLM allocates its CPU KV caches with the process's page size (4 KiB where transparent huge pages are "madvise", as
on this project's machines); sparse attention and the indexer's scorer read their rows scattered, so most rows cost a
TLB miss (glm5_hal.huge_pages). The plugin's latent-cache write and indexer ask for huge pages for each cache buffer
once (keyed by its storage and kind), where GLM5_HAL_VLLM_HUGE_PAGES is 1 (the default; 0 leaves vLLM's pages as
they are; another value stops the plugin's activation with a ValueError).
"""

from __future__ import annotations

import logging

from torch import Tensor

from glm5_hal.huge_pages import HugePages, back_with_huge_pages
from glm5_hal.vllm.settings import LOGGER, switch

HUGE_PAGES_ENV = "GLM5_HAL_VLLM_HUGE_PAGES"

logger = logging.getLogger(LOGGER)

# (storage address, kind) -> (kind, what back_with_huge_pages did); read by the tests through apply_model. Keyed by
# kind too: vLLM may hold a layer's latent and index caches in one buffer, and each kind is reported.
_seen: dict[tuple[int, str], tuple[str, HugePages]] = {}


def on_huge_pages(cache: Tensor, kind: str) -> None:
    """Back `cache` (a KV cache buffer or a view of one; kind: "latent" or "index", for the log) with huge pages
    the first time it is seen; later calls cost one dict lookup."""
    key = (cache.untyped_storage().data_ptr(), kind)
    if key in _seen:
        return
    if not switch(HUGE_PAGES_ENV, default=True):
        _seen[key] = (kind, HugePages(0, False, f"{HUGE_PAGES_ENV}=0"))
        return
    result = back_with_huge_pages(cache)
    _seen[key] = (kind, result)
    logger.info("glm5-hal vLLM plugin: %s cache, %d MiB: %s", kind, result.asked >> 20, result.reason)


def seen() -> list[tuple[str, HugePages]]:
    """(kind, outcome) of every cache buffer seen so far in this process."""
    return list(_seen.values())
