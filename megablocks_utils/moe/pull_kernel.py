"""One Triton kernel: rows pulled from the ep ranks' buffers in GPU memory they share (``pull_rows``).

Why: the static exchange (``static_exchange.py``) needs no host sync, but through NCCL's all-to-all it must send
fixed-size blocks, padding included (``ep * capacity`` rows where ``tokens * k`` are real). With the ranks' buffers
mapped into each other's address space (torch's symmetric memory, ``pull_exchange.py``) a rank reads exactly the rows
it needs, wherever they sit, at shapes fixed ahead: out[i] = buffer of rank ``src_rank[i]``, row ``src_row[i]``
(``src_row[i]`` < 0: a zero row). A module of its own: Triton is imported only where a GPU runs it, or Triton's CPU
interpreter in the tests (there with ``table`` holding the CPU tensors' addresses).
"""

import torch
import triton
import triton.language as tl

# Columns per step and warps per program: a bf16 row of Qwen3-30B-A3B (H 2048) in one step of 8 warps x 32 threads x 8
# (16-byte loads). The nineteenth session's first try, 1024 columns x 4 warps, read 200 GB/s from three peers on 4 x H200
# (bench/symm_pull_probe.py times the choices).
BLOCK_COLUMNS, WARPS = 2048, 8


@triton.jit
def _pull_rows_kernel(table_ptr, src_rank_ptr, src_row_ptr, out_ptr, H, BLOCK_H: tl.constexpr):
    """out[row] = buffer[src_rank[row]][src_row[row]] (zeros where src_row < 0); one program a row."""
    row = tl.program_id(0).to(tl.int64)
    rank = tl.load(src_rank_ptr + row)
    src = tl.load(src_row_ptr + row).to(tl.int64)
    base = tl.load(table_ptr + rank).to(tl.pointer_type(out_ptr.dtype.element_ty))
    readable = tl.where(src >= 0, H, 0)  # columns to read: none for a zero row
    src = tl.maximum(src, 0)
    for start in range(0, H, BLOCK_H):
        cols = start + tl.arange(0, BLOCK_H)
        values = tl.load(base + src * H + cols, mask=cols < readable, other=0.0)
        tl.store(out_ptr + row * H + cols, values, mask=cols < H)


def pull_rows(table: torch.Tensor, src_rank: torch.Tensor, src_row: torch.Tensor, out: torch.Tensor,
              block: int = BLOCK_COLUMNS, warps: int = WARPS) -> torch.Tensor:
    """Fill ``out`` [N, H] (contiguous) with row ``src_row[i]`` of the buffer whose address is ``table[src_rank[i]]``
    (int64 addresses of [*, H] buffers of ``out``'s dtype; ``src_rank`` in range for every row, ``src_row`` < 0 for a
    zero row). Returns ``out``. ``block``, ``warps``: columns per step and warps per program (the probe's choices)."""
    n, h = out.shape
    if n:
        _pull_rows_kernel[(n,)](table, src_rank, src_row, out, h, BLOCK_H=min(block, triton.next_power_of_2(h)), num_warps=warps)
    return out
