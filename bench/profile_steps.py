"""Where a training step's GPU time goes, by part of the model, in steady state (after warm-up and compiles).

    python bench/profile_steps.py --shape qwen3_30b_a3b --layers 12 [--data synthetic|chat] [--wait 6 --active 3] [--ep N]
    python bench/profile_steps.py --compare ep1.jsonl ep4.jsonl   # earlier runs' kernels side by side, by part
    python bench/profile_steps.py --shape mixtral --layers 32 --ep 4 --wait 2 --active 2 --shard_experts true \
        --activation_checkpointing full --activation_checkpointing_layers 16   # full Mixtral as bench/run.py full_size's ours_part

Any argument this script does not know goes to train_fsdp2.py, after the bench's own settings (so it wins).

Writes the random-weight checkpoint of ``--shape`` (bench/real_data.py's), then runs train_fsdp2.py at its
defaults on one GPU (``--ep N``: on N GPUs at ep_size N, each rank its own rows, as bench/real_data.py --ep) under
torch.profiler, recording only optimizer steps ``wait+1 .. wait+active`` (a global
optimizer step hook advances the profiler, so the script needs no change). Each kernel's time goes to the
operator that launched it, and each operator to a part (``PARTS``): expert GEMMs, dense GEMMs, attention,
permute/combine, routing, casts and copies, dispatch bookkeeping, compiled elementwise (norms, rotary, SwiGLU),
loss, the optimizer (everything under ``Optimizer.step``). Prints the table per step and writes the raw
record as one JSON line to ``--out``; the GPU's busy time per step against the step's wall time says how
much of the step the host leaves the GPU idle.

The profiler adds host time to every operator it records, so host-bound stretches (many small launches, such as
an optimizer that steps one tensor at a time) look longer than they are: read the GPU time per part, and check a
change that saves host time with bench/real_data.py, unprofiled (torchao's per-tensor AdamW step looked like
130 ms of idle GPU here, yet replacing it with a 16-tensors-per-call version changed the step time by nothing).
"""

import argparse
import cProfile
import io
import json
import os
import re
import runpy
import subprocess
import sys
import time
from datetime import date

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
sys.path.insert(0, ROOT)
sys.path.insert(0, BENCH)

DENSE_GEMMS, LOSS = "dense GEMMs (projections, lm_head, router)", "loss (log-softmax, nll; chunked: its element-wise steps)"
# (part, pattern on the launching operator's name); the first match wins, in this order.
PARTS = [
    ("expert GEMMs (grouped_mm)", r"grouped_mm"),
    ("attention", r"flash|attention|fmha|varlen|flex"),
    (DENSE_GEMMS, r"^aten::(mm|addmm|bmm|matmul|linear|_scaled_mm)$"),
    (LOSS, r"log_softmax|nll_loss|cross_entropy"),
    ("routing (softmax, top-k, sort)", r"softmax|topk|sort|sigmoid|argsort"),
    ("permute / combine (gather, scatter, index)", r"index|gather|scatter|take|put"),
    ("dispatch bookkeeping (counts, cumsum)", r"cumsum|bincount|histc|histogram|arange|repeat_interleave|nonzero|searchsorted|bucketize"),
    ("casts and copies", r"_to_copy|copy_|clone|^aten::to$|contiguous|cat|stack"),
    ("compiled elementwise (norms, rotary, SwiGLU)", r"^triton_|Torch-Compiled|CompiledFunction"),
    ("collectives", r"nccl|all_reduce|all_to_all|reduce_scatter|all_gather|c10d"),
]


def part_of(name: str, ancestors: list[str]) -> str:
    # A compiled optimizer's kernel may be recorded outside Optimizer.step; AdamW's moment update is a lerp.
    if any(a.startswith("Optimizer.step") or a.startswith("Optimizer.zero_grad") for a in ancestors) or "lerp" in name:
        return "optimizer"
    if any("AccumulateGrad" in a for a in ancestors):
        return "gradient accumulation (micro-steps)"
    if any("clip_grad" in a or "grad_norm_and_clip_coef" in a or "scale_grads_" in a for a in ancestors):
        return "gradient clip"
    # The chunked loss (megablocks_utils/train/loss.py): its GEMMs are lm_head's, the rest is the loss.
    in_chunked_loss = any(a == "chunked_loss" or "ChunkedLinearCrossEntropy" in a for a in ancestors)
    for part, pattern in PARTS:
        if re.search(pattern, name):
            return LOSS if in_chunked_loss and part != DENSE_GEMMS else part
    if in_chunked_loss:
        return LOSS
    return "other elementwise (" + name.removeprefix("aten::")[:40] + ")"


