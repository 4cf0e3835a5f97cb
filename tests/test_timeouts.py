"""A dead or stuck rank ends the job with an error on every rank, never a hang (real gloo ranks on CPU)."""

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import psutil
import pytest
import torch
import torch.distributed as dist
from conftest import ROOT, every_rank_failed, free_port, read_jsonl, run_ranks

TIMEOUT_S = 20  # small, yet well above any wait of a healthy run on 2 cores shared with another test file (-n 2) and
# with the other script's stuck-rank run (``stuck_runs`` starts both at once)


def check_mesh_groups_time_out(rank, world_size, timeout_s):
    """On a (dp=2, ep=2) mesh the dp and ep groups are groups of their own: they must time out too."""
    # The package imports its modules lazily: this loads mesh.py and errors.py, not transformers (which
    # would cost each of the 4 ranks ~20 s on 2 cores).
    from megablocks_utils.mesh import build_mesh

    mesh = build_mesh(2, "cpu", timeout=timedelta(seconds=timeout_s))
    dist.barrier()
    if rank == 3:
        time.sleep(5 * timeout_s)  # stuck: ranks 2 and 3 form an ep group
    start = time.time()
    try:
        dist.all_reduce(torch.ones(1), group=mesh.ep_group)
        failed = False
    except RuntimeError:
        failed = True
    if rank == 2:
        # Waited the group's own timeout, and failed well before the stuck rank woke. Not within 2x: torch 2.14 and
        # 2.15 raise gloo's timeout 2-4 s after it expires (3 s -> 5.2-7.3 s here under the suite's load; 2.13: 3.0 s).
        waited = time.time() - start
        assert failed and timeout_s - 0.5 <= waited < 4 * timeout_s, waited
    elif rank < 2:
        assert not failed


@pytest.mark.slow
def test_mesh_groups_have_the_given_timeout():
    run_ranks(check_mesh_groups_time_out, 4, 3)


def launch(launcher: list[str], tiny_model_dir: str, out: str, *args: str) -> subprocess.Popen:
    cmd = [sys.executable, *launcher, "--model_name_or_path", tiny_model_dir, "--output_dir", out,
           "--max_steps", "400", "--per_device_train_batch_size", "1", "--gradient_accumulation_steps", "1", *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def ranks_once_training(proc: subprocess.Popen, script: str, out: str) -> dict[int, psutil.Process]:
    """The rank processes, once a step has finished (every rank is in the training loop)."""
    metrics = os.path.join(out, "metrics.jsonl")
    start = time.time()
    while not (os.path.exists(metrics) and read_jsonl(metrics)):
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert time.time() - start < 300, "no step finished"
        time.sleep(0.05)
    workers = [p for p in psutil.Process(proc.pid).children(recursive=True) if script in " ".join(p.cmdline())]
    return {int(p.environ()["RANK"]): p for p in workers}


def kill_all(proc: subprocess.Popen, ranks: dict) -> None:
    """After a failed assertion: no process of the job outlives the test (the ranks have sessions of their own)."""
    processes = list(ranks.values())
    if proc.poll() is None:
        processes += [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]
    for p in processes:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    if proc.returncode is None:
        proc.communicate()


def assert_all_gone(proc: subprocess.Popen, ranks: dict, started: float, bound_s: float) -> str:
    """The launcher exits non-zero within ``bound_s`` of ``started`` and leaves no rank behind; returns its stderr."""
    try:
        _, stderr = proc.communicate(timeout=max(0.0, bound_s - (time.time() - started)))
    except subprocess.TimeoutExpired:
        pytest.fail(f"the job was still running {bound_s} s after the failure: a hang")
    assert proc.returncode != 0
    alive = [p.pid for p in ranks.values() if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, alive
    return stderr


@pytest.mark.slow
def test_fsdp2_dead_rank_ends_every_rank(tiny_model_dir, tmp_path):
    """kill -9 of rank 1 mid-run: torchrun stops rank 0 at once, and rank 0's own next collective fails at
    once too (gloo sees the closed connection), whichever comes first."""
    out = str(tmp_path / "run")
    proc = launch(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train_fsdp2.py"], tiny_model_dir, out,
                  "--collective_timeout_s", str(TIMEOUT_S))
    ranks = {}
    try:
        ranks = ranks_once_training(proc, "train_fsdp2.py", out)
        ranks[1].kill()
        stderr = assert_all_gone(proc, ranks, time.time(), TIMEOUT_S)
    finally:
        kill_all(proc, ranks)
    assert every_rank_failed(stderr, 2)[1] == -9, stderr[-3000:]  # rank 1 by our SIGKILL; rank 0 failed or was stopped
    assert not os.path.exists(os.path.join(out, "summary.json"))


def stuck_rank(tiny_model_dir: str, out: str, script: str) -> str:
    """SIGSTOP of rank 1 (a hang: its connections stay open): rank 0 fails when its collective times out,
    after the configured timeout; the launcher then stops rank 1, which fails when it runs again. Returns the
    launcher's stderr."""
    if script == "train_fsdp2.py":
        launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", script]
        timeout_flag = "--collective_timeout_s"
    else:
        launcher = ["-m", "accelerate.commands.launch", "--main_process_port", str(free_port()), "--num_processes", "2",
                    "--config_file", "accelerate.yaml", script, "--accelerator_config", "accelerator_config.json"]
        timeout_flag = "--ddp_timeout"  # TrainingArguments' own; the script makes it hold on CPU too
    proc = launch(launcher, tiny_model_dir, out, timeout_flag, str(TIMEOUT_S))
    ranks = {}
    try:
        ranks = ranks_once_training(proc, script, out)
        ranks[1].suspend()
        stopped = time.time()
        try:
            ranks[0].wait(timeout=TIMEOUT_S + 60)
        except psutil.TimeoutExpired:
            pytest.fail(f"rank 0 still waits {TIMEOUT_S + 60} s after rank 1 stopped (timeout {TIMEOUT_S} s)")
        waited = time.time() - stopped
        assert waited > TIMEOUT_S / 2, waited  # the timeout ended rank 0, nothing sooner
        ranks[1].resume()  # it has torchrun's SIGTERM pending; stopped, it would wait for torchrun's SIGKILL 30 s later
        return assert_all_gone(proc, ranks, stopped, TIMEOUT_S + 120)
    finally:
        kill_all(proc, ranks)


SCRIPTS = ["train_fsdp2.py", "train_fsdp1.py"]


@pytest.fixture(scope="module")
def stuck_runs(tiny_model_dir, tmp_path_factory) -> dict:
    """Both scripts' stuck-rank runs at once (``stuck_rank``): each spends most of its time waiting on its timeout, so
    side by side they cost one wait. Each script's future: its stderr, or the failure it raised."""
    with ThreadPoolExecutor(len(SCRIPTS)) as pool:
        return {s: pool.submit(stuck_rank, tiny_model_dir, str(tmp_path_factory.mktemp("stuck") / "run"), s) for s in SCRIPTS}


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS)
def test_stuck_rank_times_out_every_rank(stuck_runs, script):
    stderr = stuck_runs[script].result()  # raises what stuck_rank raised
    assert "Timed out" in stderr or "timed out" in stderr, stderr[-3000:]
