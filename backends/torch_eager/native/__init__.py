"""Native CPU kernels for what torch's CPU kernels lack, built on first use with the machine's C compiler
(build.py) and used only where backends.torch_eager.capabilities chose glm5_hal's native path (the CPU has the
instructions, the GEMM is exact and faster there; GLM5_HAL_NATIVE=0 turns them off).

One module per kernel, each a C source beside it and a Python wrapper that checks its arguments. Where the torch
backend calls a kernel behind a public op that has already validated the same arguments (a decode step's indexer
prolog, indexer scores and sparse attention), it passes `validated=True`, which skips the repeated checks of kinds
and shapes but keeps every check of values the kernel's memory safety rests on (slots it writes at); the paged
kernels bound every block id and key position themselves:
- bf16_gemm: bf16 x bf16 -> fp32 GEMM (what backends/torch_eager/gemm.py takes for products that must stay fp32);
- indexer_scores: the lightning indexer's scores from the paged key cache, keys read in place;
- indexer_prolog: the indexer prolog of a decode step (projections, LayerNorm, RoPE, head weights, the key row
  written bf16 or encoded) in two calls;
- sparse_attention: sparse attention's scores and value product, the selected rows read in place;
- topk: glm5_hal.topk's deterministic top-k of fp32 score rows (plain C, any CPU), in place of torch's select, sort
  and composite keys.
Shared: build (compile, cache, load), threads (splitting a call over torch's thread count), packing (operand
layouts), bf16.h (C helpers).
"""