# Kernels by name -> the parts an ep step adds to or takes from one GPU's (``--compare``); the first match wins, in this
# order, and the rest is "attention, dense GEMMs, loss, the rest". The cutlass kernel is torch's grouped GEMM (the dense
# GEMMs run as nvjet kernels), so it counts as the experts'.
KERNEL_GROUPS = [
    ("barriers (waits for each layer's slowest rank)", r"barrier_kernel"),
    ("moving rows (the pull's expand, pair and rank sums; one GPU: its gathers and combines)",
     r"_expand_(forward|backward)_kernel|_sum_(ranks|slots)_kernel|_pull_rows_kernel|_combine(_backward)?_kernel|"
     r"_gather_sum_kernel|vectorized_gather_kernel"),
    ("NCCL collectives (the dense gradients' all-reduce)", r"^nccl"),
    ("SwiGLU forward + backward", r"_silu_mul_backward_kernel|fused_mul_silu"),
    ("the experts' grouped GEMMs", r"cutlass"),
    ("the experts' weight gradients", r"_weight_grad_kernel"),
    ("optimizer", r"adamw|multi_tensor_apply"),
]
REST = "attention, dense GEMMs, loss, the rest"


def kernel_groups(records: list[dict]) -> dict[str, float]:
    """GPU seconds a step per ``KERNEL_GROUPS`` part, the mean over ``records`` (one a rank), with "all kernels" and
    "wall" (the profiled steps' mean wall time)."""
    groups = {name: 0.0 for name, _ in KERNEL_GROUPS} | {REST: 0.0}
    for record in records:
        for kernel, (seconds, _launches) in record["kernels_s_per_step_and_count"].items():
            part = next((name for name, pattern in KERNEL_GROUPS if re.search(pattern, kernel)), REST)
            groups[part] += seconds / len(records)
    groups["all kernels"] = sum(groups.values())
    groups["wall"] = sum(sum(r["wall_s_per_step"]) / len(r["wall_s_per_step"]) for r in records) / len(records)
    return groups


def compare(paths: list[str]) -> str:
    """The ``--compare`` table: one column a file of records (bench/profile_steps.py's, one a rank), ms a step."""
    columns = []
    for path in paths:
        with open(path) as f:
            records = [json.loads(line) for line in f if line.strip()]
        first = records[0]
        label = f"ep {first['ep']}, {first['routing']} routing, {first['data']}" if first["ep"] > 1 else f"1 GPU, {first['data']}"
        columns.append((label, kernel_groups(records)))
    lines = ["| part (GPU ms a step, mean of the ranks) | " + " | ".join(label for label, _ in columns) + " |",
             "|---" * (len(columns) + 1) + "|"]
    for part in columns[0][1]:
        lines.append(f"| {part} | " + " | ".join(f"{groups[part] * 1e3:.1f}" for _, groups in columns) + " |")
    return "\n".join(lines)


def inner(args, script_args: list[str]) -> None:
    """In the torchrun process: run train_fsdp2.py under a profiler that records optimizer steps wait+1..wait+active."""
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook
    from torch.profiler import ProfilerActivity, profile, schedule

    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                   schedule=schedule(wait=args.wait, warmup=1, active=args.active, repeat=1))
    window = {"times": []}

    def step_hook(optimizer, *_):
        if torch.cuda.is_available():  # --shrink runs on CPU too
            torch.cuda.synchronize()
        window["times"].append(time.perf_counter())
        prof.step()
        if len(window["times"]) == args.wait + 1 + args.active + 1:  # the last profiled step is done
            prof.stop()
            report(args, prof, window["times"])
            os._exit(0)  # the rest of the run (its export of the weights) is not what is measured

    register_optimizer_step_post_hook(step_hook)
    route(args)
    sys.argv = [os.path.join(ROOT, "train_fsdp2.py"), *script_args]
    prof.start()
    runpy.run_path(sys.argv[0], run_name="__main__")
    raise SystemExit("train_fsdp2.py ended before the profiled steps; raise its max_steps")


