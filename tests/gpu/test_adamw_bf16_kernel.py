"""adamw_bf16's Triton kernels on one GPU: the torch reference's update (tests/test_adamw_bf16.py ties that to torchao's),
stochastic rounding that is unbiased, on tensors that end mid-block, and the gradient clip folded into the update
giving the bits of clipping first; the multi-tensor kernel giving the per-tensor kernel's bits, the optimizer's step
through it those of one launch per tensor, with no host sync."""

import pytest
import torch

from .launch import gpus, host_sync_error

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
    """AdamWBF16 on the GPU (one launch for all tensors): ``clipped_step`` of a step prepared ahead after
    ``grad_norm_and_clip_coef`` (train_fsdp2.py's path: the table copied to the GPU before the step) leaves the weights
    and moments of ``clip_grad_norm_`` followed by the plain step, bit for bit, over three steps."""
    from megablocks_utils.parallel import grads
    from megablocks_utils.train.adamw_bf16 import AdamWBF16
    from megablocks_utils.train.optim import clipped_step, prepare_step

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
                prepared = prepare_step(opt, coef)
                torch.cuda._sleep(10_000_000)  # the GPU still busy while the step waits, as after the micro-steps
                clipped_step(opt, coef, prepared)
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


def _update(tensors, i: int, seed: int):
    """Settings that differ per tensor (lerp's two branches among them) and are not binary fractions: their fp32
    rounding on the way into each kernel is part of what is compared."""
    from megablocks_utils.train.adamw_bf16 import _TensorUpdate

    return _TensorUpdate(*tensors, lr=1e-2 * (1 + i % 4), beta1=(0.9, 0.3)[i % 2], beta2=(0.95, 0.4)[i % 3 == 0],
                         eps=1e-8 * (1 + i), weight_decay=0.1 * (i % 3), correction1=0.271 + 0.013 * i,
                         correction2_sqrt=0.3854 - 0.007 * i, seed=seed + 31 * i)


def _unaligned(tensors):
    """The same values 2 bytes into a buffer: addresses off the 16-byte grid."""
    return [torch.cat([t.new_zeros(1), t])[1:] for t in tensors]


def test_the_multi_tensor_kernel_gives_the_bits_of_the_per_tensor_kernel():
    """One launch over tensors of many sizes (one element, blocks ending mid-way, whole blocks, empty, large), some
    16-byte aligned and some not, each with its own settings and seed: each tensor's parameter and moments are those of
    its own launch of the per-tensor kernel, bit for bit, with stochastic rounding and without, with the clip's
    coefficient and without; the gradients are left as they were."""
    from megablocks_utils.train.adamw_bf16 import (
        _triton_multi_tensor_update,
        _triton_update,
    )

    sizes = (1, 2047, 2048, 2049, 0, 7, 24, 4104, 300_001, 1 << 20)
    coef = torch.tensor(0.3137, device="cuda").bfloat16()
    for stochastic in (True, False):
        for grad_coef in (None, coef):
            made = [_tensors(n, n) if i % 3 else _unaligned(_tensors(n, n)) for i, n in enumerate(sizes)]
            one_launch, per_tensor = [[t.clone() for t in ts] for ts in made], [[t.clone() for t in ts] for ts in made]
            for ts in made[::3]:
                assert ts[0].data_ptr() % 16 != 0
            _triton_multi_tensor_update([_update(ts, i, 7) for i, ts in enumerate(one_launch)], grad_coef=grad_coef,
                                        stochastic=stochastic)
            for i, ts in enumerate(per_tensor):
                _triton_update(**_update(ts, i, 7)._asdict(), grad_coef=grad_coef, stochastic=stochastic)
            for n, before, a, b in zip(sizes, made, one_launch, per_tensor):
                assert torch.equal(a[1], before[1]), n
                for name, k in (("p", 0), ("exp_avg", 2), ("exp_avg_sq", 3)):
                    assert torch.equal(a[k], b[k]), (n, stochastic, grad_coef is not None, name)
                assert n == 0 or not torch.equal(a[0], before[0]), n


def test_the_multi_tensor_kernel_past_2_to_the_31_elements():
    """A tensor of 2^31 + 2^20 + 3 elements after a small one in the same launch: the offsets within it (int64) and its
    random stream (offsets mod 2^32, as the per-tensor kernel counts them) give the per-tensor kernel's bits."""
    from megablocks_utils.train.adamw_bf16 import (
        _triton_multi_tensor_update,
        _triton_update,
    )

    big = (1 << 31) + (1 << 20) + 3
    if torch.cuda.mem_get_info()[0] < 20 * big + (8 << 30):  # two copies of four bf16 tensors, and headroom
        pytest.skip("needs about 52 GB of free GPU memory")
    g = torch.Generator(device="cuda").manual_seed(0)
    small = _tensors(2049, 1)
    large = [torch.randn(big, generator=g, device="cuda", dtype=torch.bfloat16).mul_(scale) for scale in (0.02, 1e-2, 1e-3)]
    large.append(torch.rand(big, generator=g, device="cuda", dtype=torch.bfloat16).mul_(1e-4))
    one_launch = [small, large]
    per_tensor = [[t.clone() for t in small], [t.clone() for t in large]]
    _triton_multi_tensor_update([_update(ts, i, 3) for i, ts in enumerate(one_launch)])
    for i, ts in enumerate(per_tensor):
        _triton_update(**_update(ts, i, 3)._asdict())
    for a, b in zip(one_launch, per_tensor):
        for name, k in (("p", 0), ("exp_avg", 2), ("exp_avg_sq", 3)):
            assert torch.equal(a[k], b[k]), name


