"""``pull_exchange`` (moe/pull_exchange.py): the static exchange whose ranks read what they need from each other's
buffers, one row per token and rank.

On one process: the plan (each of my copies' rank and slot, the rows per local expert, the overflow flag) and the
receivers' slots against a loop that deals the copies out one by one, for routings with ranks and experts that receive
nothing and for capacities that cut; each Triton kernel in Triton's CPU interpreter, reading and writing CPU tensors by
their addresses as it does peers' GPU memory, against the torch work of ``GatheredPeers``. On 2 and 4 gloo ranks (the
peers' buffers all-gathered, ``GatheredPeers``): with a capacity nothing overflows, the layer's output and the gradients
of x, the router weights and both expert weights equal dispatch + ``exchange`` + combine's; every operator sees the same
shapes for different routings, and none reads data on the host; with a capacity that cuts, the flag is set on every
rank exactly when some rank would receive more. The symmetric-memory transport itself runs on GPUs only
(tests/gpu/test_pull_exchange.py).
"""

import itertools
from contextlib import nullcontext

import pytest
import torch

from megablocks_utils.moe.pull_exchange import pull_capacity, pull_plan, receiver_slots, routing_meta
from tests.conftest import nan_in_uninitialized_memory, run_in_triton_interpreter, run_ranks
from tests.test_static_exchange import HIDDEN, K, LOCAL, TOKENS, make_experts, no_host_reads, routing


def dealt(top_all: list[list[list[int]]], local: int, capacity: int):
    """The exchange done by hand from every rank's top-k ``top_all[s][t]``: each rank's received copies in order
    (expert-major, then by source, each source's in its sorted order: by expert, then token, then choice) as
    (source, token, choice), cut at ``capacity``; where each copy landed: {(s, t, j): (owner, slot or -1)}."""
    ep = len(top_all)
    received = {r: [] for r in range(ep)}
    for r, e, s in itertools.product(range(ep), range(local), range(ep)):
        received[r] += [(s, t, j) for t, choices in enumerate(top_all[s]) for j, g in enumerate(choices) if g == r * local + e]
    landed = {}
    for r, copies in received.items():
        for i, copy in enumerate(copies):
            landed[copy] = (r, i if i < capacity else -1)
    return received, landed, any(len(v) > capacity for v in received.values())


def plans_and_slots(top_all, local, capacity):
    """``pull_plan`` and ``receiver_slots`` of every rank, from every rank's top-k (as each rank would see them)."""
    from megablocks_utils.moe.dispatch import route

    ep, k = len(top_all), len(top_all[0][0])
    tops = [torch.tensor(t) for t in top_all]
    routes = [route(t, ep * local) for t in tops]
    counts_all = torch.stack([r.counts for r in routes])
    meta_all = torch.stack([routing_meta(t, r.copy_row, torch.rand(t.shape)) for t, r in zip(tops, routes)])
    plans = [pull_plan(counts_all, me, local, capacity, tops[me], routes[me].copy_row) for me in range(ep)]
    slots = [receiver_slots(meta_all, p.first, p.sent_start, me, local, capacity, k) for me, p in enumerate(plans)]
    return plans, slots


@pytest.mark.parametrize("capacity", [40, 9, 3])
def test_pull_plan_and_receiver_slots_equal_the_copies_dealt_by_hand(capacity):
    ep, local = 3, 2
    top_all = [[[3, 0], [2, 3], [0, 3]], [[1, 0], [5, 4], [4, 2]], [[1, 3], [3, 4], [0, 1]]]  # k 2, experts 4-5 rank 2's
    received, landed, overflow = dealt(top_all, local, capacity)
    plans, slots = plans_and_slots(top_all, local, capacity)
    for me in range(ep):
        plan = plans[me]
        mine = [[landed[(me, t, j)] for j in range(2)] for t in range(3)]
        assert plan.owner.tolist() == [[r for r, _ in row] for row in mine], me
        assert plan.slot.tolist() == [[i for _, i in row] for row in mine], me
        kept = received[me][:capacity]
        assert plan.expert_counts.tolist() == [sum(1 for s, t, j in kept if top_all[s][t][j] % local == e) for e in range(local)]
        assert bool(plan.overflow) == overflow
        want = torch.full((ep, 3, 2), -1)
        for i, (s, t, j) in enumerate(kept):
            want[s, t, j] = i
        assert torch.equal(slots[me], want), (me, slots[me], want)


