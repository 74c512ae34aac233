"""The probe's decisions kept on disk (backends/torch_eager/probe_store.py): a second process reads them instead of
measuring; another key, a damaged file or GLM5_HAL_REPROBE=1 measures again; a record round-trips every field; no
cache folder means nothing kept, never an error. And the set-up that reads or measures them runs before the first
op (selection.prepare), so `generate` reports it apart from prefill."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_capabilities import NATIVE_OK, SAPPHIRE_RAPIDS, FakeProbe

from backends.torch_eager import capabilities as caps
from backends.torch_eager import probe_store
from backends.torch_eager.native import build
from glm5_hal.cli import main
from glm5_hal.cli.info import report_data
from glm5_hal.environment import ENV_REPROBE
from glm5_hal.selection import prepare


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty build cache (so an empty probe store), and no decisions in this process's memory."""
    monkeypatch.setenv(build.ENV_CACHE_DIR, str(tmp_path))
    monkeypatch.delenv(ENV_REPROBE, raising=False)
    caps.clear_cache()
    yield tmp_path
    caps.clear_cache()


def _fresh(mode: str = "1") -> caps.Capabilities:
    caps.clear_cache()  # as a new process: nothing in memory
    return caps.capabilities("cpu", mode)


def _choices(found: caps.Capabilities) -> tuple:
    return found.half, found.int8, found.facts


def test_a_second_process_reads_what_the_first_measured(store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = _fresh()
    assert first.origin.startswith("measured in ") and str(store) in first.origin
    (kept,) = store.glob("routes-*.json")

    def no_measuring(*args: object) -> caps.Capabilities:
        raise AssertionError("measured again although the store holds this key")

    monkeypatch.setattr(caps, "decide", no_measuring)
    second = _fresh()
    assert second.origin.startswith(f"read from {kept}") and _choices(second) == _choices(first)
    assert second.measured == first.measured


def test_reprobe_measures_again_and_replaces(store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fresh()
    monkeypatch.setenv(ENV_REPROBE, "1")
    assert _fresh().origin.startswith("measured in ")
    monkeypatch.delenv(ENV_REPROBE)
    assert _fresh().origin.startswith("read from ")


@pytest.mark.parametrize("damage", ["not json {", '{"key": 1}', "[]", "truncated"])
def test_a_damaged_or_foreign_file_is_measured_again(store: Path, damage: str) -> None:
    first = _fresh()
    (kept,) = store.glob("routes-*.json")
    if damage == "truncated":
        kept.write_text(kept.read_text()[: len(kept.read_text()) // 2])
    else:
        kept.write_text(damage)
    again = _fresh()
    assert again.origin.startswith("measured in ") and _choices(again) == _choices(first)
    assert json.loads(kept.read_text())["key"] == probe_store.key(torch.device("cpu"), caps.FORCE)  # replaced


def test_a_record_of_unreadable_shape_is_measured_again(store: Path) -> None:
    _fresh()
    (kept,) = store.glob("routes-*.json")
    record = json.loads(kept.read_text())
    del record["value"]["half"]["bfloat16"]["attention"]  # as a file from an older layout would be
    kept.write_text(json.dumps(record))
    assert _fresh().origin.startswith("measured in ")


def test_the_key_holds_what_the_decisions_depend_on(store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    base = probe_store.key(cpu, caps.AUTO)
    assert {"cpu", "flags", "torch", "threads", "glm5_hal", "probe_source", "mode", "native"} <= set(base)
    assert probe_store.key(cpu, caps.FORCE) != base
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        assert probe_store.key(cpu, caps.AUTO)["threads"] == threads + 1
    finally:
        torch.set_num_threads(threads)
    monkeypatch.setenv(build.ENV_NATIVE, "0")
    assert probe_store.key(cpu, caps.AUTO)["native"] == build.OFF
    assert probe_store.path_for(probe_store.key(cpu, caps.AUTO)) != probe_store.path_for(base)


def test_every_field_round_trips() -> None:
    """A rich answer (routes split by rows, the native kernel, int8 rows, measured times, inf max_work) is read back
    equal."""
    times = {
        (caps.WEIGHTS, caps.DECODE_ROWS): {"fp32": 2.0, "half": 3.0, "native": 1.0},
        (caps.WEIGHTS, caps.PREFILL_ROWS): {"fp32": 20.0, "half": 9.0, "native": 10.0},
    }
    probe = FakeProbe(
        times=times, native=NATIVE_OK, speed={"native": 2.0}, exact={"torch._int_mm": True}, int8={"torch._int_mm": 3.0}
    )
    found = caps.decide(caps.cpu_facts(SAPPHIRE_RAPIDS), probe, caps.AUTO)
    assert found.half_choice(torch.bfloat16).split_rows > 1  # the record holds a split
    back = caps.from_stored(json.loads(json.dumps(caps.to_stored(found))), "read")
    assert back == caps.replace(found, origin="read")
    forced = caps.decide(caps.cpu_facts(SAPPHIRE_RAPIDS), FakeProbe(), caps.FORCE)
    assert caps.from_stored(json.loads(json.dumps(caps.to_stored(forced))), "") == forced


def test_no_usable_cache_folder_keeps_nothing(store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(build, "cache_location", lambda: build.CacheLocation(None, "no folder"))
    found = _fresh()
    assert "not kept" in found.origin and not list(store.glob("routes-*.json"))
    assert _fresh().origin.startswith("measured in ")  # measured again, never an error


def test_an_unwritable_folder_keeps_nothing_and_raises_nothing(store: Path) -> None:
    if sys.platform != "linux" or os.geteuid() == 0:
        pytest.skip("root writes into a read-only folder; the check needs a plain user")
    store.chmod(0o500)
    try:
        assert "not kept" in _fresh().origin
    finally:
        store.chmod(0o700)


def test_prepare_runs_the_torch_backends_set_up_before_any_op(store: Path) -> None:
    assert "torch" in prepare(torch.device("cpu"))
    (kept,) = store.glob("routes-*.json")  # the auto mode's decisions, measured and kept
    assert json.loads(kept.read_text())["key"]["mode"] == caps.fast_paths_mode()


def test_a_new_process_reads_the_store(store: Path) -> None:
    """The real thing, across processes: the second `capabilities` call of a new interpreter reads the file."""
    code = "from backends.torch_eager import capabilities as c; print(c.capabilities('cpu', '1').origin)"
    env = {**os.environ, build.ENV_CACHE_DIR: str(store)}
    first, second = (
        subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
        for _ in range(2)
    )
    assert first.startswith("measured in ") and second.startswith("read from "), (first, second)


def test_info_reprobe_measures_again_and_leaves_the_setting_as_it_was(store: Path, capsys) -> None:
    _fresh("auto")  # a stored record for the auto mode
    caps.clear_cache()
    assert main(["info", "--reprobe", "--json"]) == 0
    cpu = report_data(json.loads(capsys.readouterr().out), "torch")["fast_paths"]["cpu"]
    assert cpu["origin"].startswith("measured in "), cpu["origin"]
    assert ENV_REPROBE not in os.environ  # the command's own setting, not the process's from then on
