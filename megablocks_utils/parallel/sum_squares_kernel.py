"""The sum of squares of large gradients as one Triton reduction per tensor (``grads.grad_norm_and_clip_coef`` uses
it for the large CUDA gradients, the experts' among them).

Why: torch's multi-tensor norm (``_foreach_norm``, what ``clip_grad_norm_`` runs) reads bf16 gradients at 2.3 TB/s on
an H200, in launches of at most a few hundred blocks each: 9.3 ms for DeepSeek-V2-Lite's 20-layer expert gradients
(21 GB), where this kernel takes 4.9 ms (4.3 TB/s; bench/grad_norm_bench.py, retired, in git history at e823338).
Each program sums its elements' squares in fp32 and writes its own partial; the partials are then summed by torch: the
same order every run, no atomics.
"""

import torch
import triton
import triton.language as tl

_BLOCK = 4096  # elements a program reads per iteration
_BLOCKS = 8  # iterations per program: 32k elements


@triton.jit
def _sum_squares_kernel(x_ptr, partial_ptr, n, BLOCK: tl.constexpr, BLOCKS: tl.constexpr):
    """``partial[program] = sum(x[i]^2)`` in fp32 over the program's ``BLOCKS * BLOCK`` elements of ``x`` (those < n)."""
    program = tl.program_id(0).to(tl.int64)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in tl.static_range(BLOCKS):
        offsets = (program * BLOCKS + i) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offsets, mask=offsets < n, other=0.0).to(tl.float32)
        acc += x * x
    tl.store(partial_ptr + program, tl.sum(acc))


def sum_of_squares(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The sum over ``tensors`` (contiguous, floating, on one device) of their elements' squares, in fp32: a 0-dim
    tensor on their device, read by nobody on the host."""
    if not tensors:
        raise ValueError("sum_of_squares: no tensors")
    for t in tensors:
        if not t.is_contiguous() or not t.is_floating_point() or t.device != tensors[0].device:
            raise ValueError(f"sum_of_squares takes contiguous floating tensors on one device; got {t.dtype} on {t.device}, "
                             f"contiguous={t.is_contiguous()}")
    programs = [triton.cdiv(t.numel(), _BLOCK * _BLOCKS) for t in tensors]
    partials = torch.zeros(sum(programs), dtype=torch.float32, device=tensors[0].device)
    start = 0
    for t, count in zip(tensors, programs):
        if count:
            _sum_squares_kernel[(count,)](t, partials[start:], t.numel(), BLOCK=_BLOCK, BLOCKS=_BLOCKS, num_warps=8)
        start += count
    return partials.sum()
