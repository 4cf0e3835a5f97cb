"""The two-node torchrun command of docs/multinode.md, as two torchrun agents on this machine (c10d rendezvous on
localhost, one rank each): the same run as one node with two ranks."""

import json
import os
import signal
import subprocess
import sys
import time

from conftest import ROOT, TWO_RANK_ARGS, free_port, read_jsonl, standard_args


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (torchrun starts its workers in their own sessions)."""
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_tree(proc: subprocess.Popen) -> None:
    for pid in [*descendants(proc.pid), proc.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def run_two_nodes(log_dir: str, *args: str, timeout: float = 300) -> None:
    """docs/multinode.md's command on two "nodes": two torchrun agents meeting at a c10d rendezvous on localhost."""
    endpoint = f"localhost:{free_port()}"
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    agents, logs = [], []
    try:
        for node in range(2):
            logs.append(open(os.path.join(log_dir, f"node{node}.log"), "w+"))
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
                   "--rdzv_backend=c10d", f"--rdzv_endpoint={endpoint}", f"--rdzv_id=test-{os.getpid()}",
                   "train_fsdp2.py", *args]
            agents.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=logs[-1], stderr=subprocess.STDOUT))
        deadline = time.monotonic() + timeout
        # Stop at the first failure: the other node would otherwise wait for its peer until gloo times out.
        while any(a.poll() is None for a in agents) and all(a.poll() in (None, 0) for a in agents):
            assert time.monotonic() < deadline, f"the two nodes did not finish in {timeout} s"
            time.sleep(0.5)
        codes = [a.poll() for a in agents]
        assert codes == [0, 0], f"exit codes {codes}\n" + "\n".join(
            f"--- node {i} ---\n{tail(log)}" for i, log in enumerate(logs))
    finally:
        for agent in agents:
            if agent.poll() is None:
                kill_tree(agent)
        for log in logs:
            log.close()


def tail(log, chars: int = 3000) -> str:
    log.flush()
    log.seek(0)
    return log.read()[-chars:]


def test_two_nodes_equal_one_node(tiny_model_dir, small_data, two_rank_run, tmp_path):
    one_node = two_rank_run  # conftest's standard 2-rank run; here the same settings on two nodes of one rank each
    # Both "nodes" write to one output_dir, as on a shared file system.
    two_nodes = str(tmp_path / "two_nodes")
    run_two_nodes(str(tmp_path), *standard_args(tiny_model_dir, small_data), "--output_dir", two_nodes, *TWO_RANK_ARGS)

    one = read_jsonl(os.path.join(one_node, "metrics.jsonl"))
    two = read_jsonl(os.path.join(two_nodes, "metrics.jsonl"))
    assert [r["step"] for r in two] == [1, 2, 3, 4]  # one writer (global rank 0): no duplicated records
    assert [r["step"] for r in one] == [1, 2, 3, 4]
    for a, b in zip(two, one):  # same ranks, same collectives: bit-identical, not just close
        for key in ("loss", "ce_loss", "aux_loss", "grad_norm", "lr", "tokens", "tokens_per_expert"):
            assert a[key] == b[key], (a["step"], key, a[key], b[key])
    with open(os.path.join(two_nodes, "summary.json")) as f:
        summary = json.load(f)
    assert (summary["world_size"], summary["dp"], summary["ep"]) == (2, 1, 2)
    # Every rank's checkpoint shards and both ranks' experts of the export landed in the one directory.
    assert sorted(os.listdir(os.path.join(two_nodes, "checkpoints", "step_00000004", "rng"))) == ["rank_0.pt", "rank_1.pt"]
    names = sorted(os.listdir(os.path.join(one_node, "final")))
    assert sorted(os.listdir(os.path.join(two_nodes, "final"))) == names
    for name in names:
        if name.endswith(".safetensors"):
            assert same_bytes(os.path.join(two_nodes, "final", name), os.path.join(one_node, "final", name)), name


def same_bytes(a: str, b: str) -> bool:
    with open(a, "rb") as fa, open(b, "rb") as fb:
        return fa.read() == fb.read()
