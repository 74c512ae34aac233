"""The references checked against hand-computed values and independent properties, so the specification itself
is tested and not only trusted (the backends are then checked against it by test_parity.py)."""

from __future__ import annotations

import numpy as np
import pytest

import ops_reference as ref

RNG = np.random.default_rng()
# fp64 sums agree to a few ulps of the magnitudes they add up, not of their result: a random sum can cancel to ~0,
# where any relative bound on the result alone fails by chance (seen: 1.3e-12 relative on an element of 1e-3 summed
# from terms of ~10).
SUM_ULPS = 1e-12


def _assert_sums_equal(got: np.ndarray, want: np.ndarray, magnitude: np.ndarray | float) -> None:
    """got == want to SUM_ULPS of `magnitude`: the same sum over the absolute values of its terms."""
    np.testing.assert_array_less(np.abs(np.asarray(got) - want), SUM_ULPS * np.asarray(magnitude) + 1e-300)


def _identity_layout(seq_lens: list[int], q_lens: list[int], block_size: int):
    """Contiguous cache: sequence b owns consecutive blocks. Returns block_table, seq_lens_k, cu_seqlens_q."""
    max_blocks = max(-(-s // block_size) for s in seq_lens)
    table = np.arange(len(seq_lens) * max_blocks, dtype=np.int32).reshape(len(seq_lens), max_blocks)
    return table, np.array(seq_lens, np.int32), np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)


def test_rms_norm_hand_value():
    out = ref.rms_norm(np.array([[3.0, 4.0]]), np.array([1.0, 2.0]), eps=0.0)
    rms = np.sqrt((9 + 16) / 2)
    np.testing.assert_allclose(out, [[3 / rms, 8 / rms]], rtol=1e-15)


def test_layer_norm_zero_mean_unit_var():
    out = ref.layer_norm(RNG.normal(3, 5, (4, 64)), np.ones(64), np.zeros(64), eps=0.0)
    np.testing.assert_allclose(out.mean(-1), 0, atol=1e-12)
    np.testing.assert_allclose(out.var(-1), 1, rtol=1e-12)


def test_rope_layouts_are_a_permutation_of_each_other():
    x, positions = RNG.normal(size=(5, 3, 64)), np.arange(5) * 7
    cos, sin = ref.rope_cos_sin(positions, 64, 1e4)
    to_half = np.concatenate([np.arange(0, 64, 2), np.arange(1, 64, 2)])  # interleaved -> half-split order
    np.testing.assert_allclose(
        ref.rope(x, cos, sin, interleaved=True)[..., to_half], ref.rope(x[..., to_half], cos, sin, interleaved=False)
    )


def test_rope_hand_value_and_norm():
    cos, sin = ref.rope_cos_sin(np.array([0, 1]), 4, 100.0)
    np.testing.assert_allclose(cos[1], [np.cos(1.0), np.cos(0.1)])
    x = np.array([[1.0, 0.0, 0.0, 1.0], [1.0, 0.0, 0.0, 1.0]])
    out = ref.rope(x, cos, sin, interleaved=True)
    np.testing.assert_allclose(out[0], x[0])  # position 0: identity
    np.testing.assert_allclose(out[1], [np.cos(1.0), np.sin(1.0), -np.sin(0.1), np.cos(0.1)])


def test_paged_positions_and_gather():
    _, seq_lens, cu = _identity_layout([5, 3], [2, 3], 4)
    np.testing.assert_array_equal(ref.token_positions(seq_lens, cu), [3, 4, 0, 1, 2])
    cache = np.arange(3 * 4 * 1, dtype=np.float64).reshape(3, 4, 1)
    table = np.array([[2, 0]], np.int32)  # position 5 -> block 0 offset 1 -> slot 1
    np.testing.assert_array_equal(ref.gather_keys(cache, table, 0, np.array([0, 5]))[:, 0], [8, 1])


def test_write_cache_skips_minus_one_and_keeps_other_rows():
    cache = RNG.normal(size=(2, 4, 3))
    new = ref.write_cache(cache, np.array([5, -1, 0]), np.ones((3, 3)))
    flat_old, flat_new = cache.reshape(8, 3), new.reshape(8, 3)
    np.testing.assert_array_equal(flat_new[[0, 5]], 1.0)
    untouched = [1, 2, 3, 4, 6, 7]
    np.testing.assert_array_equal(flat_new[untouched], flat_old[untouched])


def test_mla_prolog_against_per_head_loops():
    t, hidden, q_lora, kv_lora, heads, nope, rope_dim = 3, 16, 8, 12, 2, 6, 4
    x = RNG.normal(size=(t, hidden))
    w_dq, g_cq = RNG.normal(size=(q_lora, hidden)), RNG.normal(size=q_lora)
    w_uq_qr, w_uk = RNG.normal(size=(heads * (nope + rope_dim), q_lora)), RNG.normal(size=(heads, nope, kv_lora))
    w_dkv_kr, g_ckv = RNG.normal(size=(kv_lora + rope_dim, hidden)), RNG.normal(size=kv_lora)
    cos, sin = ref.rope_cos_sin(np.array([4, 9, 2]), rope_dim, 1e4)
    cache, slots = np.zeros((2, 4, kv_lora + rope_dim)), np.array([6, -1, 1])
    q_lat, q_pe, q_norm, new = ref.mla_prolog(
        x, w_dq, g_cq, w_uq_qr, w_uk, w_dkv_kr, g_ckv, cos, sin, cache, slots, 1e-6
    )
    for i in range(t):
        qn = ref.rms_norm(w_dq @ x[i], g_cq, 1e-6)
        for h in range(heads):
            qh = (w_uq_qr @ qn)[h * (nope + rope_dim) : (h + 1) * (nope + rope_dim)]
            qh_magnitude = (np.abs(w_uq_qr) @ np.abs(qn))[h * (nope + rope_dim) : h * (nope + rope_dim) + nope]
            _assert_sums_equal(q_lat[i, h], qh[:nope] @ w_uk[h], qh_magnitude @ np.abs(w_uk[h]))
            np.testing.assert_allclose(
                q_pe[i, h], ref.rope(qh[None, nope:], cos[i : i + 1], sin[i : i + 1], interleaved=True)[0]
            )
        np.testing.assert_allclose(q_norm[i], qn)
    flat = new.reshape(8, -1)
    kv = x[0] @ w_dkv_kr.T
    np.testing.assert_allclose(flat[6, :kv_lora], ref.rms_norm(kv[:kv_lora], g_ckv, 1e-6))
    assert not flat[[0, 2, 3, 4, 5, 7]].any()  # slot -1 (token 1) wrote nothing


def _indexer_inputs(seq_lens, q_lens, block_size=4, heads=3, dim=8):
    table, seq_lens_k, cu = _identity_layout(seq_lens, q_lens, block_size)
    cache = RNG.normal(size=(table.size + 1, block_size, dim))
    return RNG.normal(size=(cu[-1], heads, dim)), RNG.normal(size=(cu[-1], heads)), cache, table, seq_lens_k, cu


def test_indexer_logits_formula_and_block_table_invariance():
    q, w, cache, table, seq_lens_k, cu = _indexer_inputs([6, 9], [2, 3])
    logits = ref.indexer_logits(q, w, cache, table, seq_lens_k, cu)
    flat = cache.reshape(-1, cache.shape[-1])
    # token 0 of sequence 0 is at position 4 and sees keys 0..4 (slots 0..4 of the identity layout)
    want = np.maximum(q[0] @ flat[:5].T, 0).T @ w[0]
    np.testing.assert_allclose(logits[0, :5], want)
    assert np.isneginf(logits[0, 5:]).all()
    # moving the blocks around (and the table with them) changes nothing
    perm = RNG.permutation(cache.shape[0])
    shuffled = np.empty_like(cache)
    shuffled[perm] = cache
    np.testing.assert_allclose(ref.indexer_logits(q, w, shuffled, perm[table].astype(np.int32), seq_lens_k, cu), logits)


def test_lightning_indexer_topk_and_minus_one_tail():
    q, w, cache, table, seq_lens_k, cu = _indexer_inputs([10], [10])
    indices, scores = ref.lightning_indexer(q, w, cache, table, seq_lens_k, cu, 4)
    logits = ref.indexer_logits(q, w, cache, table, seq_lens_k, cu)
    assert indices.dtype == np.int32
    np.testing.assert_array_equal(indices[0], [0, -1, -1, -1])  # position 0 sees one key
    np.testing.assert_array_equal(np.sort(indices[2][:3]), [0, 1, 2])
    for t in range(4, 10):
        np.testing.assert_allclose(np.sort(scores[t]), np.sort(logits[t, : t + 1])[-4:])
        assert (indices[t] <= t).all() and len(set(indices[t])) == 4


def test_sparse_attention_equals_dense_when_topk_covers_the_context():
    heads, dim, d_v = 2, 10, 6
    _, _, cache, table, seq_lens_k, cu = _indexer_inputs([7, 4], [3, 4], dim=dim)
    q = RNG.normal(size=(cu[-1], heads, dim))
    positions = ref.token_positions(seq_lens_k, cu)
    indices = np.full((cu[-1], 8), -1, np.int32)
    for t, p in enumerate(positions):
        indices[t, : p + 1] = RNG.permutation(p + 1)  # every visible key, in any order
    sparse = ref.sparse_flash_attention(q, cache, indices, table, seq_lens_k, cu, 0.3, d_v)
    dense = ref.dense_mla_attention(q, cache, table, seq_lens_k, cu, 0.3, d_v)
    # out is a convex combination of cache values (it can cancel to ~0); lse = peak + log(total)
    _assert_sums_equal(sparse[0], dense[0], np.abs(cache[..., :d_v]).max())
    _assert_sums_equal(sparse[1], dense[1], 1.0 + np.abs(dense[1]))


def test_sparse_attention_single_key_empty_row_and_out_of_range():
    cache = RNG.normal(size=(2, 4, 6))
    table, seq_lens_k, cu = np.array([[1, 0]], np.int32), np.array([3], np.int32), np.array([0, 3], np.int32)
    q = RNG.normal(size=(3, 1, 6))
    indices = np.array([[2, -1], [-1, -1], [5, -1]], np.int32)  # one key; none; 5 >= seq_len: invalid
    out, lse = ref.sparse_flash_attention(q, cache, indices, table, seq_lens_k, cu, 0.5, 4)
    key = cache[1, 2]
    np.testing.assert_allclose(out[0, 0], key[:4])
    np.testing.assert_allclose(lse[0, 0], 0.5 * q[0, 0] @ key)  # natural log of one exp
    assert (out[1:] == 0).all() and np.isneginf(lse[1:]).all()


def test_moe_gate_hand_case_with_groups():
    logits = np.log(np.array([[0.9, 0.1, 0.8, 0.7, 0.2, 0.6]]) / (1 - np.array([[0.9, 0.1, 0.8, 0.7, 0.2, 0.6]])))
    bias = np.array([0.0, 0.0, 0.0, 0.0, 0.0, 0.5])
    # groups {0,1} {2,3} {4,5}: top-2 sums 1.0, 1.5, 1.3 -> keep groups 1 and 2 -> experts 2,3,4,5
    w, ids = ref.moe_gate(
        logits,
        bias,
        top_k=2,
        n_group=3,
        topk_group=2,
        routed_scaling_factor=2.0,
        norm_topk_prob=True,
        scoring="sigmoid",
    )
    np.testing.assert_array_equal(ids[0], [5, 2])  # 0.6+0.5 biased beats 0.8; expert 0 (0.9) is in a dropped group
    np.testing.assert_allclose(w[0], np.array([0.6, 0.8]) / 1.4 * 2.0)  # unbiased scores, normalised, scaled


def test_moe_dispatch_is_stable_and_combine_inverts_it():
    ids = np.array([[2, 0], [0, 2], [2, 3]], np.int32)  # expert 1 gets no tokens
    x = RNG.normal(size=(3, 4))
    x_sorted, offsets, src = ref.moe_dispatch(x, ids, 4)
    np.testing.assert_array_equal(offsets, [0, 2, 2, 5, 6])
    np.testing.assert_array_equal(src, [1, 2, 0, 3, 4, 5])
    np.testing.assert_array_equal(x_sorted, x[src // 2])
    w = RNG.normal(size=(3, 2))
    np.testing.assert_allclose(ref.moe_combine(x_sorted, src, w), x * w.sum(1, keepdims=True))


def test_fused_moe_against_per_token_loop():
    t, d, inter, experts, k = 5, 6, 4, 3, 2
    x, w13, w2 = RNG.normal(size=(t, d)), RNG.normal(size=(experts, 2 * inter, d)), RNG.normal(size=(experts, d, inter))
    ids = np.array([RNG.choice(experts, k, replace=False) for _ in range(t)], np.int32)
    weights = RNG.random((t, k))
    out = ref.fused_moe(x, weights, ids, w13, w2)
    for i in range(t):
        terms = [
            weights[i, j] * (w2[e] @ (ref.silu(w13[e, :inter] @ x[i]) * (w13[e, inter:] @ x[i])))
            for j, e in enumerate(ids[i])
        ]
        # |silu(g)| <= |g| <= |w_gate| @ |x|: the magnitudes of every sum along the way
        magnitudes = [
            weights[i, j]
            * (np.abs(w2[e]) @ ((np.abs(w13[e, :inter]) @ np.abs(x[i])) * (np.abs(w13[e, inter:]) @ np.abs(x[i]))))
            for j, e in enumerate(ids[i])
        ]
        _assert_sums_equal(out[i], sum(terms), sum(magnitudes))


def test_dynamic_quant_bounds_zero_row_and_round_half_even():
    x = np.vstack([RNG.normal(size=(3, 32)), np.zeros((1, 32)), [[127.0, 0.5, 1.5, -2.5] + [0.0] * 28]])
    q, scale = ref.dynamic_quant(x)
    assert q.dtype == np.int8 and np.abs(q).max() == 127
    assert scale[3] == 1.0 and not q[3].any()
    np.testing.assert_array_equal(q[4, :4], [127, 0, 2, -2])  # scale 1: halves go to even
    assert (np.abs(q[:3] * scale[:3, None] - x[:3]) <= scale[:3, None] / 2 + 1e-12).all()


def test_int4_packing_layout_and_roundtrip():
    np.testing.assert_array_equal(ref.pack_int4(np.array([[1, -1, -8, 7]])), [[0xF1, 0x78]])
    w = RNG.integers(-8, 8, size=(5, 16))
    np.testing.assert_array_equal(ref.unpack_int4(ref.pack_int4(w)), w)
    with pytest.raises(ValueError, match="w_q"):
        ref.pack_int4(np.array([[8, 0]]))


def test_quant_matmul_is_exact_integer_math_then_scales():
    x_q, w_q = RNG.integers(-127, 128, (3, 7168)), RNG.integers(-127, 128, (4, 7168))
    xs, ws, bias = RNG.random(3), RNG.random(4), RNG.normal(size=4)
    acc = np.array([[sum(int(a) * int(b) for a, b in zip(xr, wr)) for wr in w_q] for xr in x_q])
    np.testing.assert_array_equal(ref.int_matmul(x_q, w_q), acc)
    np.testing.assert_allclose(ref.quant_matmul(x_q, xs, w_q, ws, bias), acc * xs[:, None] * ws + bias, rtol=1e-15)


def test_w4a8_groups():
    x_q, w = RNG.integers(-127, 128, (3, 32)), RNG.normal(size=(4, 32))
    packed, scale = ref.quantize_weight_int4(w)
    w_q = ref.unpack_int4(packed)
    xs = RNG.random(3)
    np.testing.assert_allclose(ref.w4a8_matmul(x_q, xs, packed, scale), ref.quant_matmul(x_q, xs, w_q, scale))
    g_packed, g_scale = ref.quantize_weight_int4(w, group_size=8)
    assert g_scale.shape == (4, 4)
    dequant = ref.unpack_int4(g_packed).reshape(4, 4, 8) * g_scale[..., None]
    np.testing.assert_allclose(
        ref.w4a8_matmul(x_q, xs, g_packed, g_scale, 8), (x_q @ dequant.reshape(4, 32).T) * xs[:, None]
    )
    assert np.abs(dequant.reshape(4, 32) - w).max() <= g_scale.max() / 2 + 1e-12
