"""SwiGLU on the fused [rows, 2I] projection (``silu(gate) * up``) as one Triton kernel each way (``experts.silu_mul``
uses the backward on CUDA, and the forward where the rows are bounded; otherwise its forward is compiled).

Why: the compiled backward (torch.compile of the forward) writes [grad_gate | grad_up] as one concatenated output
element by element, so each half reads its own inputs: gate and the incoming gradient are read twice, 483 MB a
DeepSeek-V2-Lite layer and micro-step (24,576 rows x 2 x 1408) where 345 MB is the least; 12 ms of a 0.58 s step on
one H200. Here each program reads a tile of gate, up and the gradient once and writes both halves. The arithmetic is
the compiled kernel's: fp32 throughout, one rounding per output (grad_up = g * silu(gate), grad_gate =
g * up * sigmoid(gate) * (1 + gate * (1 - sigmoid(gate)))).

``valid`` (a device int: the rows the grouped GEMMs cover, their last offset) stops both there: past it the static
exchange's padding rows (up to 3x the mean rows at ep 4), whose activations and gradients nothing reads, are left
unwritten, with no host sync. The forward computes as the compiled one: fp32, one rounding.
"""

import torch
import triton
import triton.language as tl

_BLOCK_ROWS, _BLOCK_COLS = 16, 128


@triton.jit
def _silu_mul_forward_kernel(gate_up_ptr, out_ptr, rows, valid_ptr, stride_gate_up, stride_out, WIDTH: tl.constexpr,
                             BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    """One [BLOCK_ROWS, BLOCK_COLS] tile of ``silu(gate) * up``, rows below ``*valid_ptr`` only."""
    start = tl.program_id(0).to(tl.int64) * BLOCK_ROWS
    rows = tl.minimum(rows, tl.load(valid_ptr).to(tl.int64))
    if start >= rows:
        return
    r = start + tl.arange(0, BLOCK_ROWS)
    c = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    mask = (r < rows)[:, None] & (c < WIDTH)[None, :]
    at = r[:, None] * stride_gate_up + c[None, :]
    gate = tl.load(gate_up_ptr + at, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + at + WIDTH, mask=mask, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + r[:, None] * stride_out + c[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul_forward(gate_up: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up`` [rows, 2I] (row-contiguous): [rows, I] in its dtype, computed for the rows
    below ``valid`` (an integer tensor of one element, on the device); the rest of the output is left unwritten."""
    rows, width2 = gate_up.shape
    if width2 % 2 or gate_up.stride(-1) != 1:
        raise ValueError(f"silu_mul_forward: gate_up {tuple(gate_up.shape)} (last stride {gate_up.stride(-1)}) does not "
                         "fit [rows, 2I]")
    width = width2 // 2
    out = torch.empty((rows, width), dtype=gate_up.dtype, device=gate_up.device)
    if rows and width:
        grid = (triton.cdiv(rows, _BLOCK_ROWS), triton.cdiv(width, _BLOCK_COLS))
        _silu_mul_forward_kernel[grid](gate_up, out, rows, valid, gate_up.stride(0), out.stride(0), WIDTH=width,
                                       BLOCK_ROWS=_BLOCK_ROWS, BLOCK_COLS=_BLOCK_COLS, num_warps=4)
    return out


@triton.jit
def _silu_mul_backward_kernel(gate_up_ptr, grad_ptr, out_ptr, rows, valid_ptr, stride_gate_up, stride_grad, stride_out,
                              WIDTH: tl.constexpr, BOUNDED: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    """One [BLOCK_ROWS, BLOCK_COLS] tile of columns < WIDTH (= I): both halves of the gradient of ``gate_up``; with
    BOUNDED only rows below ``*valid_ptr``."""
    start = tl.program_id(0).to(tl.int64) * BLOCK_ROWS
    if BOUNDED:
        rows = tl.minimum(rows, tl.load(valid_ptr).to(tl.int64))
        if start >= rows:
            return
    r = start + tl.arange(0, BLOCK_ROWS)
    c = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    mask = (r < rows)[:, None] & (c < WIDTH)[None, :]
    at = r[:, None] * stride_gate_up + c[None, :]
    gate = tl.load(gate_up_ptr + at, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + at + WIDTH, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(grad_ptr + r[:, None] * stride_grad + c[None, :], mask=mask, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-gate))
    grad_up = g * (gate * sig)
    grad_gate = g * up * (sig * (1.0 + gate * (1.0 - sig)))
    out = out_ptr + r[:, None] * stride_out + c[None, :]
    tl.store(out, grad_gate.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out + WIDTH, grad_up.to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul_backward(gate_up: torch.Tensor, grad: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """The gradient of ``gate_up`` [rows, 2I] (row-contiguous) for ``grad`` [rows, I], the gradient of
    ``silu(gate) * up``: [rows, 2I] in ``gate_up``'s dtype. ``valid`` (an integer tensor of one element, on the device):
    only the rows below it are computed; the rest of the output is left unwritten."""
    rows, width = grad.shape
    if gate_up.shape != (rows, 2 * width) or gate_up.stride(-1) != 1:
        raise ValueError(f"silu_mul_backward: gate_up {tuple(gate_up.shape)} (last stride {gate_up.stride(-1)}) and grad "
                         f"{tuple(grad.shape)} do not fit [rows, 2I] and [rows, I]")
    grad = grad if grad.stride(-1) == 1 else grad.contiguous()
    out = torch.empty_like(gate_up, memory_format=torch.contiguous_format)
    if rows and width:
        grid = (triton.cdiv(rows, _BLOCK_ROWS), triton.cdiv(width, _BLOCK_COLS))
        _silu_mul_backward_kernel[grid](gate_up, grad, out, rows, valid if valid is not None else out, gate_up.stride(0),
                                        grad.stride(0), out.stride(0), WIDTH=width, BOUNDED=valid is not None,
                                        BLOCK_ROWS=_BLOCK_ROWS, BLOCK_COLS=_BLOCK_COLS, num_warps=4)
    return out
