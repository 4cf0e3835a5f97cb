"""FP8 GEMMs against torch's bf16 ones, one GPU. Prints one JSON line per measurement.

Default: the experts' GEMMs over an FP8 base at a model's expert shapes, forward (x @ W^T) and the input's gradient
(grad @ W): torch's bf16 grouped GEMM, a separate dequantization pass (compiled, or our Triton kernel) then it, and the
in-register dequantizing kernel (``moe/fp8_gemm_kernel.py``, each tiling). Routing even, or ``--routing uniform``: the
counts scatter around the mean as a model's do, and tiles sized to the mean run part empty.

``--table``: forward + backward (both gradients), quantization included, of torch's bf16 GEMMs against torchao's FP8
training GEMMs: the experts' grouped GEMM (torchao's rowwise grouped) and a dense Linear (torchao's float8 rowwise and
tensorwise, compiled).

    python bench/fp8_gemm_bench.py [--shapes qwen3,mixtral] [--configs 1] [--routing even|uniform] [--table]
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHAPES = {  # experts, hidden, moe width, routed rows (4,096 tokens x top-k)
    "qwen3": (128, 2048, 768, 4096 * 8),
    "mixtral": (8, 4096, 14336, 4096 * 2),
    "glm45_air": (128, 4096, 1408, 4096 * 8),
}
# The kernel's tilings and launch orders (the last field: row tiles per group; 1 = column tiles first), the kept one
# (moe/fp8_gemm_kernel.py's CONFIG) first, then the others of 2026-12-02.
CONFIGS = [(256, 128, 64, 8, 4, 1), (256, 128, 64, 8, 4, 8), (256, 128, 64, 8, 3, 1), (128, 128, 64, 4, 4, 1),
           (128, 128, 64, 4, 4, 8), (128, 256, 64, 8, 3, 1), (128, 128, 128, 8, 3, 1), (256, 128, 128, 8, 3, 1),
           (256, 128, 64, 8, 5, 1), (256, 64, 64, 4, 4, 1)]


def timed(fn, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) / reps / 1e3


def routed_offsets(experts: int, rows: int, routing: str, device: str = "cuda") -> torch.Tensor:
    """Each expert's end in the grouped rows: ``even`` (rows / experts each) or ``uniform`` (each row's expert drawn
    uniformly, seeded)."""
    if routing == "even":
        counts = torch.full((experts,), rows // experts)
    else:
        drawn = torch.randint(experts, (rows,), generator=torch.Generator().manual_seed(0))
        counts = torch.bincount(drawn, minlength=experts)
    return counts.cumsum(0).to(device=device, dtype=torch.int32)


def relative_errors(got: torch.Tensor, ref: torch.Tensor) -> dict:
    d = got.float() - ref
    return {"rel_err_max": float(d.abs().max() / ref.abs().max()), "rel_err_rms": float(d.norm() / ref.norm())}


def kernels(args) -> None:
    """The experts' GEMMs over an FP8 base: forward and the input's gradient, each path and tiling."""
    from megablocks_utils.moe.fp8_gemm_kernel import dequantize_fp8_blocks, fp8_grouped_mm
    from megablocks_utils.moe.quantized import dequantize, quantize_fp8
    from megablocks_utils.moe.weight_grad import grouped_mm

    configs = CONFIGS if args.configs == "all" else CONFIGS[: int(args.configs)]
    best = {}
    for shape in args.shapes.split(","):
        experts, hidden, width, rows = SHAPES[shape]
        offs = routed_offsets(experts, rows, args.routing)
        for name, (n, k) in {"gate_up": (2 * width, hidden), "down": (hidden, width)}.items():
            w = torch.randn(experts, n, k, device="cuda", dtype=torch.bfloat16) * 0.02
            data, scale = quantize_fp8(w)
            for way, transpose in (("forward", True), ("input_grad", False)):
                x = torch.randn(rows, k if transpose else n, device="cuda", dtype=torch.bfloat16)
                flops = 2 * int(offs[-1]) * n * k
                ref_w = dequantize("fp8", data, scale, torch.bfloat16)
                runs = {"bf16_grouped_mm": lambda: grouped_mm(x, w.transpose(-2, -1) if transpose else w, offs),
                        "dequantize_then_grouped_mm": lambda: grouped_mm(
                            x, dequantize("fp8", data, scale, torch.bfloat16).transpose(-2, -1) if transpose
                            else dequantize("fp8", data, scale, torch.bfloat16), offs),
                        "dequantize_kernel_then_grouped_mm": lambda: grouped_mm(
                            x, dequantize_fp8_blocks(data, scale, torch.bfloat16).transpose(-2, -1) if transpose
                            else dequantize_fp8_blocks(data, scale, torch.bfloat16), offs),
                        "dequantize_kernel_alone": lambda: dequantize_fp8_blocks(data, scale, torch.bfloat16)}
                ref = grouped_mm(x.float(), (ref_w.transpose(-2, -1) if transpose else ref_w).float(), offs)
                for config in configs:
                    runs[f"kernel{list(config)}"] = lambda c=config: fp8_grouped_mm(x, data, scale, offs, transpose, c)
                for path, fn in runs.items():
                    try:
                        seconds = timed(fn)
                        err = relative_errors(fn(), ref) if path not in ("bf16_grouped_mm", "dequantize_kernel_alone") else {}
                    except Exception as e:  # a tiling that does not compile (shared memory) is reported, not fatal
                        print(json.dumps({"shape": shape, "gemm": name, "way": way, "path": path, "error": str(e)[:300]}), flush=True)
                        continue
                    print(json.dumps({"shape": shape, "routing": args.routing, "gemm": name, "way": way, "path": path,
                                      "ms": seconds * 1e3,
                                      "tflops": flops / seconds / 1e12, **err}), flush=True)
                    if path.startswith("kernel"):
                        best.setdefault(shape, {}).setdefault(path, 0.0)
                        best[shape][path] += seconds
    for shape, totals in best.items():  # the four GEMMs summed, per shape
        print(json.dumps({"shape": shape, "fastest": min(totals, key=totals.get),
                          "total_ms": {k: v * 1e3 for k, v in totals.items()}}))


def table(args) -> None:
    """Forward + backward (both gradients), quantization included: bf16 against torchao's FP8 training GEMMs."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm

    from megablocks_utils.moe.weight_grad import grouped_mm

    def fwd_bwd(fn, *inputs, leaves=()):
        def step():
            for t in (*inputs, *leaves):
                t.grad = None
            fn(*inputs).backward(grad)
        return step

    def report(gemm: str, path: str, rows: int, flops: int, fn) -> None:
        try:
            seconds = timed(fn)
        except Exception as e:  # a path that does not run here is reported, not fatal
            print(json.dumps({"gemm": gemm, "path": path, "error": str(e)[:300]}), flush=True)
            return
        print(json.dumps({"gemm": gemm, "rows": rows, "path": path, "ms": seconds * 1e3, "tflops": flops / seconds / 1e12}),
              flush=True)

    if "mixtral" in args.shapes:  # the dense Linear at Mixtral's width, 16k rows, compiled
        rows = 16384
        for k, n in ((4096, 14336), (14336, 4096)):
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            grad = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
            for path in ("bf16", "rowwise", "tensorwise"):
                linear = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
                if path != "bf16":
                    linear = convert_to_float8_training(linear, config=Float8LinearConfig.from_recipe_name(path))
                report(f"linear {k}x{n}", path, rows, 3 * 2 * rows * n * k,
                       fwd_bwd(torch.compile(linear), x, leaves=(linear.weight,)))
    for shape in args.shapes.split(","):
        experts, hidden, width, rows = SHAPES[shape]
        offs = torch.arange(1, experts + 1, device="cuda", dtype=torch.int32) * (rows // experts)
        for name, (k, n) in {"gate_up": (hidden, 2 * width), "down": (width, hidden)}.items():
            a = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            b_t = (torch.randn(experts, n, k, device="cuda", dtype=torch.bfloat16) * 0.02).transpose(-2, -1).requires_grad_()
            grad = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
            paths = {"bf16_grouped_mm": fwd_bwd(lambda x, w: grouped_mm(x, w, offs), a, b_t),
                     "torchao_fp8_rowwise_grouped": fwd_bwd(lambda x, w: _to_fp8_rowwise_then_scaled_grouped_mm(
                         x, w, offs, pad_token_groups_for_grouped_mm=False), a, b_t)}
            for path, fn in paths.items():
                report(f"experts {shape} {name}", path, rows, 3 * 2 * rows * n * k, fn)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="qwen3,mixtral")
    p.add_argument("--configs", default="1", help="the kernel's tilings: all, or the first N of CONFIGS (1: the kept one)")
    p.add_argument("--routing", choices=["even", "uniform"], default="even",
                   help="the experts' row counts: even, or drawn per row (uniform; the kernels only)")
    p.add_argument("--table", action="store_true", help="forward + backward against torchao's FP8 training GEMMs")
    args = p.parse_args()
    table(args) if args.table else kernels(args)


if __name__ == "__main__":
    main()
