"""``report_to tensorboard``: each step's record (the one metrics.jsonl gets) as TensorBoard scalars, rank 0 only.

Tags follow HF Trainer's where it has one (train/loss, train/learning_rate, train/grad_norm), so runs of
both scripts line up in one TensorBoard. Expert load is one curve per MoE layer: the busiest expert's
tokens over the mean (1 = perfectly balanced; top-k routing with E experts is at most E / k).
"""

import importlib.util

from megablocks_utils.errors import InputError

SCALARS = {  # tag: the record's field
    "train/loss": "loss",
    "train/ce_loss": "ce_loss",
    "train/aux_loss": "aux_loss",
    "train/learning_rate": "lr",
    "train/grad_norm": "grad_norm",
    "train/tokens_per_second": "tokens_per_second",
    "train/mfu": "mfu",
}


def require_tensorboard() -> None:
    """At startup, before anything heavy: the package SummaryWriter writes with must be installed."""
    if importlib.util.find_spec("tensorboard") is None:
        raise InputError("--report_to tensorboard needs the tensorboard package; pip install tensorboard (or --report_to none)")


class TensorBoardWriter:
    """Event files in ``log_dir``; a resumed run (``start_step`` > 0) drops the events after its checkpoint."""

    def __init__(self, log_dir: str, start_step: int = 0):
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: TensorBoard hides earlier events of this directory from that step on (a resumed run
        # repeats those steps; a fresh run over an overwritten output_dir replaces all of them).
        self.writer = SummaryWriter(log_dir, purge_step=start_step + 1)

    def write(self, record: dict) -> None:
        step = record["step"]
        for tag, field in SCALARS.items():
            if record.get(field) is not None:  # mfu is None on CPU unless peak_tflops is given
                self.writer.add_scalar(tag, record[field], step)
        layers = len(record["tokens_per_expert_max"])
        for layer, (most, mean) in enumerate(zip(record["tokens_per_expert_max"], record["tokens_per_expert_mean"])):
            if mean > 0:
                self.writer.add_scalar(f"expert_load_max_over_mean/layer_{layer:0{len(str(layers - 1))}d}", most / mean, step)
        self.writer.flush()  # a run stopped by SIGTERM or a bad step keeps every step it logged

    def close(self) -> None:
        self.writer.close()
