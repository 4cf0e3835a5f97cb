"""What a run records (megablocks_utils/train/run_log.py, output_dir.py, stop_signal.py) and the files it leaves: the same metrics.jsonl
and summary.json keys from both scripts, a finished run left alone by a resume, a checkpoint save that
fails for want of space stopping cleanly, and inputs that name a file where a directory belongs.

The component is tested in this process (one gloo rank where a collective is needed); the scripts run
on one rank for 2 steps, each launch shared by the tests that read it.
"""

import errno
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from conftest import ROOT, free_port, read_jsonl, run_ranks
from inject_faults import full_disk_write
from test_bad_input import assert_one_message, run_plain
from torch.distributed.checkpoint import FileSystemWriter

from megablocks_utils.config.inputs import check_output_dir
from megablocks_utils.errors import CheckpointError, InputError
from megablocks_utils.model.loading import check_model_dir
from megablocks_utils.train.checkpoint import (
    complete_checkpoints,
    disk_full,
    resolve_resume,
    save_checkpoint,
)
from megablocks_utils.train.nonfinite import where_to_continue
from megablocks_utils.train.output_dir import (
    checkpoints_kept,
    disk_space_warning,
    prepare_output_dir,
)
from megablocks_utils.train.run_log import (
    MetricsLog,
    StepSums,
    summary_line,
    trim_metrics,
)

# The keys of every metrics.jsonl record, from either script (token_slots: positions computed, padding included).
RECORD_KEYS = {
    "step", "loss", "ce_loss", "aux_loss", "lr", "grad_norm", "skipped", "tokens", "token_slots", "tokens_per_second",
    "tokens_per_second_per_device", "tflops_per_device", "mfu", "step_time_s", "peak_rss_gb",
    "tokens_per_expert_max", "tokens_per_expert_mean", "tokens_per_expert",
}
SUMMARY_KEYS = {
    "train_runtime", "train_steps_per_second", "train_tokens_per_second", "train_tokens_per_second_per_device",
    "peak_rss_gb", "final_loss", "eval_loss", "token_fill", "skipped_steps", "world_size", "dp", "ep",
}
SCRIPT_SUMMARY_KEYS = {
    "train_fsdp2.py": {"bytes_per_param", "optim"},
    "train_fsdp1.py": {"distributed_type", "fsdp_wrapped_modules", "dense_numel_full", "dense_numel_local_max"},
}


