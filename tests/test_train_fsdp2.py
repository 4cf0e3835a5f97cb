"""train_fsdp2.py end to end on CPU ranks: it learns, it logs what it promises, EP equals one process."""

import json
import math
import os
import re

import pytest
import torch
from conftest import read_jsonl, run_script, standard_args, train_fsdp2

RECORD_FIELDS = {
    "step", "loss", "ce_loss", "aux_loss", "lr", "grad_norm", "tokens", "token_slots", "tokens_per_second",
    "tokens_per_second_per_device", "tflops_per_device", "mfu", "step_time_s", "peak_rss_gb",
    "tokens_per_expert_max", "tokens_per_expert_mean", "tokens_per_expert",
}
SUMMARY_FIELDS = {"train_runtime", "train_steps_per_second", "train_tokens_per_second", "peak_rss_gb"}
# 31 of data.json's records held out: 10 packed rows, so two rounds of 4 rows x 2 ranks, the second one short (rank 1
# runs filler rows only): an eval loss over the first round alone, or one that counts the fillers, differs.
EVAL_SPLIT = 0.07


def train(tiny_model_dir, out, nproc, *args):
    result = run_script(
        "train_fsdp2.py", nproc, "--model_name_or_path", tiny_model_dir, "--output_dir", out, *args
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return result


def test_two_ranks_learn_log_and_export(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    out = str(tmp_path / "run")
    # (the schedule's settings ride along: warmup_ratio 0.1 of 24 steps = 3 warmup steps, then a cosine down to 10%)
    result = train(tiny_model_dir, out, 2, "--max_steps", "24", "--activation_checkpointing",
                   "--report_to", "tensorboard", "--peak_tflops", "1",
                   "--lr_scheduler_type", "cosine_with_min_lr", "--min_lr_rate", "0.1", "--warmup_ratio", "0.1",
                   "--eval_split", str(EVAL_SPLIT), "--eval_steps", "12", "--recompute_swiglu", "true")
    assert "summary: train_runtime=" in result.stdout
    # the plan on CPU ranks: the model's size as people say it, the layout, no table of GPU memory
    assert re.search(r"^\S+: 0\.\d\d M params \(", result.stdout, re.M) and "plan: 2 CPU ranks, ep 2" in result.stdout
    assert "per GPU" not in result.stdout
    # the setting reaches the layers, which say what it does here (tests/test_silu_mul_down.py: what it does on GPUs)
    assert "recompute_swiglu: nothing to make again on CPU" in result.stdout
    records = read_jsonl(os.path.join(out, "metrics.jsonl"))
    assert [r["step"] for r in records] == list(range(1, 25))
    for r in records:
        assert RECORD_FIELDS <= set(r), RECORD_FIELDS - set(r)
        assert math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"])
        assert len(r["tokens_per_expert"]) == 4 and len(r["tokens_per_expert"][0]) == 8
    peak = 2e-3  # each record's rate is the one its step used: the warmup's 3 steps from 0, then cosine to 0.1 x peak
    assert [r["lr"] for r in records[:4]] == pytest.approx([0, peak / 3, 2 * peak / 3, peak])
    assert records[-1]["lr"] == pytest.approx(peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 20 / 21))))
    first = sum(r["loss"] for r in records[:4]) / 4
    last = sum(r["loss"] for r in records[-4:]) / 4
    assert last < first - 0.5, (first, last)
    summary = json.load(open(os.path.join(out, "summary.json")))
    assert SUMMARY_FIELDS <= set(summary)
    # the steps' times tile the run's training time (train/step_clock.py): the evals between them left out
    step_times = sum(r["step_time_s"] for r in records)
    print(f"step times {step_times:.3f} s of train_runtime {summary['train_runtime']:.3f} s")
    assert 0.5 * summary["train_runtime"] < step_times < summary["train_runtime"]
    assert sum(r["tokens"] for r in records) / sum(r["token_slots"] for r in records) > 0.9  # packed rows
    model = AutoModelForCausalLM.from_pretrained(os.path.join(out, "final"))
    assert torch.isfinite(model(torch.tensor([[1, 5, 9]])).logits).all()
    # the eval loss at steps 12 and 24; the last one equals plain transformers' on the exported model
    assert [r["step"] for r in records if "eval_loss" in r] == [12, 24]
    assert records[-1]["eval_loss"] == summary["eval_loss"] == pytest.approx(reference_eval_loss(model, tiny_model_dir), rel=1e-5)
    assert_tensorboard_scalars(os.path.join(out, "runs"), records)


