"""``AdamWBF16``, the ``adamw_bf16`` optimizer: AdamW on bf16 parameters with bf16 moments, its arithmetic in fp32, and
the new parameter rounded to bf16 stochastically (so updates far below a bf16 ulp still move the weight on average).

The update is torchao's ``_AdamW(bf16_stochastic_round=True)`` (0.18), operation for operation: weight decay, both
moments by ``lerp`` and stored rounded to nearest, the bias-corrected step, and the stochastic rounding of the
parameter (round away from zero with probability = the dropped 16 bits / 2^16). torchao compiles one step function per
tensor, and each call cost ~0.4 ms of host time: 135 tensors of a 12-layer Qwen3-30B-A3B shape took 50 ms of host time
per step for what the GPU does in less (one H200, bench/optim_step.py), so the optimizer ran host-bound.

Here one Triton launch updates all the CUDA tensors (each one's four tensors read once, three written): each program
finds its tensor in a table of addresses, sizes, seeds and scalars, built on the host and copied from pinned memory
(no sync). One launch per tensor, with its scalars and seed computed per tensor on the host, had cost 10.6-14.9 ms of host
time per step at that shape (one H200), while the GPU sat idle: the step follows a host sync, so nothing was queued
ahead. A tensor the launch cannot take (not contiguous) gets a launch of its own with the same arithmetic
(``multi_tensor=False``: every tensor so, the bits unchanged); elsewhere the same arithmetic runs as torch operations
(``_reference_update``, what the kernels are tested against).

The gradient clip can be folded into the step (``step(clip_coef=...)``): each gradient is multiplied by the clip's
coefficient as the update reads it, instead of in a pass of its own over all gradients before the step (a read and a
write of every gradient; that pass took 7-9 ms of a 417 ms step at a 12-layer Qwen3-30B-A3B shape on one H200). The
product is rounded to the gradient's dtype, the coefficient first cast to it, exactly as the in-place multiply of
``clip_grad_norm_`` stores it, so a run with the fold trains the same bits as one that clips first
(tests/test_adamw_bf16.py, tests/test_optim.py). Keeping that rounding costs a few integer operations per element in a
kernel bound by memory; dropping it would gain little, as the bf16 gradient carries an error of the same size.

The random bits come from a seed per tensor and step drawn from torch's CPU generator (one draw for all tensors, which
gives the values of one draw per tensor), which checkpoints save and restore: a resumed run rounds as the uninterrupted
one did. State (``step``, ``exp_avg``, ``exp_avg_sq``, shaped and sharded like the parameter) has torchao's keys and
dtypes, so its checkpoints load here.
"""

import math
from typing import NamedTuple

import torch
from torch.distributed.tensor import DTensor

_BLOCK = 2048  # elements per Triton block: 8 warps x 256
_BLOCKS_PER_PROGRAM = 4  # the multi-tensor launch's program: its table search once per 4 blocks


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class _TensorUpdate(NamedTuple):
    """One tensor's update: the keyword arguments of ``_reference_update`` and ``_triton_update`` but the clip's."""

    p: torch.Tensor
    grad: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    correction1: float
    correction2_sqrt: float
    seed: int


