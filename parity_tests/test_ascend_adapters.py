"""The `ascend` backend's layout conversions (backends/ascend/layouts.py), each checked against ops_reference.

These are pure tensor functions, so they run without the torch-npu wheel. Where a conversion feeds a torch_npu
kernel, the kernel's documented formula (from the strict fake, plain NumPy) closes the loop: contract layout ->
conversion -> documented kernel -> conversion back == the reference.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import ops_reference as ref
from backends.ascend import layouts
from fakes.ascend.basic import interleave_rope_formula, rotary_mul_formula
from glm5_hal.paged import token_sequences
from glm5_hal.parity.inputs import SeqSpec, paged_batch, random_topk_indices, rope_tables


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


RAGGED = [SeqSpec(5, 21), SeqSpec(0, 7), SeqSpec(1, 40), SeqSpec(9, 9), SeqSpec(3, 70)]  # one with no new tokens


def test_tnd_prefix_sums_drop_the_leading_zero() -> None:
    batch = paged_batch(RAGGED, 16, _gen())
    sums = layouts.tnd_prefix_sums(batch.cu_seqlens_q)
    assert sums.dtype == torch.int32
    assert sums.tolist() == np.cumsum([s.q_len for s in RAGGED]).tolist()
    assert layouts.uniform_prefix_sums(4, 3, torch.device("cpu")).tolist() == [3, 6, 9, 12]


def test_token_sequences_match_the_reference() -> None:
    batch = paged_batch(RAGGED, 16, _gen())
    got = token_sequences(batch.cu_seqlens_q, batch.num_tokens)
    assert got.tolist() == ref.token_sequences(batch.cu_seqlens_q.numpy()).tolist()


@pytest.mark.parametrize("block_size", [1, 8, 16])
def test_key_slots_address_the_reference_rows(block_size: int) -> None:
    gen = _gen(1)
    batch = paged_batch(RAGGED, block_size, gen)
    cache = torch.randn(batch.num_blocks, block_size, 6, generator=gen)
    indices = random_topk_indices(batch, 12, gen, invalid_fraction=0.3).to(torch.int64)
    seqs = token_sequences(batch.cu_seqlens_q, batch.num_tokens)
    valid = (indices >= 0) & (indices < batch.seq_lens_k.to(torch.int64)[seqs, None])
    slots = layouts.key_slots(batch.block_table, seqs, indices, valid, block_size, batch.num_blocks)
    assert bool((slots[~valid] == -1).all())
    rows = cache.reshape(-1, 6)
    for t in range(batch.num_tokens):
        want = ref.gather_keys(cache.numpy(), batch.block_table.numpy(), int(seqs[t]), indices[t][valid[t]].numpy())
        np.testing.assert_array_equal(rows[slots[t][valid[t]]].numpy(), want)


@pytest.mark.parametrize("rope_dim", [8, 64])
def test_interleave_rope_kernels_give_the_contract_rope_after_reinterleaving(rope_dim: int) -> None:
    """cos/sin halves into InterleaveRope (npu_interleave_rope, npu_kv_rmsnorm_rope_cache, npu_mla_prolog_v3),
    output pairs re-interleaved == the contract's interleaved RoPE."""
    gen = _gen(2)
    positions = torch.randint(0, 5000, (7,), generator=gen)
    cos, sin = rope_tables(positions, rope_dim, 1e6)
    x = torch.randn(7, 3, rope_dim, generator=gen, dtype=torch.float64)
    kernel_out = interleave_rope_formula(
        x.numpy(),
        layouts.rope_table_halves(cos, torch.float64)[:, None, :].numpy(),
        layouts.rope_table_halves(sin, torch.float64)[:, None, :].numpy(),
    )
    got = layouts.interleave_rope_pairs(torch.from_numpy(kernel_out))
    want = ref.rope(x.numpy(), cos.numpy(), sin.numpy(), interleaved=True)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("interleaved", [True, False])
def test_rotary_mul_tables_give_the_contract_rope(interleaved: bool) -> None:
    """npu_rotary_mul with pair-repeated tables ("interleave") or half-repeated tables ("half") == the contract's
    interleaved / half-split RoPE, with no re-layout of the output."""
    gen = _gen(3)
    cos, sin = rope_tables(torch.randint(0, 3000, (5,), generator=gen), 64, 1e4)
    x = torch.randn(5, 4, 64, generator=gen, dtype=torch.float64)
    table = layouts.rope_table_pairs if interleaved else layouts.rope_table_halves
    r1, r2 = table(cos, torch.float64)[:, None, :].numpy(), table(sin, torch.float64)[:, None, :].numpy()
    got = rotary_mul_formula(x.numpy(), r1, r2, "interleave" if interleaved else "half")
    want = ref.rope(x.numpy(), cos.numpy(), sin.numpy(), interleaved=interleaved)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_rope_pair_layouts_are_inverse_permutations() -> None:
    x = torch.arange(2 * 3 * 8).reshape(2, 3, 8)
    halves = layouts.halve_rope_pairs(x)
    assert halves[0, 0].tolist() == [0, 2, 4, 6, 1, 3, 5, 7]
    assert torch.equal(layouts.interleave_rope_pairs(halves), x)


