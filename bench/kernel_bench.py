"""Micro-benchmark of the MoE layer's GPU pieces at Mixtral width, one GPU, to choose between implementations.

    python bench/kernel_bench.py [--rows 16384] [--pieces swiglu,weigh,experts,gathers] [--out FILE.jsonl]

Times forward + backward (median of CUDA-event timings after warm-up) of:
  swiglu   silu(gate) * up on the fused [rows, 2I] projection: eager, torch.compile(dynamic=True) (what the
           layer used), torch.compile with automatic dynamic shapes (only the row count symbolic), and a
           plain copy of the same bytes as the memory-bandwidth yardstick;
  experts  the two expert GEMMs for ``local`` experts (1, 2, 4, 8 = ep 8, 4, 2, 1 of 8 experts):
           torch's grouped_mm against one cuBLAS GEMM per expert, reported in TFLOP/s next to a dense
           GEMM of the same total size;
  weigh    the router weighting of expert outputs ([rows, H] * fp32 weights -> bf16): eager and compiled.
  gathers  the token gathers of dispatch.py at Qwen3-30B-A3B's shape (4096 tokens, k = 8, H = 2048) and Mixtral's
           (k = 2, H = 4096), bf16: the dispatch's gather-sum backward, the combine's forward and its backward, each
           timed alone, torch.compile of the eager functions against our Triton kernels (gather_kernels.py), in GB/s
           of the bytes each must move, beside a copy of the expert outputs as the bandwidth yardstick.
Row counts change from call to call as in training (uneven routing), so compiled code sees dynamic shapes (the
gathers excepted: a training step sees one token count per micro-batch shape).
"""

import argparse
import json
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

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


def timed_after(setup, fn, host_ahead: bool, iters: int = 50, warmup: int = 5) -> float:
    """Median milliseconds of ``fn(setup())``, ``setup`` left out (a backward after its forward). ``host_ahead``: a GPU
    sleep of ~1 ms is queued before the start event, so the host has launched ``fn``'s kernels before the GPU reaches
    them and the time is the kernels' alone; otherwise it includes the host's time to launch them on an idle GPU."""
    for _ in range(warmup):
        fn(setup())
    times = []
    for _ in range(iters):
        state = setup()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if host_ahead:
            torch.cuda._sleep(2_000_000)  # clock cycles
        start.record()
        fn(state)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


GATHER_SHAPES = {"qwen3_30b_a3b": (4096, 8, 2048, 128), "mixtral": (4096, 2, 4096, 8)}  # tokens, k, H, experts


def bench_gathers(report):
    for shape, (tokens, k, hidden, experts) in GATHER_SHAPES.items():
        torch._dynamo.reset()  # each shape compiled as in training, where H and k never change (no symbolic width)
        bench_gathers_at(report, shape, tokens, k, hidden, experts)


def bench_gathers_at(report, shape: str, tokens: int, k: int, hidden: int, experts: int):
    from megablocks_utils.moe import dispatch as moe_dispatch

    route = moe_dispatch.route(torch.rand(tokens, experts, device="cuda").topk(k, dim=-1).indices, experts)
    top_w = torch.rand(tokens, k, device="cuda").softmax(-1)
    copies = torch.randn(tokens * k, hidden, device="cuda", dtype=torch.bfloat16)  # the dispatch's gradient
    out = torch.randn(tokens * k, hidden, device="cuda", dtype=torch.bfloat16)  # expert outputs, expert order
    dy = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    row, token_row = tokens * k * hidden * 2, tokens * hidden * 2  # bytes of the k copies, of one row per token

    def forward():
        o, w = out.detach().requires_grad_(), top_w.detach().requires_grad_()
        return moe_dispatch.combine(o, route, w, torch.bfloat16, True), o, w

    ops = {  # op -> (setup, timed call, bytes it must move)
        "gather_sum": (lambda: None, lambda _: moe_dispatch._fused_gather_sum(copies, route.copy_row, k), row + token_row),
        "combine_fwd": (lambda: None, lambda _: forward(), row + token_row),
        "combine_bwd": (forward, lambda state: torch.autograd.grad(state[0], state[1:], dy), token_row + 2 * row),
    }
    for variant in ("compiled", "triton"):
        moe_dispatch.FUSED_GATHERS = variant
        for op, (setup, fn, nbytes) in ops.items():
            ms, ms_idle = timed_after(setup, fn, True), timed_after(setup, fn, False)
            report({"piece": "gathers", "variant": f"{op} {variant} ({shape})", "op": op, "impl": variant, "shape": shape,
                    "tokens": tokens, "k": k, "hidden": hidden, "rows": tokens * k, "ms": ms, "ms_from_idle_gpu": ms_idle,
                    "gb_per_s": nbytes / 1e9 / ms * 1e3})
    moe_dispatch.FUSED_GATHERS = "triton"
    ms = timed_after(lambda: None, lambda _: out.clone(), True)
    report({"piece": "gathers", "variant": f"copy of the expert outputs (bandwidth yardstick, {shape})", "shape": shape,
            "rows": tokens * k, "ms": ms, "gb_per_s": 2 * row / 1e9 / ms * 1e3})


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=16384, help="expert rows on this GPU per micro-step")
    p.add_argument("--rows_per_expert", type=int, default=8192)
    p.add_argument("--pieces", default="swiglu,weigh,experts", help="any of swiglu,weigh,experts,gathers")
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
         "experts": lambda: bench_experts(args.rows_per_expert, report), "gathers": lambda: bench_gathers(report)}[piece]()
    return 0


if __name__ == "__main__":
    sys.exit(main())