class AdamWBF16(torch.optim.Optimizer):
    """AdamW for bf16 parameters (``param_groups`` as torch's; ``lr`` a number or a CPU tensor). ``multi_tensor``: update
    the contiguous CUDA tensors in one kernel launch per device (two where some are not 16-byte aligned); False: one
    launch per tensor, the same bits in more host time."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, *, multi_tensor: bool = True):
        if lr < 0 or eps < 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"AdamWBF16: lr={lr}, eps={eps}, betas={betas} out of range")
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.multi_tensor = multi_tensor
        self.steps_taken = 0  # steps applied by this object (a prepared step must be applied before the next one)

    @torch.no_grad()
    def step(self, closure=None, *, clip_coef: torch.Tensor | None = None, prepared: "PreparedStep | None" = None):
        """One update of every parameter with a gradient. ``clip_coef``: the gradient clip's coefficient (a 0-dim
        tensor on the parameters' device, ``grad_norm_and_clip_coef``'s; read on the device, no host sync), multiplied
        into each gradient as the update reads it, the stored gradient left as it is; None: the gradients as they are.
        ``prepared``: this step's host work, done ahead by ``prepare`` (then ``clip_coef`` is the one given there)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if prepared is None:
            prepared = self.prepare(clip_coef)
        elif prepared.optimizer is not self or prepared.steps_taken != self.steps_taken:
            raise RuntimeError("AdamWBF16.step: the prepared step belongs to another optimizer or step; prepare it again")
        prepared.apply()
        return loss

    @torch.no_grad()
    def prepare(self, clip_coef: torch.Tensor | None = None) -> "PreparedStep":
        """The host's part of the next ``step`` (state of new parameters, seeds, bias corrections, the multi-tensor
        launch's table, already on its way to the GPU), changing nothing that an update reads: train_fsdp2.py runs it
        before the host waits for the GPU at the step's check, so the GPU does not sit idle while the host builds the
        launch (5.7 ms of a DeepSeek-V2-Lite step on one H200, before CUDA graphs:
        bench/results/small_experts_and_lora_h200_2026-11-24_to_25/records.md#phases_new_dsv2_h200_2026-11-24jsonl). Apply it with ``step(prepared=...)``, once, or
        drop it (a skipped step): only the seeds' draw from torch's CPU generator has happened then."""
        with_grads = [(group, p) for group in self.param_groups for p in group["params"] if p.grad is not None]
        for _, p in with_grads:
            if p.dtype != torch.bfloat16:
                raise ValueError(f"adamw_bf16 updates bf16 parameters; this one is {p.dtype}")
            if not self.state[p]:
                self.state[p].update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
        steps = [self.state[p]["step"] for _, p in with_grads]
        prepared = PreparedStep(self, steps)
        if not with_grads:
            return prepared
        # One draw, in the parameters' order: the seeds that one draw per tensor gives (tests/test_adamw_bf16.py).
        seeds = torch.randint(0, 2**31 - 1, (len(with_grads),)).tolist()
        corrections = {}  # once per step count and betas: tens of us of host time each
        coefs = {}  # clip_coef cast once per (device, dtype) of the gradients, as scale_grads_ casts it
        one_launch = {}  # device -> the updates of its contiguous bf16 tensors
        for (group, p), step, seed in zip(with_grads, steps, seeds):
            beta1, beta2 = group["betas"]
            key = (float(step), step.dtype, step.device, beta1, beta2)
            if key not in corrections:
                corrections[key] = _bias_corrections(step + 1, beta1, beta2)  # the step count this update makes
            state = self.state[p]
            update = _TensorUpdate(_local(p), _local(p.grad), _local(state["exp_avg"]), _local(state["exp_avg_sq"]),
                                   float(group["lr"]), beta1, beta2, group["eps"], group["weight_decay"], *corrections[key],
                                   seed)
            coef = None
            if clip_coef is not None:
                if (update.grad.device, update.grad.dtype) not in coefs:
                    coefs[update.grad.device, update.grad.dtype] = clip_coef.to(update.grad.device, update.grad.dtype)
                coef = coefs[update.grad.device, update.grad.dtype]
            if self.multi_tensor and _fits_one_launch(update):
                one_launch.setdefault(update.p.device, []).append(update)
            else:
                prepared.single.append((update, coef))
        for device, updates in one_launch.items():
            coef = None if clip_coef is None else coefs[device, torch.bfloat16]
            prepared.launches += [(table, n, blocks, aligned, coef) for table, n, blocks, aligned in _multi_tensor_tables(updates)]
        return prepared


class PreparedStep:
    """``AdamWBF16.prepare``'s result: the updates of one step, ready to launch (``apply``)."""

    def __init__(self, optimizer: AdamWBF16, steps: list[torch.Tensor]):
        self.optimizer, self.steps = optimizer, steps
        self.steps_taken = optimizer.steps_taken  # the optimizer's count when prepared: applied only at that count
        self.single: list[tuple[_TensorUpdate, torch.Tensor | None]] = []  # a launch (or torch operations) each
        self.launches: list[tuple] = []  # the multi-tensor launches: (table, tensors, programs, aligned, coef)
        self.applied = False

    def apply(self) -> None:
        if self.applied:
            raise RuntimeError("AdamWBF16: a prepared step was applied twice")
        self.applied = True
        self.optimizer.steps_taken += 1
        if self.steps:
            torch._foreach_add_(self.steps, 1)
        for update, coef in self.single:
            if update.p.is_cuda:
                _triton_update(**update._asdict(), grad_coef=coef)
            else:
                _reference_update(**update._asdict(), grad_coef=coef)
        for table, n_tensors, blocks, aligned, coef in self.launches:
            _launch_multi_tensor(table, n_tensors, blocks, aligned, coef)


def _bias_corrections(step: torch.Tensor, beta1: float, beta2: float) -> tuple[float, float]:
    """(1 - beta1^step, sqrt(1 - beta2^step)) in fp32 on the host, as torchao computes them from its fp32 step tensor."""
    return float(1 - beta1**step), float((1 - beta2**step).sqrt())


