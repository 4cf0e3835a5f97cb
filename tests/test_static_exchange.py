"""``static_exchange`` (moe/static_exchange.py): the exchange in blocks of a fixed capacity, with no host sync.

On 2 and 4 gloo ranks, through the experts' grouped GEMM (torch runs it on CPU in fp32; rows past the valid count come
out as garbage there, as on GPUs): with a capacity no routing can overflow, the outputs and the gradients of the routed
rows and of both expert weights equal ``exchange``'s, for skewed routing, for ranks that receive no rows and for
local experts that receive none. The overflow flag is set, on every rank, exactly when some rank has more rows for
some rank than the capacity (whichever rank sends them); the rows that fit then still get their exact outputs, the
others zeros. Under a guard that fails on any host read of tensor data and on any operator whose output size depends
on data, the layer's forward and backward run through, every operator sees the same shapes for two different
routings, and a compute that reads its counts on the host is caught (``test_guard_catches_each_host_read`` shows the
guard failing on each kind of read it knows).
"""

import os
import sys
from contextlib import contextmanager, nullcontext

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from megablocks_utils.moe.static_exchange import expert_major, send_slots, static_capacity
from tests.conftest import ROOT, nan_in_uninitialized_memory, run_ranks


class HostRead(AssertionError):
    """Tensor data read on the host, or a shape that depends on tensor data: a sync on CUDA."""


# Tensor methods that hand tensor data to Python: on CUDA a device-to-host copy the host waits for. On CPU tolist and
# numpy read memory without an operator, so they are caught here, before dispatch.
HOST_READ_METHODS = {"item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__"}
# Operators whose result is a host value or has a size that depends on the data.
DATA_DEPENDENT_OPS = {
    "aten::_local_scalar_dense", "aten::equal", "aten::nonzero", "aten::masked_select", "aten::_unique", "aten::_unique2",
    "aten::unique_dim", "aten::unique_consecutive", "aten::bincount",
}
MASK_INDEXING_OPS = {"aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"}


class _NoHostReadMethods(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_READ_METHODS:
            raise HostRead(f"Tensor.{name} reads tensor data on the host")
        return func(*args, **(kwargs or {}))


class _NoDataDependentShapes(TorchDispatchMode):
    """Fails on ``DATA_DEPENDENT_OPS``, on indexing by a mask and on ``repeat_interleave`` without ``output_size``;
    records every operator's name and output shapes in ``trace``."""

    def __init__(self, trace: list):
        super().__init__()
        self.trace = trace

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        if name in DATA_DEPENDENT_OPS:
            raise HostRead(f"{func} gives a host value or a shape that depends on data")
        if name == "aten::repeat_interleave" and func._overloadname != "self_int" and kwargs.get("output_size") is None:
            raise HostRead(f"{func} without output_size: its size depends on data")
        if name in MASK_INDEXING_OPS and any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1]):
            raise HostRead(f"{func} with a mask: its size depends on data")
        out = func(*args, **kwargs)
        self.trace.append((name, tuple(tuple(t.shape) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))))
        return out


@contextmanager
def no_host_reads(trace: list | None = None):
    """Inside, a host read of tensor data or a data-dependent shape raises ``HostRead``; ``trace`` gets (operator,
    output shapes) of every operator run."""
    with _NoHostReadMethods(), _NoDataDependentShapes([] if trace is None else trace):
        yield


HOST_READS = {
    "item": lambda t: t.sum().item(),
    "tolist": lambda t: t.tolist(),
    "numpy": lambda t: t.numpy(),
    "cpu": lambda t: t.cpu(),
    "bool": lambda t: bool(t.sum() > 0),
    "int": lambda t: int(t[0]),
    "nonzero": lambda t: t.nonzero(),
    "mask_index": lambda t: t[t > 1],
    # values from a tensor, whose length must be the mask's count (a scalar put is masked_fill_ from torch 2.15 on:
    # no host read there)
    "mask_put": lambda t: t.clone().__setitem__(t > 1, torch.tensor([7, 8])),
    "masked_select": lambda t: torch.masked_select(t, t > 1),
    "unique": lambda t: torch.unique(t),
    "bincount": lambda t: torch.bincount(t),
    "repeat_interleave": lambda t: torch.repeat_interleave(t, t),
    "equal": lambda t: torch.equal(t, t),
}


