"""Shared test helpers: tiny MoE configs and a launcher that runs a function on N real gloo ranks."""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def tiny_mixtral_config(**overrides):
    return tiny_moe_config("mixtral", **overrides)


# Per-architecture settings on top of the shared tiny sizes; values away from the defaults where a
# default would hide a difference (Granite's multipliers, Qwen2's dense layer between MoE layers).
TINY_EXTRAS = {
    "mixtral": dict(num_local_experts=4),
    "qwen2_moe": dict(
        num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=48, norm_topk_prob=False,
        num_hidden_layers=3, mlp_only_layers=[1], intermediate_size=40,
    ),
    "qwen3_moe": dict(num_experts=4, moe_intermediate_size=32, norm_topk_prob=True, head_dim=16),
    "olmoe": dict(num_experts=4, norm_topk_prob=False, bos_token_id=1, eos_token_id=2),
    "granitemoe": dict(
        num_local_experts=4, embedding_multiplier=2.0, logits_scaling=1.5, residual_multiplier=0.7, attention_multiplier=0.2
    ),
    "granitemoeshared": dict(
        num_local_experts=4, shared_intermediate_size=24, embedding_multiplier=2.0, logits_scaling=1.5,
        residual_multiplier=0.7, attention_multiplier=0.2,
    ),
    # 8 experts in 2 groups, 1 group kept per token; layer 0 dense; tiny MLA; no aux loss (its coef is ignored).
    "deepseek_v3": dict(
        n_routed_experts=8, n_group=2, topk_group=1, moe_intermediate_size=16, n_shared_experts=2, first_k_dense_replace=1,
        num_hidden_layers=3, routed_scaling_factor=2.5, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
    ),
    # DeepSeek-V2-Lite's layout (q_proj without the q low-rank path), group-limited routing (2 groups of 4, the best
    # one kept per token: a group scores its best expert); layer 0 dense; no aux loss.
    "deepseek_v2": dict(
        n_routed_experts=8, n_group=2, topk_group=1, topk_method="group_limited_greedy", moe_intermediate_size=16,
        n_shared_experts=2, first_k_dense_replace=1, num_hidden_layers=3, routed_scaling_factor=2.5, num_key_value_heads=4,
        q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
    ),
    "glm4_moe": dict(
        n_routed_experts=8, n_group=2, topk_group=1, moe_intermediate_size=16, n_shared_experts=1, first_k_dense_replace=1,
        num_hidden_layers=3, routed_scaling_factor=1.5, norm_topk_prob=False, use_qk_norm=True, head_dim=16,
        attention_bias=True,
    ),
    # gpt-oss: a sliding-window layer (window 4 < the tests' sequences) and a full one; limit 0.2 so the clamp bites (about a fifth of the tiny model's projections)
    "gpt_oss": dict(
        num_local_experts=4, head_dim=16, sliding_window=4, layer_types=["sliding_attention", "full_attention"], swiglu_limit=0.2
    ),
}
ARCHITECTURES = sorted(TINY_EXTRAS)


def tiny_moe_config(model_type: str, **overrides):
    """A tiny random config of any architecture in the model table (4 experts, top-2)."""
    from transformers import AutoConfig

    values = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts_per_tok=2,
        max_position_embeddings=128,
        router_aux_loss_coef=0.02,
        output_router_logits=True,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    values.update(TINY_EXTRAS[model_type])
    values.update(overrides)
    return AutoConfig.for_model(model_type, **values)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, errors):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
        # Rank 0 holds the store every rank still talks to (a group of one rank is still registered there): a rank that
        # finished first and left took it down under a slower one ("Connection reset by peer" in new_group, CI-like
        # run of 2026-12-02). A failing rank skips this; start_processes then ends the ranks waiting here.
        dist.barrier()
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        raise
    finally:
        dist.destroy_process_group()
    # The check passed. Leave without the interpreter's teardown: C++ static destructors racing a library's
    # background thread once aborted a passing rank ("terminate called without an active exception", CI of
    # 2026-11-23), which no test here is about. A failing rank above still exits through the exception.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(fn, world_size: int, *args):
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; fail with the ranks' tracebacks."""
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    try:
        mp.start_processes(_worker, args=(world_size, free_port(), fn, args, errors), nprocs=world_size, start_method="spawn")
    except Exception:
        messages = []
        while not errors.empty():
            rank, tb = errors.get()
            messages.append(f"--- rank {rank} ---\n{tb}")
        pytest.fail("\n".join(messages) or "a rank failed", pytrace=False)


