"""The Triton kernels of the pull exchange (``pull_exchange.py``): rows read from, and summed into, the ep ranks'
buffers in GPU memory they share (torch's symmetric memory).

Why kernels of our own: a rank reads its peers' rows at addresses in a table (``*_table``: one int64 address a rank),
at shapes fixed ahead and with no host sync, which no torch operator does. A module of its own: Triton is imported only
where a GPU runs it, or Triton's CPU interpreter in the tests (there the tables hold CPU tensors' addresses).

The token exchange works on pairs (source rank s, token t) with copies for this rank's experts: ``slots`` [ep * T, KP]
holds, for pair q = s * T + t, the rows (slots) its copies take among this rank's received rows (-1: none, or cut).
- ``expand_forward``: each pair's row read once from its source and written to each of its slots, with the copies'
  router weights; the slots worked out from the sources' published routing (``pull_exchange.receiver_slots``).
- ``expand_backward``: the same read (the output gradient) times each slot's weight, and each weight's gradient.
- ``sum_slots``: each pair's slots summed (weighted or not) in fp32 into one row of this rank's shared buffer, in the
  compute dtype: the rows every peer reads back (``sum_ranks``) are half the bytes of fp32 in bf16, at the cost of one
  more rounding per rank holding a token's copies (the ep 4 profile of 2026-11-28: the rank sums' reads were 31 of a
  431 ms step in fp32).
- ``sum_ranks``: each of my tokens' rows summed over the ranks holding its copies.
- ``read_scalars``: each of my copies' value at its slot on its owner (the router weights' gradients).
- ``pull_rows``: rows by (rank, row) (the counts of every rank).
Rows past the valid ones (padding up to capacity) are written as zeros by the expand kernels' extra programs where
``zero_padding`` asks for them (one local expert: see ``pull_exchange.SymmetricPeers``); elsewhere they are left as
they are, which saves writing ~2x the mean rows of zeros twice a layer at factor 3.
"""

import torch
import triton
import triton.language as tl

# Columns per step and warps per program: the probe of 2026-11-28 (bench/reports/probes_retired_2026-12-02.md) found
# every shape from 512 x 2 to 4096 x 16 within noise at Qwen3-30B-A3B's width (2048) on 4 x H200.
BLOCK_COLUMNS, WARPS = 1024, 4
ZERO_ROWS = 8  # padding rows zeroed by one extra program