@pytest.mark.parametrize("read", sorted(HOST_READS))
def test_guard_catches_each_host_read(read):
    t = torch.tensor([3, 0, 2, 1])
    with pytest.raises(HostRead), no_host_reads():
        HOST_READS[read](t)


def test_guard_lets_fixed_shapes_through():
    t = torch.tensor([3, 0, 2, 1])
    trace = []
    with no_host_reads(trace):
        torch.repeat_interleave(torch.arange(4), t, output_size=6)
        torch.where(t > 1, t, 0).cumsum(0)
        torch.searchsorted(t.sort().values, torch.arange(5), right=True)
    assert ("aten::repeat_interleave", ((6,),)) in trace


def test_static_capacity_rounds_a_peers_share_up():
    assert static_capacity(4096, 8, 2, 1.0) == 16384
    assert static_capacity(4096, 8, 2, 1.25) == 20480
    assert static_capacity(4096, 8, 4, 1.3) == 10752  # 10649.6 -> 10650 -> 84 tiles of 128
    assert static_capacity(10, 2, 2, 8.0, multiple=8) == 24  # all 20 rows, rounded up to the tile
    assert static_capacity(1, 1, 4, 1.0) == 128
    with pytest.raises(ValueError, match="positive factor"):
        static_capacity(4096, 8, 2, 0)


@pytest.mark.parametrize("capacity", [5, 3])
def test_send_and_regroup_orders_on_one_process(capacity):
    """The index tensors of both sides: rows in expert order go to their rank's block in order, those past the
    capacity dropped; arrived blocks come out expert-major (``dispatch.regroup_order``'s order where nothing is cut),
    the padding last, and the inverse undoes it."""
    from megablocks_utils.moe.dispatch import regroup_order

    counts = np.array([[2, 0, 1], [0, 0, 0], [1, 3, 1], [0, 2, 0]])  # [ep, local]: rank 1 sends nothing, rank 2 five rows
    ep, local = counts.shape
    kept = np.minimum(counts.cumsum(1), capacity) - np.minimum(counts.cumsum(1) - counts, capacity)
    regroup, inverse, expert_counts = expert_major(torch.from_numpy(counts), capacity)
    assert expert_counts.tolist() == kept.sum(0).tolist()
    assert sorted(regroup.tolist()) == list(range(ep * capacity)) and torch.equal(regroup[inverse], torch.arange(ep * capacity))
    compact, _ = regroup_order(kept)  # into the arrived rows packed without padding: rank s's kept rows start at kept[:s].sum()
    block_of = np.repeat(np.arange(ep), kept.sum(1))
    in_block = np.arange(kept.sum()) - np.repeat(np.cumsum(kept.sum(1)) - kept.sum(1), kept.sum(1))
    assert regroup[: kept.sum()].tolist() == (block_of * capacity + in_block)[compact].tolist()

    sent_rows = torch.tensor([2, 0, 6, 1])
    slot_of_row, row_of_slot = send_slots(sent_rows, 9, capacity)
    starts = [0, 2, 2, 8]
    for r, n in enumerate(sent_rows.tolist()):
        block = row_of_slot[r * capacity:(r + 1) * capacity].tolist()
        assert block == [starts[r] + i for i in range(min(n, capacity))] + [9] * max(0, capacity - n)
        for i in range(n):
            assert slot_of_row[starts[r] + i] == (r * capacity + i if i < capacity else ep * capacity)


# ----------------------------------------------------------------------------- on gloo ranks

TOKENS, K, LOCAL, HIDDEN, INTERMEDIATE = 24, 2, 2, 16, 8