def phases(args, script_args: list[str]) -> None:
    """In the torchrun process, without a profiler: CUDA events and host clocks at each phase boundary of a step
    (each micro-batch's forward + loss, its backward, the clip, the step's sums and checks, the optimizer, the
    end-of-step sync). Between two boundaries the GPU time (events) against the host time says which phases keep the
    GPU waiting; ``lag`` at a boundary is how far the GPU is behind the host there (0: the GPU has caught up and idles)."""
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    import megablocks_utils
    from megablocks_utils.parallel import grads
    from megablocks_utils.train.step import StepLoss

    marks: list[tuple[str, float, torch.cuda.Event]] = []  # this step's (label, host time, event)
    steps: list[list[tuple[str, float, float]]] = []  # finished steps: (label, host ms, GPU ms) from the step's first mark

    class HostClock:  # on CPU (a smoke test of this script): the device is the host
        def __init__(self):
            self.t = time.perf_counter()

        def elapsed_time(self, other) -> float:
            return (other.t - self.t) * 1e3

    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def mark(label: str) -> None:
        if cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        else:
            event = HostClock()
        marks.append((label, time.perf_counter(), event))

    forward, check, clip = StepLoss.micro_batch, StepLoss.check, grads.grad_norm_and_clip_coef

    hooked = []

    def micro_batch(self, model, batch):
        if args.layer_marks and not hooked:  # a mark where each decoder layer's forward starts (recomputation included)
            from megablocks_utils.model.architectures import decoder_layers

            for i, layer in enumerate(decoder_layers(model)):
                hooked.append(layer.register_forward_pre_hook(lambda *_, i=i: mark(f"  layer {i}")))
        n = sum(label.startswith("forward") for label, _, _ in marks) + 1
        mark(f"forward {n} + loss")
        out = forward(self, model, batch)
        mark(f"backward {n} (then the next collate)")
        return out

    def timed_check(self, *a, **k):
        mark("sums + check (host sync)")
        result = check(self, *a, **k)
        mark("optimizer")
        return result

    def timed_clip(*a, **k):
        mark("clip")
        return clip(*a, **k)

    StepLoss.micro_batch, StepLoss.check = micro_batch, timed_check
    grads.grad_norm_and_clip_coef = megablocks_utils.grad_norm_and_clip_coef = timed_clip

    def step_end(optimizer, *_):
        mark("the optimizer's GPU tail (a sync)")
        sync()
        mark("end")
        if marks[0][0] != "data + collate":  # the first step: no anchor after a sync
            marks.clear()
            mark("data + collate")
            return
        start_host, start_event = marks[0][1], marks[0][2]
        steps.append([(label, (host - start_host) * 1e3, start_event.elapsed_time(event)) for label, host, event in marks])
        marks.clear()
        if args.sync_debug and len(steps) == args.wait + args.active - 1:
            watch_syncs()  # the last measured step: every host sync it makes, and where from
        if args.host_profile and len(steps) == args.wait + args.active - 1:
            host_profile.enable()  # the last measured step's Python calls (the main thread: forwards, optimizer)
        mark("data + collate")  # the next step's first mark: the GPU has just synced, so it is idle here
        if len(steps) == args.wait + args.active:
            if args.host_profile:
                host_profile.disable()
                report_host_profile(host_profile, f"{os.path.splitext(args.out)[0]}.rank{os.environ.get('RANK', '0')}.pstats")
            if args.sync_debug:
                torch.cuda.set_sync_debug_mode(0)
                print(f"host syncs in one step: {sum(syncs.values())}", flush=True)
                for where, count in sorted(syncs.items(), key=lambda kv: -kv[1]):
                    print(f"--- {count} x\n{where}", flush=True)
            report_phases(args, steps[args.wait:])
            os._exit(0)

    syncs: dict[str, int] = {}
    host_profile = cProfile.Profile() if args.host_profile else None

    def watch_syncs() -> None:
        """torch's sync debug mode warns at each synchronizing CUDA call; count them by the Python stack that made them."""
        import traceback
        import warnings

        def show(message, category, filename, lineno, file=None, line=None):
            if "synchronizing" not in str(message):
                return
            frames = [f for f in traceback.extract_stack()[:-2] if "warnings.py" not in f.filename][-7:]
            where = "\n".join(f"  {os.path.relpath(f.filename, ROOT) if f.filename.startswith(ROOT) else f.filename}:{f.lineno} "
                              f"{f.name}: {f.line}" for f in frames)
            syncs[where] = syncs.get(where, 0) + 1

        warnings.showwarning = show
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode(1)

    register_optimizer_step_post_hook(step_end)
    route(args)
    sys.argv = [os.path.join(ROOT, "train_fsdp2.py"), *script_args]
    runpy.run_path(sys.argv[0], run_name="__main__")
    raise SystemExit("train_fsdp2.py ended before the measured steps; raise its max_steps")


