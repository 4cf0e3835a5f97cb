"""The experts' grouped GEMM over FP8 base weights, dequantized inside the kernel (``quantized.py`` uses it on GPUs).

``out[t] = x[t] @ B_e`` for the rows t of expert e (grouped by ``offs``), where ``B_e[r, c]`` is a float8 e4m3 weight
element times its 128 x 128 block's scale, read through strides: the forward reads ``W_e^T`` (``W`` [E, out, in]), the
input's gradient ``W_e`` itself. Each tile of B is loaded in FP8, scaled to the compute dtype in registers (the same
values a separate dequantization would write) and fed to the tensor cores: no bf16 copy of the weights is ever written.

Why: a pass writing the bf16 weight first costs the weight's bytes at every GEMM, whatever the rows; where the experts
have few rows each (Qwen3-30B-A3B's 256 at 4,096 tokens) that costs more than this kernel's slower tiles.
``dequantize_fp8_blocks`` is that pass, at the memory's speed, for torch's bf16 grouped GEMM to read (the "dequantize"
way, which ``quantized.py`` takes from 512 rows per expert); its copy lives while its GEMM runs.

Orientation: each program computes its output tile transposed, ``B^T x^T``, so that the dequantized weight is the
tensor cores' first operand. On Hopper that operand may come from registers, where the dequantization leaves it; as
the second operand it would first be stored to shared memory, and each step would wait for the previous step's
product to finish reading that buffer.

Tiles: each program takes one [BLOCK_M, BLOCK_C] tile of one expert's rows. The experts' row counts stay on the GPU:
a program finds its expert from the running count of tiles per expert (``offs``), and the grid has room for the most
row tiles any routing can need (rows / BLOCK_M + experts); the programs past the real tiles return at once. Programs
run in groups of GROUP_M row tiles, each group through all its column tiles before the next: with GROUP_M 1 a row
tile's column tiles run together and share its rows in L2, where row tiles first read them from memory once per
column tile.
"""

import torch
import triton
import triton.language as tl

SCALE_BLOCK = 128
# (BLOCK_M, BLOCK_C, BLOCK_R, warps, stages, GROUP_M): BLOCK_R divides SCALE_BLOCK (a step of the sum stays in one
# block row). The fastest tiling where this orientation was chosen (one H200, Qwen3-30B-A3B's expert shape, 256 rows
# per expert); the sweep after it, the candidate it found and what the LoRA step measured:
# bench/reports/fp8_expert_kernel_orientation_h200_2026-12-02.md.
CONFIG = (256, 128, 64, 8, 4, 1)


