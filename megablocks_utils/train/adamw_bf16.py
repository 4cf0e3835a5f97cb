"""``optim="adamw_bf16"``: AdamW for bf16 parameters, fp32 math, bf16 moments, the update rounded stochastically.

The update is torchao's ``_AdamW(bf16_stochastic_round=True)`` (the same formula, state names and state dtypes,
so a checkpoint of either loads into the other). What differs is how it is launched: torchao calls one compiled
function per parameter, and on a 12-layer Qwen3-30B-A3B shape (135 tensors) that cost ~1 ms of host time per
tensor, 130 ms per step in which the GPU waits (bench/profile_steps.py). Here the tensors are flattened, grouped
by size (a model's layers repeat the same shapes), and updated ``CHUNK`` at a time by one compiled function with
dynamic sizes: a few calls per step, and one compiled graph per chunk length (``_chunks``: at most five) whatever
the sizes (within a chunk every size is equal, the one relation between sizes a graph is specialised on).

Stochastic rounding: adding 16 random bits below a float32's bf16 part and truncating rounds up with a
probability equal to the dropped fraction, so an update far below a bf16 ulp still moves the weight on average
(round-to-nearest would drop it every step).
"""

import torch
from torch.distributed.tensor import DTensor

CHUNK = 16  # the most tensors per compiled call: few calls, and a graph small enough to compile in seconds


def _chunks(n: int) -> list[tuple[int, int]]:
    """(start, stop) of chunks covering n tensors, each of a power-of-two length up to CHUNK: whatever the
    model, at most five lengths (16, 8, 4, 2, 1), so at most five compiled graphs."""
    spans, start = [], 0
    while start < n:
        length = min(CHUNK, 1 << ((n - start).bit_length() - 1))
        spans.append((start, start + length))
        start += length
    return spans


def _round_stochastic(x: torch.Tensor) -> torch.Tensor:
    bits = x.view(torch.int32)
    noise = torch.randint(0, 1 << 16, x.shape, device=x.device, dtype=torch.int32)
    return ((bits + noise) & -65536).view(torch.float32).to(torch.bfloat16)  # -65536: 0xFFFF0000 as an int32


def _update(params, grads, exp_avgs, exp_avg_sqs, step, lr, weight_decay, beta1: float, beta2: float, eps: float,
            stochastic: bool) -> None:
    # In the order of torchao's single_param_adam, so that without rounding noise both give the same bits.
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs):
        p32, g32 = p.float(), g.float()
        p32 = p32 - lr * weight_decay * p32
        m32 = m.float().lerp(g32, 1 - beta1)
        v32 = v.float().lerp(g32.square(), 1 - beta2)
        m.copy_(m32)
        v.copy_(v32)
        p32 = p32 - lr * (m32 / bias_correction1) / ((v32.sqrt() / bias_correction2.sqrt()) + eps)
        p.copy_(_round_stochastic(p32) if stochastic else p32)


_compiled_update = torch.compile(_update, fullgraph=True, dynamic=True)


def _flat(t: torch.Tensor) -> torch.Tensor:
    """A 1-D tensor on ``t``'s memory (its local shard for a DTensor), to update ``t`` in place.

    Not ``view(-1)``: torch.compile specialises a graph on a view's base (its rank, sizes and strides), which
    would bring back one graph per shape; a tensor ``set_`` to the same storage is no view of anything.
    """
    local = t.to_local() if isinstance(t, DTensor) else t
    if not local.is_contiguous():
        raise RuntimeError(f"adamw_bf16 updates tensors in place through a flat alias; a {tuple(local.shape)} tensor "
                           "is not contiguous (use optim adamw_torch for this model)")
    return torch.empty(0, dtype=local.dtype, device=local.device).set_(local.untyped_storage(), local.storage_offset(),
                                                                       (local.numel(),), (1,))


class AdamWBF16(torch.optim.Optimizer):
    """AdamW over bf16 parameters (plain tensors or DTensors): see the module docstring."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, stochastic_round: bool = True):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.stochastic_round = stochastic_round
        for group in self.param_groups:
            for p in group["params"]:
                if p.dtype != torch.bfloat16:
                    raise ValueError(f"adamw_bf16 needs bf16 parameters, got a {p.dtype} one")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            todo: dict[tuple, list] = {}  # (device, step, size) -> [(param, grad, exp_avg, exp_avg_sq)], flat
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)  # fp32 on the host, as torchao keeps it
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                flat = _flat(p)
                key = (flat.device, float(state["step"]), flat.numel())
                todo.setdefault(key, []).append([_flat(t) for t in (p, p.grad, state["exp_avg"], state["exp_avg_sq"])])
            beta1, beta2 = group["betas"]
            # Host scalars (0-dim CPU tensors): the compiled graph reads them at each call instead of recompiling
            # for each value the schedule gives.
            lr = torch.as_tensor(group["lr"], dtype=torch.float32)
            weight_decay = torch.tensor(group["weight_decay"], dtype=torch.float32)
            for (_, step, _), items in todo.items():
                step_t = torch.tensor(step, dtype=torch.float32)
                for start, stop in _chunks(len(items)):
                    chunk = list(zip(*items[start:stop]))
                    _compiled_update(*chunk, step_t, lr, weight_decay, beta1, beta2, group["eps"], self.stochastic_round)
        return loss
