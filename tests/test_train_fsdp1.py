"""train_fsdp1.py (HF Trainer + accelerate FSDP1) on CPU ranks: README's command really shards, equals
train_fsdp2.py and one process step by step, resumes exactly; FSDP1's clipped norm is the global one."""

import copy
import glob
import json
import math
import os
import re
import shlex
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from conftest import (
    ROOT,
    TRAIN_STEPS,
    free_port,
    read_jsonl,
    run_ranks,
    run_script,
    tiny_mixtral_config,
)

from megablocks_utils import (
    IGNORE_INDEX,
    causal_lm_loss_sum,
    clip_grad_norm_,
    count_label_tokens,
    expert_parameters,
    moe_blocks,
    router_stats,
    shard_moe,
    sync_expert_grads,
)

RECORD_FIELDS = {
    "step", "loss", "ce_loss", "aux_loss", "lr", "grad_norm", "tokens", "tokens_per_second",
    "tokens_per_second_per_device", "tflops_per_device", "mfu", "step_time_s", "peak_rss_gb",
    "tokens_per_expert_max", "tokens_per_expert_mean", "tokens_per_expert",
}
SUMMARY_FIELDS = {"train_runtime", "train_steps_per_second", "train_tokens_per_second", "peak_rss_gb"}
# conftest's standard runs: 4 steps of 2 micro-steps; 2 ranks x 2 rows = 1 rank x 4 rows per micro-step.
# An epoch of conftest's small_data has 3 steps: step 4 is in the second epoch, and checkpoint-2 is in the
# middle of the first.
STEPS = TRAIN_STEPS