@pytest.fixture
def one_rank_group():
    """A gloo process group of this process alone, for the component's collectives (gone after each
    test: a forked script run must not inherit it)."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class TinyConfig:
    num_hidden_layers, hidden_size = 2, 8


def test_step_sums_are_added_and_reduced_by_name(one_rank_group):
    sums = StepSums("cpu")
    counts = torch.tensor([[3.0, 1.0], [2.0, 2.0]], dtype=torch.float64)
    sums.add(ce_sum=torch.tensor(6.0, requires_grad=True) * 1, aux=torch.tensor(0.25), tokens=torch.tensor(5),
             token_slots=8, attention_sq=40.0, nonfinite=torch.tensor(False), tokens_per_expert=counts)
    sums.add(ce_sum=torch.tensor(4.0), aux=0.25, tokens=torch.tensor(3), token_slots=8, attention_sq=64.0, nonfinite=torch.tensor(True),
             tokens_per_expert=counts)
    assert sums.all_reduce() is sums
    assert (sums.ce_sum, sums.aux, sums.tokens, sums.token_slots, sums.attention_sq, sums.nonfinite) == (10.0, 0.5, 8.0, 16.0, 104.0, 1.0)
    assert sums.tokens_per_expert.tolist() == [[6.0, 2.0], [4.0, 4.0]]
    assert sums.stop_requests == 0.0 and sums.grad_norm is None  # no StopSignal, no norm given


def test_the_record_reads_only_what_the_all_reduce_copied_to_the_host(one_rank_group):
    """``all_reduce`` reads the totals, the global gradient norm and the expert counts in one device-to-host copy, so
    the step's record needs no device tensor after the optimizer step (on a GPU: no host sync there,
    tests/gpu/test_step_no_sync.py); the counts stay on the device for the routing bias."""
    sums = StepSums("cpu")
    counts = torch.tensor([[6.0, 2.0], [4.0, 5.0]], dtype=torch.float64)
    sums.add(ce_sum=torch.tensor(10.0), aux=0.5, tokens=8, token_slots=16, attention_sq=64.0, nonfinite=0, tokens_per_expert=counts)
    sums.all_reduce(grad_norm=torch.tensor(2.25, dtype=torch.float32))
    assert sums.grad_norm == 2.25 and isinstance(sums.grad_norm, float)
    assert sums.tokens_per_expert_cpu.dtype == counts.dtype and torch.equal(sums.tokens_per_expert_cpu, counts)
    assert torch.equal(sums.tokens_per_expert, counts)  # kept where it is, for the routing bias
    sums.tokens_per_expert = None  # the record must not read it
    record = metrics_log(None).record(1, sums, label_tokens=5.0, lr=1e-3, grad_norm=sums.grad_norm, skipped=False, step_time=1.0)
    assert record["grad_norm"] == 2.25 and record["tokens_per_expert"] == [[6, 2], [4, 5]]
    assert record["tokens_per_expert_max"] == [6.0, 5.0] and record["tokens_per_expert_mean"] == [4.0, 4.5]
    assert StepSums("cpu").all_reduce(grad_norm=3.0).grad_norm == 3.0  # train_fsdp1.py's norm is a number already


def reduced_sums(ce_sum=10.0, tokens=8, token_slots=16, attention_sq=64.0):
    sums = StepSums("cpu")  # by default 4 rows of 4 positions (4 x 4^2 attended)
    sums.add(ce_sum=ce_sum, aux=0.5, tokens=tokens, token_slots=token_slots, attention_sq=attention_sq, nonfinite=0,
             tokens_per_expert=torch.tensor([[6.0, 2.0], [4.0, 4.0]], dtype=torch.float64))
    return sums.all_reduce()


def metrics_log(path, **overrides):
    facts = dict(aux_coef=0.1, world_size=2, n_active=100, config=TinyConfig(), peak_flops=0.0, device=torch.device("cpu"))
    return MetricsLog(path, **{**facts, **overrides})


def test_record_has_the_keys_both_scripts_write(one_rank_group, tmp_path):
    path = str(tmp_path / "metrics.jsonl")
    log = metrics_log(path, peak_flops=1e12)
    record = log.record(3, reduced_sums(), label_tokens=5.0, lr=torch.tensor(1e-3), grad_norm=torch.tensor(2.0), skipped=False, step_time=2.0)
    assert set(record) == RECORD_KEYS
    assert record["step"] == 3 and record["ce_loss"] == 2.0 and record["loss"] == 2.0 + 0.1 * 0.5
    assert record["tokens"] == 8 and record["token_slots"] == 16  # real tokens and positions computed, both kept
    assert record["tokens_per_second"] == 4.0 and record["tokens_per_second_per_device"] == 2.0
    flops = (6 * 100 + 12 * 2 * 8 * 64 / 16) * 16  # per token at a span of 64 / 16 = 4, times the positions computed
    assert record["tflops_per_device"] == pytest.approx(flops / 2.0 / 2 / 1e12)
    assert record["mfu"] == pytest.approx(flops / 2.0 / 2 / 1e12)
    assert record["tokens_per_expert"] == [[6, 2], [4, 4]] and record["tokens_per_expert_max"] == [6.0, 4.0]
    assert isinstance(record["lr"], float) and isinstance(record["grad_norm"], float)
    log.close()
    assert read_jsonl(path) == [record]


def test_packed_documents_count_their_own_spans_and_eval_waits_for_its_loss(one_rank_group, tmp_path):
    """Two documents of 2 in a row of 4 attend 2 x 2^2 = 8, half of one 4-token sample's 16."""
    path = str(tmp_path / "metrics.jsonl")
    log = metrics_log(path, peak_flops=1e12)
    packed = log.record(1, reduced_sums(token_slots=4, tokens=4, attention_sq=8.0), label_tokens=5.0, lr=1e-3, grad_norm=1.0,
                        skipped=False, step_time=1.0, write=False)
    assert packed["tflops_per_device"] == pytest.approx((6 * 100 + 12 * 2 * 8 * 2) * 4 / 2 / 1e12)
    assert read_jsonl(path) == []  # waits for its eval loss
    log.add_eval(3.5, packed)
    log.close()
    assert read_jsonl(path)[0]["eval_loss"] == 3.5
    assert log.summary(runtime=1.0, steps_run=1, skipped_steps=0, dp=1, ep=1)["eval_loss"] == 3.5