def route(args) -> None:
    """``--routing`` other than own: the model train_fsdp2.py loads routes as bench/with_routing.py makes it."""
    if args.routing != "own":
        from with_routing import route_loaded_models

        route_loaded_models(args.routing)


def report_host_profile(prof, path: str) -> None:
    """The functions that took the most host time in the profiled step, by own time and with their callees (cProfile
    adds ~1 us per Python call, so Python-heavy paths look slower than they are: read the ranking, not the sums). The
    whole profile goes to ``path`` (``python -m pstats``), next to ``--out``, one per rank."""
    import pstats

    prof.dump_stats(path)
    for order in ("tottime", "cumulative"):
        stream = io.StringIO()
        pstats.Stats(prof, stream=stream).sort_stats(order).print_stats(50)
        text = stream.getvalue()
        print(f"--- host time of one step by {order}\n" + text[text.find("ncalls"):], flush=True)


def report_phases(args, steps: list[list[tuple[str, float, float]]]) -> None:
    """Per phase, the mean over the measured steps: host ms, GPU ms (boundary to boundary), the lag at its end."""
    import torch

    labels = [label for label, _, _ in steps[0]]
    rows = []
    for i in range(len(labels) - 1):
        host = sum(s[i + 1][1] - s[i][1] for s in steps) / len(steps)
        gpu = sum(s[i + 1][2] - s[i][2] for s in steps) / len(steps)
        lag = sum(s[i + 1][2] - s[i + 1][1] for s in steps) / len(steps)
        rows.append({"phase": labels[i], "host_ms": round(host, 2), "gpu_ms": round(gpu, 2), "lag_at_end_ms": round(lag, 2)})
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    record = {"date": date.today().isoformat(), "device": device, "torch": torch.__version__, "kind": "phases",
              "shape": args.shape, "layers": args.layers, "data": args.data, "routing": args.routing, "measured_steps": len(steps),
              "step_ms": [round(s[-1][2], 2) for s in steps], "phases": rows}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "a") as f:
        f.write(json.dumps(record) + "\n")
    lines = [f"{args.shape} L{args.layers}, {args.data}: step {sum(record['step_ms']) / len(steps):.1f} ms (GPU clock, mean of "
             f"{len(steps)})", "", "| phase (from its mark to the next) | host ms | GPU ms | GPU behind the host at its end, ms |",
             "|---|---|---|---|"]
    lines += [f"| {r['phase']} | {r['host_ms']:.1f} | {r['gpu_ms']:.1f} | {r['lag_at_end_ms']:.1f} |" for r in rows]
    print("\n".join(lines), flush=True)


