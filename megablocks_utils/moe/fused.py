"""``fused(fn)``: an element-wise step of the MoE layer compiled into one kernel (the layer's
``compile_elementwise``, on CUDA)."""

import functools

import torch


@functools.cache
def fused(fn):
    """``fn`` compiled: on CUDA its element-wise steps run as one generated kernel each way (forward and
    backward) instead of several passes over [tokens * k, 2I] or [tokens * k, H]. Compiled on first use,
    so CPU runs never load the compiler.

    Row counts change every step. torch.compile's automatic dynamic shapes make only the dimension that
    changed (the rows) symbolic and keep the width a constant. ``dynamic=True`` (every dimension symbolic)
    made the SwiGLU kernel 2.7x slower (forward + backward 3.77 ms vs 1.39 ms at 16384 x 28672 on an
    H200, bench/kernel_bench.py): with a symbolic width each element pays a 64-bit division for its column."""
    return torch.compile(fn)
