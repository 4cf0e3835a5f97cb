"""Where the GPU waits inside profiled steps: the idle gaps of its busiest stream, from a chrome trace.

    python bench/trace_gaps.py TRACE.json[.gz] [--top 25] [--min_us 5]

``bench/profile_steps.py --trace FILE`` writes the trace. A kernel sum (the profiler's table) says how long the GPU
computed, not how long it waited between kernels; this reads the timeline of the stream with the most kernel time:
its busy time, and each gap between one kernel's end and the next one's start. A gap is the host's when the next
kernel was launched after the gap began (the host was late), else the GPU's own (the kernel waited on something
else, or kernels too short to fill the queue). Host gaps are summed by the CPU operators that launched the next
kernel (the innermost two enclosing operators of its launch call), so the table names what to make cheaper. Last, the
stream's kernel time by kernel name: the breakdown that is left for micro-steps replayed from CUDA graphs (their
kernels have no launching operator). At ep > 1, the collectives (NCCL kernels run on streams of their own): each
collective's kernel time and how much of it no other kernel overlaps on any stream (exposed: the step waits on it).
"""

import argparse
import bisect
import gzip
import json
from collections import defaultdict

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def _merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def collectives(gpu: list[dict]) -> list[tuple[str, int, float, float]]:
    """(collective, kernels, kernel ms, exposed ms) per NCCL kernel kind (``ncclDevKernel_SendRecv``: the all-to-alls),
    exposed: the part of its kernels' time when no other kernel, copy or fill runs on any stream."""
    others = _merged([(e["ts"], e["ts"] + e["dur"]) for e in gpu if not e["name"].startswith("nccl")])
    starts = [a for a, _ in others]
    rows: dict = defaultdict(lambda: [0, 0.0, 0.0])
    for e in gpu:
        if not e["name"].startswith("nccl"):
            continue
        a, b = e["ts"], e["ts"] + e["dur"]
        hidden, i = 0.0, max(0, bisect.bisect_right(starts, a) - 1)
        while i < len(others) and others[i][0] < b:
            hidden += max(0.0, min(b, others[i][1]) - max(a, others[i][0]))
            i += 1
        name = e["name"].split("(", 1)[0].removeprefix("ncclDevKernel_").removeprefix("ncclKernel_")
        row = rows[name]
        row[0] += 1
        row[1] += e["dur"]
        row[2] += e["dur"] - hidden
    return [(n, c, round(t / 1e3, 2), round(x / 1e3, 2)) for n, (c, t, x) in sorted(rows.items(), key=lambda kv: -kv[1][1])]


