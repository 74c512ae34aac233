"""Per-op latency against each op's roofline.

[scenarios: inputs from the parity builders] -> [timing: warm-up, rotated inputs, cache flush, device events]
-> [costs: FLOPs and minimum bytes per op] + [peaks: vendor table or measured GEMM / copy] -> table, JSON, plot.

Modules: costs (the FLOP / byte model), baselines (dense MLA attention, fp32 matmul) and dense (the dense attention
itself), scenarios, timing, peaks, load (contention check), plot, and cli (`glm5-hal bench`, registered through the
`glm5_hal.commands` entry point, so glm5_hal never imports perf). test_bench_ops.py is the pytest-benchmark suite.
"""
