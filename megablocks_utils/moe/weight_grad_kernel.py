"""The experts' weight gradient as one Triton kernel that adds into the gradient already there (``weight_grad.py``
uses it): ``out[e] (+)= a_e^T @ b_e`` for every local expert e, the rows of a and b grouped by expert (``offs``).

Why a kernel of our own: with gradient accumulation every micro-step but the first adds a fresh expert gradient into
the last one. torch's grouped GEMM (``F.grouped_mm``) has no ``out`` and no beta, so autograd writes the fresh gradient,
reads it back and adds it (DTensor ``add_``): 43 ms of a DeepSeek-V2-Lite step (20 layers, 4 micro-steps, one H200),
bytes that HBM moves three times over for nothing. Here each output tile is read, added to and written once.

Each output tile's sum runs over its expert's rows in fp32 and is then rounded as the unfused path rounds: to the
compute dtype (the GEMM's output), divided by ``divisor`` in fp32 and rounded to the gradient's dtype (the cast's
backward, ``cast.py``), and added to the gradient there in fp32 and rounded once (``add_``). So only the GEMM's own
order of sums differs from torch's kernel.

A divisor that is a power of two (the ranks an expert's gradient is averaged over: 2, 4, 8) multiplies by its
reciprocal instead: the same real number rounded once, so the same bits, without IEEE division's instruction sequence
on every element of the gradient.
"""

import math

import torch
import triton
import triton.language as tl

# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages): the fastest of 8 at Qwen3-30B-A3B's and DeepSeek-V2-Lite's shapes on an
# H200, both projections (bench/weight_grad_bench.py --configs; reading the gradient's tile before the sum was slower;
# a persistent kernel, one flat loop over a program's tiles so that a tile's first loads run under the last one's
# epilogue, was 1.4-1.6x slower in 8 tilings: Triton 3.6 did not pipeline its loads across the tiles,
# bench/results/small_experts_and_lora_h200_2026-11-24_to_25/records.md#weight_grad_persistent_h200_2026-11-25jsonl).
_CONFIG = (128, 256, 64, 8, 3)


@triton.jit
def _weight_grad_kernel(a_ptr, b_ptr, out_ptr, offs_ptr, M, N, stride_at, stride_am, stride_bt, stride_bn,
                        stride_oe, stride_om, stride_on, divisor, ACCUMULATE: tl.constexpr, DIVIDE: tl.constexpr,
                        COMPUTE_DTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One [BLOCK_M, BLOCK_N] tile of expert ``program_id(1)``'s gradient: the sum over its rows t of a[t, m] b[t, n]."""
    expert = tl.program_id(1)
    tiles_n = tl.cdiv(N, BLOCK_N)
    tile_m, tile_n = tl.program_id(0) // tiles_n, tl.program_id(0) % tiles_n
    start = tl.load(offs_ptr + expert - 1, mask=expert > 0, other=0).to(tl.int64)
    end = tl.load(offs_ptr + expert).to(tl.int64)
    rm = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_in, n_in = rm < M, rn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(start, end, BLOCK_K):
        rt = k + tl.arange(0, BLOCK_K)
        t_in = rt < end
        a = tl.load(a_ptr + rt[:, None] * stride_at + rm[None, :] * stride_am, mask=t_in[:, None] & m_in[None, :], other=0.0)
        b = tl.load(b_ptr + rt[:, None] * stride_bt + rn[None, :] * stride_bn, mask=t_in[:, None] & n_in[None, :], other=0.0)
        acc = tl.dot(tl.trans(a), b, acc)
    grad = acc.to(COMPUTE_DTYPE).to(tl.float32)  # the GEMM's output
    if DIVIDE == 1:  # a power of two: ``divisor`` holds its reciprocal here (``_division``), exact
        grad = grad * divisor
    elif DIVIDE == 2:
        grad = tl.math.div_rn(grad, divisor)
    grad = grad.to(out_ptr.dtype.element_ty)  # the cast's backward
    out = out_ptr + expert.to(tl.int64) * stride_oe + rm[:, None] * stride_om + rn[None, :] * stride_on
    mask = m_in[:, None] & n_in[None, :]
    if ACCUMULATE:
        grad = (tl.load(out, mask=mask).to(tl.float32) + grad.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out, grad, mask=mask)


def _division(divisor: float) -> tuple[float, int]:
    """The kernel's ``divisor`` argument and its ``DIVIDE``: 0 none, 1 times the (exact) reciprocal of a power of two,
    2 IEEE division."""
    if divisor == 1:
        return 1.0, 0
    if divisor > 0 and math.frexp(divisor)[0] == 0.5:
        return 1.0 / divisor, 1
    return divisor, 2


_TRITON_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def grouped_weight_grad(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, out: torch.Tensor, *, accumulate: bool,
                        divisor: float = 1.0, config: tuple[int, int, int, int, int] = _CONFIG) -> torch.Tensor:
    """``out[e] = a_e^T @ b_e`` (``accumulate``: ``+=``) for a [T, M] and b [T, N] whose rows are grouped by expert,
    ``offs`` [E] each group's end (int32, as ``F.grouped_mm`` takes it), ``out`` [E, M, N] of any strides, divided by
    ``divisor`` on the way (see the module's docstring for the rounding). Returns ``out``."""
    rows, m = a.shape
    n = b.shape[1]
    experts = out.shape[0]
    if b.shape[0] != rows or tuple(out.shape) != (experts, m, n) or offs.numel() != experts:
        raise ValueError(f"grouped_weight_grad: a {tuple(a.shape)}, b {tuple(b.shape)}, out {tuple(out.shape)}, offs {tuple(offs.shape)} do not fit")
    if a.dtype != b.dtype or a.dtype not in _TRITON_DTYPES or out.dtype not in _TRITON_DTYPES:
        raise ValueError(f"grouped_weight_grad: a {a.dtype}, b {b.dtype}, out {out.dtype}: one float compute dtype, a float output")
    if experts == 0 or m == 0 or n == 0:
        return out
    block_m, block_n, block_k, warps, stages = config
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n), experts)
    divisor, divide = _division(float(divisor))
    _weight_grad_kernel[grid](
        a, b, out, offs, m, n, a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1), out.stride(2),
        divisor, ACCUMULATE=accumulate, DIVIDE=divide, COMPUTE_DTYPE=_TRITON_DTYPES[a.dtype],
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages,
    )
    return out
