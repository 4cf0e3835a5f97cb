"""The expert-parallel exchange with shapes fixed by a capacity and no host sync: ``static_exchange``.

Why: ``dispatch.exchange`` reads every count on the host (one sync per layer) and sends rows in splits of that
step's sizes. At ep 2 and 4 that sync and the launches around it pace the GPUs, where one GPU replays a CUDA graph
of its whole micro-step (bench/reports/ep2_levers_h200x2_2026-11-27b.md, section 3). Here every shape follows from
(rows sent, ep, local experts, capacity) alone, so a layer built on it could be captured in a CUDA graph at ep > 1:

  each rank gets a block of ``capacity`` rows from every rank (equal splits; past the valid rows, zeros) -> the
  received blocks regrouped by local expert on the device, the padding last -> ``compute`` -> the same way back ->
  each row's output in the order it was sent.

Exactness: a block that would need more than ``capacity`` rows drops its last rows (nothing is written out of
bounds; a dropped row's output and gradient are zero) and sets ``overflow``, the same device flag on every rank of
the group (each rank's own send overflow rides with its counts). The caller keeps a micro-step's flags on the
device, reads them once after the forward (the one sync left) and, when one is set, reruns that forward on the exact
path (``exchange``): no gradient has been touched yet. With dp > 1 every rank must take the same path (FSDP's
collectives), so the flag is reduced over the world before it is read. ``static_capacity`` sizes the blocks.

``compute(rows, counts, None)`` gets [ep * capacity, H] rows grouped by local expert and the rows per local expert
on the device only (no host counts): it must compute the first ``counts.sum()`` rows and may leave the rest as
anything. ``LocalExperts``' grouped GEMM does (its offsets end at the valid count); the per-expert loop does not (it
reads the counts and splits all rows by them), nor does the experts' bias (a one-hot of all rows, gpt-oss).

The layer uses it where ``ep_capacity_factor`` > 0 and the mode's transport is "all_to_all" (on CPU ranks, or GPUs across
nodes; within a node GPUs read from each other's memory instead, ``pull_exchange.py``: one row per token and rank,
no padding on the wire); its compute runs the per-expert loop on the valid rows only, and
``exchange_mode.run_exactly`` is the caller above: the check once per micro-step and the rerun on the exact exchange
(tests/test_exchange_mode.py, on CPU ranks). Proved on CPU ranks (tests/test_static_exchange.py);
A probe measured it on GPUs (the padding's cost: bench/reports/ep_graphs_h200x4_2026-11-27d.md).
"""

import math
from collections.abc import Callable

import torch

# exchange's own all-to-all operator and permutation: the same operators, which "selective" checkpointing keeps.
from megablocks_utils.moe.dispatch import _all_to_all, _AllToAll, _Permute


def static_capacity(tokens: int, k: int, ep: int, capacity_factor: float, multiple: int = 128) -> int:
    """Rows per block: ``capacity_factor`` times a peer's mean share of a rank's ``tokens * k`` rows, rounded up to
    a multiple of ``multiple`` (the grouped GEMM's tile); never more than the rows a rank sends, rounded likewise."""
    if capacity_factor <= 0:
        raise ValueError(f"capacity_factor={capacity_factor}: give a positive factor (1.0 = a peer's mean share of rows)")
    rows = tokens * k
    wanted = min(math.ceil(capacity_factor * rows / ep), rows)
    return max(multiple, math.ceil(wanted / multiple) * multiple)


