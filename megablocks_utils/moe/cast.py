"""The expert weights' cast to the compute dtype, whose backward divides their gradient.

Experts that FSDP leaves out (``parallelize``: dp = 1) get from this cast what FSDP's reduce would have
done to their gradient: back to the weights' dtype, divided by world size (``grads.py`` says why).
"""

import torch

from megablocks_utils.moe.fused import fused


def _divide_cast(grad: torch.Tensor, divisor: float, dtype: torch.dtype) -> torch.Tensor:
    return (grad.float() / divisor).to(dtype)


class _CastDivided(torch.autograd.Function):
    """``weight.to(dtype)``; the backward casts the gradient back to the
    weight's dtype divided by ``divisor``, in one pass: what FSDP's reduce would do (fp32, then the weight's
    dtype) for experts it leaves out (dp = 1: nothing summed, only the division by world size). ``fuse``: one
    compiled kernel (CUDA, power-of-two divisor: multiplying by its exact reciprocal, as the compiler may, then
    changes no bit); else eager ops."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, dtype: torch.dtype, divisor: float, fuse: bool) -> torch.Tensor:
        ctx.weight_dtype, ctx.divisor, ctx.fuse = weight.dtype, divisor, fuse
        return weight.to(dtype) if weight.dtype != dtype else weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return cast_grad(grad, ctx.divisor, ctx.weight_dtype, ctx.fuse), None, None, None


def cast_grad(grad: torch.Tensor, divisor: float, dtype: torch.dtype, fuse: bool) -> torch.Tensor:
    """The cast's backward: ``grad`` in the weight's ``dtype``, divided by ``divisor`` in fp32 first (also used where
    the experts' GEMM writes their gradient itself, ``weight_grad.py``). ``fuse``: ``divide_fuses``."""
    if divisor == 1:
        return grad.to(dtype)
    return (fused(_divide_cast) if fuse else _divide_cast)(grad, divisor, dtype)


def divide_fuses(grad_divisor: int, compile_elementwise: bool, is_cuda: bool) -> bool:
    """Whether ``cast_grad`` runs as one compiled kernel: CUDA, ``compile_elementwise``, a power-of-two divisor."""
    return compile_elementwise and is_cuda and grad_divisor & (grad_divisor - 1) == 0


def cast_weights(weights: list[torch.Tensor], dtype: torch.dtype, grad_divisor: int, compile_elementwise: bool) -> tuple[torch.Tensor, ...]:
    """``weights`` (local tensors) in ``dtype``, their gradients divided by ``grad_divisor`` on the way back;
    as they are when there is nothing to do. ``compile_elementwise``: the backward as one compiled kernel on CUDA."""
    if weights[0].dtype == dtype and grad_divisor == 1:
        return tuple(weights)
    fuse = divide_fuses(grad_divisor, compile_elementwise, weights[0].is_cuda)
    return tuple(_CastDivided.apply(w, dtype, float(grad_divisor), fuse) for w in weights)