def test_a_rank_that_sends_nothing_and_one_that_receives_nothing():
    top_all = [[[0, 1]] * 4, [[1, 0]] * 4]  # every copy to rank 0's experts (local 2): rank 1 receives nothing
    plans, slots = plans_and_slots(top_all, 2, 128)
    assert plans[1].expert_counts.tolist() == [0, 0] and (slots[1] == -1).all()
    assert sorted(slots[0].flatten().tolist()) == list(range(16)) and plans[0].expert_counts.tolist() == [8, 8]


def test_a_failed_symmetric_memory_setup_says_what_to_run(monkeypatch):
    from types import SimpleNamespace

    from megablocks_utils.moe import pull_exchange

    def fails(*args):
        raise RuntimeError("peer access unsupported")

    monkeypatch.setattr(pull_exchange, "SymmetricPeers", fails)
    with pytest.raises(RuntimeError, match="peer access unsupported.*--ep_capacity_factor 0"):
        pull_exchange.symmetric_peers(SimpleNamespace(group_name="g"), 8, 2, 16, 4, torch.bfloat16, 4, torch.device("cpu"))


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


# Three ranks' buffers in one process, k 3 (a power of two of columns is 4: the slots' padding column is exercised),
# a width over one column block (1024) and a capacity that cuts rank 0's last copies and pads the others'.
TOKEN_KERNELS = """
import json, torch
from megablocks_utils.moe import pull_kernel as kern
from megablocks_utils.moe.dispatch import route
from megablocks_utils.moe.pull_exchange import (expanded, expanded_backward, pair_sums, pull_plan, rank_sums, read_at,
                                                 receiver_slots, routing_meta)
g = torch.Generator().manual_seed(1)
ep, local, tokens, k, h, dtype = 3, 2, 5, 3, 1100, torch.bfloat16
tops = [torch.stack([torch.randperm(ep * local, generator=g)[:k] for _ in range(tokens)]) for _ in range(ep)]
tops[1][:, 0] = 0  # every token of rank 1 to expert 0: rank 0 receives the most
routes = [route(t, ep * local) for t in tops]
counts_all = torch.stack([r.counts for r in routes])
capacity = int(counts_all.view(ep, ep, local).sum((0, 2)).max()) - 2
weights = [torch.rand(tokens, k, generator=g) for _ in range(ep)]
meta = [routing_meta(t, r.copy_row, w) for t, r, w in zip(tops, routes, weights)]
x = [torch.randn(tokens, h, generator=g).to(dtype) for _ in range(ep)]
table = lambda ts: torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64)
check = {}
s_bufs, gw_bufs, plans = [], [], []
for me in range(ep):
    plan = pull_plan(counts_all, me, local, capacity, tops[me], routes[me].copy_row)
    plans.append(plan)
    out = torch.full((capacity, h), 7.0).to(dtype)
    w = torch.full((capacity,), 7.0)
    slots = torch.full((ep * tokens, 4), 9, dtype=torch.int32)
    kern.expand_forward(table(x), table(meta), plan.first, plan.sent_start, plan.received, out, w, slots, tokens, k, ep, local, me)
    ref_slots = receiver_slots(torch.stack(meta), plan.first, plan.sent_start, me, local, capacity, k)
    ref_out, ref_w = expanded(torch.stack(x), torch.stack(weights), ref_slots, capacity)
    check[f"slots{me}"] = torch.equal(slots[:, :k].long(), ref_slots.reshape(-1, k)) and bool((slots[:, k:] == -1).all())
    check[f"expand{me}"] = torch.equal(out, ref_out) and torch.equal(w, ref_w)
    # zero_padding False (more than one local expert): the valid rows the same, the padding left as it was
    valid = min(int(plan.received[me]), capacity)
    out2, w2 = torch.full((capacity, h), 7.0).to(dtype), torch.full((capacity,), 7.0)
    kern.expand_forward(table(x), table(meta), plan.first, plan.sent_start, plan.received, out2, w2, slots, tokens, k, ep,
                        local, me, zero_padding=False)
    check[f"unpadded{me}"] = (torch.equal(out2[:valid], ref_out[:valid]) and torch.equal(w2[:valid], ref_w[:valid])
                              and bool((out2[valid:] == 7).all()) and bool((w2[valid:] == 7).all()) and valid <= capacity)
    y = torch.randn(capacity, h, generator=g).to(dtype)
    s = torch.zeros(ep * tokens, h).to(dtype)  # the shared sums: in the compute dtype, summed in fp32
    kern.sum_slots(y, w, slots, s)
    torch.testing.assert_close(s.float(), pair_sums(y, ref_slots, ref_w), rtol=1e-2, atol=1e-2)
    s2 = torch.zeros(ep * tokens, h).to(dtype)
    kern.sum_slots(y, None, slots, s2)
    torch.testing.assert_close(s2.float(), pair_sums(y, ref_slots), rtol=1e-2, atol=1e-2)
    check[f"sums{me}"] = True
    s_bufs.append(s)
    d = [torch.randn(tokens, h, generator=g).to(dtype) for _ in range(ep)]
    d_y, d_w = torch.full((capacity, h), 7.0).to(dtype), torch.full((capacity,), 7.0)
    kern.expand_backward(table(d), slots, w, y, plan.received, d_y, d_w, tokens, ep, me)
    ref_d_y, ref_d_w = expanded_backward(torch.stack(d), ref_slots, ref_w, y)
    torch.testing.assert_close(d_y.float(), ref_d_y.float(), rtol=1e-2, atol=1e-2)  # the interpreter's bf16 rounding
    torch.testing.assert_close(d_w, ref_d_w, rtol=1e-5, atol=1e-4)
    check[f"backward{me}"] = bool((d_y[plan.received[me]:] == 0).all())  # padding zeroed
    d_y2, d_w2 = torch.full((capacity, h), 7.0).to(dtype), torch.full((capacity,), 7.0)
    kern.expand_backward(table(d), slots, w, y, plan.received, d_y2, d_w2, tokens, ep, me, zero_padding=False)
    check[f"backward_unpadded{me}"] = (torch.equal(d_y2[:valid], d_y[:valid]) and torch.equal(d_w2[:valid], d_w[:valid])
                                       and bool((d_y2[valid:] == 7).all()) and bool((d_w2[valid:] == 7).all()))
    gw_bufs.append(torch.randn(capacity, generator=g))
for me in range(ep):
    out = torch.empty(tokens, h).to(dtype)
    kern.sum_ranks(table(s_bufs), plans[me].owner, plans[me].slot, out, ep, me)
    torch.testing.assert_close(out.float(), rank_sums(torch.stack(s_bufs), plans[me].owner, plans[me].slot, me, dtype).float(),
                               rtol=1e-2, atol=1e-2)
    got = torch.empty(tokens, k)
    kern.read_scalars(table(gw_bufs), plans[me].owner, plans[me].slot, got)
    check[f"ranks{me}"] = torch.equal(got, read_at(torch.stack(gw_bufs), plans[me].owner, plans[me].slot))
check["cut"] = bool(plans[0].overflow) and any(bool((p.slot == -1).any()) for p in plans)
print(json.dumps(check))
"""


