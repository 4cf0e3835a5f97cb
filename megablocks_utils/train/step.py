"""One optimizer step's loss and bookkeeping, the same in both training scripts.

The loss of a step is the mean of the cross-entropy over all its label tokens (every micro-batch of
every rank) plus coef x the load-balancing loss over the step's global token set, whatever the number
of ranks and micro-steps: what one process computes on the whole batch. FSDP averages gradients over
ranks (and ``sync_expert_grads`` does the same for train_fsdp1.py's replicated experts), and gradients
add up over micro-steps, so each rank backpropagates world_size x its share of that mean:

    loss = world_size * (ce_sum / step_label_tokens + coef * aux_local / micro_steps)

``ce_sum`` is the micro-batch's summed cross-entropy and ``step_label_tokens`` the label tokens of
the whole step over all ranks (counted before its first forward), so the ce parts of all micro-batches
and ranks add up to the global token mean. ``aux_local`` is this rank's part of the global aux loss
(``router_stats``: summed over ranks it is the aux loss of the micro-batch's global token set); the
step's aux loss is the mean over its micro-steps.

Each micro-batch also adds its numbers (summed cross-entropy, the aux loss, tokens, expert load, whether
its loss was finite) to the step's ``StepSums``; ``check`` reduces them over ranks before the optimizer
step, so every rank logs the same record and takes the same stop-or-skip decision (nonfinite.py).
"""

import torch
import torch.distributed as dist

from megablocks_utils.moe.aux_loss import router_stats
from megablocks_utils.train.loss import forward_with_loss
from megablocks_utils.train.nonfinite import NonFiniteSteps
from megablocks_utils.train.run_log import StepSums


class StepLoss:
    """The loss of one optimizer step (``step``, counted from 1), micro-batch by micro-batch, and its sums.

    ``step_label_tokens``: the step's label tokens over all ranks and micro-steps, the loss's denominator
    (as each script counts it: a number, or train_fsdp1.py's tensor from ``get_batch_samples``);
    ``micro_steps``: how many micro-batches the step has; ``group``: all ranks.
    """

    def __init__(self, step: int, step_label_tokens, micro_steps: int, *, aux_coef: float, group: dist.ProcessGroup, device):
        self.step, self.micro_steps, self.aux_coef, self.group = step, micro_steps, aux_coef, group
        self.denominator = step_label_tokens
        self.label_tokens = float(step_label_tokens)
        self.world_size = dist.get_world_size(group)
        self.sums = StepSums(device)

    def micro_batch(self, model, batch: dict):
        """Forward one micro-batch (a ``collate`` dict); returns this rank's loss to backpropagate and the model's output."""
        # The summed cross-entropy, inside the forward where the model has a LossHead (then out.logits holds it: train/loss.py)
        ce_sum, out = forward_with_loss(model, batch["model_inputs"], batch["labels"])
        stats = router_stats(model, batch["real"], self.group)
        loss = self.world_size * (ce_sum / self.denominator + self.aux_coef * stats.local / self.micro_steps)
        self.sums.add(ce_sum=ce_sum, aux=stats.value.double() / (self.micro_steps * self.world_size), tokens=batch["real"].sum(),
                      token_slots=batch["input_ids"].numel(), attention_sq=batch["attention_sq"],
                      nonfinite=~torch.isfinite(loss.detach()), tokens_per_expert=stats.tokens_per_expert)
        return loss, out

    def check(self, nonfinite_steps: NonFiniteSteps, grad_norm) -> bool:
        """Collective, after the gradient clip and before the optimizer step: the sums over all ranks, then
        whether to skip the step; raises ``NonFiniteStep`` when the run must stop (nonfinite.py)."""
        sums = self.sums.all_reduce(self.group)
        loss = sums.ce_sum / self.label_tokens + self.aux_coef * sums.aux
        return nonfinite_steps.check(self.step, loss, float(grad_norm), int(sums.nonfinite))
