"""adamw_bf16's optimizer (``AdamWBF16``): torchao's update, step for step, and its stochastic rounding unbiased.

The Triton kernels are checked against the same reference on a GPU (tests/gpu/test_adamw_bf16_kernel.py); here, in
Triton's CPU interpreter, the clip folded into the kernel and the multi-tensor kernel against the per-tensor one."""

import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT

from megablocks_utils.train.adamw_bf16 import AdamWBF16, _reference_update


def _params(seed: int, shapes=((64, 48), (48,), (3, 16, 8))) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter((torch.randn(s, generator=g) * 0.02).bfloat16()) for s in shapes]


def _set_grads(params, step: int) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = (torch.randn(p.shape, generator=g) * 1e-2).bfloat16()


def test_the_update_is_torchaos_without_rounding_noise():
    """Rounding to nearest (no noise), three steps with weight decay: parameters and both moments equal torchao 0.18's
    ``_AdamW(bf16_stochastic_round=False)`` in all but a few elements, and those by one bf16 ulp (its compiled
    lerp may contract a multiply-add differently)."""
    torchao_optim = pytest.importorskip("torchao.optim")
    ours, theirs = _params(0), _params(0)
    reference = torchao_optim._AdamW(theirs, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, bf16_stochastic_round=False)
    state = [{"step": 0, "m": torch.zeros_like(p), "v": torch.zeros_like(p)} for p in ours]
    for step in range(1, 4):
        _set_grads(ours, step)
        _set_grads(theirs, step)
        reference.step()
        for p, s in zip(ours, state):
            t = torch.tensor(float(step))
            _reference_update(p.data, p.grad, s["m"], s["v"], lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1,
                              correction1=float(1 - 0.9**t), correction2_sqrt=float((1 - 0.95**t).sqrt()), seed=0,
                              stochastic=False)
    for p, q, s in zip(ours, theirs, state):
        theirs_state = reference.state[q]
        for a, b in ((p.data, q.data), (s["m"], theirs_state["exp_avg"]), (s["v"], theirs_state["exp_avg_sq"])):
            differ = a != b
            assert differ.float().mean() <= 0.01, (differ.sum(), a.numel())
            ulp = b[differ].float().abs() * 2**-7
            assert ((a[differ].float() - b[differ].float()).abs() <= ulp * 1.01).all()


def test_stochastic_rounding_is_unbiased_and_moves_tiny_updates():
    """An update of a quarter of a bf16 ulp: rounding to nearest would drop it, stochastic rounding moves a quarter of
    the weights by one ulp, so the mean moves by the update (within sampling noise), and every weight stays bf16."""
    n = 200_000
    p = torch.full((n,), 1.5, dtype=torch.bfloat16)
    ulp = 2**-7  # bf16 spacing in [1, 2)
    grad = torch.full((n,), 1.0, dtype=torch.bfloat16)
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    # first step: m = 0.1 g / 0.1, v = 0.05 g^2 / 0.05 -> the step is -lr * 1 / (1 + eps): lr = ulp / 4
    _reference_update(p, grad, m, v, lr=ulp / 4, beta1=0.9, beta2=0.95, eps=0.0, weight_decay=0.0, correction1=0.1,
                      correction2_sqrt=0.05**0.5, seed=3)
    moved = (p != 1.5).float().mean().item()
    assert abs(moved - 0.25) < 0.01, moved
    assert abs((p.double().mean().item() - 1.5) + ulp / 4) < 2e-5  # down by ulp/4 in the mean
    assert p.dtype == torch.bfloat16 and set(p.unique().tolist()) <= {1.5, 1.5 - ulp}


def test_the_optimizer_draws_its_noise_from_the_cpu_generator():
    """Two runs from the same torch.manual_seed give the same weights (the checkpoint saves that generator, so a resumed
    run rounds as the uninterrupted one); another seed gives other roundings."""
    def run(seed: int) -> list[torch.Tensor]:
        torch.manual_seed(seed)
        params = _params(1)
        opt = AdamWBF16(params, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.01)
        for step in range(3):
            _set_grads(params, step)
            opt.step()
        return [p.detach().clone() for p in params]

    a, b, c = run(5), run(5), run(6)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not all(torch.equal(x, z) for x, z in zip(a, c))


