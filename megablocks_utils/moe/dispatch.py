"""Token dispatch: each token's k copies sorted by expert, sent to the ep ranks that own those experts,
brought back, and weighted and summed into one row per token.

  route (``route``) -> copies in expert order (``dispatch``) -> all-to-all to the owning ranks, their
  experts, all-to-all back (``exchange``; ep > 1 only) -> k copies weighted and summed (``combine``).

No capacity factor: every token copy is computed, an expert with zero tokens is fine. ``fuse`` (the
layer's ``compile_elementwise``, on CUDA) runs the gathers and sums below as one kernel per pass: our Triton kernels
(``gather_kernels.py``), or, with ``FUSED_GATHERS = "compiled"``, torch.compile of the eager functions, kept to
compare against (bench/kernel_bench.py, tests/gpu/test_gather_kernels.py).
"""

from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch

from megablocks_utils.moe.fused import fused

# The gathers' kernels where ``fuse`` is on: "triton" (gather_kernels.py: each row read once, the combine's backward in
# one pass) or "compiled" (``fused`` of ``_gather_sum`` and ``_gather_combine``); bench/kernel_bench.py --pieces
# gathers times both.
FUSED_GATHERS = "triton"


class Route(NamedTuple):
    order: torch.Tensor  # token copies (token-major, t * k + j) sorted by expert
    token_of_copy: torch.Tensor  # each sorted copy's token
    copy_row: torch.Tensor  # each token copy's row in expert order
    counts: torch.Tensor  # token copies per expert [E]


def narrow_keys(keys: torch.Tensor, bound: int) -> torch.Tensor:
    """``keys`` (integers in [0, bound)) in the narrowest integer dtype that holds them, for a stable argsort: the same
    order, and CUDA's radix sort makes one pass per 8 bits of the key's dtype (int64 expert ids: 8 passes, 4.8 ms of a
    DeepSeek-V2-Lite step on one H200; uint8: one)."""
    for dtype, limit in ((torch.uint8, 1 << 8), (torch.int16, 1 << 15), (torch.int32, 1 << 31)):
        if bound <= limit:
            return keys.to(dtype)
    return keys


