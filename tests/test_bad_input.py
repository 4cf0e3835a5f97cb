"""Bad input to train_fsdp2.py and train_fsdp1.py: one clear message from rank 0, a non-zero exit on every
rank within seconds, and nothing of an earlier run overwritten (docs/errors.md).

Most cases are caught before the process group and the model (the checks come before the launch
check), so they run the script as `python <script>` on one process, forked from this one after the
imports that take most of a start (torch, transformers' TrainingArguments): ~0.2 s a case instead of
~3 s (train_fsdp2.py) and ~8 s (train_fsdp1.py) on 2 cores. The cases that need the tokenizer, the
world size or a failure on rank 1 only run under the script's real launcher.
"""

import json
import multiprocessing
import os
import runpy
import shutil
import subprocess
import sys
import tempfile
import time

import pytest
import torch
from conftest import ROOT, every_rank_failed, free_port, run_script
from safetensors.torch import load_file, save_file

SCRIPTS = ["train_fsdp2.py", "train_fsdp1.py"]
EARLIER = {"metrics.jsonl": '{"step": 1, "loss": 1.0}\n', "summary.json": '{"final_loss": 1.0}\n'}
EXPERT = "model.layers.0.block_sparse_moe.experts.{}.w1.weight"


def clean_env() -> dict:
    """This process's environment without any launcher's variables, on CPU."""
    launcher = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "ACCELERATE_", "FSDP_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(launcher)}
    return dict(env, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")


def _run_as_main(script: str, args: tuple, stdout: str, stderr: str) -> None:
    """In the forked child: `python <script> <args>` from ROOT, with a launcher-free environment."""
    os.environ.clear()
    os.environ.update(clean_env())
    os.chdir(ROOT)
    sys.stdout, sys.stderr = open(stdout, "w"), open(stderr, "w")
    os.dup2(sys.stdout.fileno(), 1)
    os.dup2(sys.stderr.fileno(), 2)
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")  # its sys.exit(code) becomes the child's exit code


def run_plain(script: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`python <script> <args>` on one process (the script runs unchanged as __main__ in a forked child)."""
    from transformers import Trainer, TrainingArguments  # noqa: F401  (imported once here, not in every child)

    with tempfile.TemporaryDirectory() as tmp:
        stdout, stderr = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        child = multiprocessing.get_context("fork").Process(target=_run_as_main, args=(script, args, stdout, stderr))
        child.start()
        child.join(timeout)
        if child.is_alive():
            child.kill()
            child.join()
        with open(stdout) as out, open(stderr) as err:
            return subprocess.CompletedProcess([script, *args], child.exitcode, out.read(), err.read())


def launch(script: str, nproc: int, *args: str) -> subprocess.CompletedProcess:
    """The script under its own launcher: torchrun for train_fsdp2.py, accelerate launch for train_fsdp1.py."""
    if script == "train_fsdp2.py":
        return run_script(script, nproc, *args, timeout=300)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--main_process_port", str(free_port()),
           "--num_processes", str(nproc), "--config_file", "accelerate.yaml", script, *args]
    return subprocess.run(cmd, cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=300)


# ----------------------------------------------------------------------------- bad inputs, each made in tmp


def data_file(text, name="data.json"):
    def make(tmp, model):
        path = tmp / name
        path.write_text(text)
        return ["--data_path", str(path)]

    return make


def model_copy(change):
    """A copy of the tiny model with ``change(path)`` applied."""

    def make(tmp, model):
        path = tmp / "model"
        shutil.copytree(model, path)
        change(path)
        return ["--model_name_or_path", str(path)]

    return make


def remove(*patterns):
    def change(path):
        for pattern in patterns:
            for file in path.glob(pattern):
                file.unlink()

    return change


def truncate_shard(path):
    shard = path / "model-00002-of-00003.safetensors"
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 2)


def edit_config(**changes):
    def change(path):
        config = json.loads((path / "config.json").read_text())
        config.update(changes)
        (path / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))

    return change


def edit_index(change_map):
    def change(path):
        index_path = path / "model.safetensors.index.json"
        index = json.loads(index_path.read_text())
        index["weight_map"] = change_map(index["weight_map"])
        index_path.write_text(json.dumps(index))

    return change


def drop_experts(path):
    """Leave only the dense weights: an MoE config.json over a dense checkpoint."""
    edit_index(lambda names: {n: f for n, f in names.items() if ".experts." not in n})(path)
    for shard in path.glob("*.safetensors"):
        save_file({n: t for n, t in load_file(shard).items() if ".experts." not in n}, shard, metadata={"format": "pt"})


def break_expert(expert):
    """Give one expert of layer 0 the wrong shape: only the rank that owns it reads it."""

    def change(path):
        index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
        shard = path / index[EXPERT.format(expert)]
        tensors = load_file(shard)
        tensors[EXPERT.format(expert)] = torch.zeros(3, 3)
        save_file(tensors, shard, metadata={"format": "pt"})

    return change


# name: (make the arguments, what the message says). Caught before the process group: one plain process.
EARLY_CASES = {
    "data file missing": (lambda tmp, model: ["--data_path", str(tmp / "nope.json")], "nope.json' does not exist; set data_path to a JSON list, JSONL, parquet, or a directory written by datasets' save_to_disk"),
    "data not JSON": (data_file("{oops"), "data.json is not valid JSON (Expecting property name"),
    "data not a list": (data_file('{"instruction": "a", "output": "b"}'), "data.json holds an object, not a list; wrap the records in [ ... ]"),
    "record without instruction": (data_file('[{"instruction": "a", "output": "b"}, {"output": "c"}]'), "record 1 has no 'instruction' field; every record needs instruction and output"),
    "field not a string": (data_file('[{"instruction": "a", "input": 3, "output": "b"}]'), "record 0 field 'input' is a number, not a string; fix the record"),
    "no records": (data_file("[]"), "data.json holds no records; add records to train on"),
    "corrupt parquet": (
        data_file("PAR1 not a parquet file", name="data.parquet"),
        "data.parquet cannot be read as parquet (ArrowInvalid: Parquet magic bytes not found in footer",
    ),
    "attention kernel that cannot run here": (
        lambda tmp, model: ["--attn_implementation", "varlen"],
        "attn_implementation 'varlen' (torch's flash varlen kernel) needs a GPU; on CPU use 'auto' or 'sdpa'",
    ),
    "model dir missing": (lambda tmp, model: ["--model_name_or_path", str(tmp / "nope")], "nope' does not exist; set model_name_or_path to a local Hugging Face model directory"),
    "no config.json": (model_copy(remove("config.json")), "has no config.json, so it is not a Hugging Face model directory"),
    "no safetensors": (model_copy(remove("*.safetensors", "*.index.json")), "no model.safetensors.index.json or model.safetensors in"),
    "index names a missing shard": (model_copy(remove("model-00002-of-00003.safetensors")), "names shard file(s) that are not in"),
    "truncated shard": (model_copy(truncate_shard), "model-00002-of-00003.safetensors is truncated or corrupt"),
    "dense model": (model_copy(edit_config(model_type="mistral", num_local_experts=None, num_experts_per_tok=None)), "holds a dense model (model_type='mistral', no experts in config.json)"),
    "index and shards from different saves": (
        model_copy(edit_index(lambda names: {**names, "model.extra.weight": "model-00001-of-00003.safetensors"})),
        "places 1 tensor(s) in model-00001-of-00003.safetensors that it does not hold, e.g. ['model.extra.weight']; "
        "the index and the shards come from different saves, fetch the model again",
    ),
    "experts missing": (
        model_copy(edit_index(lambda names: {n: f for n, f in names.items() if n != EXPERT.format(5)})),
        f"lacks 1 expert tensor(s), e.g. ['{EXPERT.format(5)}']; the download is incomplete, or config.json's "
        "num_local_experts=8 does not match the weights",
    ),
    "MoE config over dense weights": (model_copy(drop_experts), "has no expert weights in a layout we know"),
    "MoE architecture not in the table": (
        model_copy(edit_config(model_type="phimoe")),
        "model_type='phimoe' is not a supported MoE architecture; supported: ['deepseek_v2', 'deepseek_v3', 'glm4_moe', 'gpt_oss',",
    ),
    "launched without the launcher": (lambda tmp, model: [], {
        "train_fsdp2.py": "launch with torchrun, e.g. `torchrun --nproc_per_node=2 train_fsdp2.py`",
        "train_fsdp1.py": "launch with accelerate and the FSDP config, e.g. `accelerate launch --num_processes 2",
    }),
    "no tokenizer files": (model_copy(remove("tokenizer.json", "tokenizer_config.json")), "has no tokenizer files (none of tokenizer.json, "),
    "unknown setting": (lambda tmp, model: ["--ep_sise", "2"], "unknown setting --ep_sise (did you mean --ep_size?); valid settings: "),
    "CUDA graphs asked for on a CPU": (lambda tmp, model: ["--cuda_graphs", "true"], {
        "train_fsdp2.py": "cuda_graphs true: CUDA graphs need a GPU; run with --cuda_graphs auto or false",
        "train_fsdp1.py": "unknown setting --cuda_graphs",  # Trainer drives its micro-steps itself
    }),
    "unknown LR scheduler": (lambda tmp, model: ["--lr_scheduler_type", "cosinus"], {
        "train_fsdp2.py": "--lr_scheduler_type cosinus is unknown; choose one of linear, cosine,",
        "train_fsdp1.py": "argument --lr_scheduler_type/--lr-scheduler-type: invalid choice: 'cosinus'",
    }),
    "setting of the wrong type": (lambda tmp, model: ["--max_steps", "ten"], {
        "train_fsdp2.py": "--max_steps expects an integer, got 'ten'",
        "train_fsdp1.py": "argument --max_steps/--max-steps: invalid int value: 'ten'; fix the TrainingArguments flag",
    }),
    # Out of range (megablocks_utils/config/settings.py RULES; TrainingArguments' names in train_fsdp1.py too).
    "batch size 0": (lambda tmp, model: ["--per_device_train_batch_size", "0"], "--per_device_train_batch_size 0 is out of range; give an integer > 0"),
    "accumulation 0": (lambda tmp, model: ["--gradient_accumulation_steps", "0"], "--gradient_accumulation_steps 0 is out of range; give an integer > 0"),
    "learning rate nan": (lambda tmp, model: ["--learning_rate", "nan"], "--learning_rate nan is not a finite number; give a number > 0"),
    "negative save_steps": (lambda tmp, model: ["--save_steps", "-3"], "--save_steps -3 is out of range; give "),
    "optimizer whose package is missing": (lambda tmp, model: ["--optim", "adamw_8bit"], {  # Trainer's name for bitsandbytes' 8-bit AdamW
        "train_fsdp2.py": "--optim adamw_8bit is unknown; choose one of",
        "train_fsdp1.py": "--optim adamw_8bit: You need to install `bitsandbytes`",
    }),
    "warmup_ratio 1.5": (lambda tmp, model: ["--warmup_ratio", "1.5"], "--warmup_ratio 1.5 is out of range; give a number in [0, 1)"),
    "max_steps 0": (lambda tmp, model: ["--max_steps", "0"], "--max_steps 0 is out of range; give -1 (num_train_epochs over the data) or an integer > 0"),
    "checkpointing more layers than the model has": (
        lambda tmp, model: {
            "train_fsdp2.py": ["--activation_checkpointing", "full", "--activation_checkpointing_layers", "9"],
            "train_fsdp1.py": ["--activation_checkpointing", "true", "--activation_checkpointing_kwargs", '{"every_n_layers": 0}'],
        },
        {
            "train_fsdp2.py": "activation_checkpointing_layers=9 but the model has 4 decoder layers; give 0..4, or -1 for all",
            "train_fsdp1.py": "activation_checkpointing_kwargs every_n_layers=0 must be a positive integer (1 = every layer)",
        },
    ),
    "checkpointing more layers than the embedded default has": (  # checked before the default model is made
        lambda tmp, model: {
            "train_fsdp2.py": ["--model_name_or_path", "tiny-mixtral", "--activation_checkpointing_layers", "5"],
            "train_fsdp1.py": ["--model_name_or_path", "tiny-mixtral", "--activation_checkpointing", "true",
                               "--activation_checkpointing_kwargs", '{"every_n_layers": -1}'],
        },
        {
            "train_fsdp2.py": "activation_checkpointing_layers=5 but the model has 4 decoder layers; give 0..4, or -1 for all",
            "train_fsdp1.py": "activation_checkpointing_kwargs every_n_layers=-1 must be a positive integer (1 = every layer)",
        },
    ),
}


def earlier_run(out):
    """An output directory holding an earlier run's results."""
    (out / "final").mkdir(parents=True)
    for name, text in EARLIER.items():
        (out / name).write_text(text)
    (out / "final" / "config.json").write_text("{}")


def assert_earlier_run_intact(out):
    assert sorted(os.listdir(out)) == sorted([*EARLIER, "final"]), "a failed run wrote into the output directory"
    for name, text in EARLIER.items():
        assert (out / name).read_text() == text, f"{name} of the earlier run was overwritten"
    assert os.listdir(out / "final") == ["config.json"]


def assert_one_message(result, message):
    assert result.returncode != 0
    assert "error: " in result.stderr and message in result.stderr, result.stderr[-3000:]
    assert result.stderr.count(message) == 1, f"printed {result.stderr.count(message)} times:\n{result.stderr[-3000:]}"
    assert "Traceback" not in result.stderr.split("error: ", 1)[0], result.stderr[-3000:]


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("case", list(EARLY_CASES))
def test_early_bad_input_stops_with_one_message(tiny_model_dir, tmp_path, case, script):
    """Even with --overwrite_output_dir true, a bad input stops the run before it touches output_dir."""
    make_args, message = EARLY_CASES[case]
    message = message[script] if isinstance(message, dict) else message
    out = tmp_path / "out"
    earlier_run(out)
    args = ["--model_name_or_path", tiny_model_dir, "--output_dir", str(out), "--overwrite_output_dir", "true"]
    case_args = make_args(tmp_path, tiny_model_dir)
    case_args = case_args[script] if isinstance(case_args, dict) else case_args
    result = run_plain(script, *args, *case_args)
    assert result.returncode == 2, result.stderr[-3000:]
    assert_one_message(result, message)
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert_earlier_run_intact(out)


@pytest.mark.parametrize("script", SCRIPTS)
def test_output_dir_of_another_run_is_refused(tiny_model_dir, tmp_path, script):
    out = tmp_path / "out"
    earlier_run(out)
    result = run_plain(script, "--model_name_or_path", tiny_model_dir, "--output_dir", str(out))
    resume = "--resume auto" if script == "train_fsdp2.py" else "--resume_from_checkpoint last"
    assert result.returncode == 2, result.stderr[-3000:]
    assert_one_message(
        result,
        f"{out} already holds a run's results (final/, metrics.jsonl, summary.json); choose another output_dir, "
        f"pass {resume} to continue that run, or --overwrite_output_dir true to replace it",
    )
    assert_earlier_run_intact(out)


@pytest.mark.parametrize("script", SCRIPTS)
def test_resuming_without_a_checkpoint_keeps_a_finished_run(tiny_model_dir, tmp_path, script):
    """train_fsdp2.py's --resume auto starts afresh when there is no checkpoint, but not over a finished
    run; train_fsdp1.py's --resume_from_checkpoint last needs a checkpoint (checked before its launch check)."""
    out = tmp_path / "out"
    earlier_run(out)
    args = ["--model_name_or_path", tiny_model_dir, "--output_dir", str(out)]
    if script == "train_fsdp2.py":
        result = launch(script, 1, *args, "--resume", "auto")
        message = f"--resume auto: {out} holds a finished run and no checkpoint to continue it from"
    else:
        result = run_plain(script, *args, "--resume_from_checkpoint", "last")
        message = f"--resume_from_checkpoint last: {out} holds no complete checkpoint-* directory"
    assert_one_message(result, message)
    assert_earlier_run_intact(out)


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_sample_longer_than_max_length(tiny_model_dir, tmp_path, script):
    """Found when the data is tokenized, after the process group starts and before the model is read."""
    out = tmp_path / "out"
    earlier_run(out)
    result = launch(script, 1, "--model_name_or_path", tiny_model_dir, "--output_dir", str(out),
                    "--overwrite_output_dir", "true", "--max_length", "8")
    assert_one_message(result, "has a label token within max_length=8 (every prompt is longer, or every record is empty)")
    assert "raise max_length" in result.stderr
    assert_earlier_run_intact(out)


# Two ranks: the settings assume another number of processes, or only rank 1 meets the problem.
RANK_CASES = {
    "ep_size does not divide the world size": (
        lambda tmp, model: ["--ep_size", "4"],
        "world_size=2 is not divisible by ep_size=4; choose ep_size in [1, 2] for 2 processes, or launch a multiple of 4 processes",
    ),
    "ep_size does not divide the experts": (
        model_copy(edit_config(num_local_experts=3)),
        "num_local_experts=3 is not divisible by ep_size=0 (all 2 processes); choose ep_size in [1]",
    ),
    "an expert only rank 1 reads is broken": (
        model_copy(break_expert(7)),  # ep=2: rank 1 owns experts 4-7
        "on rank 1: checkpoint tensor '" + EXPERT.format(7) + "' has shape (3, 3) but config.json implies (128, 64); "
        "config.json does not match the weights",
    ),
}


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("case", list(RANK_CASES))
def test_two_ranks_stop_together_with_one_message(tiny_model_dir, tmp_path, case, script):
    make_args, message = RANK_CASES[case]
    out = tmp_path / "out"
    earlier_run(out)
    start = time.perf_counter()
    result = launch(script, 2, "--model_name_or_path", tiny_model_dir, "--output_dir", str(out),
                    "--overwrite_output_dir", "true", *make_args(tmp_path, tiny_model_dir))
    elapsed = time.perf_counter() - start
    assert_one_message(result, message)
    # Every rank exits with 2, or with SIGTERM when the launcher, seeing the first rank exit, stops it
    # first; a rank stuck in a collective would end with SIGKILL after the launcher's 30 s grace, and a
    # traceback with exit code 1.
    codes = set(every_rank_failed(result.stderr, 2).values())
    assert 2 in codes and codes <= {2, -15}, result.stderr[-3000:]
    assert elapsed < 200, f"took {elapsed:.0f} s"
    assert_earlier_run_intact(out)
