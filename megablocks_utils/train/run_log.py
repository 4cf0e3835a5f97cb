"""What a run records about itself: each step's sums, the metrics.jsonl records and the summary.

Both training scripts use it, so their files have the same keys and meanings (a run of one can be
compared with a run of the other line by line). A step's numbers are summed over micro-batches on
each rank, then over ranks in one all_reduce (``StepSums``); ``MetricsLog`` turns them into the
step's record and keeps the run's totals for the summary.
"""

import json
import os

import torch
import torch.distributed as dist

from megablocks_utils.train.metrics import (
    JsonlWriter,
    flops_per_token,
    peak_memory_gb,
    write_summary,
)


class StepSums:
    """One optimizer step's numbers, summed over its micro-batches, then over ranks by ``all_reduce``.

    After ``all_reduce`` the totals are plain floats under their names: ``ce_sum`` (cross-entropy
    summed over label tokens), ``aux`` (the load-balancing loss, already a mean), ``tokens`` (real
    tokens), ``token_slots`` (positions computed, padding included), ``attention_sq`` (the sum of
    squared attention spans: documents in packed rows, padded rows otherwise; data.collate),
    ``nonfinite`` (micro-batch losses that were NaN or inf) and ``stop_requests`` (ranks that had
    SIGTERM: ``add_stop_request``). ``tokens_per_expert`` ([layer, expert] top-k counts) arrives
    summed over ranks from ``router_stats`` and is only added up here; it stays on the device (the
    routing bias's update reads it there) and ``tokens_per_expert_cpu`` is its copy for the record.
    ``exchange_reruns``: forwards rerun on the exact exchange (``moe/exchange_mode.py``), counted on the host by
    ``StepLoss`` and the same on every rank; None where the static exchange is off (the record then has no such key).
    """

    FIELDS = ("ce_sum", "aux", "tokens", "token_slots", "attention_sq", "nonfinite", "stop_requests")

    def __init__(self, device):
        self.values = torch.zeros(len(self.FIELDS), dtype=torch.float64, device=device)  # one tensor: one all_reduce
        self.host = [0.0] * len(self.FIELDS)  # the Python numbers, added to ``values`` once, in ``all_reduce``
        self.tokens_per_expert = 0
        self.tokens_per_expert_cpu = None
        self.grad_norm = None
        self.exchange_reruns = None

    def add(self, *, ce_sum, aux, tokens, token_slots, attention_sq, nonfinite, tokens_per_expert=None) -> None:
        """Add one micro-batch's numbers: tensors (on the device) or Python numbers. Nothing moves between host and
        device here: a Python number copied to the GPU would wait for all queued work (a host sync per micro-batch,
        which left the GPU idle while the host launched the next forward; bench/profile_steps.py --phases)."""
        numbers = (ce_sum, aux, tokens, token_slots, attention_sq, nonfinite, 0.0)  # no stop request from a micro-batch
        zero = self.values.new_zeros(())
        for i, n in enumerate(numbers):
            if not isinstance(n, torch.Tensor):
                self.host[i] += float(n)
        self.values += torch.stack([n.detach().double() if isinstance(n, torch.Tensor) else zero for n in numbers])
        if tokens_per_expert is not None:
            self.tokens_per_expert = self.tokens_per_expert + tokens_per_expert

    def add_stop_request(self, raised: bool) -> None:
        """This rank's SIGTERM flag (``StopSignal.raised``, read once), summed over ranks with the step's numbers:
        the stop decision rides on the step's all_reduce instead of a collective and a host sync of its own."""
        self.host[self.FIELDS.index("stop_requests")] += float(raised)

    def all_reduce(self, group=None, grad_norm=None) -> "StepSums":
        """Collective: sum over the ranks of ``group``; then the totals are readable by name.

        One device-to-host copy reads the totals together with what the step's record needs that is already global:
        ``tokens_per_expert`` (as ``tokens_per_expert_cpu``) and ``grad_norm`` (the global norm, a tensor or a number;
        as the float ``self.grad_norm``). The host waits for the GPU here anyway (the stop-or-skip decision reads the
        loss), so the record reads no device tensor after the optimizer step.
        """
        self.values += torch.tensor(self.host, dtype=torch.float64).to(self.values.device)
        self.host = [0.0] * len(self.FIELDS)
        dist.all_reduce(self.values, group=group)
        norm = grad_norm if isinstance(grad_norm, torch.Tensor) else self.values.new_zeros(())
        counts = self.tokens_per_expert if isinstance(self.tokens_per_expert, torch.Tensor) else self.values.new_zeros(0)
        # fp32 norms and integer counts are exact in float64
        host = torch.cat([self.values, norm.detach().reshape(1).to(self.values), counts.reshape(-1).to(self.values)]).cpu()
        n = len(self.FIELDS)
        for name, value in zip(self.FIELDS, host[:n].tolist()):
            setattr(self, name, value)
        if isinstance(grad_norm, torch.Tensor):
            self.grad_norm = host[n].item()
        elif grad_norm is not None:
            self.grad_norm = float(grad_norm)  # train_fsdp1.py's is a number already
        if isinstance(self.tokens_per_expert, torch.Tensor):
            self.tokens_per_expert_cpu = host[n + 1:].view(counts.shape).to(counts.dtype)
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
        tokens_per_expert = sums.tokens_per_expert_cpu  # read with the sums (StepSums.all_reduce): no host sync here
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
        if sums.exchange_reruns is not None:
            record["exchange_reruns"] = sums.exchange_reruns
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

    def finish(self, summary: dict, output_dir: str, saved: str | None = None, note: str | None = None) -> None:
        """Rank 0, at the end of either script: metrics.jsonl closed, summary.json written, and the run's last
        lines printed (the summary, the skipped steps, where the model is (``saved``, by default final/ in hub
        layout), ``note``)."""
        self.close()
        write_summary(os.path.join(output_dir, "summary.json"), summary)
        print(summary_line(summary), flush=True)
        if summary["skipped_steps"]:
            print(f"skipped steps: {summary['skipped_steps']} (a non-finite loss or gradient norm; \"skipped\" in metrics.jsonl)",
                  flush=True)
        print(saved or f"saved the model in hub layout to {os.path.join(output_dir, 'final')}", flush=True)
        if note:
            print(note, flush=True)


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
