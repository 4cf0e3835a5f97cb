"""adamw_bf16's Triton kernel on one GPU: the torch reference's update (tests/test_adamw_bf16.py ties that to torchao's),
and stochastic rounding that is unbiased, on tensors that end mid-block."""

import torch

from .launch import gpus

pytestmark = gpus(1)

SETTINGS = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, correction1=0.271, correction2_sqrt=0.3854)


def _tensors(n: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    p = (torch.randn(n, generator=g, device="cuda") * 0.02).bfloat16()
    grad = (torch.randn(n, generator=g, device="cuda") * 1e-2).bfloat16()
    m = (torch.randn(n, generator=g, device="cuda") * 1e-3).bfloat16()
    v = (torch.rand(n, generator=g, device="cuda") * 1e-4).bfloat16()
    return p, grad, m, v


def test_kernel_equals_the_reference_without_rounding_noise():
    """Parameters and moments equal the torch reference's, except where a contracted multiply-add moves an fp32
    intermediate across a bf16 rounding boundary: at most 0.1% of the elements, by one bf16 ulp."""
    from megablocks_utils.train.adamw_bf16 import _reference_update, _triton_update

    for n in (1, 2047, 2048, 2049, 300_001):
        ours, ref = _tensors(n, n), _tensors(n, n)
        _triton_update(*ours, **SETTINGS, seed=0, stochastic=False)
        _reference_update(*ref, **SETTINGS, seed=0, stochastic=False)
        for name, a, b in zip(("p", "grad", "m", "v"), ours, ref):
            differ = a != b
            assert differ.float().mean() <= 1e-3, (n, name, int(differ.sum()))
            assert ((a[differ].float() - b[differ].float()).abs() <= b[differ].float().abs() * 2**-7 * 1.01).all(), (n, name)


def test_kernel_rounds_stochastically_without_bias():
    """A step of a quarter of a bf16 ulp moves a quarter of the weights by one ulp, and the mean by the step."""
    from megablocks_utils.train.adamw_bf16 import _triton_update

    n, ulp = 1_000_003, 2**-7
    p = torch.full((n,), 1.5, dtype=torch.bfloat16, device="cuda")
    grad = torch.ones_like(p)
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    _triton_update(p, grad, m, v, lr=ulp / 4, beta1=0.9, beta2=0.95, eps=0.0, weight_decay=0.0, correction1=0.1,
                   correction2_sqrt=0.05**0.5, seed=11)
    moved = (p != 1.5).float().mean().item()
    assert abs(moved - 0.25) < 0.005, moved
    assert abs((p.double().mean().item() - 1.5) + ulp / 4) < 1e-5
    assert set(p.unique().tolist()) <= {1.5, 1.5 - ulp}