def test_each_tensor_gets_its_own_seed_and_bias_corrections_as_one_draw_per_tensor_gave_them():
    """Three steps on two parameter groups (other betas, lr and weight decay; a parameter without a gradient; one with
    its own step count) give the bits of ``_reference_update`` called per tensor with a seed drawn per tensor from the
    CPU generator, in the parameters' order, and the bias corrections of that tensor's fp32 step count: the seeds drawn
    in one call are those of one call per tensor, so a run resumed from an older checkpoint rounds as before."""
    settings = ({"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.01},
                {"lr": 3e-3, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.0})
    shapes = ((64, 48), (48,), (3, 16, 8), (5,), (7, 9))
    ours, expected = _params(3, shapes), _params(3, shapes)
    opt = AdamWBF16([{"params": ours[:3], **settings[0]}, {"params": ours[3:], **settings[1]}])
    groups = [(expected[:3], settings[0]), (expected[3:], settings[1])]
    state = {id(p): {"step": torch.tensor(0.0), "m": torch.zeros_like(p), "v": torch.zeros_like(p)} for p in expected}
    torch.manual_seed(11)
    for step in range(3):
        _set_grads(ours, step)
        if step == 0:
            ours[1].grad = None  # no update, no seed drawn: its step count falls behind the others'
        opt.step()
    torch.manual_seed(11)
    for step in range(3):
        _set_grads(expected, step)
        for params, group in groups:
            beta1, beta2 = group["betas"]
            for p in params:
                if step == 0 and p is expected[1]:
                    continue
                s = state[id(p)]
                s["step"] += 1
                seed = int(torch.randint(0, 2**31 - 1, ()))
                _reference_update(p.data, p.grad, s["m"], s["v"], lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                                  weight_decay=group["weight_decay"], correction1=float(1 - beta1 ** s["step"]),
                                  correction2_sqrt=float((1 - beta2 ** s["step"]).sqrt()), seed=seed)
    for p, q in zip(ours, expected):
        assert torch.equal(p, q)
        assert torch.equal(opt.state[p]["exp_avg"], state[id(q)]["m"])
        assert torch.equal(opt.state[p]["exp_avg_sq"], state[id(q)]["v"])
        assert opt.state[p]["step"].dtype == torch.float32 and opt.state[p]["step"] == state[id(q)]["step"]
    assert opt.state[ours[1]]["step"] == 2


def test_refuses_parameters_that_are_not_bf16():
    p = torch.nn.Parameter(torch.zeros(4))
    p.grad = torch.ones(4)
    with pytest.raises(ValueError, match="bf16 parameters"):
        AdamWBF16([p]).step()


def test_the_clip_coefficient_folded_into_the_step_gives_the_bits_of_scaling_the_gradients_first():
    """``step(clip_coef=c)`` multiplies each gradient by c as the update reads it, rounded to bf16 as the in-place
    multiply of ``clip_grad_norm_`` stores it: the weights and moments are those of clipping first, bit for bit, with
    stochastic rounding and weight decay; the stored gradients are left as they were."""
    from megablocks_utils.parallel.grads import clip_grad_norm_, grad_norm_and_clip_coef

    def run(fold: bool):
        torch.manual_seed(7)
        params = _params(2)
        opt = AdamWBF16(params, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.01)
        for step in range(3):
            _set_grads(params, step)
            if fold:
                grads = [p.grad.clone() for p in params]
                norm, coef = grad_norm_and_clip_coef(params, 0.1)
                opt.step(clip_coef=coef)
                assert all(torch.equal(p.grad, g) for p, g in zip(params, grads))
            else:
                norm = clip_grad_norm_(params, 0.1)
                opt.step()
            assert norm > 0.1  # the clip scales every step
        return params, opt

    (first, first_opt), (folded, folded_opt) = run(False), run(True)
    for p, q in zip(first, folded):
        assert torch.equal(p, q)
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(first_opt.state[p][key], folded_opt.state[q][key])


def test_a_step_prepared_ahead_changes_nothing_until_applied_and_then_trains_the_same_bits():
    """``prepare`` (train_fsdp2.py runs it before the host waits at the step's check) leaves weights, moments and step
    counts as they were; applying it gives the bits of a plain ``step`` (bias corrections of the step it makes, the
    same seeds); it applies once, and not after another step."""

    def run(prepared_ahead: bool):
        torch.manual_seed(3)
        params = _params(2)
        opt = AdamWBF16(params, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.01)
        for step in range(3):
            _set_grads(params, step)
            if prepared_ahead:
                before = [p.clone() for p in params]
                prepared = opt.prepare()
                assert all(torch.equal(p, b) for p, b in zip(params, before))
                assert [float(opt.state[p]["step"]) for p in params] == [float(step)] * len(params)
                opt.step(prepared=prepared)
                with pytest.raises(RuntimeError, match="applied twice|another optimizer or step"):
                    opt.step(prepared=prepared)
            else:
                opt.step()
        return params, opt

    (plain, plain_opt), (ahead, ahead_opt) = run(False), run(True)
    for p, q in zip(plain, ahead):
        assert torch.equal(p, q)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(plain_opt.state[p][key], ahead_opt.state[q][key])
    stale = ahead_opt.prepare()
    ahead_opt.step()  # a step in between: the prepared one's bias corrections and seeds are stale
    with pytest.raises(RuntimeError, match="another optimizer or step"):
        ahead_opt.step(prepared=stale)


KERNEL_WITH_A_CLIP_COEF = """
import torch
from megablocks_utils.train.adamw_bf16 import _triton_update
settings = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, correction1=0.271, correction2_sqrt=0.3854)
def tensors(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, generator=g) * 0.02).bfloat16(), (torch.randn(n, generator=g) * 1e-2).bfloat16(),
            (torch.randn(n, generator=g) * 1e-3).bfloat16(), (torch.rand(n, generator=g) * 1e-4).bfloat16()]
coef = torch.tensor(0.3137).bfloat16()
for n in (1, 2049, 5000):
    for stochastic in (True, False):
        folded, scaled_first = tensors(n, n), tensors(n, n)
        grad = folded[1].clone()
        _triton_update(*folded, **settings, seed=5, stochastic=stochastic, grad_coef=coef)
        scaled_first[1].mul_(coef)
        _triton_update(*scaled_first, **settings, seed=5, stochastic=stochastic)
        assert torch.equal(folded[1], grad), "the stored gradient changed"
        for i in (0, 2, 3):  # the parameter and both moments
            assert torch.equal(folded[i], scaled_first[i]), (n, stochastic, i)
print("ok")
"""


def test_the_kernel_with_a_clip_coefficient_in_tritons_interpreter():
    """The Triton kernel's fold, run by Triton's CPU interpreter: the gradient times the coefficient, rounded to bf16,
    gives the bits of a gradient scaled in place first (with stochastic rounding: the same seed; and without), and the
    stored gradient is left as it was. (The kernel's update itself is checked against the torch reference on a GPU:
    tests/gpu/test_adamw_bf16_kernel.py.)"""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT, CUDA_VISIBLE_DEVICES="")
    result = subprocess.run([sys.executable, "-c", KERNEL_WITH_A_CLIP_COEF], env=env, capture_output=True, text=True, timeout=300,
                            check=False)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]


