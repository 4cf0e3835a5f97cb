"""Pictures of a run from its metrics.jsonl (written by train_fsdp2.py and train_fsdp1.py alike).

    python -m megablocks_utils.tools.plot output/fsdp2            # writes output/fsdp2/plots/*.png

- ``loss.png``: loss (and its cross-entropy part), gradient norm and learning rate over steps.
- ``throughput.png``: tokens/s per device and MFU over steps (MFU is not reported on CPU).
- ``expert_load.png``: the share of each layer's routed tokens (top-k choices) that each expert
  received over the last steps, as a layer x expert heatmap, and each layer's imbalance (the
  busiest expert's count over the mean count) at every step. Routing collapse shows up as a few
  bright cells per row and imbalance climbing towards num_experts / top_k.

matplotlib is needed (it is in requirements.txt) and only imported here; the Agg backend needs no display.
"""

import json
import os
import sys

import numpy as np

PLOTS = ("loss.png", "throughput.png", "expert_load.png")


class PlotError(Exception):
    pass


def read_metrics(run_dir: str) -> list[dict]:
    """The run's per-step records (``run_dir`` may also be the metrics.jsonl file itself)."""
    path = run_dir if os.path.isfile(run_dir) else os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise PlotError(f"{path} not found; pass the output_dir of a train_fsdp2.py or train_fsdp1.py run")
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    if not records:
        raise PlotError(f"{path} has no records yet; plot after the first optimizer step")
    return records


def expert_fractions(records: list[dict]):
    """[layer, expert] share of each layer's routed tokens, summed over ``records``."""
    counts = np.sum([np.asarray(r["tokens_per_expert"], dtype=np.float64) for r in records], axis=0)
    return counts / np.maximum(counts.sum(axis=1, keepdims=True), 1)


def imbalance(records: list[dict]):
    """[step, layer] busiest expert's count over the mean count (1 = perfectly balanced)."""
    counts = np.asarray([r["tokens_per_expert"] for r in records], dtype=np.float64)
    return counts.max(axis=2) / np.maximum(counts.mean(axis=2), 1e-12)