def test_valid_first_keeps_order_and_pads_with_minus_one() -> None:
    indices = torch.tensor([[5, -1, 9, 70, 2], [-1, -1, -1, -1, -1], [3, 4, 1, 0, 8]])
    valid = (indices >= 0) & (indices < torch.tensor([[60], [60], [60]]))
    got = layouts.valid_first(indices, valid)
    assert got.tolist() == [[5, 9, 2, -1, -1], [-1] * 5, [3, 4, 1, 0, 8]]


def test_natural_lse_from_softmax_max_and_sum() -> None:
    """[N2, T, G] max / sum of exp(s - max) -> [T, N2 * G] natural-log logsumexp; an empty row gets -inf."""
    gen = np.random.default_rng(4)
    scores = gen.normal(size=(2, 5, 3, 11)) * 4  # [N2, T, G, keys]
    scores[:, 2] = -np.inf  # token 2 has no valid key
    peak = scores.max(axis=-1)
    with np.errstate(invalid="ignore"):
        total = np.nan_to_num(np.exp(scores - peak[..., None])).sum(axis=-1)
    peak[:, 2] = np.nan  # what the kernel leaves there is undefined
    lse = layouts.natural_lse(torch.from_numpy(peak), torch.from_numpy(total))
    want = np.logaddexp.reduce(scores, axis=-1).transpose(1, 0, 2).reshape(5, 6)
    assert lse.dtype == torch.float32
    np.testing.assert_allclose(lse.numpy(), want, rtol=1e-6)
    assert bool(torch.isneginf(lse[2]).all())


def test_group_lists_and_offsets_round_trip_with_the_reference_dispatch() -> None:
    gen = _gen(5)
    topk_ids = torch.stack([torch.randperm(6, generator=gen)[:3] for _ in range(9)])  # experts 6..7 unused
    _, offsets, _ = ref.moe_dispatch(np.zeros((9, 1)), topk_ids.numpy(), 8)
    offsets = torch.from_numpy(offsets)
    cumulative = layouts.group_list(offsets, cumulative=True)
    counts = layouts.group_list(offsets, cumulative=False)
    assert cumulative.tolist() == offsets[1:].tolist() and cumulative.dtype == torch.int64
    assert counts.tolist() == np.bincount(topk_ids.reshape(-1).numpy(), minlength=8).tolist()
    assert torch.equal(layouts.offsets_from_counts(counts), offsets)


def test_unpermute_with_the_inverse_of_src_index_is_the_reference_combine() -> None:
    """npu_moe_token_unpermute gathers T[a] = permuted[sorted_indices[a]]; with sorted_indices = the inverse of the
    contract's src_index this is ref.moe_combine."""
    gen = _gen(6)
    topk_ids = torch.stack([torch.randperm(5, generator=gen)[:2] for _ in range(7)])
    _, _, src_index = ref.moe_dispatch(np.zeros((7, 1)), topk_ids.numpy(), 5)
    sorted_indices = layouts.invert_permutation(torch.from_numpy(src_index).to(torch.int32))
    assert sorted_indices.dtype == torch.int32
    y_sorted = torch.randn(14, 4, generator=gen, dtype=torch.float64)
    weights = torch.rand(7, 2, generator=gen, dtype=torch.float64)
    by_assignment = y_sorted[sorted_indices.long()].reshape(7, 2, 4)
    got = (by_assignment * weights[..., None]).sum(1)
    np.testing.assert_allclose(got.numpy(), ref.moe_combine(y_sorted.numpy(), src_index, weights.numpy()), rtol=1e-12)


def test_int4_values_unpack_every_byte_like_the_reference() -> None:
    every_byte = torch.arange(256, dtype=torch.uint8).reshape(4, 64)
    got = layouts.int4_values(every_byte)
    assert got.dtype == torch.int32 and got.shape == (4, 128)
    np.testing.assert_array_equal(got.numpy(), ref.unpack_int4(every_byte.numpy()))
