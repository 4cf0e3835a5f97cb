"""A NaN loss or gradient norm never trains on: --nonfinite stop ends every rank naming the last good
checkpoint, --nonfinite skip leaves weights and optimizer state as they were; both scripts."""

import json
import os
import re
import shlex
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, every_rank_failed, free_port, read_jsonl

from megablocks_utils.train.metrics import JsonlWriter, write_summary
from megablocks_utils.errors import NonFiniteStep
from megablocks_utils.train.nonfinite import NonFiniteSteps

NAN = float("nan")
# 4 short steps (one micro-batch of 2 samples per rank), a checkpoint after each.
FSDP2 = ["--max_steps", "4", "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "1",
         "--save_steps", "1", "--save_total_limit", "10"]
FSDP1 = ["--max_steps", "4", "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "1",
         "--save_strategy", "steps", "--save_steps", "1"]


def test_stop_raises_with_the_step_and_what_was_not_finite():
    steps = NonFiniteSteps("stop", max_consecutive_skips=5)
    assert steps.check(1, 2.5, 1.0) is False
    with pytest.raises(NonFiniteStep, match=r"^step 2: the gradient norm is nan$") as e:
        steps.check(2, 2.5, NAN)
    assert e.value.step == 2
    with pytest.raises(NonFiniteStep, match=r"^step 3: the loss is inf and the gradient norm is nan$"):
        steps.check(3, float("inf"), NAN)
    with pytest.raises(NonFiniteStep, match=r"^step 4: 1 micro-batch losses are not finite$"):
        steps.check(4, 2.5, 1.0, nonfinite_losses=1)


def test_skip_counts_and_stops_after_max_consecutive_skips():
    steps = NonFiniteSteps("skip", max_consecutive_skips=2)
    assert [steps.check(s, NAN, 1.0) for s in (1, 2)] == [True, True]
    assert steps.check(3, 2.5, 1.0) is False  # a good step resets the run of skips
    assert [steps.check(s, 2.5, NAN) for s in (4, 5)] == [True, True]
    with pytest.raises(NonFiniteStep, match=r"^step 6: the gradient norm is nan, after 2 skipped steps in a row"):
        steps.check(6, 2.5, NAN)
    assert steps.skipped == 4
    unlimited = NonFiniteSteps("skip", max_consecutive_skips=0)
    assert all(unlimited.check(s, NAN, NAN) for s in range(1, 50))


def test_unknown_mode_is_an_error():
    with pytest.raises(ValueError, match="nonfinite='ignore' is unknown; choose stop or skip"):
        NonFiniteSteps("ignore", 5)


def test_metrics_write_non_finite_numbers_as_null(tmp_path):
    path = str(tmp_path / "m.jsonl")
    writer = JsonlWriter(path)
    writer.write({"step": 3, "loss": NAN, "grad_norm": float("inf"), "lr": 1e-3, "skipped": True})
    writer.close()
    with open(path) as f:
        text = f.read()
    assert "NaN" not in text and "Infinity" not in text
    assert read_jsonl(path) == [{"step": 3, "loss": None, "grad_norm": None, "lr": 1e-3, "skipped": True}]


def test_summary_writes_non_finite_numbers_as_null(tmp_path):
    path = str(tmp_path / "summary.json")
    write_summary(path, {"final_loss": NAN, "train_runtime": 2.5, "skipped_steps": 1})
    with open(path) as f:
        text = f.read()
    assert "NaN" not in text
    assert json.loads(text) == {"final_loss": None, "train_runtime": 2.5, "skipped_steps": 1}


