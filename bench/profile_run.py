"""Run a training or bench script under torch.profiler and print where the GPU time went, by kernel.

    torchrun --nproc_per_node=1 bench/profile_run.py --out prof.txt train_fsdp2.py --max_steps 4 ...

``--shapes`` (before ``--out``) records input shapes and lists each operator once per shape (which GEMM is which).
The whole run is recorded (loading, compiling, warm-up and export too: keep it to a few steps), so the
table is not per step; rank 0 writes the operators sorted by their own device time. Compare two scripts
by their top kernels and their call counts.
"""

import os
import runpy
import sys

import torch
from torch.profiler import ProfilerActivity, profile


def main() -> None:
    args = sys.argv[1:]
    shapes = args[:1] == ["--shapes"]
    args = args[shapes:]
    if len(args) < 3 or args[0] != "--out":
        raise SystemExit("usage: profile_run.py [--shapes] --out FILE SCRIPT [ARGS...]")
    out, script, rest = args[1], args[2], args[3:]
    sys.argv = [script, *rest]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities, record_shapes=shapes) as prof:
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as e:
            if e.code not in (0, None):
                raise
    if os.environ.get("RANK", "0") == "0":
        sort = "self_cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
        table = prof.key_averages(group_by_input_shape=shapes).table(sort_by=sort, row_limit=60 if shapes else 40,
                                                                     max_name_column_width=70, max_shapes_column_width=90)
        with open(out, "w") as f:
            f.write(table)
        print(table[-6000:], flush=True)


if __name__ == "__main__":
    main()
