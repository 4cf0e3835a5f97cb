"""Chart and table of bench_moe.py results: tokens/s per GPU and peak memory per configuration.

    python bench/plot_results.py bench/results/h200x2_L4.jsonl    (writes the .png beside it)
Needs matplotlib (not a dependency of the training suite).
"""

import json
import sys

ANCHORS = [  # published numbers to print beside ours (different hardware, models and batches)
    "original README (8xA100-80GB, Mixtral-8x7B): FSDP2-only 0.033 steps/s, megablocks 0.117 steps/s",
    "successor plugin (8xA100-80GB, Mixtral-8x7B): FSDP-only 80 tokens/s/GPU, ScatterMoE EP 414",
    "Megatron-Core (Mixtral-8x7B, H100, 64 GPUs): 468 TFLOPS/GPU",
]


def main(path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in open(path)]
    ok = [r for r in rows if r.get("status") == "ok"]
    base = {r["config"]: r for r in ok}
    print("| config | GPUs | step (s) | tokens/s/GPU | TFLOPS/GPU | MFU (989) | MFU vs measured GEMM | peak alloc / reserved GiB |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        if r.get("status") != "ok":
            print(f"| {r['config']} | {r['gpus']} | {r['status']}: {r.get('error', '')} | | | | | |")
            continue
        print(f"| {r['config']} | {r['gpus']} | {r['step_time_s']:.3f} | {r['tokens_per_s_per_gpu']:.0f} | "
              f"{r['tflops_per_gpu']:.0f} | {r['mfu']:.1%} | {r['mfu_vs_dense_gemm']:.1%} | "
              f"{r['peak_allocated_gib']:.1f} / {r['peak_reserved_gib']:.1f} |")
    if "ep" in base:
        for other in ("eager", "grouped_mm", "megablocks"):
            if other in base:
                ratio = base["ep"]["tokens_per_s_per_gpu"] / base[other]["tokens_per_s_per_gpu"]
                print(f"ep / {other}: {ratio:.2f}x tokens/s")
    for line in ANCHORS:
        print("anchor:", line)

    names = [r["config"] for r in ok]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.5))
    ax1.bar(names, [r["tokens_per_s_per_gpu"] for r in ok], color=["#999", "#69c", "#e63", "#6a4"][: len(ok)])
    ax1.set_ylabel("tokens / s / GPU")
    ax2.bar(names, [r["peak_allocated_gib"] for r in ok], color=["#999", "#69c", "#e63", "#6a4"][: len(ok)])
    ax2.set_ylabel("peak allocated GiB / GPU")
    r0 = ok[0]
    fig.suptitle(f"{r0['gpus']}x {r0['device']}, Mixtral width, {r0['layers']} layers, seq {r0['seq']}, "
                 f"{r0['micro_batch'] * r0.get('grad_accum', 1)} seq/GPU/step, bf16")
    fig.tight_layout()
    out = path.rsplit(".", 1)[0] + ".png"
    fig.savefig(out, dpi=110)
    print("wrote", out)


if __name__ == "__main__":
    main(sys.argv[1])
