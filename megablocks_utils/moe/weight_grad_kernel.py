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
"""

import torch
import triton
import triton.language as tl

# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages): the fastest of 8 at Qwen3-30B-A3B's and DeepSeek-V2-Lite's shapes on an
# H200, both projections (bench/weight_grad_bench.py --configs; reading the gradient's tile before the sum was slower).
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
    if DIVIDE:
        grad = tl.math.div_rn(grad, divisor)
    grad = grad.to(out_ptr.dtype.element_ty)  # the cast's backward
    out = out_ptr + expert.to(tl.int64) * stride_oe + rm[:, None] * stride_om + rn[None, :] * stride_on
    mask = m_in[:, None] & n_in[None, :]
    if ACCUMULATE:
        grad = (tl.load(out, mask=mask).to(tl.float32) + grad.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out, grad, mask=mask)


@triton.jit
def _weight_grad_persistent_kernel(a_ptr, b_ptr, out_ptr, offs_ptr, M, N, stride_at, stride_am, stride_bt, stride_bn,
                                   stride_oe, stride_om, stride_on, divisor, EXPERTS: tl.constexpr, ACCUMULATE: tl.constexpr,
                                   DIVIDE: tl.constexpr, COMPUTE_DTYPE: tl.constexpr, BLOCK_M: tl.constexpr,
                                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr):
    """The same tiles as ``_weight_grad_kernel``, ``num_programs(0)`` programs each taking every ``num_programs``-th
    tile in one flat loop of BLOCK_K steps: the loads of a tile's first steps are in flight while the last tile's
    gradient is read, added and written (a grid of tiles waits for them; with an expert's few hundred rows a tile is
    only a handful of steps, so that wait is much of the kernel)."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_expert = tl.cdiv(M, BLOCK_M) * tiles_n
    # This program's steps: each of its tiles takes its expert's rows in BLOCK_K steps, at least one (an expert without
    # rows still has its tile written). Its tiles in expert e: the t = pid (mod programs) in [e, e + 1) * per_expert.
    e = tl.arange(0, BLOCK_E)
    ends = tl.load(offs_ptr + e, mask=e < EXPERTS, other=0)
    starts = tl.load(offs_ptr + e - 1, mask=(e > 0) & (e < EXPERTS), other=0)
    k_steps = tl.maximum(tl.cdiv(ends - starts, BLOCK_K), 1)
    below_end = tl.maximum((e + 1) * per_expert - pid + programs - 1, 0) // programs  # this program's tiles < the end
    below_start = tl.maximum(e * per_expert - pid + programs - 1, 0) // programs
    steps = tl.sum(tl.where(e < EXPERTS, (below_end - below_start) * k_steps, 0))

    tile = pid - programs
    expert = pid * 0
    k = pid.to(tl.int64) * 0  # the next step's first row
    stop = k  # the row where this tile's steps end (its end rounded up, and past its start where it has no rows)
    end = k
    off_m = pid * 0
    off_n = pid * 0
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for _ in range(0, steps):
        if k >= stop:  # the next tile
            tile += programs
            expert = tile // per_expert
            off_m = (tile % per_expert) // tiles_n * BLOCK_M
            off_n = (tile % per_expert) % tiles_n * BLOCK_N
            k = tl.load(offs_ptr + expert - 1, mask=expert > 0, other=0).to(tl.int64)
            end = tl.load(offs_ptr + expert).to(tl.int64)
            stop = k + tl.maximum(tl.cdiv(end - k, BLOCK_K), 1) * BLOCK_K
        rm = off_m + tl.arange(0, BLOCK_M)
        rn = off_n + tl.arange(0, BLOCK_N)
        rt = k + tl.arange(0, BLOCK_K)
        t_in = rt < end
        a = tl.load(a_ptr + rt[:, None] * stride_at + rm[None, :] * stride_am, mask=t_in[:, None] & (rm < M)[None, :], other=0.0)
        b = tl.load(b_ptr + rt[:, None] * stride_bt + rn[None, :] * stride_bn, mask=t_in[:, None] & (rn < N)[None, :], other=0.0)
        acc = tl.dot(tl.trans(a), b, acc)
        k += BLOCK_K
        if k >= stop:  # the tile's epilogue, as _weight_grad_kernel's
            grad = acc.to(COMPUTE_DTYPE).to(tl.float32)
            if DIVIDE:
                grad = tl.math.div_rn(grad, divisor)
            grad = grad.to(out_ptr.dtype.element_ty)
            out = out_ptr + expert.to(tl.int64) * stride_oe + rm[:, None] * stride_om + rn[None, :] * stride_on
            mask = (rm < M)[:, None] & (rn < N)[None, :]
            if ACCUMULATE:
                grad = (tl.load(out, mask=mask).to(tl.float32) + grad.to(tl.float32)).to(out_ptr.dtype.element_ty)
            tl.store(out, grad, mask=mask)
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)


_TRITON_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def grouped_weight_grad(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, out: torch.Tensor, *, accumulate: bool,
                        divisor: float = 1.0, config: tuple[int, ...] = _CONFIG) -> torch.Tensor:
    """``out[e] = a_e^T @ b_e`` (``accumulate``: ``+=``) for a [T, M] and b [T, N] whose rows are grouped by expert,
    ``offs`` [E] each group's end (int32, as ``F.grouped_mm`` takes it), ``out`` [E, M, N] of any strides, divided by
    ``divisor`` on the way (see the module's docstring for the rounding). ``config``: (BLOCK_M, BLOCK_N, BLOCK_K, warps,
    stages[, programs per SM]); with a sixth entry > 0 the persistent kernel runs. Returns ``out``."""
    rows, m = a.shape
    n = b.shape[1]
    experts = out.shape[0]
    if b.shape[0] != rows or tuple(out.shape) != (experts, m, n) or offs.numel() != experts:
        raise ValueError(f"grouped_weight_grad: a {tuple(a.shape)}, b {tuple(b.shape)}, out {tuple(out.shape)}, offs {tuple(offs.shape)} do not fit")
    if a.dtype != b.dtype or a.dtype not in _TRITON_DTYPES or out.dtype not in _TRITON_DTYPES:
        raise ValueError(f"grouped_weight_grad: a {a.dtype}, b {b.dtype}, out {out.dtype}: one float compute dtype, a float output")
    if experts == 0 or m == 0 or n == 0:
        return out
    block_m, block_n, block_k, warps, stages = config[:5]
    per_sm = config[5] if len(config) > 5 else 0
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    args = (a, b, out, offs, m, n, a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1), out.stride(2),
            float(divisor))
    options = dict(ACCUMULATE=accumulate, DIVIDE=divisor != 1, COMPUTE_DTYPE=_TRITON_DTYPES[a.dtype], BLOCK_M=block_m,
                   BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages)
    if per_sm > 0:
        programs = min(tiles * experts, per_sm * _multiprocessors(out.device))
        _weight_grad_persistent_kernel[(programs,)](*args, EXPERTS=experts, BLOCK_E=triton.next_power_of_2(experts), **options)
    else:
        _weight_grad_kernel[(tiles, experts)](*args, **options)
    return out


def _multiprocessors(device: torch.device) -> int:
    """The device's streaming multiprocessors (the persistent kernel's programs per SM times this); 4 on CPU (Triton's
    interpreter, where the count only decides how the tiles are dealt)."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count