def readme_command() -> list[str]:
    """The first `accelerate launch` command of README's train_fsdp1 section, split into words."""
    with open(os.path.join(ROOT, "README.md")) as f:
        section = f.read().split("## train_fsdp1.py", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(accelerate launch .*?)\n```", section, re.S).group(1)
    return shlex.split(block.replace("\\\n", " "))


def accelerate_launch(words: list[str], *extra: str, num_processes: int | None = None) -> subprocess.CompletedProcess:
    """Run an `accelerate launch ... train_fsdp1.py ...` command line, with ``extra`` arguments for the script.

    `python -m accelerate.commands.launch` is the `accelerate launch` console script run by this
    interpreter; a free port keeps runs apart.
    """
    assert words[:2] == ["accelerate", "launch"], words
    words = list(words)
    if num_processes is not None:
        words[words.index("--num_processes") + 1] = str(num_processes)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--main_process_port", str(free_port()), *words[2:], *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stderr[-4000:]
    return result


@pytest.fixture(scope="module")
def runs(tiny_model_dir, small_data, two_rank_run, tmp_path_factory):
    """README's command on 2 ranks (ep=2, checkpoints every 2 steps), train_fsdp2.py on 2 ranks (conftest's
    standard run, the same batches), train_fsdp1.py on 1."""
    tmp = tmp_path_factory.mktemp("fsdp1")
    model = ["--model_name_or_path", tiny_model_dir, "--data_path", small_data]
    out = {"fsdp1": str(tmp / "fsdp1"), "fsdp2": two_rank_run, "one": str(tmp / "one")}
    result = accelerate_launch(
        readme_command(), *model, "--output_dir", out["fsdp1"], *STEPS, "--ep_size", "2",
        "--per_device_train_batch_size", "2", "--save_strategy", "steps", "--save_steps", "2",
    )
    accelerate_launch(  # ep_capacity_factor -1 (auto) is the exact exchange in this script (and trains as the default)
        readme_command(), *model, "--output_dir", out["one"], *STEPS, "--ep_size", "1", "--per_device_train_batch_size", "4",
        "--report_to", "tensorboard", "--ep_capacity_factor", "-1", num_processes=1,
    )
    return {"stdout": result.stdout, "tmp": tmp, "model": model, **out}


def metrics(run_dir: str) -> list[dict]:
    return read_jsonl(os.path.join(run_dir, "metrics.jsonl"))


def assert_same_steps(records: list[dict], reference: list[dict], rel: float) -> None:
    assert records and [r["step"] for r in records] == [r["step"] for r in reference], (len(records), len(reference))
    for a, b in zip(records, reference):
        for key in ("loss", "aux_loss", "grad_norm"):
            assert abs(a[key] - b[key]) <= rel * abs(b[key]), (a["step"], key, a[key], b[key])
        assert a["tokens_per_expert"] == b["tokens_per_expert"], a["step"]


def test_readme_command_equals_fsdp2_and_one_process(runs):
    fsdp1 = metrics(runs["fsdp1"])
    assert [r["step"] for r in fsdp1] == [1, 2, 3, 4]
    for r in fsdp1:
        assert RECORD_FIELDS <= set(r), RECORD_FIELDS - set(r)
    assert_same_steps(fsdp1, metrics(runs["fsdp2"]), rel=1e-5)
    assert_same_steps(fsdp1, metrics(runs["one"]), rel=1e-5)
    assert fsdp1[-1]["loss"] < fsdp1[0]["loss"]  # it trains
    assert "summary: train_runtime=" in runs["stdout"]
    summary = json.load(open(os.path.join(runs["fsdp1"], "summary.json")))
    assert SUMMARY_FIELDS <= set(summary), SUMMARY_FIELDS - set(summary)


def test_each_step_records_the_rate_it_used_as_trainer_logs_it(runs):
    """metrics.jsonl's lr is the rate the step's update used: what Trainer's own log says (its trainer_state.json), and
    train_fsdp2.py's records of the same schedule (the first step of a warmup from zero: 0)."""
    checkpoints = sorted(glob.glob(os.path.join(runs["fsdp1"], "checkpoint-*")), key=lambda p: int(p.rsplit("-", 1)[1]))
    state = json.load(open(os.path.join(checkpoints[-1], "trainer_state.json")))
    logged = {h["step"]: h["learning_rate"] for h in state["log_history"] if "learning_rate" in h}
    ours = {r["step"]: r["lr"] for r in metrics(runs["fsdp1"])}
    assert logged and ours[1] == 0.0 and ours[2] > 0
    assert all(ours[step] == pytest.approx(lr, rel=1e-6) for step, lr in logged.items()), (logged, ours)
    assert [r["lr"] for r in metrics(runs["fsdp2"])] == pytest.approx(list(ours.values()))


def test_sharding_is_real(runs):
    summary = json.load(open(os.path.join(runs["fsdp1"], "summary.json")))
    assert summary["distributed_type"] == "DistributedType.FSDP"
    assert summary["world_size"] == 2 and summary["ep"] == 2
    assert summary["fsdp_wrapped_modules"] == 4 + 1  # each decoder layer and the root
    # Each rank holds half the dense weights (the experts are not FSDP's); one rank training alone would hold all.
    assert summary["dense_numel_local_max"] <= summary["dense_numel_full"] // 2 + 2
    # After training, both ranks see the same full dense weights (gathered by FSDP1).
    assert len(set(summary["dense_checksum"])) == 1, summary["dense_checksum"]
    one = json.load(open(os.path.join(runs["one"], "summary.json")))
    assert one["dense_numel_local_max"] == one["dense_numel_full"]  # the 1-process run holds everything


def test_export_equals_fsdp2_export(runs):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    def tensors(run_dir):
        final = os.path.join(run_dir, "final")
        return {k: v for f in sorted(os.listdir(final)) if f.endswith(".safetensors") for k, v in load_file(os.path.join(final, f)).items()}

    mine, theirs = tensors(runs["fsdp1"]), tensors(runs["fsdp2"])
    assert sorted(mine) == sorted(theirs)
    for name in mine:
        torch.testing.assert_close(mine[name], theirs[name], rtol=1e-5, atol=1e-6, msg=name)
    model = AutoModelForCausalLM.from_pretrained(os.path.join(runs["fsdp1"], "final"))
    assert torch.isfinite(model(torch.tensor([[1, 5, 9]])).logits).all()


def test_export_command_on_a_trainer_checkpoint_equals_the_live_export(runs):
    """`python -m megablocks_utils.tools.export checkpoint-N out` (its entry point, in this process; test_checkpoint runs
    the command itself) on the final Trainer checkpoint = final/."""
    from safetensors.torch import load_file

    from megablocks_utils.tools import export

    out = str(runs["tmp"] / "exported")
    checkpoint = os.path.join(runs["fsdp1"], "checkpoint-4")
    assert export.main([checkpoint, out]) == 0

    def tensors(folder):
        return {k: v for f in sorted(os.listdir(folder)) if f.endswith(".safetensors") for k, v in load_file(os.path.join(folder, f)).items()}

    exported, live = tensors(out), tensors(os.path.join(runs["fsdp1"], "final"))
    assert sorted(exported) == sorted(live)
    for name in live:
        torch.testing.assert_close(exported[name], live[name], rtol=0, atol=0, msg=name)


def test_resume_from_mid_run_checkpoint_repeats_later_losses(runs, dropout_model_dir, small_data):
    """With attention dropout: the losses repeat only if the Trainer checkpoint restores each rank's RNG too."""
    import torch.distributed.checkpoint as dcp

    checkpoint = os.path.join(runs["fsdp1"], "checkpoint-2")
    # The checkpoint holds each expert weight whole: global shape [experts, 2 x intermediate, hidden], one chunk per ep rank.
    meta = dcp.FileSystemReader(os.path.join(checkpoint, "pytorch_model_fsdp_0")).read_metadata().state_dict_metadata
    expert = meta["model.model.layers.0.mlp.experts.gate_up_proj"]
    assert tuple(expert.size) == (8, 256, 64) and len(expert.chunks) == 2
    args = ["--model_name_or_path", dropout_model_dir, "--data_path", small_data, *STEPS, "--ep_size", "2",
            "--per_device_train_batch_size", "2"]
    full, resumed = str(runs["tmp"] / "dropout"), str(runs["tmp"] / "resumed")
    accelerate_launch(readme_command(), *args, "--output_dir", full, "--save_strategy", "steps", "--save_steps", "2")
    accelerate_launch(readme_command(), *args, "--output_dir", resumed, "--resume_from_checkpoint", os.path.join(full, "checkpoint-2"))
    later = [r for r in metrics(full) if r["step"] > 2]
    assert [r["step"] for r in later] == [3, 4]
    assert_same_steps(metrics(resumed), later, rel=1e-7)


def test_plot_command_draws_a_trainer_run(runs):
    from test_plot import assert_real_pictures, plot_command

    out = str(runs["tmp"] / "plots")
    result = plot_command(runs["fsdp1"], "--out_dir", out)
    assert result.returncode == 0, result.stderr
    assert_real_pictures(out)


def test_report_to_tensorboard_is_trainers(runs):
    """--report_to tensorboard goes to Trainer's own callback: its event files under output_dir/runs/."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (log_dir,) = glob.glob(os.path.join(runs["one"], "runs", "*"))
    events = EventAccumulator(log_dir)
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3, 4]
    assert [e.step for e in events.Scalars("train/grad_norm")] == [1, 2, 3, 4]


def test_launch_without_accelerate_fsdp_config_stops(tiny_model_dir, tmp_path):
    result = run_script("train_fsdp1.py", 1, "--model_name_or_path", tiny_model_dir, "--output_dir", str(tmp_path / "out"), timeout=120)
    assert result.returncode != 0
    assert "error: launch with accelerate and the FSDP config" in result.stderr, result.stderr[-3000:]
    assert not (tmp_path / "out").exists()


def test_rank_batch_sampler_follows_global_batches_across_epochs():
    from datasets import Dataset

    from megablocks_utils.data.batches import GlobalBatches, RankBatchSampler

    dataset = Dataset.from_dict({"num_label_tokens": list(range(1, 41))})
    for rank in range(2):
        batches = GlobalBatches(dataset, micro_batch=3, grad_accum=2, world_size=2, rank=rank, seed=7)
        sampler = RankBatchSampler(batches)
        assert len(sampler) == batches.steps_per_epoch * 2 == 6
        for epoch in range(2):
            sampler.set_epoch(epoch)
            steps = range(epoch * batches.steps_per_epoch, (epoch + 1) * batches.steps_per_epoch)
            assert list(sampler) == [m for step in steps for m in batches.micro_batches(step)[0]]
        assert list(sampler) != [m for step in range(3) for m in batches.micro_batches(step)[0]]  # epochs differ


# ----------------------------------------------------------------------------- FSDP1's clipped norm, in process


def make_batch(vocab: int, batch: int = 4, seq: int = 12):
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(1, vocab, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[1, 9:] = 0
    mask[3, 5:] = 0
    labels = input_ids.masked_fill(mask == 0, IGNORE_INDEX)
    labels[:, :3] = IGNORE_INDEX
    return input_ids.masked_fill(mask == 0, 0), mask, labels


def check_fsdp1_clip_is_global(rank, world, ep_size, use_orig_params):
    from functools import partial

    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from transformers import MixtralForCausalLM
    from transformers.models.mixtral.modeling_mixtral import MixtralDecoderLayer

    from megablocks_utils.parallel.fsdp1 import grad_shard_group

    config = tiny_mixtral_config()
    torch.manual_seed(0)
    reference = MixtralForCausalLM(config).float()
    model = copy.deepcopy(reference)
    input_ids, mask, labels = make_batch(config.vocab_size)
    reference(input_ids, attention_mask=mask, labels=labels, output_router_logits=True).loss.backward()
    ref_grads = {n: p.grad for n, p in reference.named_parameters()}
    ref_norm = torch.nn.utils.get_total_norm(list(ref_grads.values()))

    mesh = shard_moe(model, ep_size, device="cpu")
    # What accelerate builds from accelerate.yaml plus the script's ignored_modules.
    wrapped = FSDP(
        model,
        auto_wrap_policy=partial(transformer_auto_wrap_policy, transformer_layer_cls={MixtralDecoderLayer}),
        ignored_modules=[block.experts for block in moe_blocks(model)],
        use_orig_params=use_orig_params,
        device_id=torch.device("cpu"),
    )
    rows = slice(rank * len(input_ids) // world, (rank + 1) * len(input_ids) // world)
    out = wrapped(input_ids=input_ids[rows], attention_mask=mask[rows])
    stats = router_stats(wrapped, mask[rows], mesh.world.get_group())
    ce = causal_lm_loss_sum(out.logits, labels[rows]) / count_label_tokens(labels)
    (world * (ce + config.router_aux_loss_coef * stats.local)).backward()
    sync_expert_grads(wrapped, mesh)
    group = grad_shard_group(wrapped)
    assert group is not None and dist.get_world_size(group) == world  # the dense gradients really are shards

    norm = clip_grad_norm_(wrapped.parameters(), max_norm=0.5 * float(ref_norm), sharded_group=group)
    assert abs(float(norm) - float(ref_norm)) <= 1e-5 * float(ref_norm), (float(norm), float(ref_norm))
    clipped = clip_grad_norm_(wrapped.parameters(), max_norm=0.0, sharded_group=group)  # measures only
    assert abs(float(clipped) - 0.5 * float(ref_norm)) <= 1e-4 * float(ref_norm), (float(clipped), float(ref_norm))
    if use_orig_params:  # every clipped gradient is the single-process one, scaled by the same factor
        experts = {id(p) for p in expert_parameters(wrapped)}
        scale = 0.5 * float(ref_norm) / (float(ref_norm) + 1e-6)
        with FSDP.summon_full_params(wrapped, with_grads=True):
            for name, p in wrapped.named_parameters():
                grad = p.grad.full_tensor() if id(p) in experts else p.grad
                expected = ref_grads[name.replace("_fsdp_wrapped_module.", "")] * scale
                torch.testing.assert_close(grad, expected, rtol=1e-4, atol=1e-7, msg=name)


@pytest.mark.parametrize("dp,ep,use_orig_params", [(1, 2, True), (2, 1, False)], ids=["ep2-orig-params", "dp2-flat-params"])
def test_fsdp1_clipped_norm_is_the_global_norm(dp, ep, use_orig_params):
    run_ranks(check_fsdp1_clip_is_global, dp * ep, ep, use_orig_params)


def test_sigterm_saves_a_trainer_checkpoint_exits_zero_and_resumes(tiny_model_dir, tmp_path):
    """SIGTERM to the ranks: a Trainer checkpoint at the step's end, exit 0; `last` skips a partial checkpoint."""
    import signal
    import time

    import psutil

    out = str(tmp_path / "run")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--main_process_port", str(free_port()), *readme_command()[2:],
           "--model_name_or_path", tiny_model_dir, "--output_dir", out, "--max_steps", "500"]
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    metrics_path = os.path.join(out, "metrics.jsonl")
    start = time.time()
    while not (os.path.exists(metrics_path) and read_jsonl(metrics_path)):  # a finished step: all ranks are training
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert time.time() - start < 300
        time.sleep(0.05)
    for child in psutil.Process(proc.pid).children(recursive=True):
        child.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    assert "SIGTERM: saved" in stdout
    steps = len(read_jsonl(metrics_path))
    assert 1 <= steps < 500  # stopped mid-run, after at least one finished step
    saved = os.path.join(out, f"checkpoint-{steps}")
    assert os.path.isfile(os.path.join(saved, "trainer_state.json")), os.listdir(out)

    os.makedirs(os.path.join(out, f"checkpoint-{steps + 5}"))  # what a crash mid-save leaves: no trainer_state.json
    accelerate_launch(readme_command(), "--model_name_or_path", tiny_model_dir, "--output_dir", out,
                      "--max_steps", str(steps + 1), "--resume_from_checkpoint", "last")
    assert [r["step"] for r in read_jsonl(metrics_path)] == list(range(1, steps + 2))


def test_eval_loss_equals_train_fsdp2s(tiny_model_dir, small_data, tmp_path):
    """Trainer's evaluation schedule (--eval_strategy steps --eval_steps 1, and the last step) gives the same
    eval loss at the same steps as train_fsdp2.py's own (evaluate.py on the expert shards in both)."""
    model = ["--model_name_or_path", tiny_model_dir, "--data_path", small_data, "--max_steps", "2", "--warmup_steps", "1",
             "--ep_size", "2", "--per_device_train_batch_size", "2", "--eval_split", "0.1"]
    accelerate_launch(readme_command(), *model, "--output_dir", str(tmp_path / "fsdp1"), "--eval_strategy", "steps",
                      "--eval_steps", "1")
    fsdp2 = run_script("train_fsdp2.py", 2, *model, "--output_dir", str(tmp_path / "fsdp2"), "--eval_steps", "1")
    assert fsdp2.returncode == 0, fsdp2.stderr[-4000:]
    one, two = (read_jsonl(str(tmp_path / run / "metrics.jsonl")) for run in ("fsdp1", "fsdp2"))
    assert [r["step"] for r in one] == [r["step"] for r in two] == [1, 2]
    for a, b in zip(one, two):
        assert math.isfinite(a["eval_loss"]) and a["eval_loss"] == pytest.approx(b["eval_loss"], rel=1e-5)
    summary = json.load(open(tmp_path / "fsdp1" / "summary.json"))
    assert summary["eval_loss"] == one[-1]["eval_loss"]
