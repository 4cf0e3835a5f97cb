"""Micro-benchmark of the MoE layer's GPU pieces at Mixtral width, one GPU, to choose between implementations.

    python bench/kernel_bench.py [--rows 16384] [--out FILE.jsonl]

Times forward + backward (median of CUDA-event timings after warm-up) of:
  swiglu   silu(gate) * up on the fused [rows, 2I] projection: eager, torch.compile(dynamic=True) (what the
           layer used), torch.compile with automatic dynamic shapes (only the row count symbolic), and a
           plain copy of the same bytes as the memory-bandwidth yardstick;
  experts  the two expert GEMMs for ``local`` experts (1, 2, 4, 8 = ep 8, 4, 2, 1 of 8 experts):
           torch's grouped_mm against one cuBLAS GEMM per expert, reported in TFLOP/s next to a dense
           GEMM of the same total size;
  weigh    the router weighting of expert outputs ([rows, H] * fp32 weights -> bf16): eager and compiled.
Row counts change from call to call as in training (uneven routing), so compiled code sees dynamic shapes.
"""

import argparse
import json
import statistics
import sys

import torch
import torch.nn.functional as F

HIDDEN, INTER = 4096, 14336


def timed(fn, iters: int = 20, warmup: int = 5) -> float:
    """Median milliseconds of ``fn()`` (which may vary its inputs between calls)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def silu_mul(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def weigh(out, weights, dtype):
    return (out * weights.unsqueeze(-1)).to(dtype)


def varying_rows(base: int, i: int) -> int:
    return base - 64 * (i % 7) - (i % 5)  # uneven, like routed row counts


def bench_swiglu(rows: int, report):
    variants = {
        "eager": silu_mul,
        "compile_dynamic_true": torch.compile(silu_mul, dynamic=True),
        "compile_auto_dynamic": torch.compile(silu_mul),
    }
    big = torch.randn(rows, 2 * INTER, device="cuda", dtype=torch.bfloat16)
    grad_big = torch.randn(rows, INTER, device="cuda", dtype=torch.bfloat16)
    for name, fn in variants.items():
        calls = [0]

        def step():
            n = varying_rows(rows, calls[0])
            calls[0] += 1
            x = big[:n].detach().requires_grad_()
            fn(x).backward(grad_big[:n])

        ms = timed(step)
        # fwd: read 2I, write I; bwd: read 2I + I, write 2I (bytes per row x 2 bytes)
        gb = rows * (3 * INTER + 5 * INTER) * 2 / 1e9
        report({"piece": "swiglu", "variant": name, "rows": rows, "ms_fwd_bwd": ms, "gb_per_s": gb / ms * 1e3})
    ms = timed(lambda: big.clone())
    report({"piece": "swiglu", "variant": "copy_of_gate_up (bandwidth yardstick)", "rows": rows, "ms": ms,
            "gb_per_s": 2 * big.numel() * 2 / 1e9 / ms * 1e3})


def grouped_mm(a, b, offs):
    return F.grouped_mm(a, b, offs=offs) if hasattr(F, "grouped_mm") else torch._grouped_mm(a, b, offs=offs)


def bench_experts(rows_per_expert: int, report):
    for local in (1, 2, 4, 8):
        w1 = torch.randn(local, 2 * INTER, HIDDEN, device="cuda", dtype=torch.bfloat16) * 0.02
        w2 = torch.randn(local, HIDDEN, INTER, device="cuda", dtype=torch.bfloat16) * 0.02
        counts = [rows_per_expert + 128 * ((e * 5) % 3) - 64 * (e % 2) for e in range(local)]
        total = sum(counts)
        x = torch.randn(total, HIDDEN, device="cuda", dtype=torch.bfloat16)
        g = torch.randn(total, HIDDEN, device="cuda", dtype=torch.bfloat16)
        offs = torch.cumsum(torch.tensor(counts, device="cuda"), 0).to(torch.int32)
        flops = 3 * 2 * total * HIDDEN * 3 * INTER  # fwd + 2x bwd; the three [H, I] matrices per expert

        def grouped():
            a = x.detach().requires_grad_()
            p1, p2 = w1.detach().requires_grad_(), w2.detach().requires_grad_()
            h = silu_mul(grouped_mm(a, p1.transpose(-2, -1), offs))
            grouped_mm(h, p2.transpose(-2, -1), offs).backward(g)

        def loop():
            a = x.detach().requires_grad_()
            p1, p2 = w1.detach().requires_grad_(), w2.detach().requires_grad_()
            outs = [F.linear(silu_mul(F.linear(r, p1[e])), p2[e]) for e, r in enumerate(torch.split(a, counts))]
            torch.cat(outs).backward(g)

        # the SwiGLU in between is the same eager code in both; timed alone to subtract it
        gu = torch.randn(total, 2 * INTER, device="cuda", dtype=torch.bfloat16)
        gh = torch.randn(total, INTER, device="cuda", dtype=torch.bfloat16)

        def swiglu_only():
            t = gu.detach().requires_grad_()
            silu_mul(t).backward(gh)

        swiglu_ms = timed(swiglu_only)
        for name, fn in (("grouped_mm", grouped), ("cublas_per_expert", loop)):
            ms = timed(fn, iters=10, warmup=3) - swiglu_ms
            report({"piece": "experts", "variant": name, "local_experts": local, "rows": total,
                    "ms_gemms_fwd_bwd": ms, "tflops": flops / ms / 1e9})
        del w1, w2, x, g, gu, gh
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = timed(lambda: a @ b, iters=20)
    report({"piece": "experts", "variant": "dense 8192^3 (yardstick)", "tflops": 2 * 8192**3 / ms / 1e9})


def bench_weigh(rows: int, report):
    out = torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(rows, device="cuda", dtype=torch.float32)
    g = torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16)
    for name, fn in (("eager", weigh), ("compile_dynamic_true", torch.compile(weigh, dynamic=True)),
                     ("compile_auto_dynamic", torch.compile(weigh))):
        calls = [0]

        def step():
            n = varying_rows(rows, calls[0])
            calls[0] += 1
            o, ww = out[:n].detach().requires_grad_(), w[:n].detach().requires_grad_()
            fn(o, ww, torch.bfloat16).backward(g[:n])

        report({"piece": "weigh", "variant": name, "rows": rows, "ms_fwd_bwd": timed(step)})


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=16384, help="expert rows on this GPU per micro-step")
    p.add_argument("--rows_per_expert", type=int, default=8192)
    p.add_argument("--pieces", default="swiglu,weigh,experts")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    sink = open(args.out, "a") if args.out else None
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}

    def report(record):
        record = {**record, **meta}
        print(json.dumps(record), flush=True)
        if sink:
            sink.write(json.dumps(record) + "\n")

    for piece in args.pieces.split(","):
        {"swiglu": lambda: bench_swiglu(args.rows, report), "weigh": lambda: bench_weigh(args.rows, report),
         "experts": lambda: bench_experts(args.rows_per_expert, report)}[piece]()
    return 0


if __name__ == "__main__":
    sys.exit(main())
