"""The experts' SwiGLU forward and backward on one GPU: the compiled function (``fused(_silu_mul)``: torch.compile
makes both kernels) against ``silu_mul`` (the compiled forward, the Triton backward of ``moe/swiglu_kernel.py``) and
``silu_mul`` bounded by a device count of valid rows (the Triton forward too: what the grouped-GEMM path runs), at the
expert rows of one micro-step of 4096 tokens (balanced routing), in ms and the backward's GB/s of least traffic. Then
the static exchange's case at ep 4: 3x those rows, the valid third at the top, unbounded against bounded.

    python bench/swiglu_bench.py [--out FILE.jsonl]
"""

import argparse
import json
import os
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megablocks_utils.moe.experts import _silu_mul, silu_mul  # noqa: E402
from megablocks_utils.moe.fused import fused  # noqa: E402

SHAPES = {"dsv2": (4096 * 6, 1408), "qwen3": (4096 * 8, 768), "mixtral": (4096 * 2, 14336)}  # (expert rows, I)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench/results/swiglu.jsonl")
    a = p.parse_args()
    shapes = [("warm-up", SHAPES["dsv2"])] + list(SHAPES.items())  # the first timings of a process ran slow: not recorded
    for name, (rows, width) in shapes:
        # Each shape compiled afresh: a second width would recompile with a symbolic width, the slow kernel fused.py avoids
        torch._dynamo.reset()
        gate_up = torch.randn(rows, 2 * width, device="cuda", dtype=torch.bfloat16).requires_grad_()
        grad = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16)
        least_bytes = rows * width * 2 * 5  # read gate, up, grad; write both halves
        record = {"shape": name, "rows": rows, "width": width, "device": torch.cuda.get_device_name(), "torch": torch.__version__}
        valid = torch.tensor([rows], device="cuda")
        for variant, fn in (("compiled", fused(_silu_mul)), ("ours", silu_mul), ("bounded", lambda t: silu_mul(t, valid))):
            out = fn(gate_up)
            record[f"{variant}_forward_ms"] = do_bench(lambda fn=fn: fn(gate_up))
            record[f"{variant}_backward_ms"] = do_bench(lambda out=out: torch.autograd.grad(out, gate_up, grad, retain_graph=True))
            record[f"{variant}_backward_gbps"] = least_bytes / record[f"{variant}_backward_ms"] / 1e6
        padded = torch.randn(3 * rows, 2 * width, device="cuda", dtype=torch.bfloat16).requires_grad_()
        padded_grad = torch.randn(3 * rows, width, device="cuda", dtype=torch.bfloat16)
        for variant, fn in (("padded_unbounded", silu_mul), ("padded_bounded", lambda t: silu_mul(t, valid))):
            out = fn(padded)
            record[f"{variant}_forward_ms"] = do_bench(lambda fn=fn: fn(padded))
            record[f"{variant}_backward_ms"] = do_bench(lambda out=out: torch.autograd.grad(out, padded, padded_grad, retain_graph=True))
        if name == "warm-up":
            continue
        print(json.dumps(record), flush=True)
        with open(a.out, "a") as f:
            f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
