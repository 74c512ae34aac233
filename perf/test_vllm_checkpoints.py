"""The vLLM benches' checkpoints (perf/vllm_bench.py write_checkpoints), perf/vllm_modes.py's head options and its
turn-taking; runs without vLLM (the engines themselves run only in the benches)."""

from __future__ import annotations

import json
import threading
import time

import pytest
import safetensors.torch

from perf import vllm_modes
from perf.vllm_bench import BENCH_CONFIG, write_checkpoints


def test_write_checkpoints_writes_the_given_config_and_its_dense_relabelling(tmp_path):
    config = BENCH_CONFIG.with_overrides(name="tiny-8h-2ih", num_attention_heads=8, index_n_heads=2, vocab_size=64)
    paths = write_checkpoints(tmp_path, config)
    dsa = json.loads((paths["dsa"] / "config.json").read_text())
    dense = json.loads((paths["dense"] / "config.json").read_text())
    assert (dsa["num_attention_heads"], dsa["num_key_value_heads"], dsa["index_n_heads"]) == (8, 8, 2)
    assert dsa["index_topk"] == BENCH_CONFIG.index_topk and dsa["model_type"] == "glm_moe_dsa"
    assert dense["model_type"] == "deepseek_v3" and dense["num_attention_heads"] == 8
    assert not any(key.startswith("index") for key in dense)
    dsa_state = safetensors.torch.load_file(str(paths["dsa"] / "model.safetensors"))
    dense_state = safetensors.torch.load_file(str(paths["dense"] / "model.safetensors"))
    indexer = {k for k in dsa_state if ".indexer." in k}
    assert indexer and set(dense_state) == set(dsa_state) - indexer
    q_b = next(v for k, v in dsa_state.items() if k.endswith("self_attn.q_b_proj.weight"))
    assert q_b.shape[0] == 8 * (config.qk_nope_head_dim + config.qk_rope_head_dim)  # the heads are in the weights


@pytest.mark.parametrize("option", ["--heads", "--index-heads"])
def test_vllm_modes_refuses_a_head_count_below_one(option, capsys):
    with pytest.raises(SystemExit):
        vllm_modes.main(["--modes", "compiled,dense", option, "0"])
    assert "--heads / --index-heads: expected positive counts" in capsys.readouterr().err


def test_alternating_engines_decode_strictly_in_turns(tmp_path):
    """take_turns: the first mode of the order goes first, then each window of one engine is followed by one of the
    other, never two at once, whichever process reaches its loop first."""
    order, windows = ["compiled", "dense"], 5
    log, running = [], []

    def engine(mode: str, delay_s: float) -> None:
        def window() -> float:
            running.append(mode)
            assert len(running) == 1, running  # the other engine is waiting
            log.append(mode)
            time.sleep(0.01)
            running.remove(mode)
            return float(len(log))

        time.sleep(delay_s)  # the second mode reaches its loop first
        results[mode] = vllm_modes.take_turns(mode, order, tmp_path, window, windows, poll_s=0.001)

    results: dict[str, list[float]] = {}
    threads = [threading.Thread(target=engine, args=(m, d)) for m, d in (("compiled", 0.05), ("dense", 0.0))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert log == order * windows
    assert results == {"compiled": [1.0, 3.0, 5.0, 7.0, 9.0], "dense": [2.0, 4.0, 6.0, 8.0, 10.0]}


def test_vllm_modes_trees_name_two_source_trees(tmp_path, capsys):
    """--trees: two glm5-hal source trees; the engines are then <mode>-A / <mode>-B and may run the same mode."""
    repo = vllm_modes.Path(vllm_modes.__file__).resolve().parents[1]
    assert vllm_modes.parse_trees(f"{repo}, {repo}") == [repo, repo]
    assert vllm_modes.engine_labels(["compiled", "compiled"], [repo, repo]) == ["compiled-A", "compiled-B"]
    assert vllm_modes.engine_labels(["compiled", "dense"], None) == ["compiled", "dense"]
    with pytest.raises(vllm_modes.argparse.ArgumentTypeError, match="expected two source trees"):
        vllm_modes.parse_trees(str(repo))
    with pytest.raises(vllm_modes.argparse.ArgumentTypeError, match="expected a glm5-hal source tree, without"):
        vllm_modes.parse_trees(f"{repo},{tmp_path}")
    # the same mode twice is refused without --trees (one engine would be timed against itself)
    with pytest.raises(SystemExit):
        vllm_modes.main(["--modes", "compiled,compiled"])
    assert "different unless --trees" in capsys.readouterr().err