def reference_eval_loss(model, tiny_model_dir):
    """The mean loss over the held-out EVAL_SPLIT of data.json, one record at a time, with no packing and no EP."""
    from conftest import ROOT
    from transformers import AutoTokenizer

    from megablocks_utils.data.batches import collate
    from megablocks_utils.data.records import build_dataset, tokenize_records
    from megablocks_utils.train.loss import causal_lm_loss_sum, count_label_tokens

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    held, fmt = build_dataset(os.path.join(ROOT, "data.json"), tokenizer, 256, eval_split=EVAL_SPLIT, seed=42)[2]
    samples = tokenize_records(held, fmt, tokenizer, 256, "eval")[0]
    total = count = 0
    with torch.no_grad():
        for sample in samples:
            batch = collate([sample], tokenizer.pad_token_id, "cpu")
            total += float(causal_lm_loss_sum(model(input_ids=batch["input_ids"]).logits, batch["labels"]))
            count += count_label_tokens(batch["labels"])
    return total / count


def assert_tensorboard_scalars(log_dir, records):
    """--report_to tensorboard: the records' numbers as scalars (rank 0 only: one event file)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert len(os.listdir(log_dir)) == 1, os.listdir(log_dir)
    events = EventAccumulator(log_dir)
    events.Reload()
    layers = [f"expert_load_max_over_mean/layer_{i}" for i in range(len(records[0]["tokens_per_expert"]))]
    tags = ["train/loss", "train/learning_rate", "train/grad_norm", "train/tokens_per_second", "train/mfu", *layers]
    assert set(tags) <= set(events.Tags()["scalars"]), events.Tags()["scalars"]
    for tag in tags:
        assert [e.step for e in events.Scalars(tag)] == [r["step"] for r in records], tag
    assert [e.value for e in events.Scalars("train/loss")] == pytest.approx([r["loss"] for r in records], rel=1e-6)
    load = [r["tokens_per_expert_max"][0] / r["tokens_per_expert_mean"][0] for r in records]
    assert [e.value for e in events.Scalars(layers[0])] == pytest.approx(load, rel=1e-6)
    assert all(v >= 1 for v in load)


@pytest.mark.parametrize("nproc,dp_args", [
    (2, ("--ep_size", "2")),
    (2, ("--ep_size", "1")),
    # 2 of 4 layers checkpointed whole, the other 2 recompute only their experts (checkpoint_experts)
    (2, ("--ep_size", "1", "--shard_experts", "false", "--activation_checkpointing_layers", "2", "--checkpoint_experts", "true")),
    pytest.param(4, ("--ep_size", "1", "--dp_replicate", "2"), marks=pytest.mark.slow),
], ids=["ep2", "dp2-experts-sharded", "dp2-experts-replicated", "hsdp2x2"])
def test_ranks_equal_one_rank(request, tiny_model_dir, small_data, tmp_path, one_rank_run, nproc, dp_args):
    """The same global batches on N ranks (ep=2; dp=2 with experts sharded or replicated over dp; HSDP with
    2 replicas of 2 shards, experts too) and on 1 rank (conftest's one_rank_run, itself held to plain
    transformers in test_matches_transformers.py)."""
    # Activation checkpointing on both sides: recomputation must route (and all-to-all) exactly as the first pass.
    if dp_args == ("--ep_size", "2"):  # the standard 2-rank run, shared with other test files
        out = request.getfixturevalue("two_rank_run")
    else:
        out = str(tmp_path / "n")
        train_fsdp2(nproc, out, *standard_args(tiny_model_dir, small_data), *dp_args,
                    "--per_device_train_batch_size", str(4 // nproc), "--activation_checkpointing", "full")
    many = read_jsonl(os.path.join(out, "metrics.jsonl"))
    one = read_jsonl(os.path.join(one_rank_run, "metrics.jsonl"))
    assert len(many) == len(one) == 4, (len(many), len(one))
    for a, b in zip(many, one):
        assert a["step"] == b["step"]
        for key in ("loss", "aux_loss", "grad_norm"):
            assert abs(a[key] - b[key]) <= 1e-5 * abs(b[key]), (a["step"], key, a[key], b[key])
        assert a["tokens_per_expert"] == b["tokens_per_expert"]


@pytest.mark.slow
def test_eight_ranks_one_expert_each_equal_one_rank(tiny_model_dir, small_data, tmp_path):
    """A node's 8 GPUs as users run it: ep 8 over the embedded model's 8 experts (one local expert per rank, its grouped
    GEMM of one group), each rank its own row, against one rank taking the same 8 rows per micro-step."""
    runs = {}
    for nproc, args in ((1, ("--per_device_train_batch_size", "8")), (8, ("--per_device_train_batch_size", "1", "--ep_size", "8"))):
        runs[nproc] = str(tmp_path / f"n{nproc}")
        train_fsdp2(nproc, runs[nproc], *standard_args(tiny_model_dir, small_data), *args, "--save_steps", "0")
    many, one = (read_jsonl(os.path.join(runs[n], "metrics.jsonl")) for n in (8, 1))
    assert len(many) == len(one) == 4
    for a, b in zip(many, one):
        for key in ("loss", "aux_loss", "grad_norm"):
            assert abs(a[key] - b[key]) <= 1e-5 * abs(b[key]), (a["step"], key, a[key], b[key])
        assert a["tokens_per_expert"] == b["tokens_per_expert"]


def test_chat_jsonl_with_a_parquet_eval_set_trains(tiny_model_dir, tmp_path):
    """The other formats end to end: chat records from JSONL (the embedded model's chat template), the eval
    loss from prompt/completion records in parquet, packing off."""
    from datasets import Dataset

    turns = [{"messages": [{"role": "user", "content": f"Add {i} and {i}."}, {"role": "assistant", "content": f"{2 * i}."}]}
             for i in range(40)]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(t) + "\n" for t in turns))
    Dataset.from_list([{"prompt": f"Add {i} and 1.", "completion": f" {i + 1}."} for i in range(6)]).to_parquet(str(tmp_path / "eval.parquet"))
    out = str(tmp_path / "run")
    result = train(tiny_model_dir, out, 1, "--data_path", str(tmp_path / "chat.jsonl"), "--eval_data_path",
                   str(tmp_path / "eval.parquet"), "--max_steps", "3", "--packing", "false")
    assert "40 chat samples" in result.stdout and "eval: 6 samples" in result.stdout
    records = read_jsonl(os.path.join(out, "metrics.jsonl"))
    assert len(records) == 3 and math.isfinite(records[-1]["eval_loss"]) and "eval_loss" not in records[0]


def test_embedded_default_is_made_from_the_shipped_data_whatever_the_data(tmp_path):
    """A fresh checkout's first run with chat records: the embedded tiny model (made in the working directory)
    gets its tokenizer from the shipped alpaca data.json, not from data_path, and trains on the chat records."""
    from conftest import ROOT

    result = run_script("train_fsdp2.py", 1, "--data_path", os.path.join(ROOT, "data_chat.jsonl"), "--output_dir",
                        str(tmp_path / "run"), "--max_steps", "1", cwd=str(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "creating the embedded tiny Mixtral" in result.stdout and "chat samples" in result.stdout
    assert os.path.isfile(tmp_path / "tiny-mixtral" / "tokenizer.json")
