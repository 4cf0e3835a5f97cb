"""The GPU combine of expert outputs (gather + weighted sum, compiled on CUDA) against the reference
weighting + index_add that CPU runs use: same values and gradients. Runs the function eagerly on CPU."""

import torch

from megablocks_utils.moe_layer import _gather_combine, _weigh


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