def routing(kind: str, rank: int, ep: int) -> torch.Tensor:
    """This rank's top-k experts [TOKENS, K] (distinct per token) for one kind of routing."""
    experts = ep * LOCAL
    generator = torch.Generator().manual_seed(100 * ep + rank)
    if kind == "skewed":  # Zipf-like expert popularity, the same on every rank; each rank's own tokens
        popularity = 1.0 / (1.0 + torch.randperm(experts, generator=torch.Generator().manual_seed(ep))) ** 1.5
        return torch.multinomial(popularity.expand(TOKENS, experts), K, generator=generator)
    if kind == "one_rank_receives":  # every token to rank 0's experts: the other ranks receive no rows
        return torch.stack([torch.randperm(LOCAL, generator=generator)[:K] for _ in range(TOKENS)])
    if kind == "idle_experts":  # expert 1 (rank 0's second) and the last expert get no rows anywhere
        allowed = torch.tensor([e for e in range(experts) if e not in (1, experts - 1)])
        return allowed[torch.stack([torch.randperm(len(allowed), generator=generator)[:K] for _ in range(TOKENS)])]
    if kind == "balanced" or (kind.startswith("flood") and rank != int(kind[-1])):  # TOKENS * K / ep rows to each rank
        return (torch.arange(TOKENS)[:, None] * K + torch.arange(K)) % experts
    target = (rank + 1) % ep  # flood:s: rank s sends every row to the next rank
    return target * LOCAL + (torch.arange(TOKENS)[:, None] * K + torch.arange(K)) % LOCAL


def make_experts(rank: int, ep: int):
    """This rank's block of one seeded set of experts, on the grouped GEMM path (GPUs' path, here in fp32)."""
    from types import SimpleNamespace

    from megablocks_utils.moe import experts as moe_experts
    from megablocks_utils.moe.layer import ExpertParallelExperts

    moe_experts.grouped_mm_supported = lambda x: True  # this spawned process only: torch's grouped GEMM runs on CPU
    generator = torch.Generator().manual_seed(0)
    gate_up = torch.randn(ep * LOCAL, 2 * INTERMEDIATE, HIDDEN, generator=generator) * 0.3
    down = torch.randn(ep * LOCAL, HIDDEN, INTERMEDIATE, generator=generator) * 0.3
    mine = slice(rank * LOCAL, (rank + 1) * LOCAL)
    experts = ExpertParallelExperts(ep * LOCAL, SimpleNamespace(ep_size=ep), "silu")
    experts.set_weights(torch.nn.Parameter(gate_up[mine].clone()), torch.nn.Parameter(down[mine].clone()))
    return experts


def run_layer(experts, top_i, path, capacity=None, compute=None, guard_trace=None):
    """Route, dispatch, exchange (``path``: "exact" or "static", with ``compute_valid_rows`` unless ``compute`` is given)
    and a backward: (outputs in expert order, the overflow flag, the gradients of x, gate_up and down, the shapes
    compute saw)."""
    import torch.distributed as dist

    from megablocks_utils.moe.dispatch import dispatch, exchange, route
    from megablocks_utils.moe.static_exchange import static_exchange

    ep, experts_count = experts.ep_size, experts.num_experts
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(7 + dist.get_rank())).requires_grad_()
    dy = torch.randn(TOKENS * K, HIDDEN, generator=torch.Generator().manual_seed(9 + dist.get_rank()))
    seen = []

    def through_experts(rows, counts, counts_host):
        seen.append((tuple(rows.shape), tuple(counts.shape), counts_host))
        return (compute or experts.compute)(rows, counts, counts_host)

    experts.gate_up_proj.grad = experts.down_proj.grad = None
    with no_host_reads(guard_trace) if guard_trace is not None else nullcontext():
        r = route(top_i, experts_count)
        routed = dispatch(x, r, K, False)
        if path == "exact":
            out, overflow = exchange([routed], [r.counts], ep, LOCAL, dist.group.WORLD, through_experts)[0], None
        else:
            out, overflow = static_exchange(routed, r.counts, ep, LOCAL, dist.group.WORLD, through_experts, capacity)
        out.backward(dy)
    return out.detach(), overflow, x.grad, experts.gate_up_proj.grad, experts.down_proj.grad, seen


