"""Triton kernels of the MoE layer's token gathers (``dispatch.py``; a module of its own: Triton is imported only
where a GPU runs it, or Triton's CPU interpreter in the tests).

Each token's k copies sit at known rows of a [tokens * k, H] tensor in expert order (``copy_row[t * k + j]``), and
each row belongs to exactly one copy, so every sum here is a gather and nothing needs atomics:

  gather_sum        out[t] = sum_j rows[copy_row[t k + j]]                    the dispatch's backward
  combine           y[t] = sum_j w[t, j] rows[copy_row[t k + j]]              the combine's forward
  combine_backward  d_rows[copy_row[t k + j]] = w[t, j] dy[t]                 the combine's backward, one pass
                    d_w[t, j] = dy[t] . rows[copy_row[t k + j]]

Why kernels of our own: torch.compile's kernels for these took 117-389 us each at Qwen3-30B-A3B's shape (4096 tokens,
k = 8, H = 2048, bf16, one H200) for bytes that HBM moves in 30-70 us. Here a program owns one token (and, in the
forward kernels, one block of H): it reads the token's k row indices once, reads each row once in contiguous blocks
along H, and writes its outputs once. Sums run in fp32 over j = 0..k-1 in order (Inductor's order for k < 8, where it
unrolls the reduction into a chain of adds; for k >= 8 it reduces in its own order), and each output is rounded
once, to the dtype the eager function gives. So the results equal the compiled kernels' to the last fp32 bit of a
sum (a multiply-add may be contracted into an fma differently), which rounds a bf16 output the other way in rare
elements; the rows' gradient (one product per element) is the same bit for bit (tests/gpu/test_gather_kernels.py).
"""

import torch
import triton
import triton.language as tl

# Block sizes chosen, not yet tuned on a GPU (bench/kernel_bench.py --pieces gathers times them):
_FORWARD_BLOCK = 2048  # columns per program in the forward kernels: 8 warps x 32 threads x 8 (16-byte bf16 loads)
_BACKWARD_TILE = 4096  # k_block x columns per step of the backward kernel: 16 elements per thread of 8 warps
# Multiply-adds contracted into fma, as Inductor compiles its kernels (enable_fp_fusion unless emulate_precision_casts);
# said here because Triton's default is to change (off from 3.10).
_FP_FUSION = True