def report(args, prof, times: list[float]) -> None:
    import torch

    first = args.wait + 1  # the profiler skipped `wait` steps and warmed up on one; it recorded the next `active`
    wall = [b - a for a, b in zip(times[first - 1:], times[first:])][:args.active]
    parts: dict[str, float] = {}
    ops: dict[str, float] = {}  # operator (under the nearest autograd node or module call that launched it)
    busy = 0.0
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CPU or not e.self_device_time_total:
            continue
        ancestors, p = [], e.cpu_parent
        while p is not None:
            ancestors.append(p.name)
            p = p.cpu_parent
        us = e.self_device_time_total
        part = part_of(e.name, ancestors)
        parts[part] = parts.get(part, 0.0) + us
        where = next((a for a in ancestors if "Backward" in a or "AccumulateGrad" in a or a.startswith(("Optimizer.", "nn.Module"))), "")
        key = f"{e.name} <- {where}" if where else e.name
        ops[key] = ops.get(key, 0.0) + us
        busy += us
    steps = args.active
    # Every kernel by name, from the GPU's own records: under CUDA graphs the replayed kernels have no launching
    # operator (the parts above miss them), but their names and times are recorded. ``union``: the time at least
    # one kernel ran (kernels on other streams overlap the compute stream's).
    kernels: dict[str, list] = {}
    spans = []
    for e in prof.events():
        # the GPU timeline's annotations (ProfilerStep#, Optimizer.step#...) span many kernels: not kernels themselves
        annotation = getattr(e, "is_user_annotation", False) or e.name.startswith(("ProfilerStep", "Optimizer."))
        if e.device_type != torch.autograd.DeviceType.CUDA or annotation:
            continue
        entry = kernels.setdefault(e.name[:110], [0.0, 0])
        entry[0] += e.time_range.elapsed_us()
        entry[1] += 1
        spans.append((e.time_range.start, e.time_range.end))
    union, end = 0.0, float("-inf")
    for start, stop in sorted(spans):
        if stop > end:
            union += stop - max(start, end)
            end = stop
    record_kernels = {k: [round(v[0] / 1e6 / steps, 6), v[1] / steps] for k, v in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:args.top]}
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"  # --shrink: a CPU smoke test
    record = {"date": date.today().isoformat(), "device": device, "torch": torch.__version__,
              "ep": args.ep, "rank": int(os.environ.get("RANK", "0")), "shape": args.shape, "layers": args.layers,
              "data": args.data, "routing": args.routing, "profiled_steps": steps,
              "wall_s_per_step": [round(w, 4) for w in wall], "gpu_busy_s_per_step": busy / 1e6 / steps,
              "parts_s_per_step": {k: v / 1e6 / steps for k, v in sorted(parts.items(), key=lambda kv: -kv[1])},
              "top_ops_s_per_step": {k: v / 1e6 / steps for k, v in sorted(ops.items(), key=lambda kv: -kv[1])[:args.top]},
              "kernels_union_s_per_step": union / 1e6 / steps, "kernels_s_per_step_and_count": record_kernels}
    if args.trace:  # at ep > 1 one file per rank: <trace>.rank<r>.json
        rank = int(os.environ.get("RANK", "0"))
        prof.export_chrome_trace(args.trace if args.ep == 1 else f"{args.trace.removesuffix('.json')}.rank{rank}.json")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "a") as f:  # one line per rank: at ep > 1 each rank's own profile (its collectives wait for the others)
        f.write(json.dumps(record) + "\n")
    print(f"rank {record['rank']} of {args.ep}: " + render(record), flush=True)


