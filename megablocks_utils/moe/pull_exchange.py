"""The static exchange without padding on the wire: each rank reads the rows it needs from its peers' buffers.

Why: ``static_exchange`` has fixed shapes (no host sync, so a micro-step can be one CUDA graph at ep > 1) but sends
through NCCL's all-to-all in equal blocks of ``capacity`` rows, padding included: at a factor that never overflows it
moves twice the bytes or more, and past it a micro-step reruns (the fifteenth session: 8% slower at ep 2, every ep 4
step rerun). Here the rows stay where they are made, in a buffer every rank of the ep group can read (torch's symmetric
memory on GPUs, ``SymmetricPeers``), and each rank pulls exactly its rows (``pull_kernel.pull_rows``): the bytes of
the exact exchange, at shapes that depend on (rows, ep, local experts, capacity) alone.

  trip out: my routed rows and counts into buffer A, barrier -> every rank's counts read -> the maps (``pull_maps``) ->
  my experts' rows pulled from every rank, expert-major, zeros past the valid ones ([capacity, H]) -> ``compute`` ->
  trip back: its output into buffer B, barrier -> my rows' outputs pulled from the ranks that computed them.

The backward runs the same two pulls the other way (the gradient of the trip back through A, of the trip out through
B), so the buffers alternate A, B, A, B in every order autograd and checkpointing run them. That alternation is what
makes one barrier a pull enough: a rank writes A again only after a barrier that every peer reached after its last
read of A. ``capacity`` counts the rows one rank receives in all (a peer's mean share is ``rows``); when some rank
would receive more, its rows past ``capacity`` (its last experts' last rows) are dropped both ways, and ``overflow`` is
set, the same on every rank with no collective (every rank has every count): ``exchange_mode`` reruns such a forward
on the exact exchange, as for ``static_exchange``.

``GatheredPeers`` is the same contract over any process group (every buffer all-gathered): the CPU tests' transport.
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


class PullMaps(NamedTuple):
    out_rank: torch.Tensor  # [capacity] int32: the rank each received row is read from
    out_row: torch.Tensor  # [capacity] int32: its row in that rank's sent rows (-1: padding, a zero row)
    back_rank: torch.Tensor  # [rows] int32: the rank that computed each of my sent rows
    back_row: torch.Tensor  # [rows] int32: its row in that rank's received rows (-1: dropped, a zero row)
    expert_counts: torch.Tensor  # [local] int64: received rows per local expert (within capacity)
    overflow: torch.Tensor  # bool: some rank would receive more than capacity rows


def pull_maps(counts_all: torch.Tensor, me: int, local: int, capacity: int, rows: int) -> PullMaps:
    """Where every row comes from, both ways, from ``counts_all`` [ep, ep * local] (rank s's rows for global expert g;
    each rank's ``rows`` sent rows are in expert order): on the device, shapes fixed by (ep, local, capacity, rows)."""
    ep = counts_all.shape[0]
    device = counts_all.device
    counts_all = counts_all.long()
    # to_rank[r, e * ep + s]: rows rank s sends to rank r's local expert e (r receives them expert-major, then by source).
    to_rank = counts_all.view(ep, ep, local).permute(1, 2, 0).reshape(ep, local * ep)
    first = to_rank.cumsum(1) - to_rank  # where block (e, s) starts among rank r's received rows
    received = to_rank.sum(1)
    sent_start = counts_all.cumsum(1) - counts_all  # where rank s's rows for expert g start among its sent rows

    # Trip out: my received row p is in block (e, s) = divmod(block, ep), row p - first of rank s's rows for my expert e.
    slot = torch.arange(capacity, device=device)
    ends = first[me] + to_rank[me]
    block = torch.searchsorted(ends, slot, right=True).clamp_(max=local * ep - 1)
    source = block % ep
    out_row = sent_start[source, me * local + block // ep] + slot - first[me, block]
    out_row = torch.where(slot < received[me], out_row, -1)
    expert_ends = ends.view(local, ep)[:, -1].clamp(max=capacity)
    expert_counts = torch.diff(expert_ends, prepend=expert_ends.new_zeros(1))

    # Trip back: my sent row i went to expert g = (r, e); rank r holds it at its block (e, me), row i - my start for g.
    row = torch.arange(rows, device=device)
    expert = torch.searchsorted(counts_all[me].cumsum(0), row, right=True).clamp_(max=ep * local - 1)
    owner = expert // local
    back_row = first[owner, (expert % local) * ep + me] + row - sent_start[me, expert]
    back_row = torch.where(back_row < capacity, back_row, -1)
    return PullMaps(source.to(torch.int32), out_row.to(torch.int32), owner.to(torch.int32), back_row.to(torch.int32),
                    expert_counts, (received > capacity).any())


class GatheredPeers:
    """The peers' buffers all-gathered over ``group`` (any backend): what ``SymmetricPeers`` reads in place, copied.
    Every rank receives every row, so it is for tests on CPU ranks, not for speed."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.ep = dist.get_world_size(group)
        self.published: dict[int, torch.Tensor] = {}
        self.counts: torch.Tensor | None = None

    def publish(self, slot: int, rows: torch.Tensor, counts: torch.Tensor | None = None) -> None:
        gathered = [torch.empty_like(rows) for _ in range(self.ep)]
        dist.all_gather(gathered, rows.contiguous(), group=self.group)
        self.published[slot] = torch.stack(gathered)
        if counts is not None:
            everyone = [torch.empty_like(counts) for _ in range(self.ep)]
            dist.all_gather(everyone, counts.contiguous(), group=self.group)
            self.counts = torch.stack(everyone)

    def all_counts(self) -> torch.Tensor:
        return self.counts

    def pull(self, slot: int, src_rank: torch.Tensor, src_row: torch.Tensor) -> torch.Tensor:
        rows = self.published[slot][src_rank.long(), src_row.clamp(min=0).long()]
        return rows * (src_row >= 0).unsqueeze(-1).to(rows.dtype)


class SymmetricPeers:
    """Buffers A (``rows_a`` x H: what a rank sends out and the gradients coming back) and B (``rows_b`` x H: the
    experts' outputs and the gradients going out), and the counts, in GPU memory every rank of ``group`` maps (torch's
    symmetric memory); one set per shape, shared by every layer (the A/B alternation keeps that safe)."""

    def __init__(self, group: dist.ProcessGroup, rows_a: int, rows_b: int, hidden: int, dtype: torch.dtype, experts: int,
                 device: torch.device):
        # Private module: torch has no public symmetric-memory API yet (2.11); rendezvous maps every rank's allocation.
        import torch.distributed._symmetric_memory as symm_mem

        from megablocks_utils.moe.pull_kernel import pull_rows  # Triton: imported where a GPU runs it

        self._pull_rows = pull_rows
        self.ep = dist.get_world_size(group)
        self.buffers = [symm_mem.empty(rows, hidden, dtype=dtype, device=device) for rows in (rows_a, rows_b)]
        self.counts = symm_mem.empty(1, experts, dtype=torch.int64, device=device)
        self.tables = []
        for t in (*self.buffers, self.counts):
            handle = symm_mem.rendezvous(t, group.group_name)
            peers = [handle.get_buffer(r, tuple(t.shape), t.dtype) for r in range(self.ep)]
            if peers[handle.rank].data_ptr() != t.data_ptr():
                raise RuntimeError("symmetric memory: this rank's own view is not its buffer; the exchange cannot read peers")
            self.tables.append(torch.tensor([p.data_ptr() for p in peers], dtype=torch.int64, device=device))
        self.handle = handle
        self.every_rank = torch.arange(self.ep, dtype=torch.int32, device=device)
        self.first_row = torch.zeros(self.ep, dtype=torch.int32, device=device)

    def publish(self, slot: int, rows: torch.Tensor, counts: torch.Tensor | None = None) -> None:
        self.buffers[slot][: rows.shape[0]].copy_(rows)
        if counts is not None:
            self.counts[0].copy_(counts)
        self.handle.barrier(channel=0)

    def all_counts(self) -> torch.Tensor:
        out = torch.empty(self.ep, self.counts.shape[1], dtype=torch.int64, device=self.counts.device)
        return self._pull_rows(self.tables[2], self.every_rank, self.first_row, out)

    def pull(self, slot: int, src_rank: torch.Tensor, src_row: torch.Tensor) -> torch.Tensor:
        buffer = self.buffers[slot]
        out = torch.empty(src_row.shape[0], buffer.shape[1], dtype=buffer.dtype, device=buffer.device)
        return self._pull_rows(self.tables[slot], src_rank, src_row, out)


_SYMMETRIC: dict[tuple, SymmetricPeers] = {}


def symmetric_peers(group: dist.ProcessGroup, rows_a: int, rows_b: int, hidden: int, dtype: torch.dtype, experts: int,
                    device: torch.device) -> SymmetricPeers:
    """The ``SymmetricPeers`` of this group and shape, made at first use (a collective: every rank makes it at the same
    layer; outside a CUDA graph's capture, which the graphs' eager warm-up steps ensure)."""
    key = (group.group_name, rows_a, rows_b, hidden, dtype, experts, device)
    if key not in _SYMMETRIC:
        try:
            _SYMMETRIC[key] = SymmetricPeers(group, rows_a, rows_b, hidden, dtype, experts, device)
        except RuntimeError as e:
            raise RuntimeError(f"the static exchange could not map the ep ranks' GPU memory to each other ({e}); run with "
                               "--ep_capacity_factor 0 (the exact exchange)") from e
    return _SYMMETRIC[key]


class _Pull(torch.autograd.Function):
    """Rows published into buffer ``slot`` and pulled by (``rank``, ``row``); the backward publishes the gradient into
    the other buffer and pulls it by (``back_rank``, ``back_row``)."""

    @staticmethod
    def forward(ctx, rows, peers, slot, rank, row, back_rank, back_row):
        ctx.peers, ctx.slot = peers, slot
        ctx.save_for_backward(back_rank, back_row)
        peers.publish(slot, rows)
        return peers.pull(slot, rank, row)

    @staticmethod
    def backward(ctx, grad):
        back_rank, back_row = ctx.saved_tensors
        ctx.peers.publish(1 - ctx.slot, grad)
        return ctx.peers.pull(1 - ctx.slot, back_rank, back_row), None, None, None, None, None, None


def pull_exchange(
    routed: torch.Tensor,
    counts: torch.Tensor,
    ep: int,
    local: int,
    group: dist.ProcessGroup,
    compute: Callable[[torch.Tensor, torch.Tensor, None], torch.Tensor],
    capacity: int,
    peers=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``static_exchange``'s contract (``routed`` [rows, H] in expert order, ``counts`` [ep * local] on the device; the
    outputs in the order sent and the overflow flag), each rank receiving at most ``capacity`` rows (``pull_capacity``)
    and reading them from its peers (``peers``: ``SymmetricPeers`` by default, ``GatheredPeers`` in tests)."""
    if capacity < 1:
        raise ValueError(f"capacity={capacity}: give at least one row (pull_capacity sizes it)")
    rows, hidden = routed.shape
    if peers is None:
        peers = symmetric_peers(group, rows, capacity, hidden, routed.dtype, ep * local, routed.device)
    me = dist.get_rank(group)
    # The counts ride with the trip out's rows (one barrier); the maps need every rank's before the rows are pulled.
    peers.publish(0, routed.detach(), counts)
    maps = pull_maps(peers.all_counts(), me, local, capacity, rows)
    arrived = _PullPublished.apply(routed, peers, maps.out_rank, maps.out_row, maps.back_rank, maps.back_row)
    expert_out = compute(arrived, maps.expert_counts, None)
    returned = _Pull.apply(expert_out, peers, 1, maps.back_rank, maps.back_row, maps.out_rank, maps.out_row)
    return returned, maps.overflow


class _PullPublished(_Pull):
    """The trip out: its rows (and counts) were published before the maps were made, so the forward only pulls."""

    @staticmethod
    def forward(ctx, rows, peers, rank, row, back_rank, back_row):
        ctx.peers, ctx.slot = peers, 0
        ctx.save_for_backward(back_rank, back_row)
        return peers.pull(0, rank, row)

    @staticmethod
    def backward(ctx, grad):
        return _Pull.backward(ctx, grad)[:6]