def route(top_i: torch.Tensor, num_experts: int) -> Route:
    """Token copies sorted by expert: the order, each copy's token, each token's copy rows, tokens per expert."""
    k = top_i.shape[1]
    flat_expert = top_i.reshape(-1)
    order = torch.argsort(narrow_keys(flat_expert, num_experts), stable=True)
    # copy_row[t * k + j]: the row (in expert order) of token t's j-th choice.
    copy_row = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    # Tokens per expert; bincount would sync with the host on CUDA (its length depends on the largest index).
    counts = flat_expert.new_zeros(num_experts).scatter_add_(0, flat_expert, torch.ones_like(flat_expert))
    return Route(order, order // k, copy_row, counts)


def _gather_sum(grad: torch.Tensor, copy_row: torch.Tensor, k: int) -> torch.Tensor:
    """Row t of the result: the sum, in fp32, of rows ``copy_row[t * k : (t + 1) * k]`` of ``grad``."""
    return grad[copy_row].view(-1, k, grad.shape[-1]).float().sum(dim=1).to(grad.dtype)


def _fused_gather_sum(grad: torch.Tensor, copy_row: torch.Tensor, k: int) -> torch.Tensor:
    """``_gather_sum`` as one kernel (``FUSED_GATHERS``)."""
    if FUSED_GATHERS == "triton":
        from megablocks_utils.moe import gather_kernels  # Triton: imported where a GPU runs it

        return gather_kernels.gather_sum(grad, copy_row, k)
    return fused(_gather_sum)(grad, copy_row, k)


class _Dispatch(torch.autograd.Function):
    """``x[token_of_copy]`` (each token's k copies, in expert order) with a gather for its backward.

    Autograd's backward of the indexing is a scatter-add into x (index_put with accumulate: on CUDA a sort
    and a serial pass over duplicate indices). Each token's k copies sit at known rows (``copy_row``), so the
    gradient of a token is the sum of those k rows: a gather, summed in fp32 (as that kernel accumulates),
    one kernel with ``fuse``.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, token_of_copy: torch.Tensor, copy_row: torch.Tensor, k: int, fuse: bool) -> torch.Tensor:
        ctx.save_for_backward(copy_row)
        ctx.k, ctx.fuse = k, fuse
        return x[token_of_copy]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (copy_row,) = ctx.saved_tensors
        return (_fused_gather_sum if ctx.fuse else _gather_sum)(grad, copy_row, ctx.k), None, None, None, None


def dispatch(x: torch.Tensor, route: Route, k: int, fuse: bool) -> torch.Tensor:
    """Each token's k copies, as rows of ``x`` in expert order."""
    return _Dispatch.apply(x, route.token_of_copy, route.copy_row, k, fuse)


# torch's functional all-to-all as the operator itself (C++), not through its Python wrapper
# (torch.distributed._functional_collectives.all_to_all_single[_autograd]), whose result is a Python tensor subclass
# that waits on first use: every operation on it then runs through Python, ~10% of the host time of an ep 2 step at
# Qwen3-30B-A3B's shape, where the host paces the step (bench/trace_gaps.py, 2 x H200). The operator is the one that
# "selective" activation checkpointing keeps (parallel/activation_checkpointing.py), so it replays, not resends.
_ALL_TO_ALL = torch.ops._c10d_functional.all_to_all_single.default
_WAIT = torch.ops._c10d_functional.wait_tensor.default


def _all_to_all(rows: torch.Tensor, recv_splits: list[int], send_splits: list[int], group, wait: bool) -> torch.Tensor:
    out = _ALL_TO_ALL(rows.contiguous(), recv_splits, send_splits, group.group_name)
    return _WAIT(out) if wait else out  # on CUDA the compute stream waits for the collective; the host does not


class _AllToAll(torch.autograd.Function):
    """``rows`` to the ep ranks (``send_splits`` rows to each) and theirs to us (``recv_splits``); the backward sends the
    gradients back the same way. ``wait`` False: the result must go through ``wait_for`` before it is read (so that
    other work can be queued meanwhile)."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, recv_splits: list[int], send_splits: list[int], group, wait: bool) -> torch.Tensor:
        ctx.recv_splits, ctx.send_splits, ctx.group = recv_splits, send_splits, group
        return _all_to_all(rows, recv_splits, send_splits, group, wait)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_to_all(grad, ctx.send_splits, ctx.recv_splits, ctx.group, True), None, None, None, None


def wait_for(rows: torch.Tensor) -> None:
    """Wait for an all-to-all issued with ``wait`` False (its result is then safe to read)."""
    with torch.no_grad():
        _WAIT(rows)


class _Permute(torch.autograd.Function):
    """``x[index]`` where ``index`` is a permutation of x's rows (``inverse``: its inverse). The backward is the gather
    by the inverse permutation: autograd's backward of indexing is an index_put with accumulate (on CUDA a sort and a
    serial pass over duplicates), which a permutation has none of."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        return x[index]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        return grad[inverse], None, None


def exchange(
    routed: list[torch.Tensor],
    counts: list[torch.Tensor],
    ep: int,
    local: int,
    group: "torch.distributed.ProcessGroup",
    compute: Callable[[torch.Tensor, torch.Tensor, list[int]], torch.Tensor],
) -> list[torch.Tensor]:
    """Each chunk's rows (expert order) to the ep ranks owning their experts, through ``compute`` (rows grouped
    by local expert; rows per local expert, on the device and as a list) there, and back: the outputs in the order the
    rows were sent. ``local`` experts per rank. One count exchange and host sync for all chunks; with several chunks
    every chunk's rows are sent before the first chunk's experts run, so that a chunk's all-to-all runs beside another's
    experts. The outputs are waited on (plain tensors with their data): a Triton kernel may read them (gather_kernels.py)."""
    chunks = len(routed)
    # send[r, c, e]: chunk c's copies for rank r's local expert e; recv[s, c, e]: rank s's for my expert e.
    send = torch.stack(counts).view(chunks, ep, local).transpose(0, 1).reshape(-1)
    recv = _all_to_all(send, [chunks * local] * ep, [chunks * local] * ep, group, True)
    # Every count sent and received, read at once: the one host sync of the layer. The host then works out the splits
    # and each chunk's regrouping from these few numbers, where the GPU would take a dozen launches and a sort.
    sent_host, received_host = torch.cat([send, recv]).cpu().numpy().reshape(2, ep, chunks, local)
    send_splits, recv_splits = sent_host.sum(-1).T.tolist(), received_host.sum(-1).T.tolist()  # [c][rank]
    received_rows = [_AllToAll.apply(rows, recv_splits[c], send_splits[c], group, chunks == 1) for c, rows in enumerate(routed)]
    outs = []
    for c in range(chunks):
        # Received rows are source-major; the experts want them expert-major.
        expert_rows = received_host[:, c, :].sum(0)  # rows per local expert
        regroup, inverse, expert_counts = _regroup(received_host[:, c, :], expert_rows, recv.device)
        if chunks > 1:
            wait_for(received_rows[c])
        expert_out = compute(_Permute.apply(received_rows[c], regroup, inverse), expert_counts, expert_rows.tolist())
        source_major = _Permute.apply(expert_out, inverse, regroup)
        outs.append(_AllToAll.apply(source_major, send_splits[c], recv_splits[c], group, True))
    return outs


