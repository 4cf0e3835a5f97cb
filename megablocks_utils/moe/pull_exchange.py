"""The static exchange without padding on the wire, one row per token and rank: each rank reads what it needs from
its peers' buffers.

Why: ``static_exchange`` has fixed shapes (no host sync, so a micro-step can be one CUDA graph at ep > 1) but sends
through NCCL's all-to-all in equal blocks of ``capacity`` rows, padding included. Here the rows stay where they are
made, in buffers every rank of the ep group can read (torch's symmetric memory on GPUs, ``SymmetricPeers``), and each
rank reads exactly what it needs (``pull_kernel.py``). And a token's copies bound for one rank are one row on the wire
both ways (top-8 of 128 experts at ep 4: ~3.6 rows a token instead of 8; the nineteenth session's version moved each
copy): the receiver writes a token's row to each of its copies' slots, and sums its copies' weighted outputs into one
row before the trip back.

  trip out: my tokens (buffer X), each copy's expert, sorted row and router weight (meta) and my counts published,
  barrier -> every rank's counts read -> the plan (``pull_plan``) -> for every (source, token) pair with copies for my
  experts, its row read once and written to those copies' slots, expert-major ([capacity, H]; past the valid rows
  zeros where one local expert's plain GEMMs read them, else whatever was there), with their weights -> ``compute``
  -> trip back: each pair's weighted outputs summed (in fp32) into one row of S, barrier -> each of my tokens' rows read
  from the ranks holding its copies and summed: the layer's output [T, H].

The backward reads the same way: the output's gradient published in X, each pair's read once (times each slot's weight;
each weight's gradient is its output dotted with it); the gradient of each pair's copies summed into S (the weights'
gradients beside it, buffer GW), each token's read from its ranks and summed. So the buffers are written X, S, X, S
in every order autograd and checkpointing run them, which makes one barrier a trip enough: a rank writes X again only
after a barrier that every peer reached after its last read of X. ``capacity`` counts the rows one rank receives in
all; when some rank would receive more, its copies past ``capacity`` (its last experts' last rows) are dropped, and
``overflow`` is set, the same on every rank with no collective (every rank has every count): ``exchange_mode`` reruns
such a forward on the exact exchange.

``GatheredPeers`` is the same contract over any process group (every buffer all-gathered, the kernels' work in torch):
the CPU tests' transport, and the reference the kernels are tested against.
"""

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist


def pull_capacity(tokens: int, k: int, ep: int, capacity_factor: float, multiple: int = 128) -> int:
    """Rows one rank can receive: ``capacity_factor`` times the mean (a rank sends ``tokens * k`` rows and receives as
    many on average), rounded up to ``multiple`` (the grouped GEMM's tile); never more than all ranks' rows."""
    if capacity_factor <= 0:
        raise ValueError(f"capacity_factor={capacity_factor}: give a positive factor (1.0 = the mean rows a rank receives)")
    rows = tokens * k
    wanted = min(math.ceil(capacity_factor * rows), ep * rows)
    return max(multiple, math.ceil(wanted / multiple) * multiple)


class PullPlan(NamedTuple):
    first: torch.Tensor  # [ep, local * ep] int64: where block (local expert e, source s) starts in rank r's received rows
    sent_start: torch.Tensor  # [ep, ep * local] int64: where rank s's copies for global expert g start in its sorted ones
    received: torch.Tensor  # [ep] int64: the rows each rank would receive
    owner: torch.Tensor  # [T, k] int32: the rank computing each of my token copies
    slot: torch.Tensor  # [T, k] int32: its row among that rank's received rows (-1: past capacity, dropped)
    expert_counts: torch.Tensor  # [local] int64: rows my experts receive (within capacity)
    overflow: torch.Tensor  # bool: some rank would receive more than capacity rows


def pull_plan(counts_all: torch.Tensor, me: int, local: int, capacity: int, top_i: torch.Tensor, copy_row: torch.Tensor) -> PullPlan:
    """Where every copy goes, from ``counts_all`` [ep, ep * local] (rank s's copies for global expert g; each rank's
    copies sorted by expert, ``copy_row`` [T * k] the sorted row of mine): on the device, shapes fixed by the inputs'.
    A rank receives its copies expert-major, then by source, each source's in its sorted order."""
    ep = counts_all.shape[0]
    counts_all = counts_all.long()
    # to_rank[r, e * ep + s]: copies rank s sends to rank r's local expert e.
    to_rank = counts_all.view(ep, ep, local).permute(1, 2, 0).reshape(ep, local * ep)
    first = to_rank.cumsum(1) - to_rank
    received = to_rank.sum(1)
    sent_start = counts_all.cumsum(1) - counts_all
    expert_ends = (first[me] + to_rank[me]).view(local, ep)[:, -1].clamp(max=capacity)
    expert_counts = torch.diff(expert_ends, prepend=expert_ends.new_zeros(1))
    expert = top_i.long()
    owner = expert // local
    slot = first[owner, (expert % local) * ep + me] + copy_row.view_as(expert) - sent_start[me, expert]
    slot = torch.where(slot < capacity, slot, -1)
    return PullPlan(first, sent_start, received, owner.to(torch.int32), slot.to(torch.int32), expert_counts,
                    (received > capacity).any())


