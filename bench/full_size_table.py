"""The table of bench/full_size.sh's records (one JSON line per variant): step time, throughput, MFU, memory."""

import json
import sys


def table(path: str) -> str:
    rows = [json.loads(line) for line in open(path) if line.strip()]
    lines = [f"{'variant':<10} {'L':>3} {'AC':>9} {'s/step':>7} {'tok/s/GPU':>9} {'TFLOPS':>6} {'MFU':>6} {'alloc':>6} {'reserved':>8} {'loss':>6}  memory of / status"]
    for r in rows:
        name = r.get("variant") or r["config"]
        ac = r.get("activation_checkpointing")
        ac = {True: "full", False: "none", None: "?"}.get(ac, ac)
        head = f"{name:<10} {r.get('layers', '?'):>3} {ac:>9}"
        if r.get("status") != "ok":
            lines.append(f"{head} {r.get('status', '?')}: {str(r.get('error', ''))[:150]}")
            continue
        alloc, reserved = r.get("peak_allocated_gib"), r.get("peak_reserved_gib")
        memory = f"{alloc:6.1f} {reserved:8.1f}" if alloc is not None else f"{'':6} {'':8}"
        lines.append(f"{head} {r['step_time_s']:7.3f} {r['tokens_per_s_per_gpu']:9.0f} {r['tflops_per_gpu']:6.0f} {r['mfu']:6.1%} "
                     f"{memory} {r.get('final_loss', float('nan')):6.3f}  {r.get('peak_memory_of', '')}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(sys.argv[1]))
