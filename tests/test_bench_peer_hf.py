"""bench/bench_peer_hf.py --data on 2 CPU ranks (gloo): transformers' FSDP2 + EP trains on ours' packed chat rows, each
rank its own rows (train_fsdp2.py's GlobalBatches at ep = world size), with ours' loss and the gradient of its global
mean. A smoke test of the benchmark's loop on the tiny model; the speed is measured on GPUs (bench/run.py ep_scaling)."""

import json
import os
import subprocess
import sys

import torch
from conftest import ROOT, run_script

sys.path.insert(0, os.path.join(ROOT, "bench"))
CHAT = os.path.join(ROOT, "data_chat.jsonl")
SEQ, MICRO_BATCH, GRAD_ACCUM, WORLD = 512, 1, 2, 2  # 512: several chat records share a row


def test_peer_on_chat_rows_counts_each_ranks_real_tokens_and_trains_on_the_global_mean(tiny_model_dir, tmp_path):
    from real_data import SEED
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megablocks_utils.data.batches import GlobalBatches, collate, load_training_data
    from megablocks_utils.train.loss import causal_lm_loss_sum

    out = tmp_path / "records.jsonl"
    result = run_script(os.path.join("bench", "bench_peer_hf.py"), WORLD, "--dir", tiny_model_dir, "--data", CHAT, "--seq", str(SEQ),
                        "--micro_batch", str(MICRO_BATCH), "--grad_accum", str(GRAD_ACCUM), "--warmup", "1", "--steps", "2",
                        "--precision", "bf16", "--optimizer", "foreach", "--out", str(out), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    (record,) = (json.loads(line) for line in open(out))
    assert record["status"] == "ok" and record["data"] == CHAT and record["fsdp_applied"], record
    assert record["host_cpu"].endswith(f", {os.cpu_count()} cores"), record["host_cpu"]
    assert record["ep_size"] == WORLD and record["steps_measured"] == 2

    # The rows each rank was given at each step, as train_fsdp2.py gives them: their real tokens, rank by rank.
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    rows = load_training_data(CHAT, tokenizer, SEQ, packing=True, seed=SEED).train
    schedules = [GlobalBatches(rows, MICRO_BATCH, GRAD_ACCUM, WORLD, rank, SEED, unit="packed rows") for rank in range(WORLD)]
    given = [[[rows[j] for m in s.micro_batches(step)[0] for j in m] for s in schedules] for step in range(3)]
    expected = [[sum(len(row["input_ids"]) for row in mine) for mine in step] for step in given]
    assert record["real_tokens_per_rank"] == expected
    assert expected[0][0] != expected[0][1], "the first step's ranks hold rows of different lengths: swapped rows would show"
    measured = sum(sum(step) for step in expected[1:])
    assert record["token_fill"] == measured / (2 * WORLD * GRAD_ACCUM * MICRO_BATCH * SEQ)
    assert abs(record["tokens_per_s_per_gpu"] - measured / sum(record["step_times_s"]) / WORLD) < 1e-6 * measured

    # Step 1, before any update: the loss and gradient norm of the mean over the step's label tokens on both ranks,
    # from one process (a gradient FSDP averaged without the world-size factor would be half of it).
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)
    label_tokens = schedules[0].micro_batches(0)[1]
    loss = sum(causal_lm_loss_sum(model(**batch["model_inputs"]).logits, batch["labels"])
               for batch in (collate([row], tokenizer.pad_token_id, "cpu", SEQ, "sdpa") for mine in given[0] for row in mine))
    (loss / label_tokens).backward()
    norm = torch.linalg.vector_norm(torch.stack([p.grad.float().norm() for p in model.parameters() if p.grad is not None]))
    loss = loss.detach()
    assert abs(record["losses"][0] - float(loss) / label_tokens) < 0.02, (record["losses"][0], float(loss) / label_tokens)
    assert abs(record["grad_norms"][0] / float(norm) - 1) < 0.05, (record["grad_norms"][0], float(norm))


def test_peer_lora_trains_the_adapters_in_sync_and_refuses_ep(tiny_model_dir, tmp_path):
    """--lora (transformers' FSDP2 at ep 1 + PEFT on the default targets): the adapters, plain tensors outside FSDP, get
    their gradients averaged by hand, so both ranks end with the same adapters (each rank trains on its own rows); at
    ep 2 the run stops before loading, saying why (PEFT's expert delta meets an ep DTensor)."""
    out = tmp_path / "records.jsonl"
    common = ("--dir", tiny_model_dir, "--data", CHAT, "--seq", str(SEQ), "--micro_batch", str(MICRO_BATCH), "--grad_accum",
              str(GRAD_ACCUM), "--warmup", "1", "--steps", "2", "--precision", "bf16", "--optimizer", "foreach", "--lora", "4",
              "--lr", "1e-3", "--out", str(out))
    result = run_script(os.path.join("bench", "bench_peer_hf.py"), WORLD, *common, "--ep_size", "1", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    (record,) = (json.loads(line) for line in open(out))
    assert record["status"] == "ok" and record["lora_r"] == 4 and record["ep_size"] == 1, record
    # q/k/v/o (4 x (64 x 4 + 4 x 64)... ) and the experts: some adapters, far fewer than the model's parameters
    assert 0 < record["adapter_params"] < 100_000, record["adapter_params"]
    high, low = record["adapter_sum_max_min"]
    assert high == low, (high, low)  # the same adapters on both ranks, bit for bit
    assert record["grad_norms"][0] > 0
    refused = subprocess.run([sys.executable, os.path.join("bench", "bench_peer_hf.py"), *common, "--ep_size", "2"], cwd=ROOT,
                             capture_output=True, text=True, timeout=120)  # refused before any process group
    assert refused.returncode != 0 and "--lora with ep 2: PEFT cannot put LoRA on experts" in refused.stderr, refused.stderr[-2000:]