def routing_meta(top_i: torch.Tensor, copy_row: torch.Tensor, top_w: torch.Tensor) -> torch.Tensor:
    """What a rank publishes about its copies, [3, T * k] int32: each copy's expert, its sorted row, its router weight
    (fp32 bits)."""
    return torch.stack([top_i.reshape(-1).to(torch.int32), copy_row.reshape(-1).to(torch.int32),
                        top_w.detach().float().reshape(-1).view(torch.int32)])


def receiver_slots(meta_all: torch.Tensor, first: torch.Tensor, sent_start: torch.Tensor, me: int, local: int, capacity: int,
                   k: int) -> torch.Tensor:
    """[ep, T, k] int64: where rank s's copy (t, j) lands among my received rows, -1 where it is not mine or is cut
    (``meta_all``: every rank's ``routing_meta``). ``expand_forward``'s slots, in torch."""
    ep = meta_all.shape[0]
    expert = meta_all[:, 0].long().view(ep, -1, k)
    sorted_row = meta_all[:, 1].long().view(ep, -1, k)
    source = torch.arange(ep, device=expert.device).view(ep, 1, 1).expand_as(expert)
    mine = expert // local == me
    slot = first[me][(expert % local) * ep + source] + sorted_row - sent_start[source, expert]
    return torch.where(mine & (slot < capacity), slot, -1)


def _scatter_rows(rows: torch.Tensor, slots: torch.Tensor, capacity: int) -> torch.Tensor:
    """[capacity, *] with ``rows[i]`` at ``slots[i]`` (slots < 0: nowhere), zeros elsewhere; no host read."""
    into = torch.where(slots >= 0, slots, capacity)  # the cut and the others' go to a row past the end, then dropped
    out = rows.new_zeros(capacity + 1, *rows.shape[1:])
    return out.index_copy(0, into, rows)[:capacity]


# The kernels' work in torch (``GatheredPeers``; the reference of pull_kernel.py's kernels in the tests). ``slots``
# [ep, T, k]: ``receiver_slots``; a pair q = s * T + t is rank s's token t.

