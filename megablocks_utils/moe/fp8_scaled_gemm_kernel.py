"""The experts' grouped GEMM in FP8 on both sides: the activations quantized to float8 e4m3 per row and 128 inputs, the
weights as held (e4m3 with one scale per 128 x 128 block), the product on FP8 tensor cores (``fp8_compute="experts"``).

``out[t] = x[t] @ B_e`` for the rows t of expert e (grouped by ``offs``), as ``fp8_gemm_kernel.py`` computes it, with
``x`` rounded to e4m3 first: each step of the sum covers one scale block (128 inputs), whose FP8 partial product is
scaled by the row's and the block's scales into an fp32 sum (the recipe of DeepSeek-V3's fine-grained FP8).

Why: the in-register dequantization of ``fp8_gemm_kernel.py`` runs at about half of torch's bf16 grouped GEMM (its
weight tiles pass through registers on their way to the tensor cores); FP8 tiles go to them as loaded, at up to twice
bf16's rate. The price: each activation carries e4m3's 3 mantissa bits (relative error up to 2^-4).
"""

import torch
import triton
import triton.language as tl

from megablocks_utils.moe.fused import fused
from megablocks_utils.moe.quantized import FP8_BLOCK as GROUP, quantize_rows_fp8  # inputs per scale, both operands

# (BLOCK_M, BLOCK_C, warps, stages) of the product; the sum's step is one scale block (GROUP)
CONFIG = (128, 128, 8, 3)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, R] -> (e4m3 [T, R], fp32 scales [T, ceil(R / 128)]): each row's 128-input group scaled so its largest
    magnitude is 448 (value = e4m3 x scale). One compiled pass on CUDA (``fused``)."""
    q, scale = (fused(quantize_rows_fp8) if x.is_cuda else quantize_rows_fp8)(x)
    return q.contiguous(), scale


@triton.jit
def _fp8_scaled_kernel(x_ptr, xs_ptr, w_ptr, s_ptr, out_ptr, offs_ptr, E, R, C, stride_xm, stride_xsm, stride_we,
                       stride_wr, stride_wc, stride_se, stride_sr, stride_sc, stride_om, stride_oc, E_POW2: tl.constexpr,
                       GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr):
    slot = tl.program_id(0)
    # This program's expert and row tile, from the tiles each expert's rows need (no host sync), as fp8_gemm_kernel.py
    ids = tl.arange(0, E_POW2)
    ends = tl.load(offs_ptr + ids, mask=ids < E, other=0).to(tl.int64)
    starts = tl.load(offs_ptr + ids - 1, mask=(ids > 0) & (ids < E), other=0).to(tl.int64)
    tiles = tl.where(ids < E, (ends - starts + BLOCK_M - 1) // BLOCK_M, 0)
    done = tl.cumsum(tiles, 0)
    if slot >= tl.sum(tiles):
        return
    expert = tl.sum((done <= slot).to(tl.int32))
    mine = ids == expert
    start = tl.sum(tl.where(mine, starts, 0))
    end = tl.sum(tl.where(mine, ends, 0))
    first_tile = tl.sum(tl.where(mine, done - tiles, 0))
    rm = start + (slot - first_tile) * BLOCK_M + tl.arange(0, BLOCK_M)
    rc = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    m_in, c_in = rm < end, rc < C
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    s_cols = s_ptr + expert.to(tl.int64) * stride_se + (rc // GROUP) * stride_sc
    acc = tl.zeros([BLOCK_M, BLOCK_C], dtype=tl.float32)
    for r0 in range(0, R, GROUP):
        rr = r0 + tl.arange(0, GROUP)
        r_in = rr < R
        a = tl.load(x_ptr + rm[:, None] * stride_xm + rr[None, :], mask=m_in[:, None] & r_in[None, :], other=0.0)
        b = tl.load(w_base + rr[:, None] * stride_wr + rc[None, :] * stride_wc, mask=r_in[:, None] & c_in[None, :], other=0.0)
        a_scale = tl.load(xs_ptr + rm * stride_xsm + r0 // GROUP, mask=m_in, other=0.0)
        b_scale = tl.load(s_cols + (r0 // GROUP) * stride_sr, mask=c_in, other=0.0)
        acc += tl.dot(a, b) * (a_scale[:, None] * b_scale[None, :])
    tl.store(out_ptr + rm[:, None] * stride_om + rc[None, :] * stride_oc, acc.to(out_ptr.dtype.element_ty),
             mask=m_in[:, None] & c_in[None, :])


def fp8_scaled_grouped_mm(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, offs: torch.Tensor, transpose: bool,
                          config: tuple[int, int, int, int] = CONFIG) -> torch.Tensor:
    """x [T, R] (rows grouped by expert, ``offs`` [E] each group's end) quantized per row and 128 inputs, times each
    expert's FP8 weight: ``W_e^T`` (``transpose``: W [E, C, R], the forward) or ``W_e`` (W [E, R, C], the input's
    gradient); ``scale`` the weight's [E, ceil(out / 128), ceil(in / 128)] block scales. Output in x's dtype; rows
    past the last offset are left unwritten."""
    experts, n, k = data.shape
    r, c = (k, n) if transpose else (n, k)
    if x.shape[1] != r or offs.numel() != experts or scale.shape != (experts, -(-n // GROUP), -(-k // GROUP)):
        raise ValueError(f"fp8_scaled_grouped_mm: x {tuple(x.shape)}, weight {tuple(data.shape)}, scale "
                         f"{tuple(scale.shape)}, offs {tuple(offs.shape)} do not fit (transpose {transpose})")
    block_m, block_c, warps, stages = config
    out = torch.empty(x.shape[0], c, dtype=x.dtype, device=x.device)
    if x.shape[0] == 0 or c == 0:
        return out
    xq, xs = quantize_rows(x)
    swr, swc = (data.stride(2), data.stride(1)) if transpose else (data.stride(1), data.stride(2))
    ssr, ssc = (scale.stride(2), scale.stride(1)) if transpose else (scale.stride(1), scale.stride(2))
    grid = (triton.cdiv(x.shape[0], block_m) + experts, triton.cdiv(c, block_c))
    _fp8_scaled_kernel[grid](
        xq, xs, data, scale, out, offs, experts, r, c, xq.stride(0), xs.stride(0), data.stride(0), swr, swc,
        scale.stride(0), ssr, ssc, out.stride(0), out.stride(1), E_POW2=triton.next_power_of_2(experts), GROUP=GROUP,
        BLOCK_M=block_m, BLOCK_C=block_c, num_warps=warps, num_stages=stages,
    )
    return out
