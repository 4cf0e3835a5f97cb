"""``AdamWBF16``, the ``adamw_bf16`` optimizer: AdamW on bf16 parameters with bf16 moments, its arithmetic in fp32, and
the new parameter rounded to bf16 stochastically (so updates far below a bf16 ulp still move the weight on average).

The update is torchao's ``_AdamW(bf16_stochastic_round=True)`` (0.18), operation for operation: weight decay, both
moments by ``lerp`` and stored rounded to nearest, the bias-corrected step, and the stochastic rounding of the
parameter (round away from zero with probability = the dropped 16 bits / 2^16). torchao compiles one step function per
tensor, and each call cost ~0.4 ms of host time: 135 tensors of a 12-layer Qwen3-30B-A3B shape took 50 ms of host time
per step for what the GPU does in less (one H200, bench/optim_step.py), so the optimizer ran host-bound. Here each tensor
is one Triton kernel launch on CUDA (its four tensors read once, three written); elsewhere the same arithmetic runs as
torch operations (``_reference_update``, what the kernel is tested against).

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
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
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
                update = _triton_update if p.is_cuda else _reference_update
                update(_local(p), _local(p.grad), _local(state["exp_avg"]), _local(state["exp_avg_sq"]), lr=lr, beta1=beta1,
                       beta2=beta2, eps=eps, weight_decay=weight_decay, correction1=correction1,
                       correction2_sqrt=correction2_sqrt, seed=seed)
        return loss


def _round_stochastic(x: torch.Tensor, random16: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16, away from zero when ``random16`` (uniform in [0, 2^16)) is below the 16 bits bf16 drops."""
    bits = x.view(torch.int32)
    truncated = bits & -65536  # the upper 16 bits: toward zero
    return torch.where(random16 < (bits & 0xFFFF), truncated + 0x10000, truncated).view(torch.float32).to(torch.bfloat16)


def _reference_update(p, grad, exp_avg, exp_avg_sq, *, lr, beta1, beta2, eps, weight_decay, correction1, correction2_sqrt,
                      seed, stochastic: bool = True) -> None:
    """The update in torch operations, in place (any device)."""
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
                   seed, stochastic: bool = True) -> None:
    """The update as one Triton kernel over the tensor's elements (CUDA, contiguous bf16 tensors), in place."""
    if not all(t.is_contiguous() and t.dtype == torch.bfloat16 for t in (p, grad, exp_avg, exp_avg_sq)):
        return _reference_update(p, grad, exp_avg, exp_avg_sq, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                                 weight_decay=weight_decay, correction1=correction1, correction2_sqrt=correction2_sqrt,
                                 seed=seed, stochastic=stochastic)
    n = p.numel()
    if n == 0:
        return None
    from megablocks_utils.train.adamw_bf16_kernel import adamw_bf16_kernel  # Triton: imported where a GPU runs it

    adamw_bf16_kernel[(math.ceil(n / _BLOCK),)](p, grad, exp_avg, exp_avg_sq, n, lr, 1 - beta1, 1 - beta2, eps, weight_decay,
                                        correction1, correction2_sqrt, seed, STOCHASTIC=stochastic, BLOCK=_BLOCK,
                                        num_warps=8)
    return None
