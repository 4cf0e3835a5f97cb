"""``AdamWBF16``, the ``adamw_bf16`` optimizer: AdamW on bf16 parameters with bf16 moments, its arithmetic in fp32, and
the new parameter rounded to bf16 stochastically (so updates far below a bf16 ulp still move the weight on average).

The update is torchao's ``_AdamW(bf16_stochastic_round=True)`` (0.18), operation for operation: weight decay, both
moments by ``lerp`` and stored rounded to nearest, the bias-corrected step, and the stochastic rounding of the
parameter (round away from zero with probability = the dropped 16 bits / 2^16). torchao compiles one step function per
tensor, and each call cost ~0.4 ms of host time: 135 tensors of a 12-layer Qwen3-30B-A3B shape took 50 ms of host time
per step for what the GPU does in less (one H200, bench/optim_step.py), so the optimizer ran host-bound. Here each tensor
is one Triton kernel launch on CUDA (its four tensors read once, three written); elsewhere the same arithmetic runs as
torch operations (``_reference_update``, what the kernel is tested against).

The gradient clip can be folded into the step (``step(clip_coef=...)``): each gradient is multiplied by the clip's
coefficient as the update reads it, instead of in a pass of its own over all gradients before the step (a read and a
write of every gradient; that pass took 7-9 ms of a 417 ms step at a 12-layer Qwen3-30B-A3B shape on one H200). The
product is rounded to the gradient's dtype, the coefficient first cast to it, exactly as the in-place multiply of
``clip_grad_norm_`` stores it, so a run with the fold trains the same bits as one that clips first
(tests/test_adamw_bf16.py, tests/test_optim.py). Keeping that rounding costs a few integer operations per element in a
kernel bound by memory; dropping it would gain little, as the bf16 gradient carries an error of the same size.

The random bits come from a seed drawn per tensor and step from torch's CPU generator, which checkpoints save and
restore: a resumed run rounds as the uninterrupted one did. State (``step``, ``exp_avg``, ``exp_avg_sq``, shaped and
sharded like the parameter) has torchao's keys and dtypes, so its checkpoints load here.
"""

import math

import torch
from torch.distributed.tensor import DTensor

_BLOCK = 2048  # elements per Triton program: 8 warps x 256


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class AdamWBF16(torch.optim.Optimizer):
    """AdamW for bf16 parameters (``param_groups`` as torch's; ``lr`` a number or a CPU tensor)."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0):
        if lr < 0 or eps < 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"AdamWBF16: lr={lr}, eps={eps}, betas={betas} out of range")
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None, *, clip_coef: torch.Tensor | None = None):
        """One update of every parameter with a gradient. ``clip_coef``: the gradient clip's coefficient (a 0-dim
        tensor on the parameters' device, ``grad_norm_and_clip_coef``'s; read on the device, no host sync), multiplied
        into each gradient as the update reads it, the stored gradient left as it is; None: the gradients as they are."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        coefs = {}  # clip_coef cast once per (device, dtype) of the gradients, as scale_grads_ casts it
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, weight_decay = float(group["lr"]), group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.dtype != torch.bfloat16:
                    raise ValueError(f"adamw_bf16 updates bf16 parameters; this one is {p.dtype}")
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                # fp32 on the host, as torchao computes them from its fp32 step tensor; no device sync
                step = state["step"]
                correction1 = float(1 - beta1**step)
                correction2_sqrt = float((1 - beta2**step).sqrt())
                seed = int(torch.randint(0, 2**31 - 1, ()))
                grad, coef = _local(p.grad), None
                if clip_coef is not None:
                    if (grad.device, grad.dtype) not in coefs:
                        coefs[grad.device, grad.dtype] = clip_coef.to(grad.device, grad.dtype)
                    coef = coefs[grad.device, grad.dtype]
                update = _triton_update if p.is_cuda else _reference_update
                update(_local(p), grad, _local(state["exp_avg"]), _local(state["exp_avg_sq"]), lr=lr, beta1=beta1,
                       beta2=beta2, eps=eps, weight_decay=weight_decay, correction1=correction1,
                       correction2_sqrt=correction2_sqrt, seed=seed, grad_coef=coef)
        return loss


def _round_stochastic(x: torch.Tensor, random16: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16, away from zero when ``random16`` (uniform in [0, 2^16)) is below the 16 bits bf16 drops."""
    bits = x.view(torch.int32)
    truncated = bits & -65536  # the upper 16 bits: toward zero
    return torch.where(random16 < (bits & 0xFFFF), truncated + 0x10000, truncated).view(torch.float32).to(torch.bfloat16)


def _reference_update(p, grad, exp_avg, exp_avg_sq, *, lr, beta1, beta2, eps, weight_decay, correction1, correction2_sqrt,
                      seed, stochastic: bool = True, grad_coef: torch.Tensor | None = None) -> None:
    """The update in torch operations, in place (any device). ``grad_coef``: a 0-dim tensor in the gradient's dtype that
    multiplies the gradient, the product rounded to that dtype (``grad`` itself is not changed)."""
    if grad_coef is not None:
        grad = grad * grad_coef
    p32, g32 = p.float(), grad.float()
    p32 = p32 - lr * weight_decay * p32
    m32 = exp_avg.float().lerp(g32, 1 - beta1)
    v32 = exp_avg_sq.float().lerp(g32.square(), 1 - beta2)
    exp_avg.copy_(m32)
    exp_avg_sq.copy_(v32)
    p32 = p32 - lr * (m32 / correction1) / (v32.sqrt() / correction2_sqrt + eps)
    if stochastic:
        random16 = torch.randint(0, 1 << 16, p32.shape, generator=torch.Generator(p32.device).manual_seed(seed),
                                 device=p32.device, dtype=torch.int32)
        p.copy_(_round_stochastic(p32, random16))
    else:
        p.copy_(p32)


def _triton_update(p, grad, exp_avg, exp_avg_sq, *, lr, beta1, beta2, eps, weight_decay, correction1, correction2_sqrt,
                   seed, stochastic: bool = True, grad_coef: torch.Tensor | None = None) -> None:
    """The update as one Triton kernel over the tensor's elements (CUDA, contiguous bf16 tensors), in place;
    ``grad_coef`` as ``_reference_update``'s, loaded by the kernel (no host sync)."""
    if not all(t.is_contiguous() and t.dtype == torch.bfloat16 for t in (p, grad, exp_avg, exp_avg_sq)) or (
        grad_coef is not None and grad_coef.dtype != torch.bfloat16
    ):
        return _reference_update(p, grad, exp_avg, exp_avg_sq, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                                 weight_decay=weight_decay, correction1=correction1, correction2_sqrt=correction2_sqrt,
                                 seed=seed, stochastic=stochastic, grad_coef=grad_coef)
    n = p.numel()
    if n == 0:
        return None
    from megablocks_utils.train.adamw_bf16_kernel import adamw_bf16_kernel  # Triton: imported where a GPU runs it

    # Without a coefficient the kernel never reads its pointer: the gradient stands in for it.
    adamw_bf16_kernel[(math.ceil(n / _BLOCK),)](p, grad, exp_avg, exp_avg_sq, grad if grad_coef is None else grad_coef, n, lr,
                                        1 - beta1, 1 - beta2, eps, weight_decay, correction1, correction2_sqrt, seed,
                                        STOCHASTIC=stochastic, SCALED=grad_coef is not None, BLOCK=_BLOCK, num_warps=8)
    return None
