"""The MoE layer's own autograd pieces against what plain indexing computes: the combine of expert outputs
(gather + weighted sum; on CUDA a Triton kernel, tests/test_gather_kernels.py) against weighting + index_add, the
dispatch's gather-sum backward, the per-expert bias as a one-hot GEMM; no host sync at ep = 1 on the grouped GEMM
path, and ``force_loop`` keeping it out. Eager, on CPU."""

import pytest
import torch

from megablocks_utils.moe.dispatch import _Dispatch, _gather_combine, _weigh
from megablocks_utils.moe.experts import add_expert_bias, expert_one_hot


def test_gather_combine_equals_weighted_index_add():
    torch.manual_seed(0)
    tokens, k, experts, hidden = 37, 2, 8, 16
    top_i = torch.stack([torch.randperm(experts)[:k] for _ in range(tokens)])
    top_i[:10] = torch.tensor([3, 5])  # many tokens on the same experts, as skewed routing does
    top_w = torch.rand(tokens, k, requires_grad=True)
    order = torch.argsort(top_i.reshape(-1), stable=True)
    out = torch.randn(tokens * k, hidden, requires_grad=True)  # expert outputs in expert order

    reference = torch.zeros(tokens, hidden).index_add(0, order // k, _weigh(out, top_w.reshape(-1)[order], torch.float32))
    copy_row = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel()))
    combined = _gather_combine(out, copy_row, top_w, torch.float32)
    torch.testing.assert_close(combined, reference, rtol=1e-6, atol=1e-6)

    grad = torch.randn(tokens, hidden)
    expected = torch.autograd.grad(reference, (out, top_w), grad)
    got = torch.autograd.grad(combined, (out, top_w), grad)
    assert len(got) == len(expected) == 2
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-6)


def test_dispatch_backward_gathers_what_indexing_scatters():
    """Each token's k copies (expert order) and back: the gather-sum backward equals autograd's scatter-add."""
    torch.manual_seed(0)
    tokens, k, experts, hidden = 37, 3, 8, 16
    top_i = torch.stack([torch.randperm(experts)[:k] for _ in range(tokens)])
    order = torch.argsort(top_i.reshape(-1), stable=True)
    copy_row = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel()))
    x = torch.randn(tokens, hidden, requires_grad=True)
    routed = _Dispatch.apply(x, order // k, copy_row, k, False)
    reference = x[order // k]
    torch.testing.assert_close(routed, reference, rtol=0, atol=0)
    grad = torch.randn(tokens * k, hidden)
    (expected,) = torch.autograd.grad(reference, x, grad)
    (got,) = torch.autograd.grad(routed, x, grad)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


def test_expert_bias_gemm_equals_indexed_add():
    """Per-expert biases on rows grouped by expert (experts with no rows among them, first and last included):
    ``addmm(rows, one_hot, bias)`` equals ``rows + bias[row_expert]`` bit for bit; the rows' gradient is the output's,
    the bias gradient each expert's sum of its rows' gradients, taken in fp32 (then one rounding to the dtype)."""
    torch.manual_seed(0)
    counts = torch.tensor([0, 5, 0, 9, 1, 0, 7, 0])
    row_expert = torch.repeat_interleave(torch.arange(len(counts)), counts)
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 2**-8)):
        one_hot = expert_one_hot(counts, int(counts.sum()), dtype)
        assert one_hot.dtype == dtype and one_hot.shape == (int(counts.sum()), len(counts))
        assert torch.equal(one_hot.argmax(1), row_expert) and torch.all(one_hot.sum(1) == 1)
        rows = torch.randn(int(counts.sum()), 12, dtype=dtype, requires_grad=True)
        bias = torch.randn(len(counts), 12, dtype=dtype, requires_grad=True)
        got = add_expert_bias(rows, one_hot, bias)
        torch.testing.assert_close(got, rows + bias[row_expert], rtol=0, atol=0)
        grad = torch.randn_like(got)
        grad_rows, grad_bias = torch.autograd.grad(got, (rows, bias), grad)
        assert torch.equal(grad_rows, grad)
        per_expert_sum = torch.zeros(len(counts), 12).index_add_(0, row_expert, grad.float())
        assert grad_bias.dtype == dtype
        torch.testing.assert_close(grad_bias.float(), per_expert_sum.to(dtype).float(), rtol=tol, atol=tol)
        assert torch.all(grad_bias[counts == 0] == 0)