def _gather_or_zero(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows ``x[index]``, zero rows where ``index`` is ``len(x)`` (a fixed shape: no mask indexing)."""
    if len(x) == 0:
        return x.new_zeros(len(index), *x.shape[1:])
    rows = x.index_select(0, index.clamp(max=len(x) - 1))
    return rows.masked_fill_((index == len(x)).unsqueeze(-1), 0)


class _GatherRows(torch.autograd.Function):
    """``x[index]``, zeros where ``index`` is ``len(x)``. Each row of x is taken at most once, so the backward is a
    gather too: ``grad[back]``, ``back[i]`` where row i of x went (``len(index)``: nowhere). No atomics, fixed shapes."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, index: torch.Tensor, back: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(back)
        return _gather_or_zero(x, index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (back,) = ctx.saved_tensors
        return _gather_or_zero(grad, back), None, None


def send_slots(sent_rows: torch.Tensor, rows: int, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows in expert order put in one block of ``capacity`` slots per rank (``sent_rows[r]`` of them for rank r, one
    run from its start): ``slot_of_row`` (``ep * capacity``: dropped) and ``row_of_slot`` (``rows``: padding)."""
    ep, device = len(sent_rows), sent_rows.device
    ends = sent_rows.cumsum(0)
    starts = ends - sent_rows
    slot = torch.arange(capacity, device=device)
    row_of_slot = torch.where(slot < sent_rows[:, None], starts[:, None] + slot, rows).reshape(-1)
    row = torch.arange(rows, device=device)
    peer = torch.searchsorted(ends, row, right=True).clamp_(max=ep - 1)
    place = row - starts[peer]
    slot_of_row = torch.where(place < capacity, peer * capacity + place, ep * capacity)
    return slot_of_row, row_of_slot


def expert_major(received: torch.Tensor, capacity: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The arrived blocks (block s: rank s's rows for my experts, ``received[s, e]`` for local expert e, in expert
    order; cut at ``capacity``) regrouped expert-major (expert e's rows from rank 0, then rank 1, ...), the padding
    after all valid rows: ``regroup`` (expert-major row p is arrived row ``regroup[p]``), its inverse, and the rows
    per local expert."""
    ep, local = received.shape
    device = received.device
    end = received.cumsum(1).clamp(max=capacity)  # where (s, e)'s rows end in block s
    begin = (received.cumsum(1) - received).clamp(max=capacity)
    kept = end - begin
    expert_counts = kept.sum(0)
    valid = end[:, -1]  # rows arrived in each block
    # The first expert-major row of (s, e): expert e's start, after what ranks before s sent to e.
    first = (expert_counts.cumsum(0) - expert_counts) + (kept.cumsum(0) - kept)
    slot = torch.arange(capacity, device=device).expand(ep, capacity)
    expert = torch.searchsorted(end, slot.contiguous(), right=True).clamp_(max=local - 1)
    to_valid = (first - begin).gather(1, expert) + slot
    padding = capacity - valid
    to_padding = valid.sum() + (padding.cumsum(0) - padding)[:, None] + slot - valid[:, None]
    inverse = torch.where(slot < valid[:, None], to_valid, to_padding).reshape(-1)
    regroup = torch.empty_like(inverse).scatter_(0, inverse, torch.arange(ep * capacity, device=device))
    return regroup, inverse, expert_counts


def static_exchange(
    routed: torch.Tensor,
    counts: torch.Tensor,
    ep: int,
    local: int,
    group: "torch.distributed.ProcessGroup",
    compute: Callable[[torch.Tensor, torch.Tensor, None], torch.Tensor],
    capacity: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``exchange`` for one chunk, in blocks of ``capacity`` rows per rank: ``routed`` [rows, H] (expert order,
    ``counts`` [ep * local] rows per expert, on the device) to the ranks owning their experts, through ``compute``
    there, and back. Returns the outputs in the order the rows were sent and ``overflow`` (a bool on the device, the
    same on every rank): True when some rank had more than ``capacity`` rows for some rank, and the outputs are then
    not exact. No host sync; every shape depends on (rows, H, ep, local, capacity) only."""
    if capacity < 1:
        raise ValueError(f"capacity={capacity}: give at least one row per block (static_capacity sizes it)")
    rows = routed.shape[0]
    splits = [capacity] * ep
    sent = counts.view(ep, local)  # sent[r, e]: my rows for rank r's local expert e
    sent_rows = sent.sum(1)
    my_overflow = (sent_rows > capacity).any()
    message = torch.cat([sent, my_overflow.to(sent.dtype).expand(ep, 1)], 1).reshape(-1)
    heard = _all_to_all(message, [local + 1] * ep, [local + 1] * ep, group, True).view(ep, local + 1)
    received, overflow = heard[:, :local], heard[:, local].any()  # received[s, e]: rank s's rows for my expert e
    slot_of_row, row_of_slot = send_slots(sent_rows, rows, capacity)
    arrived = _AllToAll.apply(_GatherRows.apply(routed, row_of_slot, slot_of_row), splits, splits, group, True)
    regroup, inverse, expert_counts = expert_major(received, capacity)
    expert_out = compute(_Permute.apply(arrived, regroup, inverse), expert_counts, None)
    returned = _AllToAll.apply(_Permute.apply(expert_out, inverse, regroup), splits, splits, group, True)
    return _GatherRows.apply(returned, slot_of_row, row_of_slot), overflow
