"""Sharded training checkpoints with torch.distributed.checkpoint (DCP): save, find, resume.

Layout of ``<output_dir>/checkpoints/step_00000120/``:
  *.distcp, .metadata   model (FSDP shards and expert DTensors) and optimizer state, written by
                        every rank for its own shards; DCP reshards them on load, so a checkpoint
                        resumes on another (dp, ep) split or world size
  trainer_state.json    step, LR scheduler, the settings that shaped the data order
  rng/rank_<r>.pt       each rank's RNG states (tensors only; loaded with weights_only=True)
  config.json, tokenizer files   so the export command needs nothing but this directory

A checkpoint is written to ``step_XXXXXXXX.tmp`` and renamed once every rank has finished, so a
directory without ``.tmp`` is always complete; a crash mid-save leaves only a ``.tmp`` behind. A save
that fails on any rank (a full disk above all) removes its ``.tmp`` and stops every rank with a
CheckpointError naming the last complete checkpoint.
"""

import errno
import json
import os
import re
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from megablocks_utils.errors import CheckpointError

CHECKPOINT_DIR = re.compile(r"^step_(\d{8})$")
STATE_NAME = "trainer_state.json"


# What a failed save can raise: DCP's CheckpointException (every rank's error) is a BaseException.
SAVE_ERRORS = (Exception, dcp.CheckpointException)


def describe_failure(e: BaseException) -> str:
    """The first underlying error of a DCP failure (CheckpointException wraps one per rank)."""
    failures = getattr(e, "failures", None)
    if failures:
        e = next(iter(failures.values()))
        if isinstance(e, tuple):  # (exception, traceback frames)
            e = e[0]
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:200]}" if lines else type(e).__name__


