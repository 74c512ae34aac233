"""Dense MLA attention over the whole context: the baseline the sparse path is compared with (not a HAL op).

Every query attends to every visible key of its sequence, in key chunks with an online softmax, so memory stays
bounded at 128K keys; the work grows linearly with the context where sparse attention's stays at topk keys.
"""

from __future__ import annotations

import torch
from torch import Tensor

from glm5_hal.paged import key_slots

KEY_CHUNK = 8192


def dense_mla_attention(
    q: Tensor,
    kv_cache: Tensor,
    block_table: Tensor,
    seq_lens_k: Tensor,
    cu_seqlens_q: Tensor,
    sm_scale: float,
    d_v: int = 512,
    **_: object,
) -> tuple[Tensor, Tensor]:
    """q [T,H,576] over every visible cache row -> (out [T,H,d_v], lse [T,H]); decode-style batches (loops over
    sequences, which are few in a decode batch)."""
    out = torch.empty(q.shape[0], q.shape[1], d_v, dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    block = kv_cache.shape[1]
    flat = kv_cache.reshape(-1, kv_cache.shape[-1])
    for b in range(block_table.shape[0]):
        t0, t1, k_len = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1]), int(seq_lens_k[b])
        seq = torch.tensor([b], device=q.device)
        qb = q[t0:t1].float() * sm_scale  # [t, H, 576]
        pos = k_len - (t1 - t0) + torch.arange(t1 - t0, device=q.device)
        run_max = torch.full(qb.shape[:2], -torch.inf, device=q.device)
        run_sum = torch.zeros(qb.shape[:2], device=q.device)
        acc = torch.zeros(*qb.shape[:2], d_v, device=q.device)
        for start in range(0, k_len, KEY_CHUNK):
            keys_pos = torch.arange(start, min(start + KEY_CHUNK, k_len), device=q.device)
            slots = key_slots(block_table, seq, keys_pos, block, kv_cache.shape[0])[0][0]  # valid tables here
            rows = flat[slots].float()  # [S, 576]
            scores = torch.einsum("thd,sd->ths", qb, rows)
            scores = scores.masked_fill(keys_pos[None, None, :] > pos[:, None, None], -torch.inf)
            new_max = torch.maximum(run_max, scores.amax(-1))
            p = torch.exp(scores - new_max[..., None])
            alpha = torch.exp(run_max - new_max)
            run_sum = run_sum * alpha + p.sum(-1)
            acc = acc * alpha[..., None] + torch.einsum("ths,sd->thd", p, rows[:, :d_v])
            run_max = new_max
        out[t0:t1] = (acc / run_sum[..., None]).to(q.dtype)
        lse[t0:t1] = run_max + torch.log(run_sum)
    return out, lse