def regroup_order(recv_counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows received source-major (``recv_counts[s, e]`` rows from rank s for local expert e, in block (s, e)) put
    expert-major (block (e, s)), keeping each block's order: ``regroup`` (expert-major row p is received row
    ``regroup[p]``) and its inverse (received row i goes to ``inverse[i]``)."""
    ep, local = recv_counts.shape
    by_source = recv_counts.reshape(-1)
    by_expert = recv_counts.T.reshape(-1)
    source_start = np.cumsum(by_source) - by_source  # block (s, e)'s first row, source-major
    expert_start = (np.cumsum(by_expert) - by_expert).reshape(local, ep).T.reshape(-1)  # and expert-major
    rows = int(by_source.sum())
    inverse = np.arange(rows, dtype=np.int64) + np.repeat(expert_start - source_start, by_source)
    regroup = np.empty_like(inverse)
    regroup[inverse] = np.arange(rows, dtype=np.int64)
    return regroup, inverse


def _regroup(recv_counts: np.ndarray, expert_rows: np.ndarray, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``regroup_order`` and ``expert_rows`` (the rows per local expert), on ``device`` in one copy (asynchronous from
    page-locked memory on CUDA: torch's pinned-memory cache keeps the buffer until the copy has run)."""
    regroup, inverse = regroup_order(recv_counts)
    host = torch.from_numpy(np.concatenate([regroup, inverse, expert_rows.astype(np.int64)]))
    on_device = host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host.to(device)
    return on_device.split([len(regroup), len(inverse), recv_counts.shape[1]])


def _weigh(out: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Each expert output row times its fp32 router weight (the product in fp32, as transformers does)."""
    return (out * weights.unsqueeze(-1)).to(dtype)


def _gather_combine(out: torch.Tensor, copy_row: torch.Tensor, top_w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Each token's k expert outputs (rows ``copy_row`` [T * k] of ``out``) weighted and summed in fp32.

    What ``fuse`` runs as one kernel in place of weighting + ``index_add``: it gathers a token's k rows and
    writes the token once, instead of a zero fill, a weighting pass and bf16 atomic adds. Its backward is a
    gather too (each copy row belongs to exactly one token), so it needs no atomics either.
    """
    num_tokens, k = top_w.shape
    rows = out[copy_row].view(num_tokens, k, out.shape[-1])
    return (rows * top_w.unsqueeze(-1)).sum(dim=1).to(dtype)


class _GatherCombine(torch.autograd.Function):
    """``_gather_combine`` as Triton kernels: one for the forward, one for the whole backward (both gradients from
    one read of dy and of the k rows). ``out`` is kept for the backward only when ``top_w`` needs a gradient."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, copy_row: torch.Tensor, top_w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        from megablocks_utils.moe import gather_kernels  # Triton: imported where a GPU runs it

        d_out, _, d_top_w = ctx.needs_input_grad[:3]
        ctx.save_for_backward(copy_row, top_w, out if d_top_w else None)
        ctx.d_out_like = (out.shape[0], out.dtype) if d_out else None
        return gather_kernels.combine(out, copy_row, top_w, dtype)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        from megablocks_utils.moe import gather_kernels

        copy_row, top_w, out = ctx.saved_tensors
        d_out, d_top_w = gather_kernels.combine_backward(dy, copy_row, top_w, out, ctx.d_out_like)
        return d_out, None, d_top_w, None


def combine(out: torch.Tensor, route: Route, top_w: torch.Tensor, dtype: torch.dtype, fuse: bool) -> torch.Tensor:
    """Each token's k expert outputs (``out``: rows in expert order) weighted by its router weights and summed."""
    if fuse and FUSED_GATHERS == "triton":
        return _GatherCombine.apply(out, route.copy_row, top_w, dtype)
    if fuse:
        return fused(_gather_combine)(out, route.copy_row, top_w, dtype)
    weights = top_w.reshape(-1)[route.order]
    num_tokens = top_w.shape[0]
    return out.new_zeros(num_tokens, out.shape[-1], dtype=dtype).index_add(0, route.token_of_copy, _weigh(out, weights, dtype))
