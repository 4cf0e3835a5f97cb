"""What a run records about itself: each step's sums, the metrics.jsonl records, summary.json, and the
output directory that holds them. Both training scripts use it, so their files have the same keys
and meanings (a run of one can be compared with a run of the other line by line).

A step's numbers are summed over micro-batches on each rank, then over ranks in one all_reduce
(``StepSums``); ``MetricsLog`` turns them into the step's record and keeps the run's totals for the
summary. ``prepare_output_dir`` and ``stop_if_finished`` decide what an earlier run's files become.
"""

import glob
import json
import os
import shutil
import signal
import sys

import torch
import torch.distributed as dist

from .metrics import JsonlWriter, flops_per_token, peak_memory_gb
from .optim import param_dtype, state_bytes_per_param


class StepSums:
    """One optimizer step's numbers, summed over its micro-batches, then over ranks by ``all_reduce``.

    After ``all_reduce`` the totals are plain floats under their names: ``ce_sum`` (cross-entropy
    summed over label tokens), ``aux`` (the load-balancing loss, already a mean), ``tokens`` (real
    tokens), ``token_slots`` (positions computed, padding included), ``attention_sq`` (the sum of
    squared attention spans: documents in packed rows, padded rows otherwise; data.collate) and
    ``nonfinite`` (micro-batch losses that were NaN or inf). ``tokens_per_expert`` ([layer, expert]
    top-k counts) arrives summed over ranks from ``router_stats`` and is only added up here.
    """

    FIELDS = ("ce_sum", "aux", "tokens", "token_slots", "attention_sq", "nonfinite")

    def __init__(self, device):
        self.values = torch.zeros(len(self.FIELDS), dtype=torch.float64, device=device)  # one tensor: one all_reduce
        self.tokens_per_expert = 0

    def add(self, *, ce_sum, aux, tokens, token_slots, attention_sq, nonfinite, tokens_per_expert=None) -> None:
        """Add one micro-batch's numbers (tensors or Python numbers; nothing is read back to the host)."""
        numbers = (ce_sum, aux, tokens, token_slots, attention_sq, nonfinite)
        self.values += torch.stack([torch.as_tensor(n, device=self.values.device).detach().double() for n in numbers])
        if tokens_per_expert is not None:
            self.tokens_per_expert = self.tokens_per_expert + tokens_per_expert

    def all_reduce(self, group=None) -> "StepSums":
        """Collective: sum over the ranks of ``group``; then the totals are readable by name."""
        dist.all_reduce(self.values, group=group)
        for name, value in zip(self.FIELDS, self.values.tolist()):
            setattr(self, name, value)
        return self


