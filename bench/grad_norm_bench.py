"""The gradient norm's GPU time at DeepSeek-V2-Lite's shape (20 layers: 38 expert gradients, 10.5 B bf16 elements), one
GPU: torch's multi-tensor norm (``_foreach_norm``, what ``grad_norm_and_clip_coef`` runs) against one reduction per
tensor (``torch.linalg.vector_norm`` in fp32) and ``parallel/sum_squares_kernel.py``'s sum of squares per tensor; and whether the expert weight
gradient overlaps the grouped GEMM's dX when it runs on a second stream.

    python bench/grad_norm_bench.py [--layers 19] [--out FILE.jsonl]
"""

import argparse
import json
import os
import sys

import torch
import triton
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megablocks_utils.moe.weight_grad import grouped_mm  # noqa: E402
from megablocks_utils.moe.weight_grad_kernel import grouped_weight_grad  # noqa: E402
from megablocks_utils.parallel.sum_squares_kernel import sum_of_squares  # noqa: E402


def triton_norms(tensors):
    """Each tensor's norm from the library's sum of squares (one Triton reduction per tensor)."""
    return torch.stack([sum_of_squares([t]) for t in tensors]).sqrt()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=19)
    p.add_argument("--out", default="bench/results/grad_norm.jsonl")
    a = p.parse_args()
    dev = "cuda"
    experts, hidden, inter, k, tokens = 64, 2048, 1408, 6, 4096
    grads = []
    for _ in range(a.layers):
        grads.append(torch.randn(experts, 2 * inter, hidden, device=dev, dtype=torch.bfloat16))
        grads.append(torch.randn(experts, hidden, inter, device=dev, dtype=torch.bfloat16))
    gb = sum(g.numel() for g in grads) * 2 / 1e9
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__, "grad_gb": gb}
    ref = torch.stack(torch._foreach_norm(grads, 2.0, dtype=torch.float32)).double()
    variants = {
        "foreach_norm": lambda: torch._foreach_norm(grads, 2.0, dtype=torch.float32),
        "vector_norm_each": lambda: [torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads],
        "triton_sum_squares": lambda: triton_norms(grads),
    }
    for name, fn in variants.items():
        ms = do_bench(fn, warmup=5, rep=50)
        got = fn()
        got = torch.stack(list(got)) if isinstance(got, (list, tuple)) else got
        out[name + "_ms"] = ms
        out[name + "_tbps"] = gb / ms
        out[name + "_rel_err"] = float(((got.double() - ref) / ref).abs().max())
    grads.clear()  # free them
    # dX and dW of one gate_up projection: in turn on one stream, or dW on a second stream beside dX
    rows = tokens * k
    counts = torch.full((experts,), rows // experts, dtype=torch.int32, device=dev)
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    w = torch.randn(experts, 2 * inter, hidden, device=dev, dtype=torch.bfloat16) * 0.02
    x = torch.randn(rows, hidden, device=dev, dtype=torch.bfloat16)
    g = torch.randn(rows, 2 * inter, device=dev, dtype=torch.bfloat16) * 0.01
    acc = torch.zeros_like(w)
    side = torch.cuda.Stream()

    def in_turn():
        grouped_mm(g, w, offs)
        grouped_weight_grad(g, x, offs, acc, accumulate=True)

    def beside():
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            grouped_weight_grad(g, x, offs, acc, accumulate=True)
        grouped_mm(g, w, offs)
        main.wait_stream(side)

    out["dx_ms"] = do_bench(lambda: grouped_mm(g, w, offs))
    out["dw_ms"] = do_bench(lambda: grouped_weight_grad(g, x, offs, acc, accumulate=True))
    out["dx_dw_in_turn_ms"] = do_bench(in_turn)
    out["dx_dw_beside_ms"] = do_bench(beside)
    print(json.dumps(out), flush=True)
    with open(a.out, "a") as f:
        f.write(json.dumps(out) + "\n")


if __name__ == "__main__":
    main()