def test_token_kernels_equal_their_torch_work_in_the_interpreter():
    result = run_in_triton_interpreter(TOKEN_KERNELS)
    assert all(result.values()) and len(result) == 22, result
    assert any(k.startswith("unpadded") for k in result)


def run_tokens(experts, top_i, path, capacity=None, guard_trace=None):
    """The layer's exchange on x and router weights: ``path`` "exact" (dispatch, ``exchange``, combine) or "pull"
    (``pull_exchange`` over all-gathered buffers), and a backward: (output, overflow flag, gradients of x, the router
    weights, gate_up and down)."""
    import torch.distributed as dist

    from megablocks_utils.moe.dispatch import combine, dispatch, exchange, route
    from megablocks_utils.moe.pull_exchange import GatheredPeers, pull_exchange

    ep, world = experts.ep_size, dist.group.WORLD
    rank = dist.get_rank()
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(7 + rank)).requires_grad_()
    top_w = torch.rand(TOKENS, K, generator=torch.Generator().manual_seed(8 + rank)).requires_grad_()
    dy = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(9 + rank))
    experts.gate_up_proj.grad = experts.down_proj.grad = None
    peers = GatheredPeers(world)
    with no_host_reads(guard_trace) if guard_trace is not None else nullcontext():
        r = route(top_i, experts.num_experts)
        if path == "exact":
            out = exchange([dispatch(x, r, K, False)], [r.counts], ep, LOCAL, world, experts.compute)[0]
            out, overflow = combine(out, r, top_w, x.dtype, False), None
        else:
            out, overflow = pull_exchange(x, top_i, top_w, r.copy_row, r.counts, ep, LOCAL, world, experts.compute_valid_rows,
                                          capacity, peers)
        out.backward(dy)
    return out.detach(), overflow, x.grad, top_w.grad, experts.gate_up_proj.grad, experts.down_proj.grad


