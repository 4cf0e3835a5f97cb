"""ep 2 against ep 1 (dp 2) on 2 GPUs, fp32 and bf16, the embedded tiny Mixtral (tests/gpu/test_train_parity.py's
runs), each bf16 run also against the fp32 run of its own mesh: whether ep 2 in bf16 is as close to the fp32 truth as
ep 1 is, step by step. ``--seeds``: more data orders (train_fsdp2's seed).

``--wraps``: instead, fp32 only: ep 2 with each FSDP wrap (``fsdp_wrap``), ep 2 with the first wrap again (the run-to-run
difference of the same code on the same GPUs) and ep 1 (dp 2, layer), each against ep 1: loss and grad norm per step.
(test_train_parity's fp32 grad norm bound failed once ep 2 took fsdp_wrap model: 1.7e-5 over 20 steps; on CPU the two
wraps give the same bits.)

    python bench/ep_parity.py [--seeds 42,1] [--out FILE]
    python bench/ep_parity.py --wraps model,layer
"""

import argparse
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tests.gpu.launch import launch_together, metrics, train_fsdp2  # noqa: E402

COMMON = ("--max_steps", "20", "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seeds", default="42")
    p.add_argument("--out", default="")
    p.add_argument("--wraps", default="", help="fp32: ep 2 under each of these fsdp_wrap values (the first twice) against ep 1")
    args = p.parse_args()
    from megablocks_utils.model.tiny import make_tiny_mixtral

    work = tempfile.mkdtemp()
    model = os.path.join(work, "tiny-mixtral")
    make_tiny_mixtral(model, os.path.join(ROOT, "data.json"))
    if args.wraps:
        return wraps(args, model, work)
    runs = {f"{dtype}_ep{ep}_s{seed}": (dtype, ep, seed) for seed in args.seeds.split(",") for dtype in ("fp32", "bf16") for ep in (2, 1)}
    out = {name: os.path.join(work, name) for name in runs}
    launch_together({name: train_fsdp2(2, out[name], "--model_name_or_path", model, *COMMON, "--dtype", dtype, "--ep_size", str(ep),
                                       "--seed", seed) for name, (dtype, ep, seed) in runs.items()})
    losses = {name: [m["loss"] for m in metrics(out[name])] for name in runs}
    for seed in args.seeds.split(","):
        rel = lambda a, b: [abs(x - y) / abs(y) for x, y in zip(losses[f"{a}_s{seed}"], losses[f"{b}_s{seed}"])]
        rows = {"fp32 ep2 vs ep1": rel("fp32_ep2", "fp32_ep1"), "bf16 ep2 vs ep1": rel("bf16_ep2", "bf16_ep1"),
                "bf16 ep2 vs fp32 ep2": rel("bf16_ep2", "fp32_ep2"), "bf16 ep1 vs fp32 ep1": rel("bf16_ep1", "fp32_ep1")}
        print(f"seed {seed}: worst relative loss difference over 20 steps (and at steps 1, 5, 10, 20)")
        for name, r in rows.items():
            print(f"  {name:22s} {max(r):.2e}   " + " ".join(f"{r[i]:.1e}" for i in (0, 4, 9, 19) if i < len(r)))
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps({"losses": losses}) + "\n")


def wraps(args, model: str, work: str) -> None:
    names = args.wraps.split(",")
    runs = {f"ep2_{w}": ("2", w) for w in names} | {f"ep2_{names[0]}_again": ("2", names[0]), "ep1_layer": ("1", "layer")}
    out = {name: os.path.join(work, name) for name in runs}
    launch_together({name: train_fsdp2(2, out[name], "--model_name_or_path", model, *COMMON, "--dtype", "fp32", "--ep_size", ep,
                                       "--fsdp_wrap", wrap) for name, (ep, wrap) in runs.items()})
    found = {name: metrics(out[name]) for name in runs}
    print("fp32, worst relative difference over 20 steps (and at steps 1, 4, 10, 20), against ep1_layer")
    for name in runs:
        for key in ("loss", "grad_norm"):
            r = [abs(a[key] - b[key]) / abs(b[key]) for a, b in zip(found[name], found["ep1_layer"])]
            print(f"  {name:18s} {key:9s} {max(r):.2e}   " + " ".join(f"{r[i]:.1e}" for i in (0, 3, 9, 19) if i < len(r)))
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps({"wraps": {name: [{k: m[k] for k in ("loss", "grad_norm")} for m in ms] for name, ms in found.items()}}) + "\n")


if __name__ == "__main__":
    main()
