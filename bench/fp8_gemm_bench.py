"""The experts' GEMMs over an FP8 base (``moe/fp8_gemm_kernel.py``) against torch's bf16 grouped GEMM, one GPU: forward
(x @ W^T) and the input's gradient (grad @ W), and the separate dequantization pass it replaces, at a model's expert
shapes, routing even. Prints one JSON line per (shape, way, path, tiling) and the fastest tiling.

    python bench/fp8_gemm_bench.py [--shapes qwen3,mixtral] [--configs all]
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
CONFIGS = [(256, 128, 64, 8, 3), (128, 256, 64, 8, 3), (128, 128, 64, 8, 3), (128, 128, 128, 8, 3), (64, 256, 64, 8, 3),
           (128, 128, 64, 4, 4), (64, 128, 64, 4, 4), (128, 64, 128, 4, 4)]  # the tilings of 2026-12-02, the kept one first


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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="qwen3,mixtral")
    p.add_argument("--configs", default="all", help="all, or the first N tilings of CONFIGS")
    args = p.parse_args()
    from megablocks_utils.moe.fp8_gemm_kernel import fp8_grouped_mm
    from megablocks_utils.moe.quantized import dequantize, quantize_fp8
    from megablocks_utils.moe.weight_grad import grouped_mm

    configs = CONFIGS if args.configs == "all" else CONFIGS[: int(args.configs)]
    best = {}
    for shape in args.shapes.split(","):
        experts, hidden, width, rows = SHAPES[shape]
        offs = torch.arange(1, experts + 1, device="cuda", dtype=torch.int32) * (rows // experts)
        for name, (n, k) in {"gate_up": (2 * width, hidden), "down": (hidden, width)}.items():
            w = torch.randn(experts, n, k, device="cuda", dtype=torch.bfloat16) * 0.02
            data, scale = quantize_fp8(w)
            for way, transpose in (("forward", True), ("input_grad", False)):
                x = torch.randn(rows, k if transpose else n, device="cuda", dtype=torch.bfloat16)
                flops = 2 * rows * n * k
                ref_w = dequantize("fp8", data, scale, torch.bfloat16)
                runs = {"bf16_grouped_mm": lambda: grouped_mm(x, w.transpose(-2, -1) if transpose else w, offs),
                        "dequantize_then_grouped_mm": lambda: grouped_mm(
                            x, dequantize("fp8", data, scale, torch.bfloat16).transpose(-2, -1) if transpose
                            else dequantize("fp8", data, scale, torch.bfloat16), offs)}
                ref = grouped_mm(x, ref_w.transpose(-2, -1) if transpose else ref_w, offs).float()
                for config in configs:
                    runs[f"kernel{list(config)}"] = lambda c=config: fp8_grouped_mm(x, data, scale, offs, transpose, c)
                for path, fn in runs.items():
                    try:
                        seconds = timed(fn)
                        err = float((fn().float() - ref).abs().max() / ref.abs().max()) if path.startswith("kernel") else None
                    except Exception as e:  # a tiling that does not compile (shared memory) is reported, not fatal
                        print(json.dumps({"shape": shape, "gemm": name, "way": way, "path": path, "error": str(e)[:200]}), flush=True)
                        continue
                    record = {"shape": shape, "gemm": name, "way": way, "path": path, "ms": seconds * 1e3,
                              "tflops": flops / seconds / 1e12, "rel_err": err}
                    print(json.dumps(record), flush=True)
                    if path.startswith("kernel"):
                        best.setdefault(path, 0.0)
                        best[path] += seconds
    if best:
        print(json.dumps({"fastest_overall": min(best, key=best.get), "total_ms": {k: v * 1e3 for k, v in best.items()}}))


if __name__ == "__main__":
    main()