def test_one_rank_grouped_gemm_layer_makes_no_host_sync(monkeypatch):
    """At ep = 1 the grouped GEMM path reads the expert counts on the device: no ``tolist`` (a host sync on
    CUDA) in forward or backward; the per-expert loop still reads them (and gets the same result)."""
    from types import SimpleNamespace

    from megablocks_utils.moe import experts as moe_experts
    from megablocks_utils.moe.layer import ExpertParallelExperts

    torch.manual_seed(0)
    experts = ExpertParallelExperts(4, SimpleNamespace(ep_size=1), "silu")
    experts.set_weights(torch.nn.Parameter(torch.randn(4, 32, 16) * 0.3), torch.nn.Parameter(torch.randn(4, 16, 16) * 0.3))
    x = torch.randn(20, 16, requires_grad=True)
    top_w, top_i = torch.rand(20, 2), torch.stack([torch.randperm(4)[:2] for _ in range(20)])
    looped = experts(x, top_i, top_w)
    calls = []
    real_tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: calls.append(t.shape) or real_tolist(t))
    monkeypatch.setattr(moe_experts, "grouped_mm_supported", lambda t: True)  # torch runs grouped_mm on CPU too
    grouped = experts(x, top_i, top_w)
    grouped.sum().backward()
    assert calls == []
    torch.testing.assert_close(grouped, looped, rtol=1e-5, atol=1e-6)
    monkeypatch.setattr(moe_experts, "grouped_mm_supported", lambda t: False)
    experts(x, top_i, top_w)
    assert calls == [torch.Size([4])]


def test_force_loop_runs_the_per_expert_loop_where_grouped_gemms_would_run(monkeypatch):
    """``force_loop``, given at construction, keeps the grouped GEMM out even where it is supported."""
    from types import SimpleNamespace

    from megablocks_utils.moe import experts as moe_experts
    from megablocks_utils.moe.layer import ExpertParallelExperts

    torch.manual_seed(0)
    weights = torch.randn(4, 32, 16) * 0.3, torch.randn(4, 16, 16) * 0.3
    x = torch.randn(20, 16)
    top_w, top_i = torch.rand(20, 2), torch.stack([torch.randperm(4)[:2] for _ in range(20)])
    looped = ExpertParallelExperts(4, SimpleNamespace(ep_size=1), "silu", force_loop=True)
    looped.set_weights(*(torch.nn.Parameter(w.clone()) for w in weights))
    reference = looped(x, top_i, top_w)
    monkeypatch.setattr(moe_experts, "grouped_mm_supported", lambda t: True)
    grouped = ExpertParallelExperts(4, SimpleNamespace(ep_size=1), "silu")
    grouped.set_weights(*(torch.nn.Parameter(w.clone()) for w in weights))
    torch.testing.assert_close(grouped(x, top_i, top_w), reference, rtol=1e-5, atol=1e-6)
    monkeypatch.setattr(moe_experts, "grouped_mm", lambda *a, **k: pytest.fail("force_loop must not use grouped_mm"))
    torch.testing.assert_close(looped(x, top_i, top_w), reference, rtol=0, atol=0)


@pytest.mark.parametrize("experts", [8, 256, 300, 40000])
def test_route_sorts_narrowed_keys_as_int64_ones(experts):
    """``route`` sorts the expert ids as uint8 / int16 / int32 (one radix pass per byte on CUDA): the same stable
    order, copy rows and counts as sorting the int64 ids, up to the largest id each dtype holds."""
    from megablocks_utils.moe.dispatch import narrow_keys, route

    torch.manual_seed(experts)
    tokens, k = 500, 4
    top_i = torch.randint(0, experts, (tokens, k))
    top_i[:50] = torch.arange(experts - k, experts)  # the largest ids, on many tokens: ties the order must keep
    got = route(top_i, experts)
    order = torch.argsort(top_i.reshape(-1), stable=True)
    assert torch.equal(got.order, order) and got.order.dtype == torch.int64
    assert torch.equal(got.token_of_copy, order // k)
    assert torch.equal(got.copy_row, torch.empty_like(order).scatter_(0, order, torch.arange(order.numel())))
    assert torch.equal(got.counts, torch.bincount(top_i.reshape(-1), minlength=experts))
    expected = torch.uint8 if experts <= 256 else torch.int16 if experts <= 32768 else torch.int32
    assert narrow_keys(top_i, experts).dtype == expected


@pytest.mark.parametrize("ep,local,none", [(1, 4, False), (2, 3, False), (4, 2, False), (2, 64, False), (3, 1, False), (2, 3, True)])
def test_regroup_order_puts_received_rows_expert_major(ep, local, none):
    """The exchange's regrouping, built on the host from the received counts: rows that arrive source-major (each
    rank's rows for my experts, in expert order) come out expert-major, each (expert, source) block in its order, some
    blocks empty; and the inverse undoes it."""
    import numpy as np

    from megablocks_utils.moe.dispatch import regroup_order

    counts = np.random.default_rng(ep * 100 + local).integers(0, 4, size=(ep, local))
    counts[0, 0] = 0
    if none:  # a rank that receives no rows at all
        counts[:] = 0
    labels = [(s, e, j) for s in range(ep) for e in range(local) for j in range(counts[s, e])]  # as they arrive
    regroup, inverse = regroup_order(counts)
    assert [labels[i] for i in regroup] == sorted(labels, key=lambda t: (t[1], t[0], t[2]))
    assert sorted(regroup.tolist()) == list(range(len(labels)))
    assert (regroup[inverse] == np.arange(len(labels))).all()