def _run_cases(rank, world_size, cases, out_dir):
    """``fn(rank, world_size, *args)`` for each (name, (fn, *args)) of ``cases`` in turn, on one process group; each outcome
    appended to out_dir/rank<rank>.jsonl. At the first failure the rank leaves at once: the others' next collective
    fails (gloo sees the closed connection) and torch.multiprocessing ends them, so a failure is never a hang."""
    path = os.path.join(out_dir, f"rank{rank}.jsonl")
    for name, (fn, *args) in cases:
        try:
            fn(rank, world_size, *args)
            error = None
        except Exception:
            error = traceback.format_exc()
        with open(path, "a") as f:
            f.write(json.dumps({"case": name, "error": error}) + "\n")
        if error:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)


def run_rank_cases(world_size: int, cases: dict, out_dir: str) -> dict:
    """``run_ranks`` for many checks in one start of the ranks (their imports and process group paid once; a module
    fixture shares it, each case's test reads its outcome). ``cases``: {name: (fn, *args)}, run in order. Returns
    {name: None where every rank passed it, else what went wrong}; cases after a failed one are not judged, and say so."""
    os.makedirs(out_dir, exist_ok=True)
    try:
        run_ranks(_run_cases, world_size, list(cases.items()), out_dir)
    except pytest.fail.Exception:
        pass  # the records below say which case failed
    records = {name: {} for name in cases}
    for rank in range(world_size):
        path = os.path.join(out_dir, f"rank{rank}.jsonl")
        for line in open(path).read().splitlines() if os.path.exists(path) else []:
            record = json.loads(line)
            records[record["case"]][rank] = record["error"]
    outcome, failed = {}, None
    for name, by_rank in records.items():  # in the order they ran
        errors = "\n".join(f"--- rank {r} ---\n{e}" for r, e in sorted(by_rank.items()) if e)
        if failed:  # what a rank saw after a peer left is no finding about this case
            outcome[name] = f"not judged: case {failed} failed before it" + (f"; then:\n{errors}" if errors else "")
        elif errors or len(by_rank) < world_size:
            outcome[name] = errors or f"no outcome from ranks {sorted(set(range(world_size)) - set(by_rank))}: a rank died"
            failed = name
        else:
            outcome[name] = None
    return outcome


def nan_in_uninitialized_memory() -> None:
    """From here on in this process, every tensor torch allocates without values (``empty``, ``empty_like``, the
    outputs of ops that leave rows unwritten) starts as NaN, not as whatever the allocator had: a value that leaks from
    such rows (even times 0) then shows up every run instead of by chance (torch's ``fill_uninitialized_memory``, which
    applies under deterministic algorithms)."""
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True


def run_in_triton_interpreter(code: str) -> dict:
    """Run ``code`` (a script that prints one JSON line last) in a child process with Triton's CPU interpreter on
    (``TRITON_INTERPRET`` is read when Triton is imported, so not in this process); its JSON."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT, CUDA_VISIBLE_DEVICES="")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture
def tmp_dir(tmp_path):
    return str(tmp_path)


def run_script(script: str, nproc: int, *args: str, timeout: int = 300, cwd: str = ROOT):
    """Launch a training script with torchrun on ``nproc`` CPU ranks; returns the CompletedProcess."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", os.path.join(ROOT, script), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """The embedded default model, made once per test session the way the scripts make it."""
    from megablocks_utils.model.tiny import make_tiny_mixtral

    path = str(tmp_path_factory.mktemp("models") / "tiny-mixtral")
    make_tiny_mixtral(path, os.path.join(ROOT, "data.json"))
    return path


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir):
    """The embedded model's tokenizer."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="session")
def samples(tokenizer):
    """data.json's records tokenized (max_length 1024: none truncated), unpacked."""
    from megablocks_utils.data.records import build_dataset

    return build_dataset(os.path.join(ROOT, "data.json"), tokenizer, 1024)[0]


