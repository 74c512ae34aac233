"""The `glm5-hal` command line: info and parity."""

from __future__ import annotations

import json
import subprocess
import sys

from glm5_hal.cli import main


def test_info_lists_every_backend_with_reason(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    for name in (
        "reference",
        "torch",
        "triton",
        "ascend",
        "cambricon",
        "kunlun",
        "mthreads",
        "hygon",
        "metax",
        "enflame",
    ):
        assert f"  {name}" in out
    assert "who runs each op on cpu tensors now" in out


def test_info_json_has_per_op_implementation(capsys):
    assert main(["info", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    torch_backend = next(b for b in data["backends"] if b["name"] == "torch")
    assert torch_backend["available"] and set(torch_backend["ops"].values()) == {"native"}
    assert data["cpu_selection"]["sparse_flash_attention"]["backend"] == "torch"


def test_parity_command_passes_and_writes_reports(tmp_path, capsys):
    json_path, md_path = tmp_path / "parity.json", tmp_path / "parity.md"
    code = main(
        [
            "parity",
            "--backends",
            "torch",
            "--ops",
            "moe_gate,hadamard_transform",
            "--quick",
            "--json",
            str(json_path),
            "--markdown",
            str(md_path),
            "--no-progress",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "moe_gate" in out and "pass" in out
    report = json.loads(json_path.read_text())
    assert {row["op"] for row in report["summary"]} == {"moe_gate", "hadamard_transform"}
    assert all(r["status"] == "pass" for r in report["results"])
    assert "| op | backend | status |" in md_path.read_text()


def test_parity_command_fails_on_a_wrong_backend(tmp_path):
    # A plugin whose sparse attention is wrong must make `glm5-hal parity` exit non-zero.
    script = """
import sys, torch
from glm5_hal.registry import ANY_DEVICE, Availability, Backend, registry
from glm5_hal.cli import main
def wrong(q, kv_cache, indices, block_table, seq_lens_k, cu_seqlens_q, sm_scale, d_v=512):
    t, h, _ = q.shape
    return q.new_ones(t, h, d_v), q.new_zeros(t, h, dtype=torch.float32)
registry().register(Backend("wrong", "broken on purpose", probe=lambda: Availability(True, "", (ANY_DEVICE,)),
                            load_ops=lambda: {"sparse_flash_attention": wrong}))
sys.exit(main(["parity", "--backends", "wrong", "--ops", "sparse_flash_attention", "--quick", "--no-progress"]))
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAILED wrong sparse_flash_attention" in proc.stdout


def test_unknown_backend_is_a_usage_error(capsys):
    assert main(["parity", "--backends", "nosuch"]) == 2
    assert "unknown" in capsys.readouterr().err