def render(record: dict) -> str:
    wall = sum(record["wall_s_per_step"]) / max(1, len(record["wall_s_per_step"]))
    busy = record["gpu_busy_s_per_step"] or 1e-12  # none on CPU (--shrink)
    lines = [f"{record['shape']} L{record['layers']}, {record['data']} data, {record['device']}: step {wall * 1e3:.0f} ms wall, "
             f"GPU busy {busy * 1e3:.0f} ms ({busy / wall:.0%} of the step) — per step:", "",
             "| part | ms/step | share of GPU time |", "|---|---|---|"]
    small = 0.0
    for part, s in record["parts_s_per_step"].items():
        if s / busy < 0.005:
            small += s
            continue
        lines.append(f"| {part} | {s * 1e3:.1f} | {s / busy:.1%} |")
    lines.append(f"| (parts under 0.5% each) | {small * 1e3:.1f} | {small / busy:.1%} |")
    union = record.get("kernels_union_s_per_step", 0.0)
    lines += ["", f"Kernels by name (the GPU's records, graphs' kernels included): some kernel running {union * 1e3:.0f} ms "
              f"of the step ({union / wall:.0%}):", "", "| kernel | ms/step | launches/step |", "|---|---|---|"]
    lines += [f"| {name[:90]} | {s * 1e3:.2f} | {n:g} |" for name, (s, n) in list(record.get("kernels_s_per_step_and_count", {}).items())[:25]]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False)  # any argument it does not know goes to train_fsdp2.py whole
    p.add_argument("--shape", default="qwen3_30b_a3b")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--data", choices=("synthetic", "chat"), default="synthetic")
    p.add_argument("--routing", default="own", help="own, balanced or skew:R (bench/routing_skew.py), as bench/real_data.py")
    p.add_argument("--wait", type=int, default=6, help="optimizer steps before the profiled ones (warm-up, compiles)")
    p.add_argument("--active", type=int, default=3, help="optimizer steps profiled")
    p.add_argument("--dir", default="", help="the checkpoint (written if missing); default /tmp/<shape>-L<layers>")
    p.add_argument("--work", default="/tmp/profile_steps")
    p.add_argument("--out", default="bench/results/profile_steps.jsonl")
    p.add_argument("--top", type=int, default=40, help="operators kept in the record's top_ops_s_per_step")
    p.add_argument("--trace", default="", help="also write the profiled steps' chrome trace to this file")
    p.add_argument("--shrink", action="store_true", help="a tiny version of the shape (a CPU smoke test of this script)")
    p.add_argument("--phases", action="store_true", help="no profiler: CUDA events at each phase of the step (host vs GPU time)")
    p.add_argument("--layer_marks", action="store_true", help="--phases: a mark where each decoder layer's forward starts")
    p.add_argument("--sync_debug", action="store_true", help="--phases: list the host syncs of the last measured step, by stack")
    p.add_argument("--host_profile", action="store_true", help="--phases: cProfile the last measured step's host time")
    p.add_argument("--cuda_graphs", default="false",
                   help="train_fsdp2.py's cuda_graphs (default false: replayed graphs hide which operator launched a kernel, so "
                        "the parts table and --phases need the micro-steps launched from Python; auto: the default run's GPU timeline; "
                        "at ep = world size false also turns off the default's segment graphs and gives FSDP's whole-model unit: "
                        "segments profiles today's default there)")
    p.add_argument("--ep", type=int, default=1, help="GPUs, ep_size = N (each rank profiles itself; one record per rank)")
    p.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--compare", nargs="+", default=[], metavar="RECORDS",
                   help="no run: the kernels of earlier runs' records (files of --out, e.g. --ep 1 then --ep 4) side by side, "
                        "by part (KERNEL_GROUPS)")
    args, script_args = p.parse_known_args()
    if args.compare:
        return print(compare(args.compare))
    if args.inner:  # this parser took --cuda_graphs: hand it on to train_fsdp2.py
        return (phases if args.phases else inner)(args, [*script_args, "--cuda_graphs", args.cuda_graphs])
    from routing_skew import parse_routing

    try:
        parse_routing(args.routing)
    except ValueError as e:
        p.error(str(e))
    from real_data import data_file, write_checkpoint

    args.dir = args.dir or f"/tmp/{args.shape}-L{args.layers}{'-shrunk' if args.shrink else ''}"
    os.makedirs(args.work, exist_ok=True)
    write_checkpoint(args.dir, args.shape, args.layers, args.shrink)
    data = data_file("ours_synthetic" if args.data == "synthetic" else "ours_chat", args.work, args.dir, run_steps(args) * args.ep)
    subprocess.run(launch_command(args, data, script_args), cwd=ROOT, check=True)


def launch_command(args, data: str, script_args: list[str]) -> list[str]:
    """torchrun over this file's inner side: train_fsdp2.py at its defaults with the bench batch, then ``script_args``
    (any argument this script does not know, e.g. full Mixtral's ``--activation_checkpointing full``), which win."""
    from real_data import GRAD_ACCUM, MICRO_BATCH, SEQ

    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.ep}", os.path.abspath(__file__), "--inner",
            "--ep", str(args.ep), "--shape", args.shape, "--layers", str(args.layers), "--data", args.data, "--routing", args.routing,
            "--wait", str(args.wait), "--active", str(args.active), "--top", str(args.top), "--out", args.out,
            *(["--trace", args.trace] if args.trace else []), *(["--phases"] if args.phases else []),
            *(["--layer_marks"] if args.layer_marks else []), *(["--sync_debug"] if args.sync_debug else []),
            *(["--host_profile"] if args.host_profile else []),
            # train_fsdp2.py's settings: its defaults, the bench batch of bench/real_data.py
            "--model_name_or_path", args.dir, "--data_path", data, "--output_dir", os.path.join(args.work, "run"),
            "--overwrite_output_dir", "true", "--max_length", str(SEQ), "--per_device_train_batch_size", str(MICRO_BATCH),
            "--gradient_accumulation_steps", str(GRAD_ACCUM), "--optim", "adamw_bf16", "--learning_rate", "1e-5",
            "--max_steps", str(run_steps(args)), "--cuda_graphs", args.cuda_graphs,
            *(["--ep_size", str(args.ep)] if args.ep > 1 else []), *script_args]


def run_steps(args) -> int:
    """Optimizer steps the run is given: one more than profiled, as the run stops itself after the profile."""
    return args.wait + 1 + args.active + 2

if __name__ == "__main__":
    main()
