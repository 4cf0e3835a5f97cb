"""What the GPU tests share: the skip mark, a runner of a function on N GPU ranks (NCCL, one process per
GPU), concurrent launches of the training scripts, and a host-sync check. Imports nothing CUDA-only."""

import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import pytest
import torch
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# NVLink multicast off, as bench/device_env.sh sets it for every device command (the lent machines' KINDS.md).
GPU_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1", "PYTHONUNBUFFERED": "1"}


def gpus(n: int):
    """Skip unless this machine has ``n`` CUDA GPUs (device_count creates no CUDA context; 0 on a CPU build)."""
    found = torch.cuda.device_count()
    return pytest.mark.skipif(found < n, reason=f"needs {n} CUDA GPU{'s' if n > 1 else ''}, found {found}")


def host_sync_error(fn) -> str:
    """Call ``fn`` (already warmed up: compiling syncs) under CUDA's sync debug mode "error": "" if it made no host
    sync, else the start of the error that names it."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        return ""
    except RuntimeError as e:
        return str(e)[:500]
    finally:
        torch.cuda.set_sync_debug_mode("default")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, fn, args, out_dir):
    import torch.distributed as dist

    os.environ.update(GPU_ENV, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    try:
        result = fn(rank, world, *args)
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    # Done: leave without the interpreter's teardown (tests/conftest.py's _worker says why).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_on_gpus(fn, world: int, *args, timeout: float = 600) -> list:
    """``fn(rank, world, *args)`` on ``world`` GPUs, one spawned process each with an NCCL process group; returns
    every rank's JSON-able result. A rank's exception fails the test with its traceback; past ``timeout`` seconds
    the ranks are stopped and the test fails (a hang in a collective is a failure, not a stuck suite)."""
    for attempt in range(PORT_ATTEMPTS):
        try:
            return _run_on_gpus(fn, world, args, timeout)
        except _PortTaken:
            if attempt == PORT_ATTEMPTS - 1:
                raise
    raise AssertionError("unreachable")


# A port free_port saw free can be taken before rank 0's store binds it: by another lane's launch (tests/gpu/lanes.sh runs
# five pytest processes at once; 4 x H200, 2026-11-27: two module fixtures failed with EADDRINUSE). Such a launch, which
# ran none of the test's work, is tried again on a new port; so is an accelerate launch (launch_together; 4 x H200,
# 2026-11-28: lane a's fsdp1 run of test_four_gpus, "TCPStore ... EADDRINUSE").
PORT_ATTEMPTS = 3


class _PortTaken(Exception):
    pass


def _run_on_gpus(fn, world: int, args: tuple, timeout: float) -> list:
    with tempfile.TemporaryDirectory() as out_dir:
        context = mp.start_processes(_worker, args=(world, free_port(), fn, args, out_dir), nprocs=world, join=False,
                                     start_method="spawn")
        deadline = time.monotonic() + timeout
        try:
            while not context.join(timeout=5):
                if time.monotonic() > deadline:
                    for p in context.processes:
                        p.kill()
                    pytest.fail(f"{fn.__name__} on {world} GPU(s) did not finish in {timeout:.0f} s", pytrace=False)
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
            if "EADDRINUSE" in str(e):
                for p in context.processes:
                    p.kill()
                raise _PortTaken(str(e)) from e
            pytest.fail(f"{fn.__name__} on {world} GPU(s) failed:\n{e}", pytrace=False)
        results = []
        for rank in range(world):
            with open(os.path.join(out_dir, f"rank{rank}.json")) as f:
                results.append(json.load(f))
        return results


def train_fsdp2(nproc: int, output_dir: str, *args: str) -> list[str]:
    """The torchrun command of train_fsdp2.py on ``nproc`` GPUs writing to ``output_dir``."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            os.path.join(ROOT, "train_fsdp2.py"), "--output_dir", output_dir, "--overwrite_output_dir", "true", *args]


def train_fsdp1(nproc: int, output_dir: str, *args: str) -> list[str]:
    """README's `accelerate launch` command of train_fsdp1.py on ``nproc`` GPUs writing to ``output_dir``."""
    return [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(nproc), "--main_process_port",
            str(free_port()), "--config_file", os.path.join(ROOT, "accelerate.yaml"), os.path.join(ROOT, "train_fsdp1.py"),
            "--accelerator_config", os.path.join(ROOT, "accelerator_config.json"), "--output_dir", output_dir, *args]


def launch_together(commands: dict[str, list[str]], timeout: float = 500) -> dict[str, str]:
    """Start every command at once (the tiny model's runs share the GPUs easily; most of each is start-up and
    compiling, on the CPU), wait for all; fail naming the ones that exited non-zero, with their output's end.
    A launch whose rendezvous port was taken (EADDRINUSE, see PORT_ATTEMPTS) is started again on a new port.
    Returns each command's output."""
    deadline = time.monotonic() + timeout
    outputs, codes = {}, {}
    todo = dict(commands)
    for attempt in range(PORT_ATTEMPTS):
        done = _start_and_wait(todo, deadline)
        outputs.update((name, out) for name, (_, out) in done.items())
        codes.update((name, code) for name, (code, _) in done.items())
        todo = {name: with_new_port(todo[name]) for name, (code, out) in done.items()
                if code != 0 and port_taken(out) and "--main_process_port" in todo[name]}
        if not todo:
            break
    failed = [f"--- {name}: exit {code} (-9: stopped after {timeout:.0f} s)\n{outputs[name][-3000:]}"
              for name, code in codes.items() if code != 0]
    if failed:
        pytest.fail("\n".join(failed), pytrace=False)
    return outputs


def port_taken(output: str) -> bool:
    """The launch failed at its rendezvous because another process bound the port first (it ran none of its work)."""
    return "EADDRINUSE" in output and "TCPStore" in output


def with_new_port(command: list[str]) -> list[str]:
    """``command`` with the value after ``--main_process_port`` (accelerate's rendezvous port) replaced by a free one.
    torchrun's ``--standalone`` picks its own port when it binds, so only accelerate's launches race for one."""
    i = command.index("--main_process_port") + 1
    return [*command[:i], str(free_port()), *command[i + 1:]]


def _start_and_wait(commands: dict[str, list[str]], deadline: float) -> dict[str, tuple[int, str]]:
    procs = {}
    for name, command in commands.items():
        log = tempfile.TemporaryFile(mode="w+")
        procs[name] = (subprocess.Popen(command, cwd=ROOT, env=dict(os.environ, **GPU_ENV), stdout=log,
                                        stderr=subprocess.STDOUT, text=True, start_new_session=True), log)
    done = {}
    for name, (proc, log) in procs.items():
        try:
            proc.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
        log.seek(0)
        done[name] = (proc.returncode, log.read())
        log.close()
    return done


def metrics(output_dir: str) -> list[dict]:
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def worst_relative(a: list[dict], b: list[dict], key: str) -> float:
    """The largest per-step |a - b| / |b| of ``key`` over two runs of the same steps."""
    assert [r["step"] for r in a] == [r["step"] for r in b], "the runs logged different steps"
    return max(abs(x[key] - y[key]) / abs(y[key]) for x, y in zip(a, b))