def _pull_on_ranks(rank: int, ep: int) -> None:
    import torch.distributed as dist

    nan_in_uninitialized_memory()  # rows past the valid ones (never written) must not reach any output, even times 0
    experts = make_experts(rank, ep)
    everything = ep * TOKENS * K  # every row of every rank fits one receiver
    traces = {}
    for kind in ("skewed", "one_rank_receives", "idle_experts"):
        top_i = routing(kind, rank, ep)
        want = run_tokens(experts, top_i, "exact")
        traces[kind] = []
        got = run_tokens(experts, top_i, "pull", everything, guard_trace=traces[kind])
        assert not got[1], kind
        names = ("out", "overflow", "d_x", "d_top_w", "d_gate_up", "d_down")
        for name, a, b in zip(names, got, want):
            if name != "overflow":
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{kind} {n}: {m}")
    assert traces["skewed"] == traces["one_rank_receives"] == traces["idle_experts"] and len(traces["skewed"]) > 30

    # Cut: rank 0 receives everything under "one_rank_receives"; a capacity of half of that overflows on every rank.
    for kind, capacity in (("one_rank_receives", everything // 2), ("balanced", TOKENS * K), ("balanced", TOKENS * K - 1)):
        top_i = routing(kind, rank, ep)
        want = run_tokens(experts, top_i, "exact")
        got = run_tokens(experts, top_i, "pull", capacity)
        every = [torch.empty_like(top_i) for _ in range(ep)]
        dist.all_gather(every, top_i.contiguous())
        _, landed, overflows = dealt([t.tolist() for t in every], LOCAL, capacity)
        assert bool(got[1]) == overflows, (kind, capacity)
        whole = torch.tensor([all(landed[(rank, t, j)][1] >= 0 for j in range(K)) for t in range(TOKENS)])
        torch.testing.assert_close(got[0][whole], want[0][whole], rtol=1e-5, atol=1e-5)
        assert overflows or whole.all()

    # The layer: its forward (the pull reads x) and send + receive (the segments' halves: the pull reads each token's
    # first copy) against the exact exchange, outputs and the input's gradient.
    from megablocks_utils.moe.exchange_mode import ExchangeMode

    experts.mesh.ep_group = dist.group.WORLD
    top_i = routing("skewed", rank, ep)
    top_w = torch.rand(TOKENS, K, generator=torch.Generator().manual_seed(3 + rank))
    results = []
    for mode, halves in ((None, False), (ExchangeMode(float(ep), "gathered"), False), (ExchangeMode(float(ep), "gathered"), True)):
        experts.exchange_mode = mode
        experts.gate_up_proj.grad = experts.down_proj.grad = None
        x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(5 + rank)).requires_grad_()
        out = experts.receive(*experts.send(x, top_i), top_w, x.dtype) if halves else experts(x, top_i, top_w)
        out.backward(torch.ones_like(out))
        assert mode is None or (len(mode.flags) == 1 and not mode.flags[0])
        results.append((out.detach(), x.grad))
    experts.exchange_mode = None
    for got in results[1:]:
        for a, b in zip(got, results[0]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ep", [2, 4])
def test_pull_exchange_equals_exchange_and_flags_overflow(ep):
    run_ranks(_pull_on_ranks, ep)


# ----------------------------------------------------------------------------- the sums alone
def test_pair_sums_read_no_row_outside_their_slots():
    """A pair's slots summed (times their weights): a row no slot names (row 0, which an empty slot's clamped index
    reads) may hold NaN, and no sum sees it; a pair with no slot sums to zero."""
    from megablocks_utils.moe.pull_exchange import pair_sums

    g = torch.Generator().manual_seed(0)
    # small integers and powers of two: every sum exact in fp32 as in float64
    rows = torch.randint(-8, 9, (6, 4), generator=g).double()
    w = 2.0 ** torch.randint(-2, 3, (6,), generator=g).double()
    rows[0], w[0] = float("nan"), float("nan")
    slots = torch.tensor([[1, 2, -1], [-1, -1, -1], [3, -1, -1], [4, 5, -1]])
    expected = torch.stack([sum((rows[s] for s in pair if s >= 0), torch.zeros(4, dtype=torch.float64)) for pair in slots.tolist()])
    weighted = torch.stack([sum((rows[s] * w[s] for s in pair if s >= 0), torch.zeros(4, dtype=torch.float64)) for pair in slots.tolist()])
    assert torch.equal(pair_sums(rows, slots), expected.float()) and torch.equal(pair_sums(rows, slots, w), weighted.float())


def test_rank_sums_read_no_rank_without_a_kept_copy():
    """My token's rows summed over the ranks holding one of its kept copies: a rank holding none (or only a cut one,
    slot -1) may have NaN in that row, and no sum sees it."""
    from megablocks_utils.moe.pull_exchange import rank_sums

    g = torch.Generator().manual_seed(0)
    ep, tokens, me = 3, 2, 1
    s_all = torch.randint(-8, 9, (ep, ep * tokens, 4), generator=g).double()  # every sum exact in fp32
    owner = torch.tensor([[0, 2], [1, 0]], dtype=torch.int32)
    slot = torch.tensor([[0, 1], [3, -1]], dtype=torch.int32)  # token 1's copy on rank 0 was cut
    s_all[1, me * tokens + 0] = float("nan")  # rank 1 holds no copy of token 0
    s_all[0, me * tokens + 1] = s_all[2, me * tokens + 1] = float("nan")  # nor ranks 0 (cut) and 2 of token 1
    expected = torch.stack([s_all[0, 2] + s_all[2, 2], s_all[1, 3]])
    assert torch.equal(rank_sums(s_all, owner, slot, me, torch.float64), expected)


SUMS_IN_BF16 = """
import json, torch
from megablocks_utils.moe import pull_kernel as kern
from megablocks_utils.moe.pull_exchange import pair_sums, rank_sums
g = torch.Generator().manual_seed(3)
ep, tokens, h = 3, 4, 96
scale = torch.logspace(-2, 2, h)  # each column's values far apart from the next: bf16 partial sums would round
def values(*shape):
    return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)
# pair sums: 5 pairs of up to 3 slots of 8 received rows, weights powers of two (products exact)
y, w = values(8, h), 2.0 ** torch.randint(-2, 3, (8,), generator=g).float()
slots = torch.tensor([[0, 1, 2, -1], [3, -1, -1, -1], [-1, -1, -1, -1], [4, 5, 6, -1], [7, 2, -1, -1]], dtype=torch.int32)
def toward_zero(t):  # Triton's interpreter rounds fp32 to bf16 toward zero (a GPU to nearest): its kernels' reference
    return (t.float().view(torch.int32) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)
exact64 = torch.stack([sum(((y[s].double() * w[s].double()) for s in p if s >= 0), torch.zeros(h, dtype=torch.float64))
                       for p in slots.tolist()])
s = torch.zeros(5, h).to(torch.bfloat16)
kern.sum_slots(y, w, slots, s)
out = {"sum_slots": torch.equal(s, toward_zero(exact64)),
       "pair_sums": torch.equal(pair_sums(y, slots[:, :3], w).to(torch.bfloat16), exact64.to(torch.bfloat16))}
# rank sums: my tokens' rows summed over the three ranks (every one holds a copy)
bufs = [values(ep * tokens, h) for _ in range(ep)]
owner = torch.tensor([[0, 1, 2]] * tokens, dtype=torch.int32)
slot = torch.zeros(tokens, 3, dtype=torch.int32)
me = 2
exact64 = torch.stack([sum(b[me * tokens + t].double() for b in bufs) for t in range(tokens)])
got = torch.empty(tokens, h).to(torch.bfloat16)
kern.sum_ranks(torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64), owner, slot, got, ep, me)
out["sum_ranks"] = torch.equal(got, toward_zero(exact64))
out["rank_sums"] = torch.equal(rank_sums(torch.stack(bufs), owner, slot, me, torch.bfloat16), exact64.to(torch.bfloat16))
mine = [b[me * tokens:(me + 1) * tokens] for b in bufs]
out["bf16_partial_sums_would_differ"] = (not torch.equal(toward_zero(toward_zero(mine[0].double() + mine[1].double()).double()
                                                                      + mine[2].double()), toward_zero(exact64))
                                         and not torch.equal(mine[0] + mine[1] + mine[2], exact64.to(torch.bfloat16)))
print(json.dumps(out))
"""


def test_pull_sums_in_bf16_round_once_like_float64():
    """The exchange's sums in bf16 (the kernels in Triton's interpreter, and their torch work): summed in fp32 and rounded
    once, each equals the float64 sum rounded to bf16 (summing in bf16 would not: the check that the inputs can tell)."""
    result = run_in_triton_interpreter(SUMS_IN_BF16)
    assert result == dict.fromkeys(("sum_slots", "pair_sums", "sum_ranks", "rank_sums", "bf16_partial_sums_would_differ"), True), result
