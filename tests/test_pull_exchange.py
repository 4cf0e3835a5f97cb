"""``pull_exchange`` (moe/pull_exchange.py): the static exchange whose ranks read their rows from each other's buffers.

On one process: the maps (where each received row is read from, where each sent row's output comes back from, the rows
per local expert and the overflow flag) against a loop that deals the rows out one by one, for routings with ranks and
experts that receive nothing and for capacities that cut; the pull kernel in Triton's CPU interpreter, reading rows of
CPU tensors by their addresses as it reads peers' GPU memory. On 2 and 4 gloo ranks (the peers' buffers all-gathered,
``GatheredPeers``): with a capacity nothing overflows, outputs and gradients of the routed rows and both expert weights
equal ``exchange``'s; every operator sees the same shapes for different routings, and none reads data on the host;
with a capacity that cuts, the flag is set on every rank exactly when some rank would receive more, the rows that fit
get their exact outputs and the cut ones zeros. The symmetric-memory transport itself runs on GPUs only
(tests/gpu/test_pull_exchange.py).
"""

import itertools

import pytest
import torch

from megablocks_utils.moe.pull_exchange import pull_capacity, pull_maps
from tests.conftest import run_in_triton_interpreter, run_ranks
from tests.test_static_exchange import K, LOCAL, TOKENS, make_experts, routing, run_layer


