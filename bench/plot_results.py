"""Chart and table of bench_moe.py and bench_fsdp1.py results: tokens/s per GPU and peak memory per configuration.

    python bench/plot_results.py bench/results/parity_throughput_megablocks_h100-h200_2026-11-20-21/records.md#h200x2_l4jsonl    (writes the .png beside it)
The table needs nothing; the chart needs matplotlib (in requirements.txt; the training scripts never import it).
"""

import json
import sys

CONFIGS = {  # config name -> (label, bar colour), in the order of the list
    "eager": ("(a) FSDP2, transformers eager experts", "#999"),
    "grouped_mm": ("(b) FSDP2, transformers grouped_mm experts", "#69c"),
    "ep": ("(c) ours: FSDP2 + EP (bench_moe.py)", "#e63"),
    "fsdp1_ep": ("(d) ours: FSDP1 + EP, Trainer path (train_fsdp1.py)", "#c39"),
    "fsdp2_ep_script": ("ours: FSDP2 + EP, train_fsdp2.py on the same input as (d)", "#f96"),
    "megablocks": ("(e) FSDP2 + EP, megablocks backend", "#396"),
    "hf_native_fsdp2_ep": ("(f) transformers' own FSDP2 + EP (DistributedConfig)", "#36c"),
    "ep_base": ("(c) at an earlier commit (bench/run.py --base)", "#fb8"),
    "ep_overlap2": ("(c) with --overlap_chunks 2", "#c52"),
}


def key(r: dict) -> str:
    """A record's configuration, with its routing when it was skewed (bench/run.py peers runs both)."""
    return f"{r['config']} (skew {r['routing_skew_target']:g})" if r.get("routing_skew_target") else r["config"]
ANCHORS = [  # published numbers to print beside ours (different hardware, models and batches)
    "original README (8xA100-80GB, Mixtral-8x7B): FSDP2-only 0.033 steps/s, megablocks 0.117 steps/s",
    "successor plugin (8xA100-80GB, Mixtral-8x7B): FSDP-only 80 tokens/s/GPU, ScatterMoE EP 414",
    "Megatron-Core (Mixtral-8x7B, H100, 64 GPUs): 468 TFLOPS/GPU",
]


def memory(r: dict) -> str:
    if "peak_allocated_gib" in r:
        return f"{r['peak_allocated_gib']:.1f} / {r['peak_reserved_gib']:.1f}"
    return f"RSS {r['peak_rss_gib']:.1f}" if "peak_rss_gib" in r else ""


def main(path: str) -> None:
    rows = [json.loads(line) for line in open(path)]
    ok = [r for r in rows if r.get("status") == "ok"]
    base = {key(r): r for r in ok}  # the last ok record of each configuration (and routing)
    print("| config | GPUs | step (s) | tokens/s/GPU | TFLOPS/GPU | MFU (989) | MFU vs measured GEMM | peak alloc / reserved GiB |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        label = CONFIGS.get(r["config"], (r["config"],))[0] + (key(r)[len(r["config"]):] if r.get("routing_skew_target") else "")
        if r.get("status") != "ok":
            print(f"| {label} | {r['gpus']} | {r['status']}: {r.get('error', '')} | | | | | |")
            continue
        vs_gemm = f"{r['mfu_vs_dense_gemm']:.1%}" if r.get("mfu_vs_dense_gemm") else "n/a"
        print(f"| {label} | {r['gpus']} | {r['step_time_s']:.3f} | {r['tokens_per_s_per_gpu']:.0f} | "
              f"{r['tflops_per_gpu']:.0f} | {r['mfu']:.1%} | {vs_gemm} | {memory(r)} |")
    for ours, others in (("ep", ("eager", "grouped_mm", "hf_native_fsdp2_ep")), ("fsdp1_ep", ("eager", "grouped_mm", "ep", "fsdp2_ep_script"))):
        for other in others:
            if ours in base and other in base:
                ratio = base[ours]["tokens_per_s_per_gpu"] / base[other]["tokens_per_s_per_gpu"]
                print(f"{ours} / {other}: {ratio:.2f}x tokens/s")
    for line in ANCHORS:
        print("anchor:", line)
    try:
        import matplotlib
    except ImportError:
        print("no chart: matplotlib is not installed")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in base.values() if "peak_allocated_gib" in r]
    if not ok:
        print("no chart: no GPU record")
        return
    names = [key(r) for r in ok]
    colors = [CONFIGS.get(r["config"], ("", "#666"))[1] for r in ok]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9 + len(ok) - 3, 3.5 + (1.0 if any(len(n) > 12 for n in names) else 0)))
    ax1.bar(names, [r["tokens_per_s_per_gpu"] for r in ok], color=colors)
    ax1.set_ylabel("tokens / s / GPU")
    ax2.bar(names, [r["peak_allocated_gib"] for r in ok], color=colors)
    ax2.set_ylabel("peak allocated GiB / GPU")
    for ax in (ax1, ax2):
        ax.tick_params(axis="x", labelrotation=30 if any(len(n) > 12 for n in names) else 0)
    r0 = ok[0]
    fig.suptitle(f"{r0['gpus']}x {r0['device']}, Mixtral width, {r0['layers']} layers, seq {r0['seq']}, "
                 f"{r0['micro_batch'] * r0.get('grad_accum', 1)} seq/GPU/step, bf16")
    fig.tight_layout()
    out = path.rsplit(".", 1)[0] + ".png"
    fig.savefig(out, dpi=110)
    print("wrote", out)


if __name__ == "__main__":
    main(sys.argv[1])