@triton.jit
def _fp8_grouped_kernel(x_ptr, w_ptr, s_ptr, out_ptr, offs_ptr, E, R, C, SLOTS, stride_xm, stride_xr, stride_we, stride_wr,
                        stride_wc, stride_se, stride_sr, stride_sc, stride_om, stride_oc, E_POW2: tl.constexpr,
                        SCALE_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
                        GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    per_group = GROUP_M * tl.cdiv(C, BLOCK_C)
    first = (pid // per_group) * GROUP_M
    size = tl.minimum(SLOTS - first, GROUP_M)  # the last group may be smaller
    slot = first + (pid % per_group) % size  # this program's row tile, counted over all experts' tiles
    column_tile = (pid % per_group) // size
    # This program's expert and row tile, from the tiles each expert's rows need (no host sync).
    ids = tl.arange(0, E_POW2)
    ends = tl.load(offs_ptr + ids, mask=ids < E, other=0).to(tl.int64)
    starts = tl.load(offs_ptr + ids - 1, mask=(ids > 0) & (ids < E), other=0).to(tl.int64)
    tiles = tl.where(ids < E, (ends - starts + BLOCK_M - 1) // BLOCK_M, 0)
    done = tl.cumsum(tiles, 0)  # tiles of the experts up to and including each
    if slot >= tl.sum(tiles):
        return
    expert = tl.sum((done <= slot).to(tl.int32))
    mine = ids == expert
    start = tl.sum(tl.where(mine, starts, 0))
    end = tl.sum(tl.where(mine, ends, 0))
    first_tile = tl.sum(tl.where(mine, done - tiles, 0))
    rm = start + (slot - first_tile) * BLOCK_M + tl.arange(0, BLOCK_M)
    rc = column_tile * BLOCK_C + tl.arange(0, BLOCK_C)
    m_in, c_in = rm < end, rc < C
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    s_cols = s_ptr + expert.to(tl.int64) * stride_se + (rc // SCALE_BLOCK) * stride_sc
    acc = tl.zeros([BLOCK_C, BLOCK_M], dtype=tl.float32)  # the output tile, transposed
    for r0 in range(0, R, BLOCK_R):
        rr = r0 + tl.arange(0, BLOCK_R)
        r_in = rr < R
        x_t = tl.load(x_ptr + rm[None, :] * stride_xm + rr[:, None] * stride_xr, mask=m_in[None, :] & r_in[:, None], other=0.0)
        w_t = tl.load(w_base + rr[None, :] * stride_wr + rc[:, None] * stride_wc, mask=r_in[None, :] & c_in[:, None], other=0.0)
        scale = tl.load(s_cols + (r0 // SCALE_BLOCK) * stride_sr, mask=c_in, other=0.0)
        b_t = (w_t.to(tl.float32) * scale[:, None]).to(x_ptr.dtype.element_ty)  # the dequantized values, B^T
        acc = tl.dot(b_t, x_t, acc)
    tl.store(out_ptr + rm[None, :] * stride_om + rc[:, None] * stride_oc, acc.to(out_ptr.dtype.element_ty),
             mask=m_in[None, :] & c_in[:, None])


def fp8_grouped_mm(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, offs: torch.Tensor, transpose: bool,
                   config: tuple[int, int, int, int, int, int] = CONFIG) -> torch.Tensor:
    """x [T, R] (rows grouped by expert, ``offs`` [E] each group's end) times each expert's dequantized FP8 weight:
    ``W_e^T`` (``transpose``: W [E, C, R], the forward) or ``W_e`` (W [E, R, C], the input's gradient); ``scale`` the
    weight's [E, ceil(out / 128), ceil(in / 128)] block scales. Rows past the last offset are left unwritten."""
    experts, n, k = data.shape
    r, c = (k, n) if transpose else (n, k)
    if x.shape[1] != r or offs.numel() != experts or scale.shape != (experts, -(-n // SCALE_BLOCK), -(-k // SCALE_BLOCK)):
        raise ValueError(f"fp8_grouped_mm: x {tuple(x.shape)}, weight {tuple(data.shape)}, scale {tuple(scale.shape)}, "
                         f"offs {tuple(offs.shape)} do not fit (transpose {transpose})")
    block_m, block_c, block_r, warps, stages, group_m = config
    out = torch.empty(x.shape[0], c, dtype=x.dtype, device=x.device)
    if x.shape[0] == 0 or c == 0:
        return out
    # W [E, n, k] and its scales as B [r, c]: the forward reads (k, n), the input's gradient (n, k)
    swr, swc = (data.stride(2), data.stride(1)) if transpose else (data.stride(1), data.stride(2))
    ssr, ssc = (scale.stride(2), scale.stride(1)) if transpose else (scale.stride(1), scale.stride(2))
    slots = triton.cdiv(x.shape[0], block_m) + experts
    grid = (slots * triton.cdiv(c, block_c),)
    _fp8_grouped_kernel[grid](
        x, data, scale, out, offs, experts, r, c, slots, x.stride(0), x.stride(1), data.stride(0), swr, swc, scale.stride(0), ssr, ssc,
        out.stride(0), out.stride(1), E_POW2=triton.next_power_of_2(experts), SCALE_BLOCK=SCALE_BLOCK,
        BLOCK_M=block_m, BLOCK_C=block_c, BLOCK_R=block_r, GROUP_M=group_m, num_warps=warps, num_stages=stages,
    )
    return out


@triton.jit
def _dequantize_kernel(w_ptr, s_ptr, out_ptr, N, K, NB, stride_we, stride_wn, stride_se, stride_sn, stride_oe, stride_on,
                       SCALE_BLOCK: tl.constexpr):
    e, i = tl.program_id(0) // NB, tl.program_id(0) % NB
    j = tl.program_id(1)
    rn = i * SCALE_BLOCK + tl.arange(0, SCALE_BLOCK)
    rk = j * SCALE_BLOCK + tl.arange(0, SCALE_BLOCK)
    mask = (rn < N)[:, None] & (rk < K)[None, :]
    e = e.to(tl.int64)
    w = tl.load(w_ptr + e * stride_we + rn[:, None].to(tl.int64) * stride_wn + rk[None, :], mask=mask, other=0.0)
    scale = tl.load(s_ptr + e * stride_se + i * stride_sn + j)
    tl.store(out_ptr + e * stride_oe + rn[:, None].to(tl.int64) * stride_on + rk[None, :],
             (w.to(tl.float32) * scale).to(out_ptr.dtype.element_ty), mask=mask)


def dequantize_fp8_blocks(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """FP8 weights [E, n, k] (rows contiguous) and their [E, ceil(n / 128), ceil(k / 128)] block scales -> [E, n, k] in
    ``dtype``: one program per 128 x 128 block."""
    experts, n, k = data.shape
    nb, kb = triton.cdiv(n, SCALE_BLOCK), triton.cdiv(k, SCALE_BLOCK)
    if data.stride(2) != 1 or scale.shape != (experts, nb, kb) or scale.stride(2) != 1:
        raise ValueError(f"dequantize_fp8_blocks: weight {tuple(data.shape)} strides {data.stride()}, scale "
                         f"{tuple(scale.shape)} strides {scale.stride()}: rows contiguous and 128 x 128 block scales")
    out = torch.empty(data.shape, dtype=dtype, device=data.device)
    if out.numel():
        _dequantize_kernel[(experts * nb, kb)](data, scale, out, n, k, nb, data.stride(0), data.stride(1), scale.stride(0),
                                               scale.stride(1), out.stride(0), out.stride(1), SCALE_BLOCK=SCALE_BLOCK,
                                               num_warps=4)
    return out