MULTI_TENSOR_KERNEL = """
import torch
from megablocks_utils.train.adamw_bf16 import _TensorUpdate, _triton_multi_tensor_update, _triton_update
def tensors(n, seed, offset=0):
    g = torch.Generator().manual_seed(seed)
    made = [(torch.randn(n, generator=g) * 0.02).bfloat16(), (torch.randn(n, generator=g) * 1e-2).bfloat16(),
            (torch.randn(n, generator=g) * 1e-3).bfloat16(), (torch.rand(n, generator=g) * 1e-4).bfloat16()]
    # offset: the tensors start 2 bytes into a buffer, so their addresses are not 16-byte aligned
    return [torch.cat([t.new_zeros(offset), t])[offset:] for t in made]
# one block, mid-block ends, whole blocks, empty, addresses off the 16-byte grid, sizes not multiples of 8
sizes = (1, 2049, 5000, 4096, 0, 24, 7, 4104)
offsets = (0, 0, 0, 0, 0, 0, 0, 1)
# Binary fractions: the interpreter computes with a Python-float argument in double precision where a GPU has its fp32
# value (1 - beta1, lr * weight_decay); with values exact in both, the per-tensor kernel interpreted gives a GPU's bits.
settings = [dict(lr=(i + 1) / 256, beta1=(0.875, 0.25)[i % 2], beta2=(0.9375, 0.375)[i % 3 == 0], eps=(i + 1) / 2**20,
                 weight_decay=(i % 3) / 16, correction1=0.25 + i / 64, correction2_sqrt=0.375 - i / 128, seed=5 + 7 * i)
            for i in range(len(sizes))]
coef = torch.tensor(0.3137).bfloat16()
for chosen in (range(len(sizes)), [2]):  # the whole table; a table of one tensor (no search)
    for stochastic in (True, False):
        for grad_coef in (None, coef):
            one_launch = [tensors(sizes[i], i, offsets[i]) for i in chosen]
            per_tensor = [tensors(sizes[i], i, offsets[i]) for i in chosen]
            grads = [ts[1].clone() for ts in one_launch]
            _triton_multi_tensor_update([_TensorUpdate(*ts, **settings[i]) for i, ts in zip(chosen, one_launch)],
                                        grad_coef=grad_coef, stochastic=stochastic)
            for i, ts in zip(chosen, per_tensor):
                _triton_update(*ts, **settings[i], stochastic=stochastic, grad_coef=grad_coef)
            for i, a, b, grad in zip(chosen, one_launch, per_tensor, grads):
                assert torch.equal(a[1], grad), "the stored gradient changed"
                for k, name in ((0, "p"), (2, "exp_avg"), (3, "exp_avg_sq")):
                    assert torch.equal(a[k], b[k]), (sizes[i], stochastic, grad_coef is not None, name)
                assert sizes[i] == 0 or not torch.equal(a[0], tensors(sizes[i], i)[0]), "not updated"
print("ok")
"""


def test_the_multi_tensor_kernel_gives_the_bits_of_the_per_tensor_kernel_in_tritons_interpreter():
    """One launch over tensors of different sizes (one element, blocks ending mid-way, whole blocks, an empty one) and
    settings (lr, betas on both sides of lerp's 0.5, weight decay, corrections, seeds), some 16-byte aligned and some
    not (the two launches), gives each tensor the bits of its own launch of the per-tensor kernel: with stochastic
    rounding (the same seeds) and without, with the clip's coefficient and without; and a table of one tensor. Run by
    Triton's CPU interpreter, which reads the addresses in the table as the GPU does."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT, CUDA_VISIBLE_DEVICES="")
    result = subprocess.run([sys.executable, "-c", MULTI_TENSOR_KERNEL], env=env, capture_output=True, text=True,
                            timeout=300, check=False)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]
