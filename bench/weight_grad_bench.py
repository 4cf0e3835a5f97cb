"""The experts' weight gradient with gradient accumulation, one GPU: torch's path against ours.

    python bench/weight_grad_bench.py [--shapes qwen3,dsv2,gptoss] [--configs] [--ep N --hot H | --all_to H] [--divisors 2,3]
        [--out FILE.jsonl]

For one MoE layer's two expert GEMMs at a model's shape (4096 tokens, every expert the same row count: balanced
routing; ``--ep N``: one rank's E/N experts and the rows it receives on average, tokens * top_k; ``--hot H``: one
expert with H times the mean rows (at most one per token of the N ranks), the rest even, the hot one ``--hot_at``
last (the worst place for index order), "mid" or first; ``--all_to H``: H experts take a row of every token of
the N ranks, the others 2 rows each, as a random checkpoint's router sends every token to the same top-k), times the
backward of a micro-step after the first, whose weight gradient is added to the one there:
  torch  autograd through ``F.grouped_mm`` (dX and dW grouped GEMMs, then ``add_`` of the fresh dW into ``.grad``);
  ours   dX by ``F.grouped_mm``, dW by ``moe/weight_grad_kernel.py`` adding into ``.grad`` in its epilogue.
And each piece alone: torch's dW GEMM (fresh), ``add_``, our kernel fresh and adding (with ``--configs``, for each tile
configuration), in TFLOP/s and GB/s, and ours' error against an fp64 reference beside torch's.
"""

import argparse
import json
import os
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megablocks_utils.moe.weight_grad import grouped_mm as gm  # noqa: E402
from megablocks_utils.moe.weight_grad_kernel import _CONFIG, grouped_weight_grad  # noqa: E402