def launch(launcher: list[str], *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    return subprocess.run([sys.executable, *launcher, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)


def torchrun(faults: list[str], *args):
    """train_fsdp2.py on 2 ranks, through tests/inject_faults.py with ``faults``."""
    return launch(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "tests/inject_faults.py", *faults,
                   "train_fsdp2.py"], *args)


def accelerate(faults: list[str], *args):
    """README's train_fsdp1.py command on 2 processes, through tests/inject_faults.py with ``faults``."""
    return launch(["-m", "accelerate.commands.launch", "--main_process_port", str(free_port()), "--num_processes", "2",
                   "--config_file", "accelerate.yaml", "tests/inject_faults.py", *faults, "train_fsdp1.py",
                   "--accelerator_config", "accelerator_config.json"], *args)


def load_dcp(path: str, tmp_path) -> dict:
    """A DCP directory as one dict of full tensors, read without a process group."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = str(tmp_path / (path.replace(os.sep, "_") + ".pt"))
    dcp_to_torch_save(path, target)
    return torch.load(target, weights_only=False)


def assert_same(a, b, where=""):
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    else:
        assert torch.equal(a, b), where


def stop_then_skip(run, train_args, out, checkpoint, resume_flag):
    """--nonfinite stop at step 3 (a NaN gradient on the last rank), then the message's own command to
    continue with --nonfinite skip (a NaN loss on the last rank, finite gradients, at step 3).
    Returns the checkpoints written after steps 2, 3 (skipped) and 4."""
    stopped = run(["--nan_grad_at", "3"], *train_args)
    assert stopped.returncode != 0
    every_rank_failed(stopped.stderr, 2)  # no rank ended well
    message = re.findall(r"error: .*", stopped.stderr)
    assert len(message) == 1, stopped.stderr[-4000:]  # one message, from rank 0
    good = checkpoint(2)
    assert message[0].startswith("error: step 3: the gradient norm is nan; stopped without applying or saving this step; "
                                 f"the last good checkpoint is {good}; continue with {resume_flag} {good} --nonfinite skip")
    # Nothing of step 3 was saved: no checkpoint (not even a partial one), no metrics record, no model.
    assert [os.path.exists(checkpoint(s)) for s in (1, 2, 3)] == [True, True, False]
    assert not [n for n in os.listdir(os.path.dirname(good)) if n.endswith(".tmp") or n.endswith("-3")]
    assert [r["step"] for r in read_jsonl(os.path.join(out, "metrics.jsonl"))] == [1, 2]
    assert not os.path.exists(os.path.join(out, "final")) and not os.path.exists(os.path.join(out, "summary.json"))

    advice = shlex.split(re.search(r"continue with (--\S+ \S+ --nonfinite skip)", message[0]).group(1))
    resumed = run(["--nan_loss_at", "3"], *train_args, *advice)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "skipped steps: 1 " in resumed.stdout
    records = read_jsonl(os.path.join(out, "metrics.jsonl"))
    assert [(r["step"], r["skipped"]) for r in records] == [(1, False), (2, False), (3, True), (4, False)]
    assert records[2]["loss"] is None and records[2]["grad_norm"] > 0  # NaN is written as null; the gradients were finite
    lrs = [r["lr"] for r in records]
    assert lrs == sorted(lrs) and len(set(lrs)) == 4  # the warmup goes on through the skipped step
    return [checkpoint(step) for step in (2, 3, 4)]


def test_fsdp2_stop_names_the_last_checkpoint_and_skip_leaves_the_weights(tiny_model_dir, tmp_path):
    out = str(tmp_path / "run")
    paths = stop_then_skip(torchrun, [*FSDP2, "--model_name_or_path", tiny_model_dir, "--output_dir", out],
                           out, lambda step: os.path.join(out, "checkpoints", f"step_{step:08d}"), "--resume")
    before, skipped, after = [load_dcp(p, tmp_path) for p in paths]
    assert_same(skipped["model"], before["model"], "model")  # no rank touched its shards
    assert_same(skipped["optim"]["state"], before["optim"]["state"], "optim")  # nor AdamW's moments and step counts
    name = "model.embed_tokens.weight"
    assert not torch.equal(after["model"][name], skipped["model"][name])  # training went on


def test_fsdp1_stop_names_the_last_checkpoint_and_skip_leaves_the_weights(tiny_model_dir, tmp_path):
    out = str(tmp_path / "run")
    paths = stop_then_skip(accelerate, [*FSDP1, "--model_name_or_path", tiny_model_dir, "--output_dir", out],
                           out, lambda step: os.path.join(out, f"checkpoint-{step}"), "--resume_from_checkpoint")
    models = [load_dcp(os.path.join(p, "pytorch_model_fsdp_0"), tmp_path)["model"] for p in paths]
    optims = [load_dcp(os.path.join(p, "optimizer_0"), tmp_path)["optimizer"] for p in paths]
    assert_same(models[1], models[0], "model")
    assert_same(optims[1]["state"], optims[0]["state"], "optim")
    name = "model.embed_tokens.weight"
    assert not torch.equal(models[2][name], models[1][name])
