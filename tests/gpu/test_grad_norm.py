"""The gradient norm on a GPU: ``grad_norm_and_clip_coef`` takes its large gradients' sum of squares from the Triton
kernel (``parallel/sum_squares_kernel.py``) and the small ones' from torch's multi-tensor norm; together they equal the
float64 norm, bf16 gradients as the experts' are."""

import pytest
import torch

from .launch import gpus

pytestmark = gpus(1)


def test_the_norm_of_large_and_small_gradients_equals_float64s(monkeypatch):
    from megablocks_utils.parallel import grads, sum_squares_kernel

    calls = []
    kernel_sum = sum_squares_kernel.sum_of_squares
    monkeypatch.setattr(sum_squares_kernel, "sum_of_squares", lambda tensors: calls.append(len(tensors)) or kernel_sum(tensors))
    g = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(64, 1024, 96), (grads.LARGE_GRADIENT + 5,), (2048,), (7, 33)]  # two large, two small
    params = [torch.nn.Parameter(torch.zeros(s, device="cuda", dtype=torch.bfloat16)) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g, device="cuda").bfloat16()
    norm, coef = grads.grad_norm_and_clip_coef(params, 1.0)
    exact = torch.cat([p.grad.double().flatten() for p in params]).norm()
    assert calls == [2], calls  # the two large gradients, in one call
    assert abs(float(norm) - float(exact)) <= 1e-6 * float(exact), (float(norm), float(exact))
    assert float(coef) == pytest.approx(1.0 / (float(norm) + 1e-6), rel=1e-6)