class MetricsLog:
    """metrics.jsonl (one record per optimizer step, written by the rank given a path) and the
    run's totals for summary.json.

    The run's constants (world size, active parameters for the FLOPs, the
    per-device peak for MFU; 0 = no MFU) are given once; ``record`` takes what changes each step.
    ``earlier``: the records kept from the run this one resumes, so ``final_loss`` is the last
    step's even when the resumed run has no step left to train.
    """

    def __init__(self, path: str | None, *, aux_coef: float, world_size: int, n_active: int,
                 config, peak_flops: float, device, earlier: list[dict] = ()):
        self.writer = JsonlWriter(path) if path else None
        self.aux_coef, self.world_size = aux_coef, world_size
        self.n_active, self.config, self.peak_flops, self.device = n_active, config, peak_flops, device
        self.tokens = self.token_slots = 0.0  # real tokens and positions computed by this run (not the resumed one's)
        self.eval_loss = None  # the newest eval loss
        self.last = earlier[-1] if earlier else None

    def record(self, step: int, sums: StepSums, *, label_tokens: float, lr: float, grad_norm: float, skipped: bool,
               step_time: float, eval_loss: float | None = None, write: bool = True) -> dict:
        """The step's record (``sums`` reduced over ranks), written to metrics.jsonl (unless ``write`` is false:
        ``add_eval`` writes it once its eval loss is known); the same on every rank."""
        ce_loss = sums.ce_sum / label_tokens
        # Attention's FLOPs grow with each document's span: the span that makes them sum to what was attended.
        flops = flops_per_token(self.n_active, self.config, sums.attention_sq / sums.token_slots) * sums.token_slots
        per_device = flops / step_time / self.world_size
        tokens_per_expert = sums.tokens_per_expert
        record = {
            "step": step,
            "loss": ce_loss + self.aux_coef * sums.aux,
            "ce_loss": ce_loss,
            "aux_loss": sums.aux,
            "lr": float(lr),
            "grad_norm": float(grad_norm),
            "skipped": skipped,
            "tokens": int(sums.tokens),  # real tokens (attention mask 1), over all ranks
            "token_slots": int(sums.token_slots),  # positions computed, padding included
            "tokens_per_second": sums.tokens / step_time,
            "tokens_per_second_per_device": sums.tokens / step_time / self.world_size,
            "tflops_per_device": per_device / 1e12,
            "mfu": per_device / self.peak_flops if self.peak_flops else None,
            "step_time_s": step_time,
            **peak_memory_gb(self.device),
            "tokens_per_expert_max": tokens_per_expert.max(dim=1).values.tolist(),
            "tokens_per_expert_mean": tokens_per_expert.mean(dim=1).tolist(),
            "tokens_per_expert": tokens_per_expert.long().tolist(),
        }
        if eval_loss is not None:
            record["eval_loss"] = self.eval_loss = eval_loss
        self.tokens += sums.tokens
        self.token_slots += sums.token_slots
        self.last = record
        if self.writer is not None and write:
            self.writer.write(record)
        return record

    def add_eval(self, value: float, record: dict | None) -> None:
        """An eval loss; with the step's unwritten ``record``, into it, and the record written."""
        self.eval_loss = value
        if record is not None:
            record["eval_loss"] = value
            if self.writer is not None:
                self.writer.write(record)

    def summary(self, *, runtime: float, steps_run: int, skipped_steps: int, dp: int, ep: int, **extra) -> dict:
        """Collective (peak memory is the largest over ranks): summary.json's numbers, then ``extra``."""
        memory = peak_memory_gb(self.device)
        largest = torch.tensor(list(memory.values()), dtype=torch.float64, device=self.device)
        dist.all_reduce(largest, op=dist.ReduceOp.MAX)
        return {
            "train_runtime": runtime,
            "train_steps_per_second": steps_run / runtime,
            "train_tokens_per_second": self.tokens / runtime,
            "train_tokens_per_second_per_device": self.tokens / runtime / self.world_size,
            **{k: float(v) for k, v in zip(memory, largest)},  # the largest over ranks
            "final_loss": self.last["loss"] if self.last else None,
            "eval_loss": self.eval_loss,
            "token_fill": self.tokens / self.token_slots if self.token_slots else None,  # real tokens per position computed
            "skipped_steps": skipped_steps,
            "world_size": self.world_size,
            "dp": dp,
            "ep": ep,
            **extra,
        }

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class StopSignal:
    """SIGTERM (a scheduler's notice before preemption) only raises a flag; the ranks agree at each step's end.

    ``agreed()`` all-reduces a snapshot of the flag and decides on the reduced value alone: a signal that lands
    on one rank between the all-reduce and the decision counts at the next step's end, on every rank. (Reading
    the flag again after the all-reduce once let one rank stop and save alone while the others went on.)
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.raised = False  # this rank had the signal
        self.stopping = False  # the last agreed(): some rank had it (the same on every rank)
        signal.signal(signal.SIGTERM, self._raise)

    def _raise(self, signum, frame) -> None:
        self.raised = True

    def agreed(self, group=None) -> bool:
        """Whether any rank had the signal by now. Collective: every rank calls it at the same point."""
        seen = torch.tensor([1.0 if self.raised else 0.0], device=self.device)
        dist.all_reduce(seen, op=dist.ReduceOp.MAX, group=group)
        self.stopping = bool(seen.item())
        return self.stopping


def summary_line(summary: dict) -> str:
    """The summary as one printed line (lists, such as per-layer checksums, left to summary.json)."""
    shown = {k: v for k, v in summary.items() if not isinstance(v, list)}
    return "summary: " + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in shown.items())


def trim_metrics(path: str, step: int) -> list[dict]:
    """Keep the records of steps up to ``step`` (where a resumed run continues); drop any later ones,
    which the resumed run writes again. Returns the kept records."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        lines = [line for line in f if line.strip()]
    kept = [line for line in lines if json.loads(line)["step"] <= step]
    with open(path, "w") as f:
        f.writelines(kept)
    return [json.loads(line) for line in kept]


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
