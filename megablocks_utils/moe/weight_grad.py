"""The experts' grouped GEMM whose backward adds the weight gradient into the parameter's ``.grad`` itself.

With gradient accumulation, autograd makes each micro-step's expert gradient as a fresh tensor and then adds it to
``.grad`` (``AccumulateGrad``): for the experts that is the largest tensor of the step written, read back and added,
43 ms of a 0.61 s DeepSeek-V2-Lite step (20 layers, 4 micro-steps, one H200). Here the backward writes the first
micro-step's gradient straight into place (torch's grouped GEMM, in the parameter's layout: no copy) and adds every
later one in the GEMM's epilogue (``weight_grad_kernel.py``), rounded as the two steps round (Megatron's "gradient
accumulation fusion" is the same idea for dense layers).

Used only where the layer owns its experts' gradients: CUDA grouped GEMMs, parameters that FSDP does not manage
(FSDP reads and reduces its own unsharded gradients) and that need a gradient. The weight is given to the GEMM
without an autograd edge, so autograd never sees it: hooks registered on these parameters' gradient do not run.
"""

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from megablocks_utils.moe.cast import cast_grad

# Set by ``gradients_written``: the ids of the parameters whose existing gradient a GEMM wrote (rather than added to).
_written: set | None = None

@contextmanager
def gradients_written(written: set):
    """Inside, every ``WeightGradInto`` writes its parameter's existing gradient instead of adding to it, and puts the
    parameter's id in ``written``. For a step's first micro-step captured into a CUDA graph (train/cuda_graph.py):
    gradients kept in place between steps need no zeroing where the first micro-step writes them whole (the experts'
    are most of a model's: ~21 GB of memset a DeepSeek-V2-Lite step, and the first GEMM's read of those zeros)."""
    global _written
    outer, _written = _written, written
    try:
        yield written
    finally:
        _written = outer


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """torch's grouped GEMM (CUDA sm80+, bf16): rows of ``a`` in groups ending at ``offs``, each times its ``b``."""
    if hasattr(F, "grouped_mm"):  # public since torch 2.12
        return F.grouped_mm(a, b, offs=offs)
    return torch._grouped_mm(a, b, offs=offs)  # the same kernel under its older name


class WeightGradInto:
    """Where one expert weight's gradient goes: ``param.grad`` (a DTensor's local block, or the tensor), made on the
    first backward after it was cleared and added to on every later one (written over inside ``gradients_written``), in
    ``param``'s dtype and divided by ``divisor`` (the cast's backward: ``cast.cast_grad``, compiled with ``fuse``)."""

    def __init__(self, param: torch.Tensor, divisor: float, fuse: bool):
        self.param = param
        self.divisor = float(divisor)
        self.fuse = fuse

    def add(self, a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> None:
        """``param.grad[e] += a_e^T @ b_e`` over the row groups of ``offs`` (a [T, M], b [T, N], the local weight
        [E, M, N])."""
        grad = self.param.grad
        if grad is None:
            fresh = cast_grad(grouped_mm(a.t(), b, offs), self.divisor, self.param.dtype, self.fuse)  # [E, M, N]: its layout
            if isinstance(self.param, DTensor):
                fresh = DTensor.from_local(fresh, self.param.device_mesh, self.param.placements,
                                           shape=self.param.shape, stride=self.param.stride(), run_check=False)
            self.param.grad = fresh
            return
        from megablocks_utils.moe import weight_grad_kernel  # Triton: imported where a GPU runs it

        local = grad.to_local() if isinstance(grad, DTensor) else grad
        if _written is not None:
            _written.add(id(self.param))
        weight_grad_kernel.grouped_weight_grad(a, b, offs, local, accumulate=_written is None, divisor=self.divisor)


class _GroupedMMGradInto(torch.autograd.Function):
    """``x @ w_e`` for the rows of each expert (``w`` [E, K, N]; ``transpose_weight``: ``w`` [E, N, K] used as
    ``x @ w_e^T``), the weight's gradient given to ``into`` instead of autograd."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, into: WeightGradInto, transpose_weight: bool):
        ctx.save_for_backward(x, w, offs)
        ctx.into, ctx.transpose_weight = into, transpose_weight
        return grouped_mm(x, w.transpose(-2, -1) if transpose_weight else w, offs)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, w, offs = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = grouped_mm(grad_out, w if ctx.transpose_weight else w.transpose(-2, -1), offs)
        # w_e [N, K]: its gradient grad_out_e^T @ x_e; w_e [K, N]: x_e^T @ grad_out_e
        a, b = (grad_out, x) if ctx.transpose_weight else (x, grad_out)
        ctx.into.add(a, b, offs)
        return grad_x, None, None, None, None


def grouped_mm_grad_into(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, into: WeightGradInto, transpose_weight: bool) -> torch.Tensor:
    """The grouped GEMM ``x @ w_e`` (``w_e^T`` with ``transpose_weight``), ``w`` a local weight without autograd edge
    (already in the compute dtype), its gradient added by the backward into ``into``'s parameter."""
    return _GroupedMMGradInto.apply(x, w, offs, into, transpose_weight)
