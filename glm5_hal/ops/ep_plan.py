"""The plan of one expert-parallel exchange: where every token copy goes, identical on every rank.

ep_dispatch agrees on it before any data moves (glm5_hal/ops/expert_parallel.py): after one all_gather of every
rank's per-expert copy counts, each rank holds the whole [W, E] count matrix and derives from it, without further
communication, what it sends, what it receives and where each received row belongs. Backends implement the exchange
from the plan; every decision a backend takes from it (e.g. the Ascend backend's fused kernel or its fallback) is the
same on every rank, so no rank takes a different collective path.

Row orders (OPS.md section 6), with L = E / W local experts per rank:
  send order     the rank's T * k copies grouped by destination expert ascending (hence by destination rank), in
                 assignment order a = t * k + j within an expert: moe_dispatch's order, src_index = send_order
  receive buffer what all_to_all_single delivers: source rank major, then (local expert, t, j) as the source sent
  recv_x         local expert major, then (source rank, t, j): receive_order maps it to the receive buffer
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor


@dataclass(frozen=True)
class EPRoute:
    """The two permutations of the portable exchange (device tensors).

    send_order: [T * k] int64. Row i sent is the copy of assignment send_order[i] (= t * k + j), i.e. token
        send_order[i] // k: moe_dispatch's src_index.
    receive_order: [R] int64. recv_x[i] = receive_buffer[receive_order[i]].
    """

    send_order: Tensor
    receive_order: Tensor


@dataclass(frozen=True)
class EPPlan:
    """One ep_dispatch call, as every rank of the group agreed on it.

    group: the process group; rank / world_size: this rank's index in it and its size W.
    num_experts: E (E % W == 0); rank r owns global experts [r * E/W, (r + 1) * E/W).
    hidden: D, the width of the dispatched rows; top_k: k, copies per token; dtype: x's dtype on every rank.
    quantize: rows travel as int8 codes + an fp32 scale (dynamic_quant).
    tokens: T of each rank. counts: [W][E] host ints, counts[s][e] = copies rank s sends to global expert e.
    rows_unique: no rank's topk_ids has a row naming one expert twice (fused kernels may require it).
    sequence: this is the group's `sequence`-th ep_dispatch (ep_combine checks that all ranks combine the same one).
    """

    group: dist.ProcessGroup
    rank: int
    world_size: int
    num_experts: int
    hidden: int
    top_k: int
    dtype: torch.dtype
    quantize: bool
    tokens: tuple[int, ...]
    counts: tuple[tuple[int, ...], ...]
    rows_unique: bool
    sequence: int

    @property
    def local_experts(self) -> int:
        """L = E / W experts per rank."""
        return self.num_experts // self.world_size

    @property
    def first_expert(self) -> int:
        """This rank's first global expert (it owns first_expert .. first_expert + L - 1)."""
        return self.rank * self.local_experts

    @functools.cached_property
    def recv_counts(self) -> tuple[tuple[int, ...], ...]:
        """[W][L]: copies source rank s sends to this rank's local expert l."""
        lo, hi = self.first_expert, self.first_expert + self.local_experts
        return tuple(row[lo:hi] for row in self.counts)

    @functools.cached_property
    def send_splits(self) -> list[int]:
        """Rows this rank sends to each rank (all_to_all_single's input split sizes)."""
        local, mine = self.local_experts, self.counts[self.rank]
        return [sum(mine[d * local : (d + 1) * local]) for d in range(self.world_size)]

    @functools.cached_property
    def recv_splits(self) -> list[int]:
        """Rows this rank receives from each rank (all_to_all_single's output split sizes)."""
        return [sum(row) for row in self.recv_counts]

    @property
    def recv_rows(self) -> int:
        """R: rows this rank receives, i.e. rows of recv_x."""
        return sum(self.recv_splits)

    @functools.cached_property
    def rows_per_local_expert(self) -> list[int]:
        return [sum(row[e] for row in self.recv_counts) for e in range(self.local_experts)]

    def expert_offsets(self, device: torch.device) -> Tensor:
        """[L + 1] int32: recv_x rows of local expert l are expert_offsets[l] : expert_offsets[l + 1]."""
        offsets = [0]
        for rows in self.rows_per_local_expert:
            offsets.append(offsets[-1] + rows)
        return torch.tensor(offsets, dtype=torch.int32, device=device)

    def receive_order(self, device: torch.device) -> Tensor:
        """[R] int64: recv_x[i] = receive_buffer[receive_order[i]] (see the module docstring for both orders)."""
        world, local = self.world_size, self.local_experts
        sizes = torch.tensor(self.recv_counts, dtype=torch.int64).reshape(world * local)  # chunks (s, l)
        starts = torch.cumsum(sizes, 0) - sizes  # where chunk (s, l) begins in the receive buffer
        # recv_x takes the chunks in (l, s) order; inside a chunk rows keep their order.
        sizes_lm = sizes.view(world, local).t().reshape(-1)
        starts_lm = starts.view(world, local).t().reshape(-1)
        chunk_of_row = torch.repeat_interleave(torch.arange(sizes_lm.numel()), sizes_lm)
        chunk_begin = torch.cumsum(sizes_lm, 0) - sizes_lm  # where chunk (l, s) begins in recv_x
        rows = torch.arange(int(sizes_lm.sum()))
        return (starts_lm[chunk_of_row] + rows - chunk_begin[chunk_of_row]).to(device)

    def route(self, topk_ids: Tensor) -> EPRoute:
        """The portable exchange's permutations for this rank's topk_ids [T, k] (validated by ep_dispatch)."""
        send_order = torch.sort(topk_ids.reshape(-1).to(torch.int64), stable=True).indices
        return EPRoute(send_order, self.receive_order(topk_ids.device))
