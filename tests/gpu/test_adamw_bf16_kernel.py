"""adamw_bf16's Triton kernel on one GPU: the torch reference's update (tests/test_adamw_bf16.py ties that to torchao's),
stochastic rounding that is unbiased, on tensors that end mid-block, and the gradient clip folded into the update
giving the bits of clipping first."""

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


def test_kernel_with_a_clip_coefficient_equals_the_gradient_scaled_first():
    """The clip folded into the kernel (the gradient times the bf16 coefficient, rounded to bf16) gives the bits of the
    gradient scaled in place first, with stochastic rounding (same seed) and without; the stored gradient is unchanged."""
    from megablocks_utils.train.adamw_bf16 import _triton_update

    coef = torch.tensor(0.3137, device="cuda").bfloat16()
    for n in (1, 2047, 2049, 300_001):
        for stochastic in (True, False):
            folded, scaled_first = _tensors(n, n), _tensors(n, n)
            grad = folded[1].clone()
            _triton_update(*folded, **SETTINGS, seed=9, stochastic=stochastic, grad_coef=coef)
            scaled_first[1].mul_(coef)
            _triton_update(*scaled_first, **SETTINGS, seed=9, stochastic=stochastic)
            assert torch.equal(folded[1], grad), n
            for name, i in (("p", 0), ("m", 2), ("v", 3)):
                assert torch.equal(folded[i], scaled_first[i]), (n, stochastic, name)


def test_the_step_with_the_clip_folded_in_equals_clipping_first():
    """AdamWBF16 on the GPU (one kernel per tensor): ``clipped_step`` after ``grad_norm_and_clip_coef`` leaves the
    weights and moments of ``clip_grad_norm_`` followed by the plain step, bit for bit, over three steps."""
    from megablocks_utils.parallel import grads
    from megablocks_utils.train.adamw_bf16 import AdamWBF16

    def run(fold: bool):
        torch.manual_seed(3)
        params = [torch.nn.Parameter((torch.randn(s, device="cuda") * 0.02).bfloat16()) for s in ((512, 384), (384,), (7, 4099))]
        opt = AdamWBF16(params, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.01)
        for step in range(3):
            g = torch.Generator(device="cuda").manual_seed(50 + step)
            for p in params:
                p.grad = torch.randn(p.shape, generator=g, device="cuda").bfloat16()
            if fold:
                norm, coef = grads.grad_norm_and_clip_coef(params, 1.0)
                grads.clipped_step(opt, coef)
            else:
                norm = grads.clip_grad_norm_(params, 1.0)
                opt.step()
            assert norm > 1.0  # the clip scales every step
        return params, opt

    (first, first_opt), (folded, folded_opt) = run(False), run(True)
    for p, q in zip(first, folded):
        assert torch.equal(p, q)
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(first_opt.state[p][key], folded_opt.state[q][key])