def beside(gpu: list[dict], prefix: str, top: int = 12) -> dict:
    """The kernels named ``prefix...``: their durations in trace order, and what ran on other streams while they ran
    (by kernel name, the overlapping time): a kernel slower in the step than alone may share the GPU's SMs or memory."""
    mine = sorted((e for e in gpu if e["name"].startswith(prefix)), key=lambda e: e["ts"])
    others: dict = defaultdict(float)
    for m in mine:
        a, b = m["ts"], m["ts"] + m["dur"]
        for e in gpu:
            if e is m or (e["pid"], e["tid"]) == (m["pid"], m["tid"]):
                continue
            overlap = min(b, e["ts"] + e["dur"]) - max(a, e["ts"])
            if overlap > 0:
                others[e["name"].split("(", 1)[0][:80]] += overlap
    durations = [m["dur"] for m in mine]
    ordered = sorted(durations)
    return {"kernel": prefix, "count": len(mine), "ms": round(sum(durations) / 1e3, 2),
            "us_min_median_max": [round(ordered[0]), round(ordered[len(ordered) // 2]), round(ordered[-1])] if mine else [],
            "us_in_order": [round(d) for d in durations],
            "beside_ms": [(n, round(t / 1e3, 2)) for n, t in sorted(others.items(), key=lambda kv: -kv[1])[:top]]}


def analyse(events: list[dict], min_us: float = 5.0, top: int = 25, beside_kernel: str = "") -> dict:
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATEGORIES]
    per_stream: dict = defaultdict(list)
    for e in gpu:
        per_stream[(e["pid"], e["tid"])].append(e)
    stream = max(per_stream, key=lambda s: sum(e["dur"] for e in per_stream[s]))
    kernels = sorted(per_stream[stream], key=lambda e: e["ts"])
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    ops_by_tid: dict = defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation"):
            ops_by_tid[e["tid"]].append(e)
    starts_by_tid = {}
    for tid, ops in ops_by_tid.items():
        ops.sort(key=lambda e: e["ts"])
        starts_by_tid[tid] = [e["ts"] for e in ops]

    def launcher(kernel: dict) -> str:
        launch = launches.get(kernel.get("args", {}).get("correlation"))
        if launch is None:
            return "(launch not recorded)"
        ops, starts = ops_by_tid.get(launch["tid"], []), starts_by_tid.get(launch["tid"], [])
        enclosing = []
        i = bisect.bisect_right(starts, launch["ts"]) - 1
        while i >= 0 and len(enclosing) < 2 and launch["ts"] - ops[i]["ts"] < 5e6:
            op = ops[i]
            if op["ts"] <= launch["ts"] <= op["ts"] + op["dur"]:
                enclosing.append(op["name"][:60])
            i -= 1
        return " < ".join(enclosing) or "(no enclosing operator)"

    span = kernels[-1]["ts"] + kernels[-1]["dur"] - kernels[0]["ts"]
    busy, end = 0.0, kernels[0]["ts"]
    host_gaps: dict = defaultdict(lambda: [0, 0.0])
    device_gaps: dict = defaultdict(lambda: [0, 0.0])
    sizes = {"< 5 us": [0, 0.0], "5-50 us": [0, 0.0], "50-500 us": [0, 0.0], ">= 500 us": [0, 0.0]}
    for k in kernels:
        gap = k["ts"] - end
        if gap > 0:
            key = "< 5 us" if gap < 5 else "5-50 us" if gap < 50 else "50-500 us" if gap < 500 else ">= 500 us"
            sizes[key][0] += 1
            sizes[key][1] += gap
            if gap >= min_us:
                launch = launches.get(k.get("args", {}).get("correlation"))
                late = launch is not None and launch["ts"] > end
                table = host_gaps if late else device_gaps
                name = launcher(k) if late else k["name"][:80]
                table[name][0] += 1
                table[name][1] += gap
        busy += k["dur"] - max(0.0, end - k["ts"]) if k["ts"] + k["dur"] > end else 0.0
        end = max(end, k["ts"] + k["dur"])
    # Kernel time by kernel (template arguments cut): what a step replayed from CUDA graphs shows, whose kernels name no
    # launching operator (the graph launched them all).
    by_kernel: dict = defaultdict(lambda: [0, 0.0])
    for k in kernels:
        by_kernel[k["name"].split("<", 1)[0][:90]][0] += 1
        by_kernel[k["name"].split("<", 1)[0][:90]][1] += k["dur"]
    rank = lambda t: sorted(t.items(), key=lambda kv: -kv[1][1])[:top]  # noqa: E731
    return {"stream": list(stream), "kernels": len(kernels), "span_ms": span / 1e3, "busy_ms": busy / 1e3,
            "idle_ms": (span - busy) / 1e3, "gap_sizes": {k: {"count": c, "ms": round(t / 1e3, 2)} for k, (c, t) in sizes.items()},
            "host_late_ms": sum(t for _, t in host_gaps.values()) / 1e3,
            "device_wait_ms": sum(t for _, t in device_gaps.values()) / 1e3,
            "host_late_by_launcher": [(n, c, round(t / 1e3, 2)) for n, (c, t) in rank(host_gaps)],
            "device_wait_before_kernel": [(n, c, round(t / 1e3, 2)) for n, (c, t) in rank(device_gaps)],
            "kernel_time": [(n, c, round(t / 1e3, 3)) for n, (c, t) in rank(by_kernel)],
            "collectives": collectives(gpu), **({"beside": beside(gpu, beside_kernel)} if beside_kernel else {})}


def render(result: dict) -> str:
    lines = [f"stream {result['stream']}: {result['kernels']} kernels over {result['span_ms']:.1f} ms, busy {result['busy_ms']:.1f} ms, "
             f"idle {result['idle_ms']:.1f} ms (host late {result['host_late_ms']:.1f} ms, the GPU waiting with the next kernel "
             f"launched {result['device_wait_ms']:.1f} ms; gaps under --min_us in neither)", "", "| gap size | count | ms |", "|---|---|---|"]
    lines += [f"| {k} | {v['count']} | {v['ms']:.2f} |" for k, v in result["gap_sizes"].items()]
    lines += ["", "| host late: launched by | gaps | ms |", "|---|---|---|"]
    lines += [f"| {n} | {c} | {t:.2f} |" for n, c, t in result["host_late_by_launcher"]]
    lines += ["", "| GPU waiting, launched: before kernel | gaps | ms |", "|---|---|---|"]
    lines += [f"| {n} | {c} | {t:.2f} |" for n, c, t in result["device_wait_before_kernel"]]
    lines += ["", "| kernel (busiest stream, whole trace) | launches | ms |", "|---|---|---|"]
    lines += [f"| {n} | {c} | {t:.2f} |" for n, c, t in result.get("kernel_time", [])]
    if result.get("collectives"):
        lines += ["", "| collective (every stream, whole trace) | kernels | ms | exposed ms (no other kernel beside) |", "|---|---|---|---|"]
        lines += [f"| {n} | {c} | {t:.2f} | {x:.2f} |" for n, c, t, x in result["collectives"]]
    if result.get("beside"):
        found = result["beside"]
        lines += ["", f"{found['kernel']}: {found['count']} kernels, {found['ms']:.2f} ms, us min/median/max "
                  f"{found['us_min_median_max']}; in trace order: {found['us_in_order']}", "",
                  "| beside it on another stream | overlapping ms |", "|---|---|"]
        lines += [f"| {n} | {t:.2f} |" for n, t in found["beside_ms"]]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("trace")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--min_us", type=float, default=5.0, help="gaps shorter than this are counted, not attributed")
    p.add_argument("--out", default="", help="also append the result as one JSON line here")
    p.add_argument("--beside", default="", help="kernels named so (a prefix): their durations and what ran beside them")
    args = p.parse_args()
    result = analyse(load(args.trace), args.min_us, args.top, args.beside)
    print(render(result))
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(dict(result, trace=args.trace)) + "\n")


if __name__ == "__main__":
    main()