class _CountedLaunches:
    """A Triton kernel that counts its launches (``kernel[grid](...)``)."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


def _many_params(seed: int) -> list[torch.nn.Parameter]:
    """40 parameters: aligned and not (sizes not multiples of 8; one 2 bytes into its buffer), one transposed (not
    contiguous: the per-tensor path), one element, blocks ending mid-way."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    shapes = [(512, 384), (384,), (7, 4099), (1,), (2049,), (3, 5, 7), (256, 8, 16), (4096,), (33, 64), (11,)] * 4
    params = [torch.nn.Parameter(torch.randn(s, generator=g, device="cuda").bfloat16() * 0.02) for s in shapes]
    params[5] = torch.nn.Parameter(torch.randn(96, 40, generator=g, device="cuda").bfloat16().t() * 0.02)
    params[9] = torch.nn.Parameter(_unaligned([torch.randn(4096, generator=g, device="cuda").bfloat16() * 0.02])[0])
    assert not params[5].is_contiguous() and params[9].data_ptr() % 16 != 0
    return params


def test_the_one_launch_step_gives_the_bits_of_one_launch_per_tensor(monkeypatch):
    """AdamWBF16's step, over two parameter groups with other settings, three steps, with the clip folded in and
    without: one launch for the aligned tensors and one for the others (the transposed one through its own path), and
    the weights, moments and step counts of ``multi_tensor=False`` (one launch per tensor) bit for bit: the same seeds,
    from the same generator state."""
    from megablocks_utils.parallel.grads import grad_norm_and_clip_coef
    from megablocks_utils.train import adamw_bf16_kernel
    from megablocks_utils.train.adamw_bf16 import AdamWBF16

    multi = _CountedLaunches(adamw_bf16_kernel.adamw_bf16_multi_tensor_kernel)
    single = _CountedLaunches(adamw_bf16_kernel.adamw_bf16_kernel)
    monkeypatch.setattr(adamw_bf16_kernel, "adamw_bf16_multi_tensor_kernel", multi)
    monkeypatch.setattr(adamw_bf16_kernel, "adamw_bf16_kernel", single)

    def run(multi_tensor: bool, fold: bool):
        torch.manual_seed(5)
        params = _many_params(1)
        opt = AdamWBF16([{"params": params[:25], "weight_decay": 0.01},
                         {"params": params[25:], "lr": 3e-3, "betas": (0.8, 0.99), "eps": 1e-6}],
                        lr=1e-3, betas=(0.9, 0.95), multi_tensor=multi_tensor)
        for step in range(3):
            g = torch.Generator(device="cuda").manual_seed(50 + step)
            for p in params:
                p.grad = torch.randn(p.shape, generator=g, device="cuda").bfloat16().as_strided(p.shape, p.stride())
            if fold:
                opt.step(clip_coef=grad_norm_and_clip_coef(params, 1.0)[1])
            else:
                opt.step()
            opt.zero_grad(set_to_none=True)
        return params, opt

    for fold in (False, True):
        multi.launches = single.launches = 0
        ours, ours_opt = run(True, fold)
        assert (multi.launches, single.launches) == (3 * 2, 0), (multi.launches, single.launches)
        multi.launches = single.launches = 0
        theirs, theirs_opt = run(False, fold)
        assert (multi.launches, single.launches) == (0, 3 * 39), (multi.launches, single.launches)
        for i, (p, q) in enumerate(zip(ours, theirs)):
            assert torch.equal(p, q), (fold, i)
            for key in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(ours_opt.state[p][key], theirs_opt.state[q][key]), (fold, i, key)


def test_the_one_launch_step_makes_no_host_sync():
    """After a first step (compiles, the moments' allocation, the first pinned block), a step over many tensors, with
    the clip folded in and without, queues its work and returns: building the table, copying it from pinned memory and
    the launches wait for nothing on the GPU. Two checks: CUDA's sync debug mode (work queued ahead), and a step
    returning while a kernel of about half a second queued before it still runs (a copy from pageable memory waits
    for the queue without the debug mode seeing it)."""
    from megablocks_utils.train.adamw_bf16 import AdamWBF16

    params = [p for p in _many_params(2) if p.is_contiguous()]  # the one-launch path only (aligned and not)
    opt = AdamWBF16(params, lr=1e-3, weight_decay=0.01)
    coef = torch.tensor(0.5, device="cuda")

    def set_grads():
        for p in params:
            p.grad = torch.randn_like(p)

    for clip_coef in (None, coef):  # warm-up
        set_grads()
        opt.step(clip_coef=clip_coef)
    busy = torch.randn(4096, 4096, device="cuda")

    def two_steps():
        for clip_coef in (None, coef):
            set_grads()
            torch.mm(busy, busy)  # work queued ahead: a sync would wait for it
            opt.step(clip_coef=clip_coef)

    assert host_sync_error(two_steps) == ""
    torch.cuda.synchronize()
    torch.cuda._sleep(1_000_000_000)  # GPU clock cycles: about half a second
    slept = torch.cuda.Event()
    slept.record()
    set_grads()
    opt.step(clip_coef=coef)
    assert not slept.query(), "the step waited for the GPU work queued before it"
    torch.cuda.synchronize()
