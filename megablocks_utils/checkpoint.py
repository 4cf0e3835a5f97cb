"""Sharded training checkpoints with torch.distributed.checkpoint (DCP): save, find, resume.

Layout of ``<output_dir>/checkpoints/step_00000120/``:
  *.distcp, .metadata   model (FSDP shards and expert DTensors) and optimizer state, written by
                        every rank for its own shards; DCP reshards them on load, so a checkpoint
                        resumes on another (dp, ep) split or world size
  trainer_state.json    step, LR scheduler, the settings that shaped the data order
  rng/rank_<r>.pt       each rank's RNG states (tensors only; loaded with weights_only=True)
  config.json, tokenizer files   so the export command needs nothing but this directory

A checkpoint is written to ``step_XXXXXXXX.tmp`` and renamed once every rank has finished, so a
directory without ``.tmp`` is always complete; a crash mid-save leaves only a ``.tmp`` behind.
"""

import json
import os
import re
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

CHECKPOINT_DIR = re.compile(r"^step_(\d{8})$")
STATE_NAME = "trainer_state.json"
# Test hook: SIGKILL rank 0 after the shards of this step are written but before the rename, so
# tests can prove a half-saved checkpoint is ignored on resume. Unset in normal use.
KILL_IN_SAVE_ENV = "MEGABLOCKS_TEST_KILL_IN_SAVE_AT_STEP"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used, with what to do about it."""


def describe_failure(e: BaseException) -> str:
    """The first underlying error of a DCP failure (CheckpointException wraps one per rank)."""
    failures = getattr(e, "failures", None)
    if failures:
        e = next(iter(failures.values()))
        if isinstance(e, tuple):  # (exception, traceback frames)
            e = e[0]
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:200]}" if lines else type(e).__name__


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


def rng_state() -> dict:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def copy_model_files(source_dir: str, dest: str) -> None:
    """config.json, generation config and tokenizer files (no weights), so a checkpoint exports alone."""
    for name in os.listdir(source_dir):
        if name.endswith(".json") and not name.endswith(".index.json") or name.startswith("tokenizer"):
            shutil.copy(os.path.join(source_dir, name), dest)


def _plain(value):
    """``value`` with 0-d tensors as numbers, for JSON: torchao's optimizers keep each group's lr as a
    tensor, so an LR scheduler's state (base_lrs, _last_lr) holds tensors."""
    if isinstance(value, torch.Tensor):
        return value.item()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def save_checkpoint(root: str, step: int, model, optimizer, scheduler, trainer_state: dict, keep_last: int, source_dir: str | None = None) -> str:
    """Collective: every rank writes its shards; returns the final directory."""
    rank = dist.get_rank()
    final = os.path.join(root, checkpoint_name(step))
    tmp = final + ".tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(os.path.join(tmp, "rng"))
    dist.barrier()
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=tmp)
    torch.save(rng_state(), os.path.join(tmp, "rng", f"rank_{rank}.pt"))
    if rank == 0:
        state = dict(trainer_state, step=step, world_size=dist.get_world_size(), scheduler=_plain(scheduler.state_dict()))
        with open(os.path.join(tmp, STATE_NAME), "w") as f:
            json.dump(state, f, indent=1)
        if source_dir is not None:
            copy_model_files(source_dir, tmp)
    dist.barrier()
    if rank == 0 and os.environ.get(KILL_IN_SAVE_ENV) == str(step):
        os.kill(os.getpid(), 9)
    if rank == 0:
        os.replace(tmp, final)
        for old in complete_checkpoints(root)[:-keep_last] if keep_last > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def complete_checkpoints(root: str) -> list[str]:
    """Complete checkpoint directories under ``root``, oldest first (``.tmp`` leftovers ignored)."""
    if not os.path.isdir(root):
        return []
    names = sorted(n for n in os.listdir(root) if CHECKPOINT_DIR.match(n))
    return [os.path.join(root, n) for n in names]


def resolve_resume(resume: str, root: str) -> str | None:
    """'' -> None, 'auto' -> the newest complete checkpoint (or None), else the given path, checked."""
    if not resume:
        return None
    if resume == "auto":
        found = complete_checkpoints(root)
        return found[-1] if found else None
    if not os.path.isfile(os.path.join(resume, STATE_NAME)):
        raise CheckpointError(f"{resume} is not a complete checkpoint (no {STATE_NAME}); pass a step_XXXXXXXX directory or 'auto'")
    return resume


def load_checkpoint(path: str, model, optimizer, scheduler) -> dict:
    """Collective: restore model, optimizer, scheduler (and RNG when the world size is unchanged)."""
    try:
        with open(os.path.join(path, STATE_NAME)) as f:
            state = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read {os.path.join(path, STATE_NAME)} ({e}); resume from an earlier checkpoint") from e
    model_state, optim_state = get_state_dict(model, optimizer)
    target = {"model": model_state, "optim": optim_state}
    try:
        dcp.load(target, checkpoint_id=path)
    except (Exception, dcp.CheckpointException) as e:  # the latter is a BaseException
        raise CheckpointError(
            f"the checkpoint {path} is corrupt or truncated ({describe_failure(e)}); "
            "resume from an earlier checkpoint or delete this one"
        ) from e
    set_state_dict(model, optimizer, model_state_dict=target["model"], optim_state_dict=target["optim"])
    scheduler.load_state_dict(state["scheduler"])
    rng_path = os.path.join(path, "rng", f"rank_{dist.get_rank()}.pt")
    if state["world_size"] == dist.get_world_size() and os.path.isfile(rng_path):
        rng = torch.load(rng_path, weights_only=True)
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    return state
