"""bench/real_data.py on CPU, shrunk: DeepSeek-V2-Lite's shape (a dense first layer, shared experts, MLA) trains in
train_fsdp2.py (under bench/with_routing.py) and in transformers' own model on the same synthetic rows, both routed by
the same balanced hooks, every expert exactly the same share (a smoke test of the harness; the speed is measured on a
GPU). gpt-oss-20b's shape runs the same code path (its model is tested in tests/test_gpt_oss.py and
test_scripts_models.py); it was left out of the suite for time (24 s on 2 cores)."""

import argparse
import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "bench"))


@pytest.mark.parametrize("shape", ["deepseek_v2_lite"])
def test_both_sides_train_the_shrunk_shape_with_the_same_balanced_routing(shape, tmp_path):
    out = tmp_path / "records.jsonl"
    command = [sys.executable, os.path.join("bench", "real_data.py"), "--shape", shape, "--layers", "2", "--shrink", "--seq", "256",
               "--routing", "balanced", "--runs", "ours_synthetic,hf_synthetic", "--warmup", "1", "--steps", "1",
               "--dir", str(tmp_path / "model"), "--work", str(tmp_path / "work"), "--out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    ours, hf = (json.loads(line) for line in open(out))
    assert (ours["run"], hf["run"]) == ("ours_synthetic", "hf_synthetic")
    for record in (ours, hf):
        assert record["status"] == "ok" and record["routing"] == "balanced", record
        assert record["host_cpu"].endswith(f", {os.cpu_count()} cores"), record["host_cpu"]
        assert record["busiest_over_mean_per_layer"] == [1.0] * (1 if shape == "deepseek_v2_lite" else 2)  # V2: layer 0 dense
        assert record["token_fill"] == 1.0 and record["tflops"] > 0
    assert ours["busiest_rank_over_mean"] == {"2": [1.0, 1.0], "4": [1.0, 1.0], "8": [1.0, 1.0]}  # 64 experts, each the same
    assert hf["experts_implementation"] == "grouped_mm"
    assert hf["attention"] == ("sdpa" if shape == "deepseek_v2_lite" else "eager")  # gpt-oss's sinks: eager on CPU
    assert "attention auto" in ours["launch"]
    assert ours["chose"] == ["cuda_graphs auto: off (CUDA graphs need a GPU)"]  # the script's own note of its choice


def test_rank_loads_sum_each_ranks_block_of_experts():
    """Rank r owns experts [r E / ep, (r + 1) E / ep): per layer the busiest block over the blocks' mean, averaged over
    steps, then the layers' mean and largest; an ep that does not divide the experts is left out."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from real_data import rank_loads

    step1 = [[6, 0, 1, 1], [1, 1, 1, 1]]  # layer 0 at ep 2: blocks of 6 and 2 rows, 6 / 4 = 1.5; at ep 4: 6 / 2 = 3
    step2 = [[2, 2, 2, 2], [0, 0, 0, 4]]  # layer 1 at ep 2: 0 and 4, 4 / 2 = 2; at ep 4: 4 / 1 = 4
    found = rank_loads([step1, step2], eps=(2, 4, 3))
    # ep 2: layers (1.5 + 1) / 2 and (1 + 2) / 2, so mean 1.375, largest 1.5; ep 4: (3 + 1) / 2 and (1 + 4) / 2
    assert found["busiest_rank_over_mean"] == {"2": (1.375, 1.5), "4": (2.25, 2.5)}
    # Placed by step 1's loads, judged on step 2: layer 0 at ep 2 {0, 1} {2, 3} -> 4 and 4 (1.0); layer 1 (step 1 even:
    # {0, 2} {1, 3}) -> 0 and 4 (2.0); at ep 4 one expert a rank: 1.0 and 4.0
    assert found["busiest_rank_over_mean_placed"] == {"2": (1.5, 2.0), "4": (2.5, 4.0)}
    assert rank_loads([]) == {}


def test_placement_by_load_evens_the_ranks_where_blocks_do_not():
    """Experts 0 and 1 hot: contiguous blocks at ep 2 give 7 against 1 (1.75); placed by load, 4 and 4."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from real_data import rank_loads

    found = rank_loads([[[4, 3, 1, 0]]] * 2, eps=(2,))
    assert found == {"busiest_rank_over_mean": {"2": (1.75, 1.75)}, "busiest_rank_over_mean_placed": {"2": (1.0, 1.0)}}


def test_ep_runs_ours_alone():
    """--ep N puts ours on N GPUs; transformers' side runs on one, so asking for both at N > 1 stops with the fix."""
    proc = subprocess.run([sys.executable, os.path.join("bench", "real_data.py"), "--ep", "2", "--runs", "ours_synthetic,hf_synthetic"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "give only ours' runs" in proc.stderr, proc.stderr[-1000:]


def test_a_numa_run_asks_torchrun_to_bind_its_ranks(monkeypatch, tmp_path):
    """ours_chat_numa is ours_chat launched with torchrun's ``--numa-binding node`` (a torchrun flag: before the script);
    ours_chat has no binding."""
    from types import SimpleNamespace

    import real_data

    launched = []

    def popen(command, **kwargs):
        launched.append(command)
        raise RuntimeError("stop here")

    monkeypatch.setattr(real_data.subprocess, "Popen", popen)
    args = SimpleNamespace(warmup=1, steps=1, chat_steps=1, static_factor="", ep=2, routing="own", dir=str(tmp_path), seq=64)
    for run in ("ours_chat_numa", "ours_chat"):
        with pytest.raises(RuntimeError, match="stop here"):
            real_data.ours(run, args, str(tmp_path))
    numa, plain = launched
    script = numa.index(os.path.join(ROOT, "train_fsdp2.py"))
    assert numa[numa.index("--numa-binding") + 1] == "node" and numa.index("--numa-binding") < script
    same_script_args = [a.replace("ours_chat_numa", "ours_chat") for a in numa[script:]]  # its own output folder
    assert "--numa-binding" not in plain and numa[:4] == plain[:4]
    assert same_script_args == plain[plain.index(os.path.join(ROOT, "train_fsdp2.py")):]


def test_placed_by_places_every_placed_run_by_the_named_runs_loads(tiny_model_dir, tmp_path):
    """``*_placed`` runs take their own plain run's loads (in-sample), or with --placed_by another run's (out of sample):
    the placed checkpoint's order is the named run's balanced placement, each layer's hot expert on its own rank."""
    from real_data import placed_model

    from megablocks_utils.model.loading import load_config

    layers = load_config(tiny_model_dir).num_hidden_layers
    work = str(tmp_path)
    hot = {"ours_chat": [8, 7, 0, 0, 0, 0, 0, 1], "ours_alpaca": [0, 0, 0, 0, 0, 1, 8, 7]}  # two hot experts, by run
    for run, load in hot.items():
        with open(os.path.join(work, f"{run}.loads.json"), "w") as f:
            json.dump([[float(n) for n in load]] * layers, f)

    def order(placed_by: str) -> list[int]:
        args = argparse.Namespace(dir=tiny_model_dir, ep=2, placed_by=placed_by)
        placed = placed_model("ours_chat_placed", args, work)
        assert placed.endswith(f"-placed-ep2-{placed_by or 'ours_chat'}"), placed
        with open(os.path.join(placed, "expert_order.json")) as f:
            orders = json.load(f)["orders"]
        assert len(orders) == layers and len({tuple(o) for o in orders.values()}) == 1
        return next(iter(orders.values()))

    own, by_alpaca = order(""), order("ours_alpaca")
    assert sorted(own[:4]) != sorted(by_alpaca[:4])  # different loads, different blocks
    assert {0, 1} & set(own[:4]) and {0, 1} & set(own[4:])  # chat's hot experts 0 and 1 on different ranks
    assert {6, 7} & set(by_alpaca[:4]) and {6, 7} & set(by_alpaca[4:])  # alpaca's 6 and 7