# (experts, hidden, intermediate, top_k)
SHAPES = {"qwen3": (128, 2048, 768, 8), "dsv2": (64, 2048, 1408, 6), "gptoss": (32, 2880, 2880, 4), "mixtral": (8, 4096, 14336, 2)}
CONFIGS = [(128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (256, 128, 64, 8, 3), (256, 128, 64, 8, 4), (256, 128, 32, 8, 4),
           (128, 128, 32, 4, 4), (128, 128, 64, 4, 4), (64, 128, 64, 4, 4)]


def compiled_kernels() -> list:
    """Each compiled weight-gradient kernel's shared memory, registers, spills and whether its loop was pipelined (the
    async copies in its TTGIR): a kernel whose loads are not pipelined waits for each tile's rows."""
    from megablocks_utils.moe import weight_grad_kernel as kernels

    found = []
    for cache in getattr(kernels._weight_grad_kernel, "device_caches", {}).values():
        compiled = cache[0] if isinstance(cache, tuple) else cache  # the layout differs between Triton versions
        for kernel in getattr(compiled, "values", lambda: [])():
            ttgir = kernel.asm.get("ttgir", "")
            found.append({"warps": kernel.metadata.num_warps, "stages": kernel.metadata.num_stages,
                          "shared": kernel.metadata.shared, "regs": getattr(kernel, "n_regs", None),
                          "spills": getattr(kernel, "n_spills", None), "async_copies": ttgir.count("async_copy"),
                          "tma": ttgir.count("tma")})
    return found


def row_counts(experts: int, rows: int, hot: float, hot_at: str, cap: int, all_to: int = 0) -> torch.Tensor:
    """Rows per expert: even, or one expert with ``hot`` times the mean (at most ``cap``) and the rest even, or
    ``all_to`` experts with ``cap`` rows each and the rest 2 each."""
    if all_to:
        counts = torch.full((experts,), 2, dtype=torch.int32)
        counts[:all_to] = cap
        return counts
    if not hot:
        counts = torch.full((experts,), rows // experts, dtype=torch.int32)
        counts[: rows - int(counts.sum())] += 1
        return counts
    hot_rows = min(int(hot * rows / experts), cap, rows)
    counts = row_counts(experts - 1, rows - hot_rows, 0, hot_at, cap)
    at = {"last": experts - 1, "mid": experts // 2, "first": 0}[hot_at]
    return torch.cat([counts[:at], torch.tensor([hot_rows], dtype=torch.int32), counts[at:]])


def run_shape(name, tokens, configs, record, ep=1, hot=0.0, hot_at="last", all_to=0, divisors=()):
    experts, hidden, inter, k = SHAPES[name]
    experts //= ep
    counts = row_counts(experts, tokens * k, hot, hot_at, tokens * ep, all_to).cuda()
    rows = int(counts.sum())
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    dt = torch.bfloat16
    for proj, (m, n) in {"gate_up": (2 * inter, hidden), "down": (hidden, inter)}.items():
        # weight [E, m, n]; forward y = x @ w_e^T with x [rows, n], y [rows, m]; dW_e = g_e^T @ x_e
        w = torch.randn(experts, m, n, device="cuda", dtype=dt) * 0.02
        x = torch.randn(rows, n, device="cuda", dtype=dt)
        g = torch.randn(rows, m, device="cuda", dtype=dt) * 0.01
        flops = 2 * rows * m * n
        grad_bytes = experts * m * n * 2

        wp = w.clone().requires_grad_()
        wp.grad = torch.randn_like(w) * 1e-3
        xp = x.clone().requires_grad_()

        def torch_step():
            y = gm(xp, wp.transpose(-2, -1), offs)
            y.backward(g)

        acc = torch.randn_like(w) * 1e-3

        def ours_step():
            y = gm(x, w.transpose(-2, -1), offs)
            gm(g, w, offs)  # dX
            grouped_weight_grad(g, x, offs, acc, accumulate=True)
            return y

        def forward_only():
            gm(x, w.transpose(-2, -1), offs)

        fresh = torch.empty_like(w)
        start_check = torch.randn_like(w) * 1e-3
        default_check = grouped_weight_grad(g, x, offs, start_check.clone(), accumulate=True)
        out = {
            "shape": name, "proj": proj, "experts": experts, "m": m, "n": n, "rows": rows, "ep": ep, "hot": hot,
            "hot_at": hot_at if hot else None, "all_to": all_to, "max_rows": int(counts.max()),
            "forward_ms": do_bench(forward_only),
            "torch_fwd_bwd_ms": do_bench(torch_step, grad_to_none=[xp]),
            "ours_fwd_bwd_ms": do_bench(ours_step),
            "torch_dw_ms": do_bench(lambda: gm(x.t(), g, offs)),  # [E, n, m] as autograd makes it
            "add_ms": do_bench(lambda: acc.add_(fresh.transpose(-2, -1).contiguous().transpose(-2, -1))),
            "add_contiguous_ms": do_bench(lambda: acc.add_(fresh)),
        }
        for cfg in configs:
            key = "x".join(map(str, cfg))
            out[f"ours_fresh_ms[{key}]"] = do_bench(lambda cfg=cfg: grouped_weight_grad(g, x, offs, fresh, accumulate=False, config=cfg))
            out[f"ours_acc_ms[{key}]"] = do_bench(lambda cfg=cfg: grouped_weight_grad(g, x, offs, acc, accumulate=True, config=cfg))
            check = grouped_weight_grad(g, x, offs, start_check.clone(), accumulate=True, config=cfg)
            out[f"ours_equal_default[{key}]"] = bool(torch.equal(check, default_check))
        for d in divisors:  # the gradient divided on the way (the ranks it is averaged over): 2, 4 by reciprocal, 3 by division
            out[f"ours_acc_div{d:g}_ms"] = do_bench(lambda d=d: grouped_weight_grad(g, x, offs, acc, accumulate=True, divisor=d))
        out["torch_dw_tflops"] = flops / out["torch_dw_ms"] / 1e9
        out["add_gbps"] = 3 * grad_bytes / out["add_ms"] / 1e6
        # accuracy: against fp64 per expert, the accumulate from a known start
        start = torch.randn_like(w) * 1e-3
        ref = start.double().clone()
        for e in range(experts):
            a0, a1 = (int(offs[e - 1]) if e else 0), int(offs[e])
            ref[e] += g[a0:a1].double().t() @ x[a0:a1].double()
        ours = grouped_weight_grad(g, x, offs, start.clone(), accumulate=True)
        theirs = start.clone().add_(gm(x.t(), g, offs).transpose(-2, -1))
        scale = ref.abs().max().item()
        out["ours_max_err"] = (ours.double() - ref).abs().max().item() / scale
        out["torch_max_err"] = (theirs.double() - ref).abs().max().item() / scale
        out["ours_vs_torch_max_diff"] = (ours.double() - theirs.double()).abs().max().item() / scale
        out["ours_vs_torch_equal_frac"] = (ours == theirs).float().mean().item()
        out["compiled"] = compiled_kernels()
        print(json.dumps(out), flush=True)
        record.write(json.dumps(out) + "\n")
        record.flush()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="qwen3,dsv2,gptoss")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--configs", nargs="?", const="all", default="",
                   help="time every tile configuration of CONFIGS (or these, as BMxBNxBKxWARPSxSTAGES,...), not only the chosen one")
    p.add_argument("--ep", type=int, default=1, help="one rank of ep N: E/N local experts")
    p.add_argument("--hot", type=float, default=0.0, help="one expert with this many times the mean rows (0: even)")
    p.add_argument("--hot_at", choices=("last", "mid", "first"), default="last")
    p.add_argument("--all_to", type=int, default=0, help="this many experts take a row of every token of the ep ranks")
    p.add_argument("--divisors", default="", help="also ours adding, divided by each of these (comma-separated)")
    p.add_argument("--out", default="bench/results/weight_grad.jsonl")
    args = p.parse_args()
    if args.hot and args.all_to:
        p.error("--hot (one busy expert) and --all_to (a few experts with every token) are two routings: give one")
    if args.configs == "all":
        configs = CONFIGS
    elif args.configs:
        configs = [tuple(int(v) for v in c.split("x")) for c in args.configs.split(",")]
    else:
        configs = [_CONFIG]
    print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    with open(args.out, "a") as record:
        for name in args.shapes.split(","):
            run_shape(name, args.tokens, configs, record, args.ep, args.hot, args.hot_at, args.all_to,
                      [float(d) for d in args.divisors.split(",") if d])


if __name__ == "__main__":
    main()