def _fits_one_launch(update: _TensorUpdate) -> bool:
    """What the multi-tensor kernel reads: contiguous bf16 tensors on the parameter's GPU."""
    tensors = (update.p, update.grad, update.exp_avg, update.exp_avg_sq)
    return update.p.is_cuda and all(t.device == update.p.device and t.dtype == torch.bfloat16 and t.is_contiguous()
                                    for t in tensors)


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
    # Triton: imported where a GPU runs it
    from megablocks_utils.train.adamw_bf16_kernel import adamw_bf16_kernel

    # Without a coefficient the kernel never reads its pointer: the gradient stands in for it.
    adamw_bf16_kernel[(math.ceil(n / _BLOCK),)](p, grad, exp_avg, exp_avg_sq, grad if grad_coef is None else grad_coef, n, lr,
                                        1 - beta1, 1 - beta2, eps, weight_decay, correction1, correction2_sqrt, seed,
                                        STOCHASTIC=stochastic, SCALED=grad_coef is not None, BLOCK=_BLOCK, num_warps=8)
    return None


def _triton_multi_tensor_update(updates: list[_TensorUpdate], *, grad_coef: torch.Tensor | None = None,
                                stochastic: bool = True) -> None:
    """``_triton_update`` of every tensor of ``updates`` (contiguous bf16 tensors on one device, ``grad_coef`` a bf16
    0-dim tensor there) in one launch of the multi-tensor kernel, the same bits; two launches when some tensor's
    addresses or size are not multiples of 16 bytes (those load an element at a time, the others 16 bytes)."""
    for table, n_tensors, blocks, aligned in _multi_tensor_tables(updates):
        _launch_multi_tensor(table, n_tensors, blocks, aligned, grad_coef, stochastic)


def _multi_tensor_tables(updates: list[_TensorUpdate]) -> list[tuple[torch.Tensor, int, int, bool]]:
    """The multi-tensor kernel's tables for ``updates`` (on their device; a CUDA one copied from pinned memory, no
    sync): (table, tensors, programs, aligned), one for the tensors whose addresses and size are multiples of 16 bytes
    and one for the others, where there are any."""
    aligned, unaligned = [], []  # (update, numel, addresses)
    for u in updates:
        n = u.p.numel()
        addresses = (u.p.data_ptr(), u.grad.data_ptr(), u.exp_avg.data_ptr(), u.exp_avg_sq.data_ptr())
        if n > 0:
            fits = n % 8 == 0 and all(address % 16 == 0 for address in addresses)
            (aligned if fits else unaligned).append((u, n, addresses))
    tables = []
    for batch, is_aligned in ((aligned, True), (unaligned, False)):
        if not batch:
            continue
        # The table of adamw_bf16_kernel.py, a row per tensor: 7 int64, then 8 fp32 (Python floats reach the
        # per-tensor kernel as fp32 too: the same values).
        int_rows, float_rows, blocks = [], [], 0
        for u, n, addresses in batch:
            int_rows.append((blocks, n, u.seed, *addresses))
            float_rows.append((u.lr, 1 - u.beta1, 1 - u.beta2, u.eps, u.weight_decay, u.correction1, u.correction2_sqrt,
                               0.0))
            blocks += math.ceil(n / (_BLOCK * _BLOCKS_PER_PROGRAM))
        table = torch.cat([torch.tensor(int_rows, dtype=torch.int64),
                           torch.tensor(float_rows, dtype=torch.float32).view(torch.int64)], dim=1)
        device = batch[0][0].p.device
        if device.type == "cuda":
            # From pinned memory: a copy from pageable memory waits for the GPU's queue (a host sync). The pinned block
            # is not reused before the copy is done (torch's caching host allocator records it).
            table = table.pin_memory().to(device, non_blocking=True)
        tables.append((table, len(batch), blocks, is_aligned))
    return tables


def _launch_multi_tensor(table: torch.Tensor, n_tensors: int, blocks: int, aligned: bool, grad_coef: torch.Tensor | None,
                         stochastic: bool = True) -> None:
    """One launch of the multi-tensor kernel over a table of ``_multi_tensor_tables``."""
    # Triton: imported where a GPU runs it
    from megablocks_utils.train.adamw_bf16_kernel import adamw_bf16_multi_tensor_kernel

    # Without a coefficient the kernel never reads its pointer: the table stands in for it.
    adamw_bf16_multi_tensor_kernel[(blocks,)](table, n_tensors, table if grad_coef is None else grad_coef,
                                              STOCHASTIC=stochastic, SCALED=grad_coef is not None, ALIGNED=aligned,
                                              SEARCH_STEPS=(n_tensors - 1).bit_length(), BLOCK=_BLOCK,
                                              BLOCKS_PER_PROGRAM=_BLOCKS_PER_PROGRAM, num_warps=8)