def expanded(x_all: torch.Tensor, w_all: torch.Tensor, slots: torch.Tensor, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``expand_forward``: each pair's row (``x_all`` [ep, T, H]) at its slots, their weights (``w_all`` [ep, T, k])."""
    ep, tokens, h = x_all.shape
    rows = x_all.unsqueeze(2).expand(ep, tokens, slots.shape[2], h).reshape(-1, h)
    flat = slots.reshape(-1)
    return _scatter_rows(rows, flat, capacity), _scatter_rows(w_all.reshape(-1).float(), flat, capacity)


def expanded_backward(d_all: torch.Tensor, slots: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``expand_backward``: each pair's gradient (``d_all`` [ep, T, H]) times its slots' weights, and each slot's
    output (``y`` [capacity, H]) dotted with it."""
    capacity, h = y.shape
    d = d_all.reshape(-1, 1, h).float()
    at = slots.reshape(d.shape[0], -1).clamp(min=0)
    d_y = (w[at].unsqueeze(-1) * d).to(y.dtype).reshape(-1, h)
    d_w = (y[at].float() * d).sum(-1).reshape(-1)
    return _scatter_rows(d_y, slots.reshape(-1), capacity), _scatter_rows(d_w, slots.reshape(-1), capacity)


def pair_sums(rows: torch.Tensor, slots: torch.Tensor, w: torch.Tensor | None = None) -> torch.Tensor:
    """``sum_slots``: [ep * T, H] fp32, each pair's slots of ``rows`` summed (times ``w``), zeros for none (the
    shared buffer holds them in ``rows``' dtype)."""
    at = slots.reshape(-1, slots.shape[-1])
    picked = rows[at.clamp(min=0)].float()
    if w is not None:
        picked = picked * w[at.clamp(min=0)].unsqueeze(-1)
    # where, not a product with the mask: a row read for no slot may hold anything, NaN included (0 x NaN is NaN)
    return torch.where((at >= 0).unsqueeze(-1), picked, 0.0).sum(1)


def rank_sums(s_all: torch.Tensor, owner: torch.Tensor, slot: torch.Tensor, me: int, dtype: torch.dtype) -> torch.Tensor:
    """``sum_ranks``: each of my tokens' rows (``me * T + t`` of ``s_all`` [ep, ep * T, H]) summed in fp32 over the
    ranks holding one of its kept copies, in ``dtype``."""
    ep, tokens = s_all.shape[0], owner.shape[0]
    holds = ((owner.long().unsqueeze(-1) == torch.arange(ep, device=owner.device)) & (slot >= 0).unsqueeze(-1)).any(1)
    mine = s_all[:, me * tokens : (me + 1) * tokens].float()
    return torch.where(holds.T.unsqueeze(-1), mine, 0.0).sum(0).to(dtype)  # a rank's row for no copy may hold anything


def read_at(gw_all: torch.Tensor, owner: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """``read_scalars``: entry ``slot`` of rank ``owner``'s row of ``gw_all`` [ep, capacity] (0 where slot < 0)."""
    return torch.where(slot >= 0, gw_all[owner.long(), slot.long().clamp(min=0)], 0.0)


class GatheredPeers:
    """The peers' buffers all-gathered over ``group`` (any backend) and the kernels' work in torch: what
    ``SymmetricPeers`` does in place. Every rank receives every buffer, so it is for tests on CPU ranks, not speed."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.ep = dist.get_world_size(group)
        self.x_all = self.meta_all = self.counts_all = self.s_all = self.gw_all = None

    def _gather(self, t: torch.Tensor) -> torch.Tensor:
        everyone = [torch.empty_like(t) for _ in range(self.ep)]
        dist.all_gather(everyone, t.contiguous(), group=self.group)
        return torch.stack(everyone)

    def share(self, x: torch.Tensor, meta: torch.Tensor | None = None, counts: torch.Tensor | None = None) -> None:
        self.x_all = self._gather(x)
        if meta is not None:
            self.meta_all, self.counts_all = self._gather(meta), self._gather(counts)

    def all_counts(self) -> torch.Tensor:
        return self.counts_all

    def expand_forward(self, plan: PullPlan, me: int, local: int, capacity: int, k: int):
        slots = receiver_slots(self.meta_all, plan.first, plan.sent_start, me, local, capacity, k)
        w_all = self.meta_all[:, 2].contiguous().view(torch.float32)
        arrived, w = expanded(self.x_all, w_all, slots, capacity)
        return arrived, w, slots.reshape(-1, k)

    def expand_backward(self, slots: torch.Tensor, w: torch.Tensor, y: torch.Tensor, received: torch.Tensor, me: int):
        return expanded_backward(self.x_all, slots, w, y)

    def share_sums(self, rows: torch.Tensor, slots: torch.Tensor, w: torch.Tensor | None = None,
                   grad_w: torch.Tensor | None = None) -> None:
        self.s_all = self._gather(pair_sums(rows, slots, w).to(rows.dtype))
        if grad_w is not None:
            self.gw_all = self._gather(grad_w)

    def sum_ranks(self, plan: PullPlan, me: int) -> torch.Tensor:
        return rank_sums(self.s_all, plan.owner, plan.slot, me, self.x_all.dtype)

    def weight_grads(self, plan: PullPlan) -> torch.Tensor:
        return read_at(self.gw_all, plan.owner, plan.slot)


class SymmetricPeers:
    """``GatheredPeers``' contract in GPU memory every rank of ``group`` maps (torch's symmetric memory): buffers X
    (``tokens`` x H: my tokens, then my output's gradient), S (ep * ``tokens`` x H: per (source, token) sums), GW
    (``capacity`` fp32: the weights' gradients), the routing meta and the counts; one set per shape, shared by every
    layer (the X, S alternation keeps that safe)."""

    def __init__(self, group: dist.ProcessGroup, tokens: int, k: int, capacity: int, hidden: int, dtype: torch.dtype,
                 experts: int, device: torch.device):
        # Private module: torch has no public symmetric-memory API yet (2.11); rendezvous maps every rank's allocation.
        import torch.distributed._symmetric_memory as symm_mem

        from megablocks_utils.moe import pull_kernel  # Triton: imported where a GPU runs it

        self.kernels = pull_kernel
        self.ep = dist.get_world_size(group)
        self.x = symm_mem.empty(tokens, hidden, dtype=dtype, device=device)
        self.s = symm_mem.empty(self.ep * tokens, hidden, dtype=dtype, device=device)  # sums in the compute dtype
        self.gw = symm_mem.empty(capacity, dtype=torch.float32, device=device)
        self.meta = symm_mem.empty(3, tokens * k, dtype=torch.int32, device=device)
        self.counts = symm_mem.empty(1, experts, dtype=torch.int64, device=device)
        self.tables = {}
        for name in ("x", "s", "gw", "meta", "counts"):
            t = getattr(self, name)
            handle = symm_mem.rendezvous(t, group.group_name)
            peers = [handle.get_buffer(r, tuple(t.shape), t.dtype) for r in range(self.ep)]
            if peers[handle.rank].data_ptr() != t.data_ptr():
                raise RuntimeError("symmetric memory: this rank's own view is not its buffer; the exchange cannot read peers")
            self.tables[name] = torch.tensor([p.data_ptr() for p in peers], dtype=torch.int64, device=device)
        self.handle = handle  # any buffer's handle serves for the barrier
        # The padding rows past the valid ones (up to capacity) of the copies and of their gradients: zeroed only for one
        # local expert, whose plain GEMMs run over every row and sum the padding into the weights' gradients (zeros keep
        # those exact). Grouped GEMMs stop at their last offset and the per-expert loop runs on the valid rows
        # (``layer.compute_valid_rows``), so with more experts nothing reads them: ~2x the mean rows a layer at factor 3,
        # not written twice (forward and backward).
        self.zero_padding = experts // self.ep == 1
        self.every_rank = torch.arange(self.ep, dtype=torch.int32, device=device)
        self.first_row = torch.zeros(self.ep, dtype=torch.int32, device=device)

    def share(self, x: torch.Tensor, meta: torch.Tensor | None = None, counts: torch.Tensor | None = None) -> None:
        self.x.copy_(x)
        if meta is not None:
            self.meta.copy_(meta)
            self.counts[0].copy_(counts)
        self.handle.barrier(channel=0)

    def all_counts(self) -> torch.Tensor:
        out = torch.empty(self.ep, self.counts.shape[1], dtype=torch.int64, device=self.counts.device)
        return self.kernels.pull_rows(self.tables["counts"], self.every_rank, self.first_row, out)

    def expand_forward(self, plan: PullPlan, me: int, local: int, capacity: int, k: int):
        tokens = self.x.shape[0]
        out = torch.empty(capacity, self.x.shape[1], dtype=self.x.dtype, device=self.x.device)
        w = torch.empty(capacity, dtype=torch.float32, device=self.x.device)
        # a power of two of columns (Triton's ranges): -1 past k
        slots = torch.empty(self.ep * tokens, 1 << (k - 1).bit_length(), dtype=torch.int32, device=self.x.device)
        self.kernels.expand_forward(self.tables["x"], self.tables["meta"], plan.first, plan.sent_start, plan.received, out,
                                    w, slots, tokens, k, self.ep, local, me, zero_padding=self.zero_padding)
        return out, w, slots

    def expand_backward(self, slots: torch.Tensor, w: torch.Tensor, y: torch.Tensor, received: torch.Tensor, me: int):
        d_y, d_w = torch.empty_like(y), torch.empty(y.shape[0], dtype=torch.float32, device=y.device)
        self.kernels.expand_backward(self.tables["x"], slots, w, y, received, d_y, d_w, self.x.shape[0], self.ep, me,
                                     zero_padding=self.zero_padding)
        return d_y, d_w

    def share_sums(self, rows: torch.Tensor, slots: torch.Tensor, w: torch.Tensor | None = None,
                   grad_w: torch.Tensor | None = None) -> None:
        self.kernels.sum_slots(rows, w, slots, self.s)
        if grad_w is not None:
            self.gw.copy_(grad_w)
        self.handle.barrier(channel=0)

    def sum_ranks(self, plan: PullPlan, me: int) -> torch.Tensor:
        out = torch.empty_like(self.x)
        self.kernels.sum_ranks(self.tables["s"], plan.owner, plan.slot, out, self.ep, me)
        return out

    def weight_grads(self, plan: PullPlan) -> torch.Tensor:
        out = torch.empty(plan.slot.shape, dtype=torch.float32, device=plan.slot.device)
        self.kernels.read_scalars(self.tables["gw"], plan.owner, plan.slot, out)
        return out


_SYMMETRIC: dict[tuple, SymmetricPeers] = {}


def symmetric_peers(group: dist.ProcessGroup, tokens: int, k: int, capacity: int, hidden: int, dtype: torch.dtype,
                    experts: int, device: torch.device) -> SymmetricPeers:
    """The ``SymmetricPeers`` of this group and shape, made at first use (a collective: every rank makes it at the same
    layer; outside a CUDA graph's capture, which the graphs' eager warm-up steps ensure)."""
    key = (group.group_name, tokens, k, capacity, hidden, dtype, experts, device)
    if key not in _SYMMETRIC:
        try:
            _SYMMETRIC[key] = SymmetricPeers(group, tokens, k, capacity, hidden, dtype, experts, device)
        except RuntimeError as e:
            raise RuntimeError(f"the static exchange could not map the ep ranks' GPU memory to each other ({e}); run with "
                               "--ep_capacity_factor 0 (the exact exchange)") from e
    return _SYMMETRIC[key]


class _TokensOut(torch.autograd.Function):
    """The trip out: ``x`` and ``top_w`` (already published with the meta) -> the copies for my experts [capacity, H],
    their router weights [capacity] and the slots table (for the trip back). Backward: the copies' gradients summed per
    (source, token) into S, the weights' into GW; each of my tokens' summed over its ranks."""

    @staticmethod
    def forward(ctx, x, top_w, peers, plan, me, local, capacity):
        arrived, weights, slots = peers.expand_forward(plan, me, local, capacity, top_w.shape[1])
        ctx.peers, ctx.plan, ctx.me, ctx.w_dtype = peers, plan, me, top_w.dtype
        ctx.save_for_backward(slots)
        ctx.mark_non_differentiable(slots)
        return arrived, weights, slots

    @staticmethod
    def backward(ctx, d_arrived, d_weights, _):
        (slots,) = ctx.saved_tensors
        ctx.peers.share_sums(d_arrived.contiguous(), slots, grad_w=d_weights if ctx.needs_input_grad[1] else None)
        d_x = ctx.peers.sum_ranks(ctx.plan, ctx.me)
        d_top_w = ctx.peers.weight_grads(ctx.plan).to(ctx.w_dtype) if ctx.needs_input_grad[1] else None
        return d_x, d_top_w, None, None, None, None, None


class _TokensBack(torch.autograd.Function):
    """The trip back: the experts' outputs at my slots and their weights -> each of my tokens' output [T, H] (weighted,
    summed per (source, token) into S; each token's summed over its ranks). Backward: the output's gradient published
    in X, read once per (source, token) into each slot (times its weight) and each weight's gradient."""

    @staticmethod
    def forward(ctx, y, weights, slots, peers, plan, me):
        peers.share_sums(y, slots, w=weights)
        ctx.peers, ctx.received, ctx.me = peers, plan.received, me
        ctx.save_for_backward(y, weights, slots)
        return peers.sum_ranks(plan, me)

    @staticmethod
    def backward(ctx, d_out):
        y, weights, slots = ctx.saved_tensors
        ctx.peers.share(d_out.contiguous())
        d_y, d_w = ctx.peers.expand_backward(slots, weights, y, ctx.received, ctx.me)
        return d_y, d_w, None, None, None, None


def pull_exchange(
    x: torch.Tensor,
    top_i: torch.Tensor,
    top_w: torch.Tensor,
    copy_row: torch.Tensor,
    counts: torch.Tensor,
    ep: int,
    local: int,
    group: dist.ProcessGroup,
    compute: Callable[[torch.Tensor, torch.Tensor, None], torch.Tensor],
    capacity: int,
    peers=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's experts on ``x`` [T, H] routed by ``top_i``, ``top_w`` [T, k] (``copy_row`` [T * k] and ``counts``
    [ep * local]: the route's, ``dispatch.route``): each token's copies weighted and summed, [T, H] in x's dtype, and the
    overflow flag. Each rank receives at most ``capacity`` rows (``pull_capacity``) and reads from its peers
    (``peers``: ``SymmetricPeers`` by default, ``GatheredPeers`` in tests); ``compute`` as ``static_exchange``'s."""
    if capacity < 1:
        raise ValueError(f"capacity={capacity}: give at least one row (pull_capacity sizes it)")
    tokens, k = top_i.shape
    if peers is None:
        peers = symmetric_peers(group, tokens, k, capacity, x.shape[1], x.dtype, ep * local, x.device)
    me = dist.get_rank(group)
    # The meta and counts ride with the trip out's rows (one barrier); the plan needs every rank's counts.
    peers.share(x.detach(), routing_meta(top_i, copy_row, top_w), counts)
    plan = pull_plan(peers.all_counts(), me, local, capacity, top_i, copy_row)
    arrived, weights, slots = _TokensOut.apply(x, top_w, peers, plan, me, local, capacity)
    expert_out = compute(arrived, plan.expert_counts, None)
    return _TokensBack.apply(expert_out, weights, slots, peers, plan, me), plan.overflow
