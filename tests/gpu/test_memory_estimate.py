"""The fit check's estimate (megablocks_utils/train/memory_plan.py, printed by train_fsdp2.py before loading) against the
peak a real run reaches on one GPU (docs/memory.md).

Mixtral-8x7B's width cut to 4 layers (random bf16 weights, written once to /tmp/mixtral-L4, the benchmarks' checkpoint),
train_fsdp2.py --optim adamw_bf16 --activation_checkpointing full, 1 row x 4096 tokens x 4 micro-steps, 3 steps,
stopped before its final export (bench/bench_fsdp1.py run --skip_export): rank 0's peak memory from metrics.jsonl.
About 55 GiB: fits an 80 GB H100. `python bench/run.py memory` measures the other optimizer and checkpointing settings.
"""

import json
import os
import subprocess
import sys

from megablocks_utils.train.memory_plan import OVERHEAD_BYTES

from .launch import GPU_ENV, ROOT, gpus

pytestmark = gpus(1)
CHECKPOINT = "/tmp/mixtral-L4"


def test_estimate_is_within_ten_percent_of_the_measured_peak(tmp_path):
    """The estimate is a plan, not a fitted number: it must not fall below what PyTorch allocated (a "fits" verdict
    would then be wrong), and its part that torch's caching allocator holds (all but ``OVERHEAD_BYTES``, the fixed 3 GiB
    it plans for the CUDA context, NCCL and libraries' workspaces, which ``max_memory_reserved`` does not see) stays within
    10% of the reserved peak. One H200: 2026-11-24, 54.1 GiB against 49.0 allocated, 50.3 reserved; 2026-11-27, 53.1
    against 46.8 allocated, 47.5 reserved (50.1 of it for the allocator: +5.4%; the whole estimate, context included, is
    +12% of the reserved peak, which the old form of this test held to 10%)."""
    work, out = str(tmp_path / "work"), str(tmp_path / "runs.jsonl")
    command = [sys.executable, os.path.join(ROOT, "bench", "bench_fsdp1.py"), "run", "--script", "train_fsdp2.py",
               "--dir", CHECKPOINT, "--layers", "4", "--gpus", "1", "--seq", "4096", "--grad_accum", "4", "--warmup", "1",
               "--steps", "2", "--train_args", "--optim adamw_bf16 --activation_checkpointing full", "--name", "bf16_full",
               "--skip_export", "--timeout", "300", "--work", work, "--out", out]
    result = subprocess.run(command, cwd=ROOT, env=dict(os.environ, **GPU_ENV), capture_output=True, text=True, timeout=540)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (record,) = [json.loads(line) for line in open(out)]
    with open(os.path.join(work, "launch.log")) as f:
        estimate = next(float(line.split()[1]) for line in f if line.startswith("  peak "))
    assert record["status"] == "ok", record
    allocated, reserved = record["peak_allocated_gib"], record["peak_reserved_gib"]
    in_allocator = estimate - OVERHEAD_BYTES / 2**30
    assert allocated <= estimate, (estimate, allocated, reserved)
    assert 0.9 * reserved <= in_allocator <= 1.1 * reserved, (estimate, in_allocator, allocated, reserved)
