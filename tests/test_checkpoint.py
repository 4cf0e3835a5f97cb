"""Sharded checkpoints: exact resume after kill -9 (mid-step and mid-save), SIGTERM, resharding, export."""

import os
import re
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch
from conftest import ROOT, exit_codes, read_jsonl, run_script, standard_args

# The kill tests' runs: 6 steps, checkpoints at 2, 4, 6, on a model with attention dropout, so that a
# resumed run's losses equal the uninterrupted run's only if each rank's RNG state is restored too; with adamw_bf16
# (bf16 weights and moments, stochastic rounding), whose rounding noise comes from torch's CPU generator
# (adamw_bf16.py): the resumed run rounds its updates as the uninterrupted one did only if that state is restored too.
COMMON = ["--max_steps", "6", "--save_steps", "2", "--save_total_limit", "3", "--optim", "adamw_bf16",
          "--gradient_accumulation_steps", "2", "--warmup_steps", "2", "--per_device_train_batch_size", "2"]
RESUMED = re.compile(r"resumed from (\S+) at step (\d+) ")


def launch(model_dir, out, nproc=2, *args, faults=()):
    """train_fsdp2.py on ``nproc`` ranks, started in the background; with ``faults``, through tests/inject_faults.py."""
    script = ["tests/inject_faults.py", *faults, "train_fsdp2.py"] if faults else ["train_fsdp2.py"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *script,
           "--model_name_or_path", model_dir, "--output_dir", out, *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def train(model_dir, out, nproc, *args):
    result = run_script("train_fsdp2.py", nproc, "--model_name_or_path", model_dir, "--output_dir", out, *args)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def resumed_at(result) -> int:
    """The step the run says it resumed at."""
    found = RESUMED.findall(result.stdout)
    assert len(found) == 1, result.stdout[-2000:]
    return int(found[0][1])


def wait_for(path, proc, timeout=120):
    start = time.time()
    while not os.path.exists(path):
        assert proc.poll() is None, f"the run ended before {path} appeared: {proc.stderr.read()[-2000:]}"
        assert time.time() - start < timeout, f"{path} did not appear"
        time.sleep(0.02)


def records_written(metrics: str) -> int:
    """Complete lines of metrics.jsonl (rank 0 writes and flushes one per finished step)."""
    if not os.path.exists(metrics):
        return 0
    with open(metrics) as f:
        return f.read().count("\n")


def kill_mid_step(proc, out, nproc, after_records, timeout=300):
    """kill -9 every rank while they compute the step after ``after_records`` finished steps.

    The ranks are frozen (SIGSTOP) the moment rank 0 has written that many records, so what is on disk
    is exactly what a kill at that moment leaves; then the ranks and torchrun are killed (torchrun gives
    each worker a session of its own: killing torchrun's process group would leave the ranks running).
    Returns the number of records written and the names in checkpoints/.
    """
    metrics = os.path.join(out, "metrics.jsonl")
    ranks, start = [], time.time()
    try:
        while records_written(metrics) < after_records:
            assert proc.poll() is None, f"the run ended before it was killed: {proc.stderr.read()[-2000:]}"
            assert time.time() - start < timeout, f"no {after_records} steps in {timeout} s"
            if len(ranks) < nproc and os.path.exists(metrics):  # every rank has loaded the model
                ranks = [p for p in psutil.Process(proc.pid).children(recursive=True) if "train_fsdp2.py" in " ".join(p.cmdline())]
            time.sleep(0.002)
        for p in ranks:
            p.suspend()
        assert len(ranks) == nproc, ranks
        written = records_written(metrics)
        names = sorted(os.listdir(os.path.join(out, "checkpoints")))
    finally:
        for p in [*ranks, psutil.Process(proc.pid)]:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        proc.communicate()
    gone, alive = psutil.wait_procs(ranks, timeout=30)
    assert not alive, alive
    return written, names


@pytest.fixture(scope="module")
def dropout_reference(dropout_model_dir, tmp_path_factory):
    """The uninterrupted run of the kill tests: 2 ranks, ep=2, checkpoints at steps 2, 4, 6."""
    out = str(tmp_path_factory.mktemp("reference") / "run")
    train(dropout_model_dir, out, 2, *COMMON)
    return out


def losses(out):
    return [(r["step"], r["loss"], r["grad_norm"]) for r in read_jsonl(os.path.join(out, "metrics.jsonl"))]


def test_kill_mid_step_then_resume_is_bit_identical(dropout_model_dir, dropout_reference, tmp_path):
    """kill -9 in step 4: the resumed run starts from step 2's checkpoint, drops the records of the steps
    after it, and repeats them with the same losses, dropout included (the RNG state is restored)."""
    out = str(tmp_path / "run")
    proc = launch(dropout_model_dir, out, 2, *COMMON)
    written, names = kill_mid_step(proc, out, 2, after_records=3)
    assert 3 <= written < 6, f"the kill landed after step {written}"  # fewer records than the run's 6
    complete = [int(n[5:]) for n in names if not n.endswith(".tmp")]
    assert complete and max(complete) < written, (names, written)  # so the resumed run repeats recorded steps
    assert not os.path.exists(os.path.join(out, "summary.json"))
    result = train(dropout_model_dir, out, 2, *COMMON, "--resume", "auto")
    assert resumed_at(result) == max(complete) < 6  # at least one step trained after the resume
    assert "is not used" not in result.stdout, "the learning rate warning fired for the same learning rate"
    expected = losses(dropout_reference)
    assert [s for s, _, _ in expected] == [1, 2, 3, 4, 5, 6]
    assert losses(out) == expected  # exact equality: bit-identical on CPU


def test_kill_mid_save_leaves_only_a_partial_that_resume_ignores(dropout_model_dir, dropout_reference, tmp_path):
    out = str(tmp_path / "run")
    proc = launch(dropout_model_dir, out, 2, *COMMON, faults=["--kill_in_save_at", "4"])
    _, stderr = proc.communicate(timeout=300)
    assert exit_codes(stderr)[0] == -9, stderr[-3000:]  # rank 0 killed itself inside the save
    names = sorted(os.listdir(os.path.join(out, "checkpoints")))
    assert names == ["step_00000002", "step_00000004.tmp"], names
    assert records_written(os.path.join(out, "metrics.jsonl")) == 4  # step 4 was recorded, then its save died
    result = train(dropout_model_dir, out, 2, *COMMON, "--resume", "auto")
    assert "step_00000002 at step 2" in result.stdout and resumed_at(result) == 2
    expected = losses(dropout_reference)
    assert [s for s, _, _ in expected] == [1, 2, 3, 4, 5, 6]
    assert losses(out) == expected


def test_sigterm_saves_a_checkpoint_and_exits_zero(tiny_model_dir, tmp_path):
    out = str(tmp_path / "run")
    proc = launch(tiny_model_dir, out, 2, "--max_steps", "500")
    metrics = os.path.join(out, "metrics.jsonl")
    wait_for(metrics, proc)
    while not records_written(metrics):  # a first finished step: every rank is in the training loop
        assert proc.poll() is None, proc.stderr.read()[-2000:]
        time.sleep(0.05)
    for child in psutil.Process(proc.pid).children(recursive=True):  # what a scheduler does: signal every task
        child.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr[-3000:]
    assert "SIGTERM: saved" in stdout
    saved = [n for n in os.listdir(os.path.join(out, "checkpoints")) if n.startswith("step_")]
    assert len(saved) == 1 and not saved[0].endswith(".tmp"), saved
    assert int(saved[0][5:]) == len(read_jsonl(metrics)) < 500


@pytest.mark.parametrize("nproc,ep,micro", [
    (2, 1, 2),
    pytest.param(4, 2, 1, marks=pytest.mark.slow),
    pytest.param(4, 4, 1, marks=pytest.mark.slow),
], ids=["dp2-ep1", "dp2-ep2", "dp1-ep4"])
def test_resume_on_another_mesh(tiny_model_dir, small_data, two_rank_run, tmp_path, nproc, ep, micro):
    """A (dp=1, ep=2) checkpoint (conftest's standard 2-rank run) continues on other splits and world
    sizes with the same losses.

    A different --learning_rate on resume is not used (the checkpoint's schedule continues), and the run says so."""
    out = str(tmp_path / "run")
    ckpt = os.path.join(two_rank_run, "checkpoints", "step_00000002")
    result = run_script("train_fsdp2.py", nproc, *standard_args(tiny_model_dir, small_data), "--output_dir", out,
                        "--per_device_train_batch_size", str(micro), "--ep_size", str(ep), "--resume", ckpt, "--learning_rate", "0.5")
    assert result.returncode == 0, result.stderr[-3000:]
    assert resumed_at(result) == 2
    assert result.stdout.count("a resumed run continues its schedule, so learning_rate=0.5 is not used") == 1, result.stdout[-2000:]
    expected = {step: (loss, norm) for step, loss, norm in losses(two_rank_run)}
    assert sorted(expected) == [1, 2, 3, 4]
    got = losses(out)
    assert [s for s, _, _ in got] == [3, 4]
    for step, loss, norm in got:
        assert abs(loss - expected[step][0]) <= 1e-5 * expected[step][0], (step, loss, expected[step])
        assert abs(norm - expected[step][1]) <= 1e-5 * expected[step][1], (step, norm, expected[step])


def test_export_command_matches_the_live_export(two_rank_run, tmp_path):
    from transformers import AutoModelForCausalLM

    out = str(tmp_path / "hf")
    reference = two_rank_run
    result = subprocess.run([sys.executable, "-m", "megablocks_utils.tools.export", os.path.join(reference, "checkpoints", "step_00000004"), out],
                            cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    exported = AutoModelForCausalLM.from_pretrained(out)
    live = AutoModelForCausalLM.from_pretrained(os.path.join(reference, "final"))
    ids = torch.tensor([[1, 7, 42, 99, 3, 250]])
    torch.testing.assert_close(exported(ids).logits, live(ids).logits, rtol=0, atol=0)


def test_truncated_checkpoint_is_a_clear_error(tiny_model_dir, small_data, two_rank_run, tmp_path, capsys):
    ckpt = str(tmp_path / "step_00000004")
    shutil.copytree(os.path.join(two_rank_run, "checkpoints", "step_00000004"), ckpt)
    shard = next(os.path.join(ckpt, n) for n in sorted(os.listdir(ckpt)) if n.endswith(".distcp"))
    with open(shard, "r+b") as f:
        f.truncate(64)  # cut inside the first tensor
    result = run_script("train_fsdp2.py", 2, *standard_args(tiny_model_dir, small_data), "--output_dir", str(tmp_path / "run"),
                        "--per_device_train_batch_size", "2", "--resume", ckpt)
    assert result.returncode != 0
    assert "is corrupt or truncated" in result.stderr, result.stderr[-3000:]
    from megablocks_utils.tools import export

    assert export.main([ckpt, str(tmp_path / "hf")]) == 2  # the export command's entry point, in this process
    printed = capsys.readouterr().out
    assert "corrupt or truncated" in printed, printed


OLD = os.path.join(ROOT, "tests", "fixtures", "checkpoint_before_expert_fsdp")


def assert_continues_the_old_run(fixture: str, out: str) -> None:
    """The resumed run (steps 3 and 4 in ``out``) has the fixture's recorded losses and gradient norms."""
    expected = {r["step"]: r for r in read_jsonl(os.path.join(fixture, "metrics.jsonl"))}
    got = read_jsonl(os.path.join(out, "metrics.jsonl"))
    assert len(expected) == 4 and [r["step"] for r in got] == [3, 4], [r["step"] for r in got]
    for r in got:
        for key in ("loss", "grad_norm"):
            assert abs(r[key] - expected[r["step"]][key]) <= 1e-5 * abs(expected[r["step"]][key]), (r["step"], key, r[key])


@pytest.mark.parametrize("nproc,ep,micro", [(2, 2, 2), pytest.param(4, 2, 1, marks=pytest.mark.slow)], ids=["dp1-ep2", "dp2-ep2-sharded"])
def test_resume_from_a_checkpoint_written_before_experts_were_fsdp_sharded(tmp_path, nproc, ep, micro):
    """A checkpoint of the old layout (experts replicated over dp, no FSDP on them) resumes into the new
    one, also with experts FSDP-sharded over dp = 2, and continues the old run's losses."""
    out = str(tmp_path / "run")
    shutil.copytree(os.path.join(OLD, "step_00000002"), os.path.join(out, "checkpoints", "step_00000002"))
    train(os.path.join(OLD, "model"), out, nproc, "--max_steps", "4", "--save_steps", "0", "--gradient_accumulation_steps", "2",
          "--warmup_steps", "2", "--per_device_train_batch_size", str(micro), "--ep_size", str(ep), "--resume", "auto",
          "--shard_experts", "true", "--packing", "false")  # the old run's data: one padded sample per row
    assert_continues_the_old_run(OLD, out)


EXPERTS_UNDER_FSDP = os.path.join(ROOT, "tests", "fixtures", "checkpoint_experts_fsdp_dp1")


def test_resume_from_a_checkpoint_with_experts_under_fsdp_at_dp1(tmp_path):
    """A checkpoint of the previous layout (experts under FSDP at dp = 1: 3-D DTensors) resumes into today's (on
    one-rank expert meshes they stay out of FSDP: 1-D DTensors on the ep mesh) and
    continues the old run's losses."""
    out = str(tmp_path / "run")
    shutil.copytree(os.path.join(EXPERTS_UNDER_FSDP, "step_00000002"), os.path.join(out, "checkpoints", "step_00000002"))
    result = train(os.path.join(OLD, "model"), out, 2, "--max_steps", "4", "--save_steps", "0", "--gradient_accumulation_steps", "2",
                   "--warmup_steps", "2", "--per_device_train_batch_size", "2", "--ep_size", "2", "--resume", "auto")
    assert "the experts stay out of FSDP" in result.stdout, result.stdout[-2000:]
    assert_continues_the_old_run(EXPERTS_UNDER_FSDP, out)


def test_resume_with_packing_changed_warns_and_goes_on(two_rank_run, tiny_model_dir, small_data, tmp_path):
    """The shared 2-rank run (packed rows) resumed from its step-2 checkpoint with packing off: the data order
    cannot continue the original run's, and the run says so before it trains on."""
    from conftest import TWO_RANK_ARGS

    out = str(tmp_path / "run")
    shutil.copytree(os.path.join(two_rank_run, "checkpoints", "step_00000002"), os.path.join(out, "checkpoints", "step_00000002"))
    result = train(tiny_model_dir, out, 2, *standard_args(tiny_model_dir, small_data)[2:], *TWO_RANK_ARGS, "--resume", "auto",
                   "--packing", "false", "--max_steps", "3")
    assert resumed_at(result) == 2
    assert re.search(r"warning: the checkpoint's run used \d+ rows per step, this one \d+ samples: the data order after "
                     r"resume differs from the original run", result.stdout), result.stdout[-2000:]
    assert [r["step"] for r in read_jsonl(os.path.join(out, "metrics.jsonl"))] == [3]


def test_the_same_command_again_has_nothing_to_do(tiny_model_dir, small_data, two_rank_run):
    """A finished run's command run again (the quick start twice in a row) ends at once with exit 0 and one line, no
    launcher traceback, and leaves the run as it was; another setting there is still refused."""
    from conftest import TWO_RANK_ARGS, run_script, standard_args

    summary = os.path.join(two_rank_run, "summary.json")
    before = (os.path.getmtime(summary), sorted(os.listdir(two_rank_run)))
    result = run_script("train_fsdp2.py", 2, "--output_dir", two_rank_run, *standard_args(tiny_model_dir, small_data), *TWO_RANK_ARGS)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    assert lines == [f"{two_rank_run} already holds this run, finished with these settings (summary.json, final/): nothing to do; "
                     "to train it again pass --overwrite_output_dir true, or choose another --output_dir"], result.stdout
    assert "Traceback" not in result.stderr and "ChildFailedError" not in result.stderr, result.stderr[-3000:]
    assert (os.path.getmtime(summary), sorted(os.listdir(two_rank_run))) == before
    other = run_script("train_fsdp2.py", 2, "--output_dir", two_rank_run, *standard_args(tiny_model_dir, small_data), *TWO_RANK_ARGS,
                       "--learning_rate", "1e-3")
    assert other.returncode != 0 and "already holds a run's results" in other.stderr, other.stderr[-2000:]