def _import_pyplot():
    try:
        import matplotlib
    except ImportError:
        raise PlotError("the plot command needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _step_axis(ax) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)


def plot_loss(records: list[dict], path: str, plt) -> None:
    steps = [r["step"] for r in records]
    fig, (ax_loss, ax_norm, ax_lr) = plt.subplots(1, 3, figsize=(12, 3.6))
    ax_loss.plot(steps, [r["loss"] for r in records], label="loss (CE + coef x aux)")
    if "ce_loss" in records[0]:
        ax_loss.plot(steps, [r["ce_loss"] for r in records], label="cross-entropy", linestyle="--")
    ax_loss.set_title("loss")
    ax_loss.legend()
    ax_norm.plot(steps, [r["grad_norm"] for r in records], color="tab:red")
    ax_norm.set_title("gradient norm (before clipping)")
    ax_lr.plot(steps, [r["lr"] for r in records], color="tab:green")
    ax_lr.set_title("learning rate")
    ax_lr.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    for ax in (ax_loss, ax_norm, ax_lr):
        _step_axis(ax)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_throughput(records: list[dict], path: str, plt) -> None:
    steps = [r["step"] for r in records]
    fig, (ax_tps, ax_mfu) = plt.subplots(1, 2, figsize=(10, 3.6))
    ax_tps.plot(steps, [r["tokens_per_second_per_device"] for r in records])
    ax_tps.set_title("tokens/s per device")
    mfu = [(r["step"], r["mfu"]) for r in records if r.get("mfu") is not None]
    if mfu:
        ax_mfu.plot([s for s, _ in mfu], [100 * m for _, m in mfu], color="tab:purple")
        ax_mfu.set_ylabel("%")
    else:  # mfu is None without a peak FLOP/s: on CPU unless --peak_tflops is given
        ax_mfu.text(0.5, 0.5, "n/a on CPU\n(no peak FLOP/s; set --peak_tflops)", ha="center", va="center",
                    transform=ax_mfu.transAxes, fontsize=12, color="0.4")
        ax_mfu.set_yticks([])
    ax_mfu.set_title("MFU")
    for ax in (ax_tps, ax_mfu):
        _step_axis(ax)
        ax.set_xlim(steps[0], max(steps[-1], steps[0] + 1))
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_expert_load(records: list[dict], path: str, plt, window: int) -> None:
    last = records[-window:]
    fractions = expert_fractions(last)
    layers, experts = fractions.shape
    fig, (ax_map, ax_line) = plt.subplots(
        1, 2, figsize=(12, max(3.6, 0.35 * layers + 1.5)), gridspec_kw={"width_ratios": [1.1, 1]}
    )
    image = ax_map.imshow(fractions, cmap="viridis", aspect="auto", vmin=0)
    if layers * experts <= 256:  # numbers in the cells while they stay readable
        for (layer, expert), value in np.ndenumerate(fractions):
            ax_map.text(expert, layer, f"{100 * value:.0f}", ha="center", va="center", fontsize=7,
                        color="white" if value < 0.6 * fractions.max() else "black")
    span = f"step {last[0]['step']}" if len(last) == 1 else f"steps {last[0]['step']}-{last[-1]['step']}"
    ax_map.set_title(f"share of routed tokens, {span} (uniform = {100 / experts:.1f}%)", fontsize=10)
    ax_map.set_xlabel("expert")
    ax_map.set_ylabel("MoE layer")
    if experts <= 32:
        ax_map.set_xticks(range(experts))
    if layers <= 32:
        ax_map.set_yticks(range(layers))
    fig.colorbar(image, ax=ax_map, label="fraction of the layer's top-k choices")

    steps = [r["step"] for r in records]
    ratio = imbalance(records)
    colors = plt.get_cmap("viridis")
    for layer in range(layers):
        ax_line.plot(steps, ratio[:, layer], color=colors(layer / max(layers - 1, 1)), linewidth=1,
                     label=f"layer {layer}" if layers <= 8 else None)
    ax_line.axhline(1.0, color="0.5", linestyle=":", linewidth=1)
    ax_line.set_title("imbalance: busiest expert / mean, per layer", fontsize=10)
    _step_axis(ax_line)
    ax_line.set_ylim(bottom=0.9)
    if layers <= 8:
        ax_line.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_run(run_dir: str, out_dir: str | None = None, window: int = 10, dpi: int = 100) -> list[str]:
    """Write the run's PNGs to ``out_dir`` (default ``run_dir/plots``); returns their paths."""
    records = read_metrics(run_dir)
    plt = _import_pyplot()
    if out_dir is None:
        out_dir = os.path.join(run_dir if os.path.isdir(run_dir) else os.path.dirname(run_dir), "plots")
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, name) for name in PLOTS]
    with plt.rc_context({"savefig.dpi": dpi, "axes.formatter.useoffset": False}):
        plot_loss(records, paths[0], plt)
        plot_throughput(records, paths[1], plt)
        plot_expert_load(records, paths[2], plt, max(window, 1))
    return paths


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m megablocks_utils.tools.plot",
        description="Plot a run's metrics.jsonl: loss, learning rate, throughput, MFU and the expert-load heatmap.",
    )
    parser.add_argument("run_dir", help="the output_dir of a train_fsdp2.py or train_fsdp1.py run (or its metrics.jsonl)")
    parser.add_argument("--out_dir", help="where to write the PNGs (default: run_dir/plots)")
    parser.add_argument("--window", type=int, default=10, help="the heatmap sums the expert load over the last N steps")
    parser.add_argument("--dpi", type=int, default=100)
    args = parser.parse_args(argv)
    try:
        paths = plot_run(args.run_dir, args.out_dir, args.window, args.dpi)
    except PlotError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    for path in paths:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
