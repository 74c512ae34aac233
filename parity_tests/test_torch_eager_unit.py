"""Unit tests of the `torch` backend for what the parity suite does not cover.

- Memory shape: sparse attention and the indexer never allocate a [T, H, S] tensor (an aten-level allocation spy).
- Real GLM-5 dims: sparse attention (T=64, H=64, topk=2048) and the indexer (HI=32, DI=128, topk=2048) over a
  16K-token paged cache finish in seconds and match the reference on a subsample of tokens. They take well under a
  second each on 2 CPU cores, so they are not marked slow.
- Integer exactness of the W8A8 / W4A8 accumulators at large K, bit for bit against int64 math.
- Hadamard: orthonormality at 6144 and 7168, butterflies against the Sylvester matrix, the transform against the
  reference at every base size.
- Batches with sequences that bring no new token, reference tie-breaking in the router, strided cache writes.
"""

from __future__ import annotations

import time
import zlib
from unittest import mock

import numpy as np
import pytest
import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import ops_reference as ref
from backends.torch_eager import OPS
from backends.torch_eager.hadamard import base_matrix, walsh_hadamard
from backends.torch_eager.paged import write_cache
from backends.torch_eager.quant import (
    INT4_MAX_PRODUCT,
    INT8_MAX_PRODUCT,
    chunked_fp32_int_matmul,
    int8_matmul,
    unpack_int4,
)
from glm5_hal.config import GLM5, GLM5_MINI
from glm5_hal.parity.compare import compare_float, compare_topk, to_numpy
from glm5_hal.parity.inputs import PagedBatch, SeqSpec, paged_batch, randn, random_topk_indices
from glm5_hal.parity.runner import session_seed

# ------------------------------------------------------------------------------------------------- helpers


@pytest.fixture
def gen(request: pytest.FixtureRequest) -> torch.Generator:
    """Fresh inputs every run, reproducible with GLM5_HAL_PARITY_SEED (printed with a failing test's output)."""
    seed = (session_seed() * 1_000_003 + zlib.crc32(request.node.name.encode())) % 2**63
    print(f"{request.node.name}: GLM5_HAL_PARITY_SEED={session_seed()} (generator seed {seed})")
    return torch.Generator().manual_seed(seed)


class _AllocationSpy(TorchDispatchMode):
    """Records the element count of every tensor an aten op returns that owns fresh storage (views excluded).

    Spy on a second call of the op: the first call in a process may run one-time set-up (the route probe measures
    products at its own shapes when its decisions are not on disk yet), which is not the op's working set.
    """

    def __init__(self) -> None:
        super().__init__()
        self.fresh: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        input_storages = {a.untyped_storage().data_ptr() for a in inputs}
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in input_storages:
                self.fresh.append((str(func), tuple(t.shape)))
        return out

    def largest(self) -> tuple[int, str, tuple[int, ...]]:
        return max((int(np.prod(shape)), name, shape) for name, shape in self.fresh)


def _one_token_batch(batch: PagedBatch, tokens: np.ndarray, keys_seen: np.ndarray) -> dict[str, np.ndarray]:
    """The sampled `tokens` as a batch of one-token sequences that see `keys_seen[i]` keys each (same blocks)."""
    seqs = ref.token_sequences(to_numpy(batch.cu_seqlens_q))[tokens]
    return {
        "block_table": to_numpy(batch.block_table)[seqs],
        "seq_lens_k": keys_seen.astype(np.int32),
        "cu_seqlens_q": np.arange(len(tokens) + 1, dtype=np.int32),
    }


# ------------------------------------------------------------------------------------------- memory shape


