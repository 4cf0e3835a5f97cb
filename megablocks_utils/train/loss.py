"""Token-level causal-LM loss as a sum, so micro-batches and ranks can share one global denominator."""

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def causal_lm_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum (not mean) of next-token cross-entropy over label positions that are not IGNORE_INDEX."""
    shift_logits = logits[:, :-1].reshape(-1, logits.shape[-1]).float()
    shift_labels = labels[:, 1:].reshape(-1)
    return F.cross_entropy(shift_logits, shift_labels, ignore_index=IGNORE_INDEX, reduction="sum")


def count_label_tokens(labels: torch.Tensor) -> int:
    """How many positions ``causal_lm_loss_sum`` counts."""
    return int((labels[:, 1:] != IGNORE_INDEX).sum())
