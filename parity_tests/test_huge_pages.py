"""glm5_hal.huge_pages (a CPU tensor's memory on transparent huge pages) and the vLLM plugin's use of it for its KV
caches (glm5_hal.vllm.caches: importable without vLLM)."""

from __future__ import annotations

import sys

import pytest
import torch

from glm5_hal.huge_pages import HUGE_PAGE, back_with_huge_pages
from glm5_hal.vllm import caches

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="transparent huge pages are Linux's")


def _anon_huge_bytes(address: int) -> int:
    """AnonHugePages of the mapping of this process that holds `address` (/proc/self/smaps)."""
    inside, huge = False, 0
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            first = line.split()[0]
            if "-" in first and ":" not in first:  # a mapping's header: start-end perms ...
                start, end = (int(x, 16) for x in first.split("-"))
                inside = start <= address < end
            elif inside and first == "AnonHugePages:":
                huge = int(line.split()[1]) * 1024
    return huge


@linux
def test_the_whole_pages_inside_a_storage_are_asked_for_and_values_are_kept():
    """A view's whole storage counts (not the view's elements); only whole 2 MiB pages inside it are advised; where
    the kernel collapses them (Linux 6.1+ with THP enabled), the mapping shows that many bytes of huge pages."""
    gen = torch.Generator().manual_seed(0)
    base = torch.randint(0, 256, (9 * HUGE_PAGE + 12345,), generator=gen, dtype=torch.uint8)
    before = base.clone()
    view = base[HUGE_PAGE * 4 : HUGE_PAGE * 4 + 10]  # small view, large storage
    result = back_with_huge_pages(view)
    first = base.data_ptr()
    whole = ((first + base.numel()) // HUGE_PAGE - -(-first // HUGE_PAGE)) * HUGE_PAGE
    assert torch.equal(base, before)
    if result.asked == 0:
        pytest.skip(f"this kernel refused: {result.reason}")
    assert result.asked == whole >= 8 * HUGE_PAGE
    if result.collapsed:
        assert result.reason == "collapsed into huge pages"
        assert _anon_huge_bytes(first + base.numel() // 2) >= HUGE_PAGE
    else:
        assert "MADV_COLLAPSE refused" in result.reason


def test_what_cannot_be_backed_says_why():
    small = back_with_huge_pages(torch.zeros(1000))
    assert (small.asked, small.collapsed) == (0, False)
    assert "no whole 2 MiB page" in small.reason or "Linux" in small.reason
    meta = back_with_huge_pages(torch.empty(HUGE_PAGE * 4, device="meta"))
    assert meta == type(meta)(0, False, "not CPU memory (meta)")


@linux
def test_the_plugin_backs_each_cache_once_unless_switched_off(monkeypatch):
    monkeypatch.setattr(caches, "_seen", {})
    latent, index = torch.zeros(3 * HUGE_PAGE, dtype=torch.uint8), torch.zeros(3 * HUGE_PAGE, dtype=torch.uint8)
    calls = []
    monkeypatch.setattr(caches, "back_with_huge_pages", lambda t: calls.append(t.data_ptr()) or back_with_huge_pages(t))
    for _ in range(3):  # a step per layer: the first call asks, the others look it up
        caches.on_huge_pages(latent[HUGE_PAGE:], "latent")
        caches.on_huge_pages(index, "index")
    assert calls == [latent.data_ptr() + HUGE_PAGE, index.data_ptr()]
    assert sorted(kind for kind, _ in caches.seen()) == ["index", "latent"]
    monkeypatch.setenv(caches.HUGE_PAGES_ENV, "0")
    other = torch.zeros(3 * HUGE_PAGE, dtype=torch.uint8)
    caches.on_huge_pages(other, "latent")
    assert len(calls) == 2 and caches.seen()[-1][1].reason == f"{caches.HUGE_PAGES_ENV}=0"
    monkeypatch.setenv(caches.HUGE_PAGES_ENV, "yes")
    with pytest.raises(ValueError, match="GLM5_HAL_VLLM_HUGE_PAGES: expected '0' or '1', got 'yes'"):
        caches.on_huge_pages(torch.zeros(3 * HUGE_PAGE, dtype=torch.uint8), "index")