def test_nonfinite_loss_is_null_and_no_mfu_without_a_peak(one_rank_group, tmp_path):
    path = str(tmp_path / "metrics.jsonl")
    log = metrics_log(path)
    log.record(1, reduced_sums(ce_sum=float("nan")), label_tokens=5.0, lr=1e-3, grad_norm=1.0, skipped=True, step_time=1.0)
    log.close()
    (written,) = read_jsonl(path)
    assert written["loss"] is None and written["skipped"] is True and written["mfu"] is None


def test_summary_keys_and_totals(one_rank_group):
    log = metrics_log(None)  # a rank other than 0: records are made, nothing is written
    for step in (1, 2):
        log.record(step, reduced_sums(), label_tokens=5.0, lr=1e-3, grad_norm=1.0, skipped=False, step_time=1.0)
    summary = log.summary(runtime=4.0, steps_run=2, skipped_steps=0, dp=1, ep=2, optim="adamw_torch")
    assert set(summary) == SUMMARY_KEYS | {"optim"}
    assert summary["train_tokens_per_second"] == 16 / 4.0 and summary["train_tokens_per_second_per_device"] == 16 / 4.0 / 2
    assert summary["final_loss"] == 2.05 and summary["train_steps_per_second"] == 0.5
    assert summary_line({"a": 1.23456, "b": 2, "c": [1, 2]}) == "summary: a=1.235 b=2"


def test_a_resume_with_no_step_left_keeps_the_last_loss(one_rank_group):
    log = metrics_log(None, earlier=[{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.5}])
    assert log.summary(runtime=1.0, steps_run=0, skipped_steps=0, dp=1, ep=1)["final_loss"] == 2.5