def _tensor_to_json(value):
    """torchao's optimizers keep the learning rate as a 0-d tensor, so the scheduler's state holds tensors."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return {"__tensor__": value.item()}
    raise TypeError(f"cannot write {type(value).__name__} to {STATE_NAME}")


def _tensors_from_json(value):
    if isinstance(value, dict):
        if set(value) == {"__tensor__"}:
            return torch.tensor(value["__tensor__"])
        return {k: _tensors_from_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_tensors_from_json(v) for v in value]
    return value


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


def disk_full(e: BaseException) -> bool:
    """Whether a save failed for want of space: ENOSPC anywhere in the error's chain (DCP wraps each
    rank's error), or the short write torch's zip writer reports ("unexpected pos")."""
    todo, seen = [e], set()
    while todo:
        e = todo.pop()
        if isinstance(e, tuple):  # DCP's (exception, traceback frames)
            e = e[0]
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno == errno.ENOSPC or "No space left" in str(e) or "unexpected pos" in str(e):
            return True
        todo += [e.__cause__, e.__context__, *(getattr(e, "failures", None) or {}).values()]
    return False


def stop_if_save_failed(error: BaseException | None, step: int, partial: str, list_complete, resume_flag: str) -> None:
    """Collective, after each part of a save: if it failed on any rank, rank 0 removes the ``partial``
    checkpoint directory and every rank raises the same CheckpointError, which says whether the disk
    is full and names the last complete checkpoint (``list_complete()``, oldest first). A rank going on
    alone would wait for the others forever. Used by both scripts' saves (DCP here, Trainer's in train_fsdp1.py).
    """
    found = None
    if error is not None:  # DCP's error names the rank whose write failed
        found = (next(iter(getattr(error, "failures", None) or {dist.get_rank(): None})), disk_full(error), describe_failure(error))
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, found)
    failed = [e for e in errors if e is not None]
    if not failed:
        return
    if dist.get_rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)
    rank, full, what = failed[0]
    where = f" on rank {rank}" if dist.get_world_size() > 1 else ""
    complete = list_complete()
    last = f"the last complete checkpoint is {complete[-1]}" if complete else "no checkpoint of this run is complete yet"
    parent = os.path.dirname(partial)
    if full:
        free = shutil.disk_usage(parent).free / 2**30 if os.path.isdir(parent) else float("nan")
        raise CheckpointError(
            f"the disk is full: saving the checkpoint of step {step} to {partial} failed{where} ({what}; {free:.2f} GiB "
            f"free there); removed the partial {os.path.basename(partial)}; {last}. Free space (or lower save_total_limit), "
            f"then continue with {resume_flag}"
        )
    raise CheckpointError(
        f"saving the checkpoint of step {step} to {partial} failed{where} ({what}); removed the partial "
        f"{os.path.basename(partial)}; {last}; continue with {resume_flag} once the cause is fixed"
    )


def state_dict_options(model) -> StateDictOptions:
    """LoRA (frozen base weights): the checkpoint holds only what trains, the base comes from the model directory."""
    frozen = any(not p.requires_grad for p in model.parameters())
    return StateDictOptions(ignore_frozen_params=frozen, strict=not frozen)


def save_checkpoint(root: str, step: int, model, optimizer, scheduler, trainer_state: dict, keep_last: int, source_dir: str | None = None) -> str:
    """Collective: every rank writes its shards; returns the final directory.

    Raises CheckpointError on every rank when any rank cannot write (see ``stop_if_save_failed``).
    """
    rank = dist.get_rank()
    final = os.path.join(root, checkpoint_name(step))
    tmp = final + ".tmp"
    error = None
    if rank == 0:
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(os.path.join(tmp, "rng"))
        except OSError as e:
            error = e
    stop_if_save_failed(error, step, tmp, lambda: complete_checkpoints(root), "--resume auto")  # also the barrier before the others write
    model_state, optim_state = get_state_dict(model, optimizer, options=state_dict_options(model))
    try:
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=tmp)
        torch.save(rng_state(), os.path.join(tmp, "rng", f"rank_{rank}.pt"))
        if rank == 0:
            state = dict(trainer_state, step=step, world_size=dist.get_world_size(), scheduler=scheduler.state_dict())
            with open(os.path.join(tmp, STATE_NAME), "w") as f:
                json.dump(state, f, indent=1, default=_tensor_to_json)
            if source_dir is not None:
                copy_model_files(source_dir, tmp)
    except SAVE_ERRORS as e:  # DCP raises on every rank when one rank's write fails
        error = e
    stop_if_save_failed(error, step, tmp, lambda: complete_checkpoints(root), "--resume auto")  # also the barrier before the rename
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
    if not os.path.exists(resume):
        raise CheckpointError(f"--resume {resume}: the directory does not exist; pass a step_XXXXXXXX directory of a run or 'auto'")
    if not os.path.isdir(resume):
        raise CheckpointError(f"--resume {resume} is a file, not a checkpoint directory; pass a step_XXXXXXXX directory or 'auto'")
    if not os.path.isfile(os.path.join(resume, STATE_NAME)):
        raise CheckpointError(f"{resume} is not a complete checkpoint (no {STATE_NAME}); pass a step_XXXXXXXX directory or 'auto'")
    return resume


def checkpoint_step(path: str) -> int:
    """The step a complete checkpoint was saved at (read from its state file alone)."""
    try:
        with open(os.path.join(path, STATE_NAME)) as f:
            return int(json.load(f)["step"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"cannot read the step from {os.path.join(path, STATE_NAME)} ({e}); resume from an earlier checkpoint") from e


def load_checkpoint(path: str, model, optimizer, scheduler) -> dict:
    """Collective: restore model, optimizer, scheduler (and RNG when the world size is unchanged)."""
    try:
        with open(os.path.join(path, STATE_NAME)) as f:
            state = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read {os.path.join(path, STATE_NAME)} ({e}); resume from an earlier checkpoint") from e
    options = state_dict_options(model)
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    target = {"model": model_state, "optim": optim_state}
    try:
        dcp.load(target, checkpoint_id=path)
    except (Exception, dcp.CheckpointException) as e:  # the latter is a BaseException
        raise CheckpointError(
            f"the checkpoint {path} is corrupt or truncated ({describe_failure(e)}); "
            "resume from an earlier checkpoint or delete this one"
        ) from e
    set_state_dict(model, optimizer, model_state_dict=target["model"], optim_state_dict=target["optim"], options=options)
    scheduler.load_state_dict(_tensors_from_json(state["scheduler"]))
    rng_path = os.path.join(path, "rng", f"rank_{dist.get_rank()}.pt")
    if state["world_size"] == dist.get_world_size() and os.path.isfile(rng_path):
        rng = torch.load(rng_path, weights_only=True)
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    return state
