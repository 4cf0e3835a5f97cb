"""bench/profile_steps.py --compare: earlier runs' kernels side by side, by part of the ep step, on 2026-11-28's
records (4 x H200: one GPU, ep 4 under the checkpoint's own and balanced routing). The expected figures were summed by
hand from the same records' kernel lists (bench/reports/ep4_profile_full_size_h200x4_2026-11-28e.md, section 3)."""

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "bench"))
import profile_steps  # noqa: E402

RECORDS = os.path.join(ROOT, "bench", "results", "ep4_profile_full_size_h200x4_2026-11-28e", "b_profile_ep4_h200x4")
FILES = [os.path.join(RECORDS, f"prof_{name}.jsonl") for name in ("ep1", "ep4_own", "ep4_balanced")]


def ms(path: str) -> dict[str, float]:
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    return {part: round(s * 1e3, 1) for part, s in profile_steps.kernel_groups(records).items()}


@pytest.mark.parametrize("path,expect", [
    (FILES[0], {"barriers": 0.0, "moving rows": 11.0, "NCCL": 0.0, "SwiGLU": 4.7, "grouped GEMMs": 56.3, "weight gradients": 51.6,
                "optimizer": 31.7, "all kernels": 316.5}),
    (FILES[1], {"barriers": 51.2, "moving rows": 69.5, "NCCL": 14.8, "SwiGLU": 13.7, "grouped GEMMs": 47.8, "weight gradients": 28.7,
                "optimizer": 10.0, "all kernels": 392.3}),
    (FILES[2], {"barriers": 11.5, "moving rows": 68.3, "NCCL": 14.9, "grouped GEMMs": 45.3, "all kernels": 349.5}),
])
def test_kernels_fall_into_the_parts_summed_by_hand(path, expect):
    got = ms(path)
    for key, value in expect.items():
        (part,) = [p for p in got if key in p]
        assert got[part] == pytest.approx(value, abs=0.051), (key, got)
    parts = [p for p in got if p not in ("all kernels", "wall")]
    assert sum(got[p] for p in parts) == pytest.approx(got["all kernels"], abs=0.5)


def test_compare_prints_one_column_a_file_with_the_walls():
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "profile_steps.py"), "--compare", *FILES], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == ("| part (GPU ms a step, mean of the ranks) | 1 GPU, synthetic | ep 4, own routing, synthetic | "
                        "ep 4, balanced routing, synthetic |")
    assert "| wall | 347.7 | 431.2 | 386.9 |" in lines  # the profiled steps' walls: 348, 431, 387 ms (the reports)


def test_arguments_it_does_not_know_reach_train_fsdp2_after_the_bench_settings_so_they_win():
    from types import SimpleNamespace

    args = SimpleNamespace(ep=4, shape="mixtral", layers=32, data="synthetic", routing="own", wait=2, active=2, top=40, out="o.jsonl",
                           trace="", phases=False, layer_marks=False, sync_debug=False, host_profile=False, dir="/ckpt", work="/w",
                           cuda_graphs="false")
    command = profile_steps.launch_command(args, "d.jsonl", ["--optim", "adamw_torch", "--activation_checkpointing", "full"])
    optim_values = [command[i + 1] for i, a in enumerate(command) if a == "--optim"]
    assert optim_values == ["adamw_bf16", "adamw_torch"]  # the bench's default, then the caller's: the last one is taken
    assert command[-2:] == ["--activation_checkpointing", "full"]
    assert command[command.index("--max_steps") + 1] == "7" and command[command.index("--ep_size") + 1] == "4"
