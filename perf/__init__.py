"""Per-op latency against each op's roofline: the cost model (costs.py), scenarios, timing, device peaks, the
`glm5-hal bench` command (cli.py, registered through the `glm5_hal.commands` entry point) and the
pytest-benchmark suite (test_bench_ops.py)."""