def _block(h: int) -> int:
    return min(BLOCK_COLUMNS, triton.next_power_of_2(h))


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
    (int64 addresses of [*, H] buffers of ``out``'s dtype; ``src_row`` < 0: a zero row). Returns ``out``. ``block``,
    ``warps``: columns per step and warps per program (the probe's choices)."""
    n, h = out.shape
    if n:
        _pull_rows_kernel[(n,)](table, src_rank, src_row, out, h, BLOCK_H=min(block, triton.next_power_of_2(h)), num_warps=warps)
    return out


@triton.jit
def _zero_padding(out_ptr, w_ptr, received_ptr, me, capacity, H, block, ZERO: tl.constexpr, BLOCK_H: tl.constexpr):
    """Rows [received[me], capacity) of ``out`` [capacity, H] and ``w`` [capacity] in this block of ZERO rows: zeros."""
    valid_rows = tl.minimum(tl.load(received_ptr + me), capacity)
    rows = (block * ZERO + tl.arange(0, ZERO)).to(tl.int64)
    pad = (rows >= valid_rows) & (rows < capacity)
    for start in range(0, H, BLOCK_H):
        cols = start + tl.arange(0, BLOCK_H)
        zeros = tl.zeros([ZERO, BLOCK_H], dtype=out_ptr.dtype.element_ty)
        tl.store(out_ptr + rows[:, None] * H + cols[None, :], zeros, mask=pad[:, None] & (cols < H)[None, :])
    tl.store(w_ptr + rows, tl.zeros([ZERO], dtype=tl.float32), mask=pad)


@triton.jit
def _expand_forward_kernel(x_table, meta_table, first_ptr, sent_start_ptr, received_ptr, out_ptr, w_out_ptr, slots_ptr,
                           T, H, E, ep, local, me, capacity, K: tl.constexpr, KP: tl.constexpr, ZERO: tl.constexpr,
                           BLOCK_H: tl.constexpr):
    q = tl.program_id(0)
    if q < ep * T:
        s = q // T
        t = (q % T).to(tl.int64)
        j = tl.arange(0, KP)
        copies = j < K
        meta = tl.load(meta_table + s).to(tl.pointer_type(tl.int32))  # the source's [3, T * K]: expert, sorted row, weight
        expert = tl.load(meta + t * K + j, mask=copies, other=-1)
        sorted_row = tl.load(meta + T * K + t * K + j, mask=copies, other=0).to(tl.int64)
        weight = tl.load(meta + 2 * T * K + t * K + j, mask=copies, other=0).to(tl.float32, bitcast=True)
        mine = copies & (expert >= me * local) & (expert < me * local + local)
        expert = tl.where(mine, expert, 0)
        block_start = tl.load(first_ptr + me * local * ep + (expert - me * local) * ep + s, mask=mine, other=0)
        slot = block_start + sorted_row - tl.load(sent_start_ptr + s * E + expert, mask=mine, other=0)
        valid = mine & (slot < capacity)
        slot = tl.where(valid, slot, -1)
        tl.store(slots_ptr + q.to(tl.int64) * KP + j, slot.to(tl.int32))
        slot = tl.maximum(slot, 0)
        tl.store(w_out_ptr + slot, weight, mask=valid)
        readable = tl.where(tl.sum(valid.to(tl.int32), axis=0) > 0, H, 0)  # columns to read: none without a slot
        src = tl.load(x_table + s).to(tl.pointer_type(out_ptr.dtype.element_ty))
        for start in range(0, H, BLOCK_H):
            cols = start + tl.arange(0, BLOCK_H)
            row = tl.load(src + t * H + cols, mask=cols < readable, other=0.0)
            tl.store(out_ptr + slot[:, None] * H + cols[None, :], tl.broadcast_to(row[None, :], (KP, BLOCK_H)),
                     mask=valid[:, None] & (cols < H)[None, :])
    else:
        _zero_padding(out_ptr, w_out_ptr, received_ptr, me, capacity, H, q - ep * T, ZERO, BLOCK_H)


def expand_forward(x_table, meta_table, first, sent_start, received, out, w_out, slots, tokens, k, ep, local, me,
                   zero_padding: bool = True):
    """Every (source, token) pair's row read once and written to its copies' slots in ``out`` [capacity, H], their
    router weights into ``w_out`` [capacity] fp32, the slots into ``slots`` [ep * tokens, KP] int32; padding zeroed
    with ``zero_padding``, else left as it is."""
    capacity, h = out.shape
    grid = (ep * tokens + (triton.cdiv(capacity, ZERO_ROWS) if zero_padding else 0),)
    _expand_forward_kernel[grid](x_table, meta_table, first, sent_start, received, out, w_out, slots, tokens, h,
                                 sent_start.shape[1], ep, local, me, capacity, K=k, KP=slots.shape[1], ZERO=ZERO_ROWS,
                                 BLOCK_H=_block(h), num_warps=WARPS)


@triton.jit
def _expand_backward_kernel(d_table, slots_ptr, w_ptr, y_ptr, received_ptr, grad_y_ptr, grad_w_ptr, T, H, ep, me, capacity,
                            KP: tl.constexpr, ZERO: tl.constexpr, BLOCK_H: tl.constexpr):
    q = tl.program_id(0)
    if q < ep * T:
        s = q // T
        t = (q % T).to(tl.int64)
        j = tl.arange(0, KP)
        slot = tl.load(slots_ptr + q.to(tl.int64) * KP + j).to(tl.int64)
        valid = slot >= 0
        readable = tl.where(tl.sum(valid.to(tl.int32), axis=0) > 0, H, 0)
        slot = tl.maximum(slot, 0)
        weight = tl.load(w_ptr + slot, mask=valid, other=0.0)
        src = tl.load(d_table + s).to(tl.pointer_type(grad_y_ptr.dtype.element_ty))
        dot = tl.zeros([KP], dtype=tl.float32)
        for start in range(0, H, BLOCK_H):
            cols = start + tl.arange(0, BLOCK_H)
            inside = valid[:, None] & (cols < H)[None, :]
            d = tl.load(src + t * H + cols, mask=cols < readable, other=0.0).to(tl.float32)
            tl.store(grad_y_ptr + slot[:, None] * H + cols[None, :], (weight[:, None] * d[None, :]).to(grad_y_ptr.dtype.element_ty),
                     mask=inside)
            y = tl.load(y_ptr + slot[:, None] * H + cols[None, :], mask=inside, other=0.0).to(tl.float32)
            dot += tl.sum(y * d[None, :], axis=1)
        tl.store(grad_w_ptr + slot, dot, mask=valid)
    else:
        _zero_padding(grad_y_ptr, grad_w_ptr, received_ptr, me, capacity, H, q - ep * T, ZERO, BLOCK_H)


def expand_backward(d_table, slots, w, y, received, grad_y, grad_w, tokens, ep, me, zero_padding: bool = True):
    """The output gradient of each (source, token) pair read once: ``grad_y`` [capacity, H] = its slots' weights times it,
    ``grad_w`` [capacity] fp32 = each slot's output dotted with it; padding zeroed with ``zero_padding``."""
    capacity, h = grad_y.shape
    grid = (ep * tokens + (triton.cdiv(capacity, ZERO_ROWS) if zero_padding else 0),)
    _expand_backward_kernel[grid](d_table, slots, w, y, received, grad_y, grad_w, tokens, h, ep, me, capacity,
                                  KP=slots.shape[1], ZERO=ZERO_ROWS, BLOCK_H=_block(h), num_warps=WARPS)


@triton.jit
def _sum_slots_kernel(rows_ptr, w_ptr, slots_ptr, out_ptr, H, KP: tl.constexpr, WEIGHTED: tl.constexpr, BLOCK_H: tl.constexpr):
    q = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, KP)
    slot = tl.load(slots_ptr + q * KP + j).to(tl.int64)
    valid = slot >= 0
    writable = tl.where(tl.sum(valid.to(tl.int32), axis=0) > 0, H, 0)  # a pair without a slot: nothing written
    slot = tl.maximum(slot, 0)
    if WEIGHTED:
        weight = tl.load(w_ptr + slot, mask=valid, other=0.0)
    else:
        weight = tl.full([KP], 1.0, dtype=tl.float32)
    for start in range(0, H, BLOCK_H):
        cols = start + tl.arange(0, BLOCK_H)
        values = tl.load(rows_ptr + slot[:, None] * H + cols[None, :], mask=valid[:, None] & (cols < H)[None, :], other=0.0)
        total = tl.sum(values.to(tl.float32) * weight[:, None], axis=0)
        tl.store(out_ptr + q * H + cols, total.to(out_ptr.dtype.element_ty), mask=cols < writable)


def sum_slots(rows, w, slots, out):
    """``out[q]`` = the sum over pair q's slots of ``rows[slot]`` (times ``w[slot]`` where ``w`` is given), in fp32,
    written in ``out``'s dtype;
    rows of pairs without a slot are left as they are (nobody reads them)."""
    pairs, h = out.shape
    _sum_slots_kernel[(pairs,)](rows, w if w is not None else rows, slots, out, h, KP=slots.shape[1], WEIGHTED=w is not None,
                                BLOCK_H=_block(h), num_warps=WARPS)


@triton.jit
def _sum_ranks_kernel(s_table, owner_ptr, slot_ptr, out_ptr, T, H, me, K: tl.constexpr, KP: tl.constexpr, EP: tl.constexpr,
                      BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, KP)
    copies = j < K
    owner = tl.load(owner_ptr + t * K + j, mask=copies, other=-1)
    slot = tl.load(slot_ptr + t * K + j, mask=copies, other=-1)
    owner = tl.where(slot >= 0, owner, -1)
    row = (me * T + t) * H
    for start in range(0, H, BLOCK_H):
        cols = start + tl.arange(0, BLOCK_H)
        total = tl.zeros([BLOCK_H], dtype=tl.float32)
        for r in tl.static_range(EP):
            readable = tl.where(tl.sum((owner == r).to(tl.int32), axis=0) > 0, H, 0)  # none where r holds no copy
            src = tl.load(s_table + r).to(tl.pointer_type(out_ptr.dtype.element_ty))  # the per-pair sums, in out's dtype
            total += tl.load(src + row + cols, mask=cols < readable, other=0.0).to(tl.float32)
        tl.store(out_ptr + t * H + cols, total.to(out_ptr.dtype.element_ty), mask=cols < H)


def sum_ranks(s_table, owner, slot, out, ep, me):
    """``out[t]`` = the sum over the ranks holding a copy of my token t (``owner``, ``slot`` [T, k]; -1 slots: cut) of row
    ``me * T + t`` of their shared buffer (``out``'s dtype), in fp32, written in ``out``'s dtype."""
    tokens, h = out.shape
    _sum_ranks_kernel[(tokens,)](s_table, owner, slot, out, tokens, h, me, K=owner.shape[1],
                                 KP=triton.next_power_of_2(owner.shape[1]), EP=ep, BLOCK_H=_block(h), num_warps=WARPS)


@triton.jit
def _read_scalars_kernel(table, owner_ptr, slot_ptr, out_ptr, N, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = i < N
    slot = tl.load(slot_ptr + i, mask=inside, other=-1)
    owner = tl.load(owner_ptr + i, mask=inside, other=0)
    base = tl.load(table + owner, mask=inside, other=0).to(tl.pointer_type(tl.float32))
    tl.store(out_ptr + i, tl.load(base + slot, mask=inside & (slot >= 0), other=0.0), mask=inside)


def read_scalars(table, owner, slot, out):
    """``out`` (fp32, ``owner``'s shape) = entry ``slot`` of rank ``owner``'s shared fp32 buffer (0 where slot < 0)."""
    n = out.numel()
    _read_scalars_kernel[(triton.cdiv(n, 1024),)](table, owner, slot, out, n, BLOCK=1024)