@triton.jit
def _gather_sum_kernel(rows_ptr, copy_row_ptr, out_ptr, H, K: tl.constexpr, BLOCK_H: tl.constexpr):
    """out[token, block] = sum over j of rows[copy_row[token * K + j], block], in fp32."""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < H
    row = tl.load(copy_row_ptr + token * K).to(tl.int64)
    total = tl.load(rows_ptr + row * H + cols, mask=mask).to(tl.float32)
    for j in tl.static_range(1, K):
        row = tl.load(copy_row_ptr + token * K + j).to(tl.int64)
        total += tl.load(rows_ptr + row * H + cols, mask=mask).to(tl.float32)
    tl.store(out_ptr + token * H + cols, total.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _combine_kernel(rows_ptr, copy_row_ptr, w_ptr, out_ptr, H, K: tl.constexpr, BLOCK_H: tl.constexpr):
    """out[token, block] = sum over j of w[token, j] * rows[copy_row[token * K + j], block], in fp32."""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < H
    row = tl.load(copy_row_ptr + token * K).to(tl.int64)
    weight = tl.load(w_ptr + token * K).to(tl.float32)
    total = tl.load(rows_ptr + row * H + cols, mask=mask).to(tl.float32) * weight
    for j in tl.static_range(1, K):
        row = tl.load(copy_row_ptr + token * K + j).to(tl.int64)
        weight = tl.load(w_ptr + token * K + j).to(tl.float32)
        total += tl.load(rows_ptr + row * H + cols, mask=mask).to(tl.float32) * weight
    tl.store(out_ptr + token * H + cols, total.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _combine_backward_kernel(dy_ptr, rows_ptr, copy_row_ptr, w_ptr, d_rows_ptr, d_w_ptr, H, K: tl.constexpr,
                             K_BLOCK: tl.constexpr, BLOCK_H: tl.constexpr, D_ROWS: tl.constexpr, D_W: tl.constexpr):
    """For one token, over all of H in blocks: d_rows[copy_row[token * K + j]] = w[token, j] * dy[token] (``D_ROWS``)
    and d_w[token, j] = dy[token] . rows[copy_row[token * K + j]] in fp32 (``D_W``). dy is read once for both."""
    token = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, K_BLOCK)
    j_mask = j < K
    rows = tl.load(copy_row_ptr + token * K + j, mask=j_mask, other=0).to(tl.int64)
    weights = tl.load(w_ptr + token * K + j, mask=j_mask, other=0).to(tl.float32)
    dots = tl.zeros([K_BLOCK, BLOCK_H], dtype=tl.float32)
    for start in range(0, H, BLOCK_H):
        cols = start + tl.arange(0, BLOCK_H)
        col_mask = cols < H
        dy = tl.load(dy_ptr + token * H + cols, mask=col_mask, other=0).to(tl.float32)
        offsets = rows[:, None] * H + cols[None, :]
        mask = j_mask[:, None] & col_mask[None, :]
        if D_ROWS:
            tl.store(d_rows_ptr + offsets, (dy[None, :] * weights[:, None]).to(d_rows_ptr.dtype.element_ty), mask=mask)
        if D_W:
            dots += tl.load(rows_ptr + offsets, mask=mask, other=0).to(tl.float32) * dy[None, :]
    if D_W:
        tl.store(d_w_ptr + token * K + j, tl.sum(dots, axis=1).to(d_w_ptr.dtype.element_ty), mask=j_mask)


def _forward_launch(H: int) -> tuple[int, int, int]:
    """(column blocks per token, columns per block, warps): a block of up to 2048 columns, 8 columns per thread."""
    block = min(triton.next_power_of_2(H), _FORWARD_BLOCK)
    return triton.cdiv(H, block), block, max(1, min(8, block // 256))


def gather_sum(rows: torch.Tensor, copy_row: torch.Tensor, k: int) -> torch.Tensor:
    """[tokens * k, H] -> [tokens, H]: row t the fp32 sum of rows ``copy_row[t * k : (t + 1) * k]``, in ``rows.dtype``
    (``dispatch._gather_sum``)."""
    rows, copy_row = rows.contiguous(), copy_row.contiguous()
    num_tokens, hidden = copy_row.numel() // k, rows.shape[-1]
    out = rows.new_empty(num_tokens, hidden)
    if out.numel() == 0:
        return out
    blocks, block, warps = _forward_launch(hidden)
    _gather_sum_kernel[(num_tokens, blocks)](rows, copy_row, out, hidden, K=k, BLOCK_H=block, num_warps=warps,
                                             enable_fp_fusion=_FP_FUSION)
    return out


def combine(rows: torch.Tensor, copy_row: torch.Tensor, top_w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[tokens * k, H] -> [tokens, H] in ``dtype``: each token's k rows (``copy_row``) weighted by ``top_w`` [tokens, k]
    and summed, in fp32 (``dispatch._gather_combine``)."""
    rows, copy_row, top_w = (t.contiguous() for t in (rows, copy_row, top_w))
    (num_tokens, k), hidden = top_w.shape, rows.shape[-1]
    out = rows.new_empty(num_tokens, hidden, dtype=dtype)
    if out.numel() == 0:
        return out
    blocks, block, warps = _forward_launch(hidden)
    _combine_kernel[(num_tokens, blocks)](rows, copy_row, top_w, out, hidden, K=k, BLOCK_H=block, num_warps=warps,
                                          enable_fp_fusion=_FP_FUSION)
    return out


def combine_backward(dy: torch.Tensor, copy_row: torch.Tensor, top_w: torch.Tensor, rows: torch.Tensor | None,
                     d_rows_like: tuple[int, torch.dtype] | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The gradients of ``combine`` for ``dy`` [tokens, H], each only where asked: the rows' ([row count, H] in the dtype
    of ``d_rows_like``; None without it) and ``top_w``'s (in its dtype; None without ``rows``, which it reads). Rows
    that no copy points to get zeros."""
    dy, copy_row, top_w = (t.contiguous() for t in (dy, copy_row, top_w))
    rows = rows.contiguous() if rows is not None else None
    (num_tokens, k), hidden = top_w.shape, dy.shape[-1]
    d_rows = None
    if d_rows_like is not None:
        row_count, dtype = d_rows_like
        d_rows = dy.new_empty(row_count, hidden, dtype=dtype)
        if row_count != copy_row.numel():  # the kernel writes each copy's row once; only the others need zeros
            d_rows.zero_()
    d_w = None if rows is None else torch.zeros_like(top_w) if hidden == 0 else torch.empty_like(top_w)
    if num_tokens == 0 or hidden == 0 or (d_rows is None and d_w is None):
        return d_rows, d_w
    k_block = triton.next_power_of_2(k)
    block = min(triton.next_power_of_2(hidden), max(_BACKWARD_TILE // k_block, 16))
    # Pointers the kernel does not touch (D_ROWS or D_W off) are given as dy.
    _combine_backward_kernel[(num_tokens,)](
        dy, dy if rows is None else rows, copy_row, top_w, dy if d_rows is None else d_rows, dy if d_w is None else d_w,
        hidden, K=k, K_BLOCK=k_block, BLOCK_H=block, D_ROWS=d_rows is not None, D_W=d_w is not None, num_warps=8,
        enable_fp_fusion=_FP_FUSION)
    return d_rows, d_w
