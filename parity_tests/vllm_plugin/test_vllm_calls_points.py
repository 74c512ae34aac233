"""perf/vllm_calls.py times the plugin's call chain by wrapping named functions: each must still exist, so that the
tool fails here rather than in a bench run after a rename."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: the plugin's tests run in the vLLM environment")

from perf import vllm_calls  # noqa: E402  (after the skip: it names the plugin's modules, which import vLLM)


@pytest.mark.parametrize(("label", "module", "attribute"), [p for p in vllm_calls.POINTS if p[1]])
def test_every_timed_point_is_a_function(label: str, module: str, attribute: str) -> None:
    owner, name, function = vllm_calls.resolve(module, attribute)
    assert callable(function) and getattr(owner, name) is function, label


def test_a_missing_point_is_named() -> None:
    with pytest.raises(AttributeError, match=r"glm5_hal.vllm.indexer.no_such_function is not a function"):
        vllm_calls.resolve("glm5_hal.vllm.indexer", "no_such_function")