def exit_codes(stderr: str) -> dict[int, int]:
    """The exit codes in torchrun's failure report (accelerate launch prints the same one), parsed:
    {global rank: exit code} for every rank it lists. It lists only ranks that failed or that it stopped
    (SIGTERM: -15); a rank that exited 0 is not in it, and a run without failures has no report ({})."""
    found = re.findall(r"^\s*rank\s*:\s*(\d+) \(local_rank: \d+\)\n\s*exitcode\s*:\s*(-?\d+)", stderr, re.M)
    codes = {int(rank): int(code) for rank, code in found}
    assert len(codes) == len(found), f"a rank is listed twice in the report: {found}"
    return codes


def every_rank_failed(stderr: str, world_size: int) -> dict[int, int]:
    """Assert that the report lists every rank with a non-zero exit code (none ended well); returns the codes."""
    codes = exit_codes(stderr)
    assert sorted(codes) == list(range(world_size)) and 0 not in codes.values(), f"exit codes {codes}\n{stderr[-3000:]}"
    return codes


# ----------------------------------------------------------------------------- shared runs
# The standard train_fsdp2.py runs, launched once per session and read by several test files (a launch
# costs ~15 s of start-up on 2 cores; steps cost little). 90 samples pack into 27 rows of 256 tokens:
# an epoch is 3 steps of 8 rows, so step 4 is in the second epoch. Tests that launch a variant add their
# flags to standard_args.
TRAIN_STEPS = ["--max_steps", "4", "--gradient_accumulation_steps", "2", "--warmup_steps", "1"]
STANDARD_STEPS = [*TRAIN_STEPS, "--save_steps", "2"]
NUM_SAMPLES = 90
TWO_RANK_ARGS = ["--ep_size", "2", "--per_device_train_batch_size", "2", "--activation_checkpointing", "full"]


@pytest.fixture(scope="session")
def small_data(tmp_path_factory) -> str:
    """The first NUM_SAMPLES samples of data.json."""
    path = tmp_path_factory.mktemp("data") / "data.json"
    with open(os.path.join(ROOT, "data.json")) as f:
        path.write_text(json.dumps(json.load(f)[:NUM_SAMPLES]))
    return str(path)


@pytest.fixture(scope="session")
def dropout_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with attention dropout 0.1: every training step draws from each rank's RNG, so a
    resumed run repeats the uninterrupted one's losses only if its RNG state was restored."""

    path = str(tmp_path_factory.mktemp("dropout") / "tiny-mixtral-dropout")
    shutil.copytree(tiny_model_dir, path)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["attention_dropout"] = 0.1
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


def standard_args(tiny_model_dir: str, small_data: str) -> list[str]:
    return ["--model_name_or_path", tiny_model_dir, "--data_path", small_data, *STANDARD_STEPS]


def train_fsdp2(nproc: int, out: str, *args: str) -> subprocess.CompletedProcess:
    """train_fsdp2.py on ``nproc`` ranks into ``out``; fails the test unless it exits 0."""
    result = run_script("train_fsdp2.py", nproc, "--output_dir", out, *args)
    assert result.returncode == 0, result.stderr[-4000:]
    return result


@pytest.fixture(scope="session")
def one_rank_run(tiny_model_dir, small_data, tmp_path_factory) -> str:
    """1 rank, 4 samples per micro-step, activation checkpointing: the reference the N-rank runs and the
    plain transformers loop are held to. Returns its output_dir."""
    out = str(tmp_path_factory.mktemp("one_rank") / "run")
    train_fsdp2(1, out, *standard_args(tiny_model_dir, small_data), "--per_device_train_batch_size", "4",
                "--activation_checkpointing", "full")
    return out


@pytest.fixture(scope="session")
def two_rank_run(tiny_model_dir, small_data, tmp_path_factory) -> str:
    """2 ranks (dp 1 x ep 2), 2 samples each per micro-step, activation checkpointing: the same global
    batches as ``one_rank_run``, with checkpoints at steps 2 and 4. Returns its output_dir."""
    out = str(tmp_path_factory.mktemp("two_rank") / "run")
    train_fsdp2(2, out, *standard_args(tiny_model_dir, small_data), *TWO_RANK_ARGS)
    return out


def read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: launches 4 ranks or waits on timeouts (still run in CI; -m 'not slow' skips them locally)")
