"""The output directory: what an earlier run's files become, whether there is anything left to do,
and whether the disk holds the checkpoints the run keeps.
"""

import glob
import json
import os
import shutil
import sys

import torch.distributed as dist

from megablocks_utils.train.optim import param_dtype, state_bytes_per_param
from megablocks_utils.train.run_log import trim_metrics


def prepare_output_dir(output_dir: str, results: tuple[str, ...], clear: bool, resumed_step: int, settings: dict) -> list[dict]:
    """Rank 0, before the first step: remove an earlier run's ``results`` (glob patterns) when ``clear``
    (--overwrite_output_dir on a run that does not resume; checkpoints too, so a later --resume auto
    never picks up the replaced run's), create the directory, trim metrics.jsonl to ``resumed_step``
    and write settings.json. Returns the metrics records kept from the resumed run."""
    if clear and os.path.isdir(output_dir):
        for path in [p for pattern in results for p in glob.glob(os.path.join(glob.escape(output_dir), pattern))]:
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    os.makedirs(output_dir, exist_ok=True)
    kept = trim_metrics(os.path.join(output_dir, "metrics.jsonl"), resumed_step)
    with open(os.path.join(output_dir, "settings.json"), "w") as f:
        json.dump(settings, f, indent=1, default=str)
    return kept


def stop_if_finished(output_dir: str, checkpoint: str | None, checkpoint_step: int, total_steps: int) -> None:
    """Exit 0, writing nothing, when resuming from ``checkpoint`` leaves nothing to do: it is at the run's
    last step (or beyond) and the run's summary.json and final/ are there (a requeued job's --resume auto
    after the run ended). Every rank reaches the same verdict from the same files; rank 0 says why.

    Without this check such a resume trains no step and writes summary.json (an empty run's numbers)
    and final/ again. A checkpoint at the last step whose run did not finish exporting (summary.json or
    final/ missing) is not finished: resuming from it writes them.
    """
    if checkpoint is None or checkpoint_step < total_steps:
        return
    if not (os.path.isfile(os.path.join(output_dir, "summary.json")) and os.path.isdir(os.path.join(output_dir, "final"))):
        return
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"{output_dir} holds a finished run: its checkpoint {checkpoint} is at step {checkpoint_step} of {total_steps}, "
              "and summary.json and final/ are written; nothing to do, nothing changed (raise max_steps to train further, "
              "or choose another output_dir for a new run)", flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.exit(0)


def disk_space_warning(output_dir: str, n_params: int, optim: str, checkpoints: int) -> str | None:
    """A warning when the file system of ``output_dir`` has less free space than the ``checkpoints`` the
    run keeps at once (``checkpoints_kept``), or None. A checkpoint holds the weights in ``optim``'s
    dtype and its optimizer state: ``n_params`` x bytes per parameter (gradients are not saved)."""
    checkpoint_bytes = n_params * (param_dtype(optim).itemsize + state_bytes_per_param(optim))
    path = os.path.abspath(output_dir)
    while not os.path.exists(path):  # the directory may not exist yet: ask its nearest existing parent
        path = os.path.dirname(path)
    free = shutil.disk_usage(path).free
    needed = checkpoint_bytes * checkpoints
    if free >= needed:
        return None
    return (f"warning: {path} has {free / 2**30:.1f} GiB free, less than the {checkpoints} checkpoints of "
            f"~{checkpoint_bytes / 2**30:.1f} GiB each this run keeps at once ({needed / 2**30:.1f} GiB); a save "
            "will fail when the disk fills: free space, lower save_total_limit, or write to another output_dir")


def checkpoints_kept(total_steps: int, save_every: int, save_total_limit: int) -> int:
    """How many checkpoints are on disk at once at most: the newest ``save_total_limit`` plus the one
    being written (the oldest is removed after it), never more than the run saves (0: no saving)."""
    if save_every <= 0:
        return 0
    saves = -(-total_steps // save_every)  # the last step is saved too
    return min(saves, save_total_limit + 1) if save_total_limit > 0 else saves
