"""What glm5-hal's own Python costs around the kernels of one DSA layer at a decode step, on the CPU.

    python -m perf.decode_calls --context 256      # the kernels' work is small: the calls' Python is most of it
    python -m perf.decode_calls --context 32768    # the vLLM bench's context

One layer's calls as the vLLM plugin makes them for one decode token (glm5-mini's dims: 4 indexer heads, 4
attention heads, index_topk 2048; bf16 activations, an fp8_index index cache and a bf16 latent cache of 64-row
blocks, a block table wider than the context as vLLM's is): `indexer_prolog`, `lightning_indexer` (its top-k copied
into a top-k buffer), the latent cache write (`kv_formats.write_rows` of [kv_c | k_pe]) and `sparse_flash_attention`;
then the same work through the torch backend's native kernels called directly (no validation, dispatch or packing):
what the calls' Python adds is the difference. Each is timed `--reps` times after a warm-up, one torch thread: the
20th percentile (the machine's quiet state: on a shared machine the median moves with the neighbours) and the
median, in microseconds. Pin it to one core (`taskset -c 0`) and name the CPU with the numbers.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

import glm5_hal
from backends.torch_eager.capabilities import ATTENTION, QUANTIZED_INDEXER
from backends.torch_eager.gemm import gemm_for
from backends.torch_eager.native import indexer_prolog as native_prolog
from backends.torch_eager.native import quantized_index_scores as native_scores
from backends.torch_eager.native import sparse_attention as native_attention
from backends.torch_eager.native import topk as native_topk
from glm5_hal.config import GLM5_MINI
from glm5_hal.kv_formats import FORMATS, encode_rows, write_rows
from glm5_hal.model.rope import rope_cos_sin
from glm5_hal.paged import blocks_in_use
from perf.vllm_bench import cpu_name

BLOCK_SIZE = 64
TOPK = 2048
INDEX_FORMAT = "fp8_index"


class NoNativeRoute(RuntimeError):
    """The backend does not run these calls on its native kernels here: there is no "kernels alone" to compare."""


def _layer(context: int) -> tuple[dict[str, Callable[[], object]], dict[str, Callable[[], object]]]:
    """(the public calls, the kernels alone) of one layer at one decode token over `context` keys."""
    cfg = GLM5_MINI
    gen = torch.Generator().manual_seed(0)
    dtype, heads, index_heads, dims = torch.bfloat16, cfg.num_attention_heads, cfg.index_n_heads, cfg.index_head_dim

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    blocks = -(-context // BLOCK_SIZE) + 8
    index_cache = torch.zeros(blocks, BLOCK_SIZE, FORMATS[INDEX_FORMAT].row_bytes, dtype=torch.uint8)
    filled = context // BLOCK_SIZE * BLOCK_SIZE
    index_cache.view(-1, index_cache.shape[2])[:filled] = encode_rows(
        torch.randn(filled, dims, generator=gen), FORMATS[INDEX_FORMAT]
    )
    latent_cache = randn(blocks, BLOCK_SIZE, 576)
    table = torch.arange(blocks, dtype=torch.int32)[None].repeat(1, 4)  # as wide as vLLM's, past the context
    seq_lens = torch.tensor([context], dtype=torch.int32)
    cu_seqlens = torch.tensor([0, 1], dtype=torch.int32)
    slots = torch.tensor([context - 1], dtype=torch.int64)
    x, q_norm = randn(1, cfg.hidden_size), randn(1, cfg.q_lora_rank)
    w_iq, w_ik = randn(index_heads * dims, cfg.q_lora_rank, scale=0.05), randn(dims, cfg.hidden_size, scale=0.05)
    norm_w, norm_b, w_iw = torch.ones(dims, dtype=dtype), torch.zeros(dims, dtype=dtype), randn(index_heads, 256)
    cos, sin = rope_cos_sin(cfg, slots, torch.float32)
    q_latent, kv_c, k_pe = randn(1, heads, 576), randn(1, 512), randn(1, 1, 64)
    topk_buffer = torch.full((8, TOPK), -1, dtype=torch.int32)
    used = blocks_in_use(table, context, BLOCK_SIZE)  # what the plugin's indexer reads
    weights = (w_iq, w_ik, norm_w, norm_b, w_iw)

    def prolog() -> object:
        return glm5_hal.indexer_prolog(
            x, q_norm, *weights, cos, sin, index_cache, slots, rope_interleaved=True, kv_cache_dtype=INDEX_FORMAT
        )

    q_idx, head_weights = prolog()

    def indexer() -> object:
        topk = glm5_hal.lightning_indexer(
            q_idx, head_weights, index_cache, used, seq_lens, cu_seqlens, TOPK, kv_cache_dtype=INDEX_FORMAT
        )
        return topk_buffer[:1].copy_(topk)

    def cache_write() -> object:
        write_rows(latent_cache, slots, torch.cat([kv_c, k_pe.reshape(1, -1)], dim=-1))

    def attention() -> object:
        return glm5_hal.sparse_flash_attention(
            q_latent, latent_cache, topk_buffer[:1], table, seq_lens, cu_seqlens, cfg.sm_scale, d_v=512
        )

    indexer()
    calls = {"indexer_prolog": prolog, "lightning_indexer": indexer, "cache write": cache_write}
    calls["sparse_flash_attention"] = attention
    # The kernels alone, each the build the torch backend's route takes here (its probe's choice), so that both
    # sides compute the same bits (perf/test_decode_calls.py).
    cpu = torch.device("cpu")
    routes = {
        "indexer_prolog": gemm_for(dtype, cpu).for_rows(x, 1),
        "lightning_indexer": gemm_for(dtype, cpu, QUANTIZED_INDEXER),
        "sparse_flash_attention": gemm_for(dtype, cpu, ATTENTION).at(heads),
    }
    off = [name for name, route in routes.items() if not route.vector_kernels]
    if off:
        raise NoNativeRoute(f"the torch backend's routes of {off} are not its native kernels here (its probe's choice)")
    prolog_isa, scores_isa, attention_isa = (route.native_isa for route in routes.values())
    q_out, w_out = torch.empty(1, index_heads, dims, dtype=dtype), torch.empty(1, index_heads)
    logits = torch.empty(1, used.shape[1] * BLOCK_SIZE)
    k = min(TOPK, logits.shape[1])
    scale = index_heads**-0.5 * dims**-0.5
    flat_latent = latent_cache.view(-1, 576)
    kernels = {
        "indexer_prolog": lambda: native_prolog._run(
            x, q_norm, *weights, cos, sin, index_cache, slots, q_out, w_out, 1e-6, scale, True, INDEX_FORMAT,
            prolog_isa, None,
        ),
        "lightning_indexer": lambda: (
            native_scores._run_paged(
                q_idx, head_weights, index_cache, used, seq_lens, cu_seqlens, logits, INDEX_FORMAT, 0, scores_isa,
                None,
            ),
            native_topk._run(logits, k, None, positions=True),
        ),
        "cache write": lambda: flat_latent.index_copy_(0, slots, torch.cat([kv_c, k_pe.reshape(1, -1)], dim=-1)),
        "sparse_flash_attention": lambda: native_attention._paged_attention(
            q_latent, latent_cache, topk_buffer[:1], table, seq_lens, cu_seqlens, cfg.sm_scale, 512, dtype,
            attention_isa, None,
        ),
    }  # fmt: skip
    return calls, kernels


def _time(fn: Callable[[], object], reps: int) -> tuple[float, float]:
    """(20th percentile, median) of `reps` calls, microseconds."""
    for _ in range(max(10, reps // 10)):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 5] * 1e6, statistics.median(times) * 1e6


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=256, help="keys in the sequence (the decode token's own last)")
    parser.add_argument("--reps", type=int, default=400, help="timed calls of each")
    args = parser.parse_args(argv)
    if args.context < BLOCK_SIZE:
        parser.error(f"--context: expected at least {BLOCK_SIZE} (one block), got {args.context}")
    torch.set_num_threads(1)
    try:
        calls, kernels = _layer(args.context)
    except NoNativeRoute as why:
        raise SystemExit(f"perf.decode_calls: {why}") from None
    print(f"{cpu_name()}; one decode token, context {args.context}, glm5-mini dims, 1 thread; microseconds")
    print("| call | public op p20 | median | kernels alone p20 | median |")
    print("|---|---|---|---|---|")
    layer = {"calls": lambda: [fn() for fn in calls.values()], "kernels": lambda: [fn() for fn in kernels.values()]}
    for name in [*calls, "the layer"]:
        if name == "the layer":
            public, alone = _time(layer["calls"], args.reps), _time(layer["kernels"], args.reps)
        else:
            public, alone = _time(calls[name], args.reps), _time(kernels[name], args.reps)
        print(f"| {name} | {public[0]:.1f} | {public[1]:.1f} | {alone[0]:.1f} | {alone[1]:.1f} |")


if __name__ == "__main__":
    main()
