"""The full-size runs' CPU parts (bench/run.py full_size): the layer view, the record read from a run's metrics.jsonl
and its output (what the script chose) when the launch is stopped after its last step (bench_fsdp1.py --skip_export),
and the results table."""

import json
import os
import sys
import time

import torch
from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "bench"))
import bench_fsdp1  # noqa: E402
from bench_moe import PEAK_TFLOPS, megatron_flops_per_token  # noqa: E402
from run import full_size_table  # noqa: E402

HIDDEN, INTERMEDIATE = 64, 128

# Stands in for the torchrun launch: rank 0's metrics.jsonl, one line per step, then a long "export".
FAKE_RUN = """
import json, os, sys, time
out = sys.argv[1]
os.makedirs(out, exist_ok=True)
print("world 2 = dp 1 x ep 2 (FSDP units: each layer); optim adamw_bf16; attention auto: sdpa_causal", flush=True)
print("ep_capacity_factor auto: 0, the exact exchange (fsdp_wrap layer)", flush=True)
print("cuda_graphs: captured the first micro-step in 1.2 s", flush=True)  # progress, not a choice
with open(os.path.join(out, "metrics.jsonl"), "a") as f:
    for step, t in enumerate([9.0, 5.0, 2.0, 3.0, 2.5], 1):
        f.write(json.dumps({"step": step, "loss": 10.0 - step, "tokens": 2 * 4 * 128, "step_time_s": t, "tflops_per_device": 1.0,
                            "tokens_per_expert_max": [6.0, 8.0], "tokens_per_expert_mean": [4.0, 4.0],
                            "peak_memory_allocated_gb": 11.0 + step, "peak_memory_reserved_gb": 20.0}) + "\\n")
        f.flush()
time.sleep(120)
"""


def test_layer_view_is_the_first_layers_of_the_source(tmp_path):
    from transformers import AutoModelForCausalLM

    source, view = str(tmp_path / "L3"), str(tmp_path / "L3-first2")
    bench_fsdp1.write_checkpoint(source, 3, HIDDEN, INTERMEDIATE)
    bench_fsdp1.write_layer_view(view, source, 2)
    assert bench_fsdp1.checkpoint_complete(view, 2, HIDDEN, INTERMEDIATE)
    full = AutoModelForCausalLM.from_pretrained(source)
    part = AutoModelForCausalLM.from_pretrained(view)
    assert part.config.num_hidden_layers == 2
    kept = full.state_dict()
    for name, tensor in part.state_dict().items():
        assert torch.equal(tensor, kept[name]), name


def test_skip_export_stops_after_the_last_step_and_reads_its_metrics(tmp_path, monkeypatch):
    checkpoint, work, out = str(tmp_path / "L2"), str(tmp_path / "work"), str(tmp_path / "results.jsonl")
    bench_fsdp1.write_checkpoint(checkpoint, 2, HIDDEN, INTERMEDIATE)
    monkeypatch.setattr(bench_fsdp1, "launch_command", lambda args, cuda, data, out_dir: [sys.executable, "-c", FAKE_RUN, out_dir])
    monkeypatch.setattr(sys, "argv", [
        "bench_fsdp1.py", "run", "--script", "train_fsdp2.py", "--dir", checkpoint, "--layers", "2", "--hidden", str(HIDDEN),
        "--intermediate", str(INTERMEDIATE), "--gpus", "2", "--seq", "128", "--micro_batch", "1", "--grad_accum", "4",
        "--warmup", "2", "--steps", "3", "--train_args", "--optim adamw_bf16 --activation_checkpointing selective",
        "--name", "ours_sel", "--skip_export", "--timeout", "100", "--work", work, "--out", out,
    ])
    start = time.perf_counter()
    bench_fsdp1.main()
    assert time.perf_counter() - start < 60  # not the fake export's 120 s
    (record,) = [json.loads(line) for line in open(out)]
    assert record["config"] == "ours_sel" and record["status"] == "ok"
    assert record["launch_exit"] == "stopped after the last step (--skip_export)"
    assert record["activation_checkpointing"] == "selective"
    assert record["step_time_s"] == 2.5 and record["steps_measured"] == 3  # median of the steps after the warmup
    assert record["tokens_per_s_per_gpu"] == 2 * 4 * 128 / 2 / 2.5
    config = type("C", (), dict(hidden_size=HIDDEN, num_hidden_layers=2, num_key_value_heads=1, num_attention_heads=1,
                                intermediate_size=INTERMEDIATE, num_experts_per_tok=2, vocab_size=32000))
    tflops = megatron_flops_per_token(config, 128) * record["tokens_per_s_per_gpu"] / 1e12
    assert abs(record["mfu"] - tflops / PEAK_TFLOPS) < 1e-12
    assert record["peak_allocated_gib"] == 16.0 and "rank 0" in record["peak_memory_of"]
    assert record["expert_load_max_over_mean"] == 1.75
    # what the script said it chose, from its output (FSDP's units, auto's factor), as real_data.py's records keep it
    assert record["launch"].startswith("world 2 = dp 1 x ep 2 (FSDP units: each layer)")
    assert record["chose"] == ["ep_capacity_factor auto: 0, the exact exchange (fsdp_wrap layer)"]


def test_table_shows_ok_failed_and_skipped_runs():
    rows = [
        {"config": "hf_native_fsdp2_ep", "variant": "full_size", "name": "hf", "layers": 32, "activation_checkpointing": True,
         "status": "ok", "step_time_s": 5.97, "tokens_per_s_per_gpu": 2746.0, "tflops_per_gpu": 227.5, "mfu": 0.23,
         "final_loss": 10.4, "peak_allocated_gib": 94.0, "peak_reserved_gib": 110.0, "peak_memory_of": "largest over ranks"},
        {"config": "ours_sel", "variant": "full_size", "name": "ours_sel", "layers": 32, "activation_checkpointing": "selective",
         "status": "OOM", "error": "CUDA out of memory"},
        {"variant": "full_size", "name": "emul16", "status": "skipped", "error": "80 s left of the 560 s budget"},
    ]
    lines = full_size_table(rows).splitlines()
    assert len(lines) == 4
    assert lines[1].split()[:8] == ["hf", "32", "full", "5.970", "2746", "228", "23.0%", "94.0"]
    assert lines[2].startswith("ours_sel") and "OOM: CUDA out of memory" in lines[2]
    assert lines[3].startswith("emul16") and "skipped" in lines[3]