def test_trim_metrics_keeps_the_steps_up_to_the_resumed_one(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": float(s)}) + "\n" for s in (1, 2, 3, 4)) + "\n")
    assert [r["step"] for r in trim_metrics(str(path), 2)] == [1, 2]
    assert [r["step"] for r in read_jsonl(str(path))] == [1, 2]
    assert trim_metrics(str(tmp_path / "none.jsonl"), 2) == []


@pytest.mark.parametrize("clear", [True, False])
def test_prepare_output_dir(tmp_path, clear):
    out = tmp_path / "out"
    (out / "checkpoint-2").mkdir(parents=True)
    (out / "final").mkdir()
    (out / "summary.json").write_text("{}")
    (out / "notes.txt").write_text("mine")
    (out / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n')
    kept = prepare_output_dir(str(out), ("metrics.jsonl", "summary.json", "final", "checkpoint-*"), clear, 2, {"seed": 1})
    expected = {"notes.txt", "settings.json"} | (set() if clear else {"checkpoint-2", "final", "summary.json", "metrics.jsonl"})
    assert set(os.listdir(out)) == expected
    assert kept == ([] if clear else [{"step": 1}, {"step": 2}])
    assert json.loads((out / "settings.json").read_text()) == {"seed": 1}
    prepare_output_dir(str(tmp_path / "new" / "run"), (), False, 0, {})
    assert os.listdir(tmp_path / "new" / "run") == ["settings.json"]


def test_checkpoints_kept_at_once():
    assert checkpoints_kept(40, 0, 2) == 0  # no saving
    assert checkpoints_kept(40, 10, 2) == 3  # the newest 2 and the one being written
    assert checkpoints_kept(40, 20, 2) == 2  # only 2 saves in the run
    assert checkpoints_kept(45, 10, 0) == 5  # no limit: every save (the last step's too)


def test_disk_space_warning_when_the_checkpoints_do_not_fit(tmp_path, monkeypatch):
    free = {"bytes": 100 * 2**30}
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(0, 0, free["bytes"]))
    out = str(tmp_path / "not" / "yet")  # asked of the nearest existing parent
    assert disk_space_warning(out, 2 * 2**30, "adamw_torch", 3) is None  # 3 x 24 GiB < 100 GiB
    warning = disk_space_warning(out, 3 * 2**30, "adamw_torch", 3)  # fp32 weights + 2 fp32 moments: 12 B/param
    assert warning.startswith(f"warning: {tmp_path} has 100.0 GiB free, less than the 3 checkpoints of ~36.0 GiB each")
    assert "(108.0 GiB)" in warning and "lower save_total_limit" in warning
    assert disk_space_warning(out, 3 * 2**30, "adamw_bf16", 3) is None  # bf16 weights + 2 bf16 moments: 6 B/param
    assert disk_space_warning(out, 10**12, "adamw_torch", 0) is None  # no checkpoints


def test_disk_full_is_recognised_in_what_dcp_and_torch_raise():
    enospc = OSError(errno.ENOSPC, "No space left on device")
    assert disk_full(enospc)
    assert disk_full(RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"))
    wrapped = RuntimeError("save failed")
    wrapped.__cause__ = enospc
    assert disk_full(wrapped)
    dcp_like = RuntimeError("CheckpointException ranks:dict_keys([1])")
    dcp_like.failures = {1: (enospc, None)}
    assert disk_full(dcp_like)
    assert not disk_full(PermissionError(errno.EACCES, "Permission denied"))


def test_where_to_continue_names_the_newest_checkpoint_before_the_bad_step():
    saved = [(2, "ck/step_2"), (4, "ck/step_4"), (8, "ck/step_8")]  # step 8: another run's, left behind
    text = where_to_continue(6, saved, "--resume", "--save_steps N")
    assert text.startswith("the last good checkpoint is ck/step_4; continue with --resume ck/step_4 --nonfinite skip")
    assert where_to_continue(2, saved, "--resume", "--save_steps N").startswith("no checkpoint was saved before it (--save_steps N keeps some)")


# ----------------------------------------------------------------------------- a save that fails
@pytest.fixture
def tiny_training(one_rank_group):
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)


def save(root, step, training):
    model, optimizer, scheduler = training
    return save_checkpoint(str(root), step, model, optimizer, scheduler, {"seed": 1}, 2)


def test_full_disk_in_dcp_removes_the_partial_checkpoint(tmp_path, tiny_training, monkeypatch):
    root = tmp_path / "checkpoints"
    save(root, 2, tiny_training)
    with monkeypatch.context() as patch, pytest.raises(CheckpointError) as e:
        patch.setattr(FileSystemWriter, "write_data", full_disk_write)  # the shard writes fail inside DCP, as with ENOSPC
        save(root, 4, tiny_training)
    message = str(e.value)
    assert message.startswith(f"the disk is full: saving the checkpoint of step 4 to {root}/step_00000004.tmp failed (OSError: [Errno 28]")
    assert f"removed the partial step_00000004.tmp; the last complete checkpoint is {root}/step_00000002" in message
    assert "continue with --resume auto" in message
    assert os.listdir(root) == ["step_00000002"]
    save(root, 4, tiny_training)  # space again: the next save works
    assert complete_checkpoints(str(root)) == [str(root / "step_00000002"), str(root / "step_00000004")]


def test_torch_short_write_is_a_full_disk_too(tmp_path, tiny_training, monkeypatch):
    """What a full disk gives from torch.save: "[enforce fail at inline_container.cc:672] unexpected pos"."""
    import megablocks_utils.train.checkpoint as checkpoint

    def short_write(obj, path):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    monkeypatch.setattr(checkpoint.torch, "save", short_write)
    with pytest.raises(CheckpointError, match=r"^the disk is full: .*unexpected pos 704 vs 598.*no checkpoint of this run is complete yet"):
        save(tmp_path / "checkpoints", 2, tiny_training)
    assert os.listdir(tmp_path / "checkpoints") == []


# ----------------------------------------------------------------------------- paths that are not what they should be
def test_resume_path_that_does_not_exist_or_is_a_file(tmp_path):
    with pytest.raises(CheckpointError, match=f"--resume {tmp_path}/nope: the directory does not exist"):
        resolve_resume(str(tmp_path / "nope"), str(tmp_path / "checkpoints"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match=f"--resume {tmp_path}/file is a file, not a checkpoint directory"):
        resolve_resume(str(tmp_path / "file"), str(tmp_path / "checkpoints"))


def test_output_dir_or_model_path_that_is_a_file(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(InputError, match=f"^output_dir {tmp_path}/file is a file, not a directory; set output_dir to a directory path"):
        check_output_dir(str(tmp_path / "file"), ("summary.json",), False, False, "--resume auto")
    with pytest.raises(InputError, match=f"output_dir {tmp_path}/file/run lies inside {tmp_path}/file, which is a file"):
        check_output_dir(str(tmp_path / "file" / "run"), ("summary.json",), False, False, "--resume auto")
    assert check_output_dir(str(tmp_path / "new" / "run"), ("summary.json",), False, False, "--resume auto") == []
    with pytest.raises(InputError, match=f"model_name_or_path '{tmp_path}/file' is a file, not a model directory"):
        check_model_dir(str(tmp_path / "file"))


@pytest.mark.parametrize("script", ["train_fsdp2.py", "train_fsdp1.py"])
def test_scripts_say_a_path_is_a_file(tiny_model_dir, tmp_path, script):
    """One line, no FileExistsError traceback, for an output_dir or a model path that names a file."""
    (tmp_path / "file").write_text("x")
    result = run_plain(script, "--model_name_or_path", tiny_model_dir, "--output_dir", str(tmp_path / "file"))
    assert result.returncode == 2
    assert_one_message(result, f"output_dir {tmp_path}/file is a file, not a directory")
    result = run_plain(script, "--model_name_or_path", str(tmp_path / "file"), "--output_dir", str(tmp_path / "out"))
    assert result.returncode == 2
    assert_one_message(result, "is a file, not a model directory")
    assert (tmp_path / "file").read_text() == "x" and not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- the scripts' files
TWO_STEPS = ["--max_steps", "2", "--gradient_accumulation_steps", "1", "--warmup_steps", "1", "--per_device_train_batch_size", "2"]
SAVE = {"train_fsdp2.py": ["--save_steps", "2"], "train_fsdp1.py": ["--save_strategy", "steps", "--save_steps", "2"]}
RESUME = {"train_fsdp2.py": ["--resume", "auto"], "train_fsdp1.py": ["--resume_from_checkpoint", "last"]}


def launch_one_rank(script, *args, faults=()):
    """The script on one CPU rank under its own launcher (torchrun; accelerate launch with README's config);
    with ``faults``, through tests/inject_faults.py."""
    if script == "train_fsdp2.py":
        launcher = ["torch.distributed.run", "--standalone", "--nproc_per_node=1"]
    else:
        launcher = ["accelerate.commands.launch", "--main_process_port", str(free_port()), "--num_processes", "1",
                    "--config_file", "accelerate.yaml"]
        args = ("--accelerator_config", "accelerator_config.json", *args)
    wrapper = ["tests/inject_faults.py", *faults] if faults else []
    return subprocess.run([sys.executable, "-m", *launcher, *wrapper, script, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES=""))


@pytest.fixture(scope="module", params=["train_fsdp2.py", "train_fsdp1.py"])
def finished(request, tiny_model_dir, tmp_path_factory):
    """A finished 2-step run on one rank whose last checkpoint is its last step."""
    script = request.param
    out = str(tmp_path_factory.mktemp(script.split(".")[0]) / "run")
    args = ["--model_name_or_path", tiny_model_dir, "--output_dir", out, *TWO_STEPS, *SAVE[script]]
    result = launch_one_rank(script, *args)
    assert result.returncode == 0, result.stderr[-4000:]
    return script, out, args


def test_scripts_write_the_same_record_and_summary_keys(finished):
    script, out, _ = finished
    records = read_jsonl(os.path.join(out, "metrics.jsonl"))
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert set(r) == RECORD_KEYS, set(r) ^ RECORD_KEYS
        assert 0 < r["tokens"] <= r["token_slots"]
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    assert SUMMARY_KEYS | SCRIPT_SUMMARY_KEYS[script] <= set(summary)
    assert summary["final_loss"] == records[-1]["loss"]


def snapshot(path):
    """Every file under ``path`` with its modification time and content."""
    found = {}
    for folder, _, files in os.walk(path):
        for name in files:
            file = os.path.join(folder, name)
            with open(file, "rb") as f:
                found[file] = (os.stat(file).st_mtime_ns, f.read())
    return found


def test_resuming_a_finished_run_changes_nothing(finished):
    """A resume at the last step trains nothing and writes nothing: not an empty run's summary.json (final_loss null),
    not final/ again."""
    script, out, args = finished
    before = snapshot(out)
    result = launch_one_rank(script, *args, *RESUME[script])
    assert result.returncode == 0, result.stderr[-4000:]
    checkpoint = os.path.join(out, "checkpoints", "step_00000002") if script == "train_fsdp2.py" else os.path.join(out, "checkpoint-2")
    assert f"{out} holds a finished run: its checkpoint {checkpoint} is at step 2 of 2, and summary.json and final/ are written; " \
           "nothing to do, nothing changed" in result.stdout, result.stdout[-3000:]
    assert snapshot(out) == before


@pytest.mark.parametrize("script", ["train_fsdp2.py", "train_fsdp1.py"])
def test_full_disk_while_saving_stops_with_one_message(tiny_model_dir, tmp_path, script):
    """A save that fails for want of space (tests/inject_faults.py --disk_full_at) gives one message, not torch's
    "[enforce fail at inline_container.cc:672] unexpected pos" traceback on every rank, and leaves no partial
    checkpoint (step_00000002.tmp; Trainer's checkpoint-2)."""
    out = tmp_path / "run"
    save = ["--save_steps", "1"] if script == "train_fsdp2.py" else ["--save_strategy", "steps", "--save_steps", "1"]
    result = launch_one_rank(script, "--model_name_or_path", tiny_model_dir, "--output_dir", str(out), *TWO_STEPS, *save,
                             faults=["--disk_full_at", "2"])
    assert result.returncode != 0
    if script == "train_fsdp2.py":
        partial, last, left = out / "checkpoints" / "step_00000002.tmp", out / "checkpoints" / "step_00000001", out / "checkpoints"
    else:
        partial, last, left = out / "checkpoint-2", out / "checkpoint-1", out
    assert_one_message(result, f"error: the disk is full: saving the checkpoint of step 2 to {partial} failed")
    assert f"the last complete checkpoint is {last}" in result.stderr, result.stderr[-3000:]
    assert not partial.exists() and last.is_dir(), os.listdir(left)


def check_stop_signal_is_agreed(rank, world):
    import os
    import signal

    from megablocks_utils.train.stop_signal import StopSignal

    stop = StopSignal(torch.device("cpu"))
    assert stop.agreed() is False
    if rank == 1:  # the signal lands right after this step's all-reduce, before anything reads a decision
        os.kill(os.getpid(), signal.SIGTERM)
    decided_now = stop.stopping
    assert decided_now is False  # this step's decision stands on every rank
    assert stop.agreed() is True and stop.stopping  # and the next step's end stops every rank
    assert stop.raised is (rank == 1)


def check_stop_request_rides_on_the_step_sums(rank, world):
    import os
    import signal
    from unittest import mock

    from megablocks_utils.train.nonfinite import NonFiniteSteps
    from megablocks_utils.train.step import StepLoss
    from megablocks_utils.train.stop_signal import StopSignal

    stop, nonfinite = StopSignal(torch.device("cpu")), NonFiniteSteps("stop", 0)
    all_reduce, collectives, decisions = dist.all_reduce, [], []

    def signal_after_step_2s_reduce(tensor, *args, **kwargs):
        all_reduce(tensor, *args, **kwargs)
        collectives.append(step)
        if rank == 1 and step == 2:  # lands after the step's snapshots were reduced, before any rank decided
            os.kill(os.getpid(), signal.SIGTERM)

    for step in (1, 2, 3):
        step_loss = StepLoss(step, 4.0 * world, 1, aux_coef=0.0, group=dist.group.WORLD, device=torch.device("cpu"))
        step_loss.sums.add(ce_sum=1.0, aux=0.0, tokens=4, token_slots=4, attention_sq=16.0, nonfinite=0)
        with mock.patch.object(dist, "all_reduce", signal_after_step_2s_reduce):
            assert step_loss.check(nonfinite, torch.tensor(1.0), stop) is False
        decisions.append((stop.stopping, step_loss.sums.stop_requests))
    assert decisions == [(False, 0.0), (False, 0.0), (True, 1.0)], decisions  # the same on every rank
    assert collectives == [1, 2, 3]  # one collective per step: the flag went with the sums
    assert stop.raised is (rank == 1)


def test_sigterm_rides_on_the_step_sums_and_stops_every_rank_at_the_same_step():
    """train_fsdp2.py's path (``StepLoss.check(..., stop_signal)``): each rank's flag is reduced with the step's sums, in
    the step's one all_reduce, and every rank decides on the reduced count alone: a signal on rank 1 that lands right
    after step 2's all_reduce stops no rank at step 2 and every rank at step 3."""
    run_ranks(check_stop_request_rides_on_the_step_sums, 2)


def test_sigterm_between_the_all_reduce_and_the_decision_counts_next_step_on_every_rank():
    """A rank signalled just after the step's all-reduce does not stop (and save) alone: each step's decision is
    the all-reduced value only."""
    run_ranks(check_stop_signal_is_agreed, 2)


def test_step_clock_laps_tile_the_training_time_and_leave_out_what_follows_a_drain(monkeypatch):
    from megablocks_utils.train import step_clock

    now = iter([0.0, 1.0, 2.5, 3.0, 10.0, 11.0])  # step 1 starts, its check; step 2's check, a drain; step 3 after an eval
    monkeypatch.setattr(step_clock.time, "perf_counter", lambda: next(now))
    clock = step_clock.StepClock(torch.device("cpu"))
    clock.start()
    first = clock.lap()
    clock.start()  # the lap runs on from step 1's check: no new mark
    second = clock.lap() + clock.drain()  # step 2: its forwards and backwards, then its optimizer up to the drain
    clock.start()  # after the drain (an eval from 3.0 to 10.0): a new mark
    third = clock.lap()
    assert (first, second, third) == (1.0, 2.0, 1.0)  # 3.0 + 1.0 of training, the 7.0 between left out