def dealt(counts_all: list[list[int]], local: int, capacity: int):
    """The exchange done by hand: every rank's received rows (expert-major, then by source) as (source, sent row), cut
    at ``capacity``; and for every rank's sent rows, (owner, received row) or (owner, -1) where cut."""
    ep = len(counts_all)
    received = {r: [] for r in range(ep)}
    for r, e, s in itertools.product(range(ep), range(local), range(ep)):
        g = r * local + e
        start = sum(counts_all[s][:g])
        received[r] += [(s, start + i, e) for i in range(counts_all[s][g])]
    back = {s: [] for s in range(ep)}
    for s in range(ep):
        for g, n in enumerate(counts_all[s]):
            for i in range(n):
                row = sum(counts_all[s][:g]) + i
                at = received[g // local].index((s, row, g % local))
                back[s].append((g // local, at if at < capacity else -1))
    return {r: rows[:capacity] for r, rows in received.items()}, back, any(len(v) > capacity for v in received.values())


@pytest.mark.parametrize("capacity", [40, 9, 3])
def test_pull_maps_equal_the_rows_dealt_by_hand(capacity):
    ep, local = 3, 2
    counts_all = [[2, 0, 1, 3, 0, 0], [0, 0, 0, 0, 0, 0], [1, 4, 0, 2, 2, 1]]  # rank 1 sends nothing; experts 4-5 rank 2's
    received, back, overflow = dealt(counts_all, local, capacity)
    for me in range(ep):
        rows = sum(counts_all[me])
        maps = pull_maps(torch.tensor(counts_all), me, local, capacity, rows)
        assert maps.out_rank.shape == maps.out_row.shape == (capacity,) and maps.back_row.shape == (rows,)
        got = [(int(r), int(i)) for r, i in zip(maps.out_rank, maps.out_row) if i >= 0]
        assert got == [(s, i) for s, i, _ in received[me]], (me, got, received[me])
        assert (maps.out_row[len(received[me]):] == -1).all()
        assert list(zip(maps.back_rank.tolist(), maps.back_row.tolist())) == back[me]
        assert maps.expert_counts.tolist() == [sum(1 for *_, e in received[me] if e == x) for x in range(local)]
        assert bool(maps.overflow) == overflow


def test_a_failed_symmetric_memory_setup_says_what_to_run(monkeypatch):
    from types import SimpleNamespace

    from megablocks_utils.moe import pull_exchange

    def fails(*args):
        raise RuntimeError("peer access unsupported")

    monkeypatch.setattr(pull_exchange, "SymmetricPeers", fails)
    with pytest.raises(RuntimeError, match="peer access unsupported.*--ep_capacity_factor 0"):
        pull_exchange.symmetric_peers(SimpleNamespace(group_name="g"), 8, 16, 4, torch.bfloat16, 4, torch.device("cpu"))


def test_pull_capacity_counts_a_receivers_rows():
    assert pull_capacity(4096, 8, 4, 2.0) == 65536
    assert pull_capacity(4096, 8, 2, 1.3) == 42624  # 42598.4 -> 42599 -> 333 tiles of 128
    assert pull_capacity(10, 2, 2, 9.0, multiple=8) == 40  # all ranks' rows, rounded up to the tile
    with pytest.raises(ValueError, match="positive factor"):
        pull_capacity(4096, 8, 2, 0)


def test_pull_kernel_reads_rows_by_address_in_the_interpreter():
    result = run_in_triton_interpreter(
        "import json, torch\n"
        "from megablocks_utils.moe.pull_kernel import pull_rows\n"
        "g = torch.Generator().manual_seed(0)\n"
        "ok = []\n"
        "for dtype, h in ((torch.bfloat16, 40), (torch.float32, 2500), (torch.int64, 6)):\n"
        "    bufs = [(torch.randn(10, h, generator=g) * 100).to(dtype) for _ in range(3)]\n"
        "    table = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64)\n"
        "    rank = torch.randint(0, 3, (17,), generator=g).to(torch.int32)\n"
        "    row = torch.randint(-1, 10, (17,), generator=g).to(torch.int32)\n"
        "    out = pull_rows(table, rank, row, torch.full((17, h), 7, dtype=dtype))\n"
        "    want = torch.stack([bufs[r][i] if i >= 0 else torch.zeros(h, dtype=dtype) for r, i in zip(rank.tolist(), row.tolist())])\n"
        "    ok.append(bool(torch.equal(out, want)) and bool((row < 0).any()))\n"
        "print(json.dumps(ok))\n")
    assert result == [True, True, True]


def _pull_on_ranks(rank: int, ep: int) -> None:
    import torch.distributed as dist

    experts = make_experts(rank, ep)
    everything = ep * TOKENS * K  # every row of every rank fits one receiver
    traces = {}
    for kind in ("skewed", "one_rank_receives", "idle_experts"):
        top_i = routing(kind, rank, ep)
        want = run_layer(experts, top_i, "exact")
        traces[kind] = []
        got = run_layer(experts, top_i, "pull", everything, guard_trace=traces[kind])
        assert not got[1], kind
        for name, a, b in zip(("out", "d_x", "d_gate_up", "d_down"), got[:1] + got[2:5], want[:1] + want[2:5]):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=lambda m, n=name: f"{kind} {n}: {m}")
    assert traces["skewed"] == traces["one_rank_receives"] == traces["idle_experts"] and len(traces["skewed"]) > 30

    # Cut: rank 0 receives everything under "one_rank_receives"; a capacity of half of that overflows on every rank.
    for kind, capacity in (("one_rank_receives", everything // 2), ("balanced", TOKENS * K), ("balanced", TOKENS * K - 1)):
        top_i = routing(kind, rank, ep)
        want = run_layer(experts, top_i, "exact")
        got = run_layer(experts, top_i, "pull", capacity)
        counts = torch.zeros(ep * LOCAL, dtype=torch.long).scatter_add_(0, top_i.reshape(-1), torch.ones(TOKENS * K, dtype=torch.long))
        every = [torch.empty_like(counts) for _ in range(ep)]
        dist.all_gather(every, counts)
        _, back, overflows = dealt([c.tolist() for c in every], LOCAL, capacity)
        assert bool(got[1]) == overflows, (kind, capacity)
        kept = torch.tensor([row >= 0 for _, row in back[rank]])
        torch.testing.assert_close(got[0][kept], want[0][kept], rtol=1e-6, atol=1e-6)
        assert torch.all(got[0][~kept] == 0) and (overflows or kept.all())


@pytest.mark.parametrize("ep", [2, 4])
def test_pull_exchange_equals_exchange_and_flags_overflow(ep):
    run_ranks(_pull_on_ranks, ep)