def kept_rows(top_i: torch.Tensor, capacity: int, ep: int) -> torch.Tensor:
    """Which rows (expert order) fit their rank's block of ``capacity`` rows (a test may read counts on the host)."""
    peer = torch.sort(top_i.reshape(-1)).values // LOCAL
    starts = torch.searchsorted(peer, torch.arange(ep))
    return torch.arange(len(peer)) - starts[peer] < capacity


def _static_exchange_on_ranks(rank: int, ep: int) -> None:
    nan_in_uninitialized_memory()  # the padding rows (never written) must not reach any output, even times 0
    experts = make_experts(rank, ep)
    never_overflows = static_capacity(TOKENS, K, ep, float(ep), multiple=8)  # all TOKENS * K rows fit any block
    traces = {}
    for kind in ("skewed", "one_rank_receives", "idle_experts"):
        top_i = routing(kind, rank, ep)
        out, _, d_x, d_gate_up, d_down, _ = run_layer(experts, top_i, "exact")
        traces[kind] = []
        got, overflow, got_d_x, got_d_gate_up, got_d_down, seen = run_layer(experts, top_i, "static", never_overflows,
                                                                            guard_trace=traces[kind])
        assert not overflow, kind
        assert seen == [((ep * never_overflows, HIDDEN), (LOCAL,), None)], seen
        for name, a, b in (("out", got, out), ("d_x", got_d_x, d_x), ("d_gate_up", got_d_gate_up, d_gate_up),
                           ("d_down", got_d_down, d_down)):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=lambda m, n=name: f"{kind} {n}: {m}")
    # The same operators on the same shapes whatever the routing (route, dispatch, the exchange, the GEMMs, backward).
    assert traces["skewed"] == traces["one_rank_receives"] == traces["idle_experts"] and len(traces["skewed"]) > 50

    # A compute that reads its counts on the host is caught by the guard, on every rank alike.
    reads = lambda rows, counts, counts_host: experts.compute(rows, counts, counts.tolist())  # noqa: E731
    try:
        run_layer(experts, routing("skewed", rank, ep), "static", never_overflows, compute=reads, guard_trace=[])
        raise AssertionError("the guard let a compute that reads its counts on the host through")
    except HostRead:
        pass

    # Overflow: exactly when some rank has more rows for some rank than the capacity, whichever rank sends them.
    share = TOKENS * K // ep
    cases = [("balanced", share, False), ("balanced", share - 1, True)]
    cases += [(f"flood:{s}", c, c < TOKENS * K) for s in (0, 1) for c in (TOKENS * K, TOKENS * K - 1)]
    for kind, capacity, overflows in cases:
        top_i = routing(kind, rank, ep)
        out, _, d_x, _, _, _ = run_layer(experts, top_i, "exact")
        got, overflow, got_d_x, _, _, seen = run_layer(experts, top_i, "static", capacity)
        assert overflow.dtype == torch.bool and overflow.shape == () and bool(overflow) == overflows, (kind, capacity, overflow)
        assert got.shape == out.shape and seen[0][0] == (ep * capacity, HIDDEN)
        kept = kept_rows(top_i, capacity, ep)
        assert overflows or kept.all()
        torch.testing.assert_close(got[kept], out[kept], rtol=1e-6, atol=1e-6)
        assert torch.all(got[~kept] == 0)
        if not overflows:
            torch.testing.assert_close(got_d_x, d_x, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("ep", [2, 4])
def test_static_exchange_equals_exchange_and_flags_overflow(ep):
    run_ranks(_static_exchange_on_ranks, ep)


if __name__ == "__main__":
    sys.exit(pytest.main([os.path.join(ROOT, "tests", os.path.basename(__file__)), "-q"]))