def test_sparse_attention_never_allocates_tokens_x_heads_x_context(gen: torch.Generator) -> None:
    num_heads, context, topk = 16, 32768, 64
    batch = paged_batch([SeqSpec(24, context), SeqSpec(8, context // 2)], 64, gen)
    num_tokens = batch.num_tokens
    q = randn((num_tokens, num_heads, 576), gen)
    cache = randn((batch.num_blocks, 64, 576), gen)
    indices = random_topk_indices(batch, topk, gen)
    args = (q, cache, indices, batch.block_table, batch.seq_lens_k, batch.cu_seqlens_q, 0.0625, 512)
    OPS["sparse_flash_attention"](*args)  # one-time set-up first (_AllocationSpy's docstring)
    with _AllocationSpy() as spy:
        OPS["sparse_flash_attention"](*args)
    numel, name, shape = spy.largest()
    # A dense formulation would need num_tokens * num_heads * context elements for its scores alone.
    assert numel < num_tokens * num_heads * context // 8, f"{name} allocated {shape}"


@pytest.mark.parametrize("op", ["lightning_indexer", "indexer_logits"])
def test_indexer_never_allocates_tokens_x_heads_x_keys(op: str, gen: torch.Generator) -> None:
    num_heads, head_dim, context = 32, 128, 32768
    batch = paged_batch([SeqSpec(24, context), SeqSpec(8, context // 2)], 64, gen)
    num_tokens = batch.num_tokens
    q_idx = randn((num_tokens, num_heads, head_dim), gen)
    weights = randn((num_tokens, num_heads), gen, std=0.1)
    cache = randn((batch.num_blocks, 64, head_dim), gen)
    extra = (2048,) if op == "lightning_indexer" else ()
    args = (q_idx, weights, cache, batch.block_table, batch.seq_lens_k, batch.cu_seqlens_q, *extra)
    OPS[op](*args)  # one-time set-up first (_AllocationSpy's docstring)
    with _AllocationSpy() as spy:
        OPS[op](*args)
    numel, name, shape = spy.largest()
    assert numel < num_tokens * num_heads * context // 4, f"{name} allocated {shape}"


# ------------------------------------------------------------------------------------------- real GLM-5 dims


def test_sparse_attention_glm5_dims_16k(gen: torch.Generator) -> None:
    """T=64, H=64, topk=2048 over a 16K-token paged cache (bf16); the reference checks 6 sampled tokens."""
    cfg = GLM5
    batch = paged_batch([SeqSpec(40, 16384), SeqSpec(24, 9000)], 64, gen)
    q = randn((batch.num_tokens, cfg.num_attention_heads, cfg.latent_dim), gen, dtype=torch.bfloat16)
    cache = randn((batch.num_blocks, 64, cfg.latent_dim), gen, dtype=torch.bfloat16)
    indices = random_topk_indices(batch, cfg.index_topk, gen, invalid_fraction=0.05)
    assert batch.num_tokens == 64 and indices.shape == (64, 2048)

    started = time.perf_counter()
    out, lse = OPS["sparse_flash_attention"](
        q, cache, indices, batch.block_table, batch.seq_lens_k, batch.cu_seqlens_q, cfg.sm_scale, cfg.kv_lora_rank
    )
    elapsed = time.perf_counter() - started
    print(f"sparse_flash_attention T=64 H=64 topk=2048 16K cache bf16: {elapsed:.2f} s")
    assert elapsed < 30.0, f"took {elapsed:.1f} s"

    tokens = np.sort(np.random.default_rng(int(gen.initial_seed())).choice(batch.num_tokens, 6, replace=False))
    seqs = ref.token_sequences(to_numpy(batch.cu_seqlens_q))[tokens]
    sub = _one_token_batch(batch, tokens, to_numpy(batch.seq_lens_k)[seqs])
    want_out, want_lse = ref.sparse_flash_attention(
        to_numpy(q)[tokens], to_numpy(cache), to_numpy(indices)[tokens], **sub, sm_scale=cfg.sm_scale, d_v=512
    )
    for verdict in (
        compare_float("out", out[tokens], want_out, torch.bfloat16),
        compare_float("lse", lse[tokens], want_lse, torch.bfloat16),
    ):
        assert verdict.passed, verdict.detail


def test_lightning_indexer_glm5_dims_16k(gen: torch.Generator) -> None:
    """HI=32, DI=128, topk=2048, 64 tokens over 16K keys (bf16); the reference checks 4 sampled tokens."""
    cfg = GLM5
    batch = paged_batch([SeqSpec(40, 16384), SeqSpec(24, 9000)], 64, gen)
    q_idx = randn((batch.num_tokens, cfg.index_n_heads, cfg.index_head_dim), gen, dtype=torch.bfloat16)
    weights = randn((batch.num_tokens, cfg.index_n_heads), gen, std=cfg.indexer_weight_scale)
    cache = randn((batch.num_blocks, 64, cfg.index_head_dim), gen, dtype=torch.bfloat16)

    started = time.perf_counter()
    indices, scores = OPS["lightning_indexer"](
        q_idx, weights, cache, batch.block_table, batch.seq_lens_k, batch.cu_seqlens_q, cfg.index_topk
    )
    elapsed = time.perf_counter() - started
    print(f"lightning_indexer T=64 HI=32 DI=128 topk=2048 16K keys bf16: {elapsed:.2f} s")
    assert elapsed < 30.0, f"took {elapsed:.1f} s"

    tokens = np.sort(np.random.default_rng(int(gen.initial_seed())).choice(batch.num_tokens, 4, replace=False))
    sub = _one_token_batch(batch, tokens, to_numpy(batch.positions)[tokens] + 1)
    logits = ref.indexer_logits(to_numpy(q_idx)[tokens], to_numpy(weights)[tokens], to_numpy(cache), **sub)
    verdict = compare_topk("indices", indices[tokens], logits, cfg.index_topk, torch.bfloat16)
    assert verdict.passed, verdict.detail
    picked = to_numpy(indices[tokens]).astype(np.int64)
    want_scores = np.where(picked >= 0, np.take_along_axis(logits, np.clip(picked, 0, None), axis=1), -np.inf)
    verdict = compare_float("scores", scores[tokens], want_scores, torch.bfloat16)
    assert verdict.passed, verdict.detail


# -------------------------------------------------------------------------------------------- int exactness


def _extreme_int8(rows: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """int8 rows that push an accumulator to its limits: all +127, all -127, all -128, random +-127, mixed."""
    signs = torch.where(torch.rand(rows, k, generator=gen) < 0.5, -1, 1)
    out = (127 * signs).to(torch.int8)
    out[0], out[1], out[2] = 127, -127, -128
    out[3, ::2] = -128
    return out


def test_int8_accumulator_exact_at_k7168(gen: torch.Generator) -> None:
    k = 7168
    x_q, w_q = _extreme_int8(9, k, gen), _extreme_int8(24, k, gen)
    want = x_q.to(torch.int64) @ w_q.to(torch.int64).T
    # The data must defeat a plain fp32 accumulator: sums past 2^24 are not all representable in fp32.
    assert int(want.abs().max()) > 2**24
    for got in (int8_matmul(x_q, w_q), chunked_fp32_int_matmul(x_q, w_q, INT8_MAX_PRODUCT)):
        assert got.dtype == torch.int32
        assert torch.equal(got.to(torch.int64), want)


def test_quant_matmul_scales_the_exact_accumulator(gen: torch.Generator) -> None:
    k = 7168
    x_q, w_q = _extreme_int8(5, k, gen), _extreme_int8(16, k, gen)
    x_scale, w_scale = torch.rand(5, generator=gen) + 0.5, torch.rand(16, generator=gen) + 0.5
    got = OPS["quant_matmul"](x_q, x_scale, w_q, w_scale, None, torch.float32)
    want = ref.quant_matmul(*(to_numpy(t) for t in (x_q, x_scale, w_q, w_scale)))
    verdict = compare_float("y", got, want, torch.float32)
    assert verdict.passed, verdict.detail


def test_unpack_int4_matches_reference(gen: torch.Generator) -> None:
    packed = torch.randint(0, 256, (7, 64), generator=gen, dtype=torch.uint8)
    assert torch.equal(unpack_int4(packed), torch.from_numpy(ref.unpack_int4(packed.numpy())))


@pytest.mark.parametrize("group_size", [None, 128])
def test_w4a8_accumulators_exact_at_large_k(group_size: int | None, gen: torch.Generator) -> None:
    """K = 40960 (past the 16384 columns one fp32 GEMM holds exactly for int8 x int4) with extreme codes."""
    k = 40960
    x_q = _extreme_int8(4, k, gen)
    w_codes = torch.where(torch.rand(8, k, generator=gen) < 0.5, -8, 7).to(torch.int64)
    w_codes[0], w_codes[1] = -8, 7
    w_packed = torch.from_numpy(ref.pack_int4(w_codes.numpy()))
    exact = chunked_fp32_int_matmul(x_q, unpack_int4(w_packed), INT4_MAX_PRODUCT)
    want_int = x_q.to(torch.int64) @ w_codes.T
    assert int(want_int.abs().max()) > 2**24
    assert torch.equal(exact.to(torch.int64), want_int)

    groups = 1 if group_size is None else k // group_size
    w_scale = torch.rand(8 * groups, generator=gen) * 0.02 + 1e-3
    w_scale = w_scale if group_size is None else w_scale.reshape(8, groups)
    x_scale = torch.rand(4, generator=gen) + 0.5
    got = OPS["w4a8_matmul"](x_q, x_scale, w_packed, w_scale, group_size, torch.float32)
    want = ref.w4a8_matmul(*(to_numpy(t) for t in (x_q, x_scale, w_packed, w_scale)), group_size)
    verdict = compare_float("y", got, want, torch.float32)
    assert verdict.passed, verdict.detail


# ------------------------------------------------------------------------------------------------- Hadamard


@pytest.mark.parametrize("n", [6144, 7168])
def test_hadamard_orthonormal_at_model_widths(n: int, gen: torch.Generator) -> None:
    # Every building block is orthogonal, in exact integer arithmetic ...
    base = {6144: 12, 7168: 28}[n]
    h_k = base_matrix(base, torch.device("cpu"), torch.float64)
    assert torch.equal(h_k @ h_k.T, base * torch.eye(base, dtype=torch.float64))
    h_pow2 = walsh_hadamard(torch.eye(n // base, dtype=torch.float64))
    assert torch.equal(h_pow2 @ h_pow2.T, (n // base) * torch.eye(n // base, dtype=torch.float64))
    # ... every entry of the whole transform is +-1/sqrt(n) (probed on sampled unit vectors) ...
    probes = torch.eye(n)[torch.randperm(n, generator=gen)[:16]]
    entries = OPS["hadamard_transform"](probes).abs() * n**0.5
    assert torch.allclose(entries, torch.ones_like(entries), atol=1e-5)
    # ... and it preserves inner products (the Gram matrix of random vectors), i.e. H^T H = I on them.
    x = randn((48, n), gen)
    y = OPS["hadamard_transform"](x)
    gram_x, gram_y = x.double() @ x.double().T, y.double() @ y.double().T
    assert torch.allclose(gram_y, gram_x, rtol=0, atol=1e-5 * float(gram_x.diagonal().max()))


@pytest.mark.parametrize("n", [2, 16, 512, 4096])
def test_walsh_hadamard_is_sylvester(n: int, gen: torch.Generator) -> None:
    sylvester = np.ones((1, 1))
    while sylvester.shape[0] < n:
        sylvester = np.block([[sylvester, sylvester], [sylvester, -sylvester]])
    x = randn((5, n), gen, dtype=torch.float64)
    np.testing.assert_allclose(walsh_hadamard(x).numpy(), x.numpy() @ sylvester.T, rtol=1e-12, atol=1e-9)


@pytest.mark.parametrize("base", [1, 12, 20, 28, 36, 40, 52, 60, 108, 140, 156, 172])
@pytest.mark.parametrize("scale", [None, 0.25])
def test_hadamard_transform_matches_reference(base: int, scale: float | None, gen: torch.Generator) -> None:
    n = base * (256 if base in (12, 28) else 8)
    x = randn((3, 2, n), gen)
    verdict = compare_float(
        "y", OPS["hadamard_transform"](x, scale=scale), ref.hadamard_transform(to_numpy(x), scale=scale), torch.float32
    )
    assert verdict.passed, verdict.detail


# ------------------------------------------------------------------------------------------ batch corner cases

# A sequence with no new token sits between two that have some (the batch of a scheduler that paused it).
IDLE_SEQUENCE = [SeqSpec(3, 30), SeqSpec(0, 17), SeqSpec(2, 9), SeqSpec(0, 4)]


def test_sequences_without_new_tokens(gen: torch.Generator) -> None:
    cfg = GLM5_MINI
    batch = paged_batch(IDLE_SEQUENCE, 8, gen)
    q_idx = randn((batch.num_tokens, cfg.index_n_heads, cfg.index_head_dim), gen)
    weights = randn((batch.num_tokens, cfg.index_n_heads), gen, std=0.1)
    index_cache = randn((batch.num_blocks, 8, cfg.index_head_dim), gen)
    paged = (batch.block_table, batch.seq_lens_k, batch.cu_seqlens_q)
    logits = OPS["indexer_logits"](q_idx, weights, index_cache, *paged)
    want = ref.indexer_logits(*(to_numpy(t) for t in (q_idx, weights, index_cache, *paged)))
    verdict = compare_float("logits", logits, want, torch.float32)
    assert verdict.passed, verdict.detail

    indices = random_topk_indices(batch, 12, gen)
    q = randn((batch.num_tokens, 4, 64), gen)
    kv_cache = randn((batch.num_blocks, 8, 64), gen)
    out, lse = OPS["sparse_flash_attention"](q, kv_cache, indices, *paged, 0.125, 48)
    want_out, want_lse = ref.sparse_flash_attention(
        *(to_numpy(t) for t in (q, kv_cache, indices, *paged)), sm_scale=0.125, d_v=48
    )
    for verdict in (
        compare_float("out", out, want_out, torch.float32),
        compare_float("lse", lse, want_lse, torch.float32),
    ):
        assert verdict.passed, verdict.detail


def test_router_ties_break_to_the_lower_expert_like_the_reference() -> None:
    logits = torch.zeros(3, 16)
    logits[1, 5:9] = 1.0  # four tied leaders
    options = dict(top_k=3, n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True)
    for scoring in ("sigmoid", "softmax"):
        weights, ids = OPS["moe_gate"](logits, None, scoring=scoring, **options)
        want_weights, want_ids = ref.moe_gate(logits.numpy(), None, scoring=scoring, **options)
        assert torch.equal(ids, torch.from_numpy(want_ids))
        np.testing.assert_allclose(weights.numpy(), want_weights, rtol=1e-6)


def test_cache_write_on_a_strided_cache(gen: torch.Generator) -> None:
    storage = randn((6, 4, 40), gen)
    original = storage.clone()
    cache = storage[:, :, 8:32]  # [6, 4, 24], not contiguous
    before = cache.clone()
    slots = torch.tensor([5, -1, 22, 0, -1], dtype=torch.int64)
    rows = randn((5, 24), gen)
    write_cache(cache, slots, rows)
    want = ref.write_cache(before.numpy(), slots.numpy(), rows.numpy())
    assert torch.equal(cache, torch.from_numpy(want).to(torch.float32))
    # The columns around the view are not the cache's: they stay as they were.
    assert torch.equal(storage[:, :, :8], original[:, :, :8]) and torch.equal(storage[:, :, 32:], original[:, :, 32:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_attention_invalid_keys_without_host_reads(dtype: torch.dtype) -> None:
    """Where a host read is not allowed (graph capture, tracing), sparse attention masks every gathered row instead
    of zeroing the invalid keys' rows by index: the same output, bit for bit, and NaN in the slot that invalid keys
    read (slot 0, an unused block here) reaches neither."""
    gen = torch.Generator().manual_seed(5)
    block, width, heads = 16, 576, 4
    cache = randn((3, block, width), gen, dtype=dtype)
    cache[0] = float("nan")  # block 0 belongs to no sequence
    block_table = torch.tensor([[2, 1]], dtype=torch.int32)
    seq_lens_k = torch.tensor([20], dtype=torch.int32)
    cu_seqlens_q = torch.tensor([0, 2], dtype=torch.int32)
    q = randn((2, heads, width), gen, dtype=dtype)
    # valid positions, -1 padding and positions past the sequence (20, 25): the last two kinds are invalid keys
    indices = torch.tensor([[3, 0, 18, -1, 25, 19], [19, 4, -1, 20, 7, 1]], dtype=torch.int32)
    args = (q, cache, indices, block_table, seq_lens_k, cu_seqlens_q, 0.05, 512)
    out, lse = OPS["sparse_flash_attention"](*args)
    with mock.patch("backends.torch_eager.sparse_attention.host_reads_allowed", return_value=False):
        traced_out, traced_lse = OPS["sparse_flash_attention"](*args)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert torch.equal(out, traced_out) and torch.equal(lse, traced_lse)
