"""The static exchange read from the peers' GPU memory (``moe/pull_exchange.py``, symmetric memory, one row per token
and rank) gives what the same exchange over all-gathered copies and the exact exchange give.

Three MoE layers' experts in a row at ep 2 on two GPUs (NCCL), bf16 grouped GEMMs, skewed routing (uneven rows both
ways), every layer's exchange through one set of shared buffers (the X/S alternation under test: each layer's trip out
writes buffer X while the backward of the layer after it is still to come), forward then backward, twice:
- ``SymmetricPeers`` (the Triton kernels) against ``GatheredPeers`` (their work in torch, here over NCCL): outputs, the
  gradients of the input, the router weights and every expert weight within 1e-2 relative (the same copies; sums in
  fp32 in another order), with 8 local experts (grouped GEMMs: the padding rows left unwritten) and with one (plain
  GEMMs over every row: the padding zeroed);
- against dispatch + ``dispatch.exchange`` + combine (NCCL's all-to-all, the exact rows only): within 2e-2 relative
  (a token's copies summed per rank in fp32 before the sum over ranks, in another order; the grouped GEMM's tiles
  over padded rows; measured: see the assertion's message);
- a capacity that cuts: the overflow flag set on both ranks;
- the whole layer stack captured in one CUDA graph and replayed on new inputs equals the same stack run eagerly.
"""

import pytest
import torch

from .launch import gpus, run_on_gpus

pytestmark = gpus(2)

EXPERTS, HIDDEN, INTER, TOKENS, K, LAYERS = 16, 512, 256, 2048, 4, 3


def measure(rank, world, num_experts):
    from types import SimpleNamespace

    import torch.distributed as dist

    from megablocks_utils.moe.dispatch import combine, dispatch, exchange, route
    from megablocks_utils.moe.layer import ExpertParallelExperts
    from megablocks_utils.moe.pull_exchange import GatheredPeers, pull_capacity, pull_exchange

    group = dist.group.WORLD
    local = num_experts // world
    mesh = SimpleNamespace(ep_size=world, ep_group=group)
    gen = torch.Generator(device="cuda").manual_seed(rank)
    layers = []
    for _ in range(LAYERS):
        experts = ExpertParallelExperts(num_experts, mesh, "silu")
        experts.set_weights(*(torch.nn.Parameter(0.05 * torch.randn(s, device="cuda", dtype=torch.bfloat16, generator=gen))
                              for s in [(local, 2 * INTER, HIDDEN), (local, HIDDEN, INTER)]))
        layers.append(experts)
    x = torch.randn(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen)
    routes = [(torch.rand(TOKENS, K, device="cuda", generator=gen).square() * num_experts).long() for _ in range(LAYERS)]
    weights = [torch.rand(TOKENS, K, device="cuda", generator=gen).softmax(-1).requires_grad_() for _ in range(LAYERS)]
    gathered = GatheredPeers(group)

    def stack(inputs, how, capacity):
        """The layers in a row, each through ``how`` ("symmetric", "gathered" or "exact"); output and overflow flags."""
        h, flags = inputs, []
        for experts, top_i, top_w in zip(layers, routes, weights):
            r = route(top_i, num_experts)
            if how == "exact":
                out = exchange([dispatch(h, r, K, True)], [r.counts], world, local, group, experts.compute)[0]
                out = combine(out, r, top_w, h.dtype, True)
            else:
                out, flag = pull_exchange(h, top_i, top_w, r.copy_row, r.counts, world, local, group, experts.compute_valid_rows,
                                          capacity, gathered if how == "gathered" else None)
                flags.append(flag)
            h = h + out
        return h, flags

    def run(how, capacity=pull_capacity(TOKENS, K, world, float(world))):
        for e in layers:
            e.zero_grad(set_to_none=True)
        for w in weights:
            w.grad = None
        leaf = x.clone().requires_grad_(True)
        results = []
        for _ in range(2):  # the second pass adds into the weights' gradients
            out, flags = stack(leaf, how, capacity)
            out.float().square().sum().backward()
            results.append(out.detach())
        torch.cuda.synchronize()
        grads = [leaf.grad, *(w.grad.clone() for w in weights), *(p.grad.clone() for e in layers for p in (e.gate_up_proj, e.down_proj))]
        return [*results, *grads], flags

    run("symmetric")  # warm-up: compiles the element-wise kernels, makes the shared buffers
    symmetric, flags = run("symmetric")
    via_gather, _ = run("gathered")
    exact, _ = run("exact")
    _, cut_flags = run("symmetric", capacity=128)

    # One CUDA graph of the forward (a fixed input buffer), replayed on a new input, against eager.
    static_in = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(stream):
        stack(static_in, "symmetric", pull_capacity(TOKENS, K, world, float(world)))
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        static_out, _ = stack(static_in, "symmetric", pull_capacity(TOKENS, K, world, float(world)))
    new_in = torch.randn(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen)
    static_in.copy_(new_in)
    graph.replay()
    torch.cuda.synchronize()
    with torch.no_grad():
        eager_out, _ = stack(new_in, "symmetric", pull_capacity(TOKENS, K, world, float(world)))
    relative = lambda ours, theirs: [float((a.float() - b.float()).norm() / b.float().norm()) for a, b in zip(ours, theirs)]  # noqa: E731
    return {
        "relative_gathered": relative(symmetric, via_gather),
        "relative_exact": relative(symmetric, exact),
        "finite_nonzero": [bool(t.isfinite().all() and t.abs().sum() > 0) for t in symmetric],
        "overflow": [bool(f) for f in flags],
        "cut_overflow": [bool(f) for f in cut_flags],
        "graph_equal": bool(torch.equal(static_out, eager_out)),
    }


# 16 experts: 8 a rank, the grouped GEMMs, which leave the padding rows past the valid ones unread (the exchange writes no
# zeros there); 2: one a rank, plain GEMMs over every row, whose weight gradients need those rows zeroed.
@pytest.fixture(scope="module", params=[EXPERTS, 2], ids=["8-local", "1-local"])
def results(request):
    return run_on_gpus(measure, 2, request.param)


def test_symmetric_memory_gives_what_gathered_copies_give(results):
    for r in results:
        assert r["finite_nonzero"] == [True] * len(r["finite_nonzero"]), r
        assert max(r["relative_gathered"]) <= 1e-2, r["relative_gathered"]
        assert r["overflow"] == [False] * 3, r


def test_pulled_rows_give_the_exact_exchange_result(results):
    for r in results:
        assert max(r["relative_exact"]) <= 2e-2, r["relative_exact"]


def test_a_cut_is_flagged_on_every_rank(results):
    assert [r["cut_overflow"] for r in results] == [[True] * 3, [True] * 3], results


def test_a_graph_of_the_stack_replays_what_eager_computes(results):
    assert all(r["graph_equal"] for r in results), results
