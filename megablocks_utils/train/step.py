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
step, so every rank logs the same record and takes the same stop-or-skip decision (nonfinite.py). The
same all_reduce carries each rank's SIGTERM flag (stop_signal.py) when the script passes its StopSignal.
"""

import torch
import torch.distributed as dist

from megablocks_utils.moe.aux_loss import router_stats
from megablocks_utils.moe.exchange_mode import exchange_mode, forward_deferred, run_exactly
from megablocks_utils.train.loss import forward_with_loss
from megablocks_utils.train.nonfinite import NonFiniteSteps
from megablocks_utils.train.run_log import StepSums
from megablocks_utils.train.stop_signal import StopSignal


class StepLoss:
    """The loss of one optimizer step (``step``, counted from 1), micro-batch by micro-batch, and its sums.

    ``step_label_tokens``: the step's label tokens over all ranks and micro-steps, the loss's denominator
    (as each script counts it: a number, or train_fsdp1.py's tensor from ``get_batch_samples``);
    ``micro_steps``: how many micro-batches the step has; ``group``: all ranks. ``defer_overflow`` (CUDA graphs with
    the static exchange): no check per micro-step; ``overflow`` collects each micro-step's flag on the device and the
    script asks ``exchange_mode.step_overflowed`` once the micro-steps are done (moe/exchange_mode.py).
    """

    def __init__(self, step: int, step_label_tokens, micro_steps: int, *, aux_coef: float, group: dist.ProcessGroup, device,
                 defer_overflow: bool = False):
        self.step, self.micro_steps, self.aux_coef, self.group = step, micro_steps, aux_coef, group
        self.defer_overflow = defer_overflow
        self.overflow = None  # with defer_overflow: whether any micro-step's static exchange overflowed (a device bool)
        self.denominator = step_label_tokens
        self.label_tokens = float(step_label_tokens)
        self.world_size = dist.get_world_size(group)
        self.sums = StepSums(device)
        self.device = device

    def micro_batch(self, model, batch: dict):
        """Forward one micro-batch (a ``collate`` dict); returns this rank's loss to backpropagate and the model's output."""
        loss, numbers, out = self.loss_and_numbers(model, batch)
        self.add(numbers, batch)
        return loss, out

    def loss_and_numbers(self, model, batch: dict, loss_scale: torch.Tensor | None = None):
        """The micro-batch's loss, its numbers for the step's sums (device tensors: ``add``) and the model's output.

        ``loss_scale``: 1 / ``step_label_tokens`` as an fp32 device tensor, for a CUDA graph (``cuda_graph.py``), which
        cannot take the step's count as a Python number; the same bits (a division by a Python number is a
        multiplication by its fp32 reciprocal in torch's CUDA kernel)."""
        def forward():  # the summed cross-entropy, inside the forward where the model has a LossHead (train/loss.py)
            ce_sum, out = forward_with_loss(model, batch["model_inputs"], batch["labels"])
            return ce_sum, out, router_stats(model, batch["real"], self.group)

        # With ep_capacity_factor > 0, a forward whose static exchange overflowed is run again exactly (exchange_mode.py);
        # deferred, its flag goes with the numbers and the script reruns the whole step
        overflow, rerun = None, False
        if self.defer_overflow:
            (ce_sum, out, stats), overflow = forward_deferred(model, forward)
        else:
            (ce_sum, out, stats), rerun = run_exactly(model, forward, self.group, self.device)
        if exchange_mode(model) is not None:
            self.sums.exchange_reruns = (self.sums.exchange_reruns or 0) + rerun  # the same on every rank: not reduced
        ce = ce_sum / self.denominator if loss_scale is None else ce_sum * loss_scale
        loss = self.world_size * (ce + self.aux_coef * stats.local / self.micro_steps)
        numbers = {"ce_sum": ce_sum.detach(), "aux": stats.value.double() / (self.micro_steps * self.world_size),
                   "tokens": batch["real"].sum(), "nonfinite": ~torch.isfinite(loss.detach()),
                   "tokens_per_expert": stats.tokens_per_expert}
        if overflow is not None:
            numbers["exchange_overflow"] = overflow
        return loss, numbers, out

    def add(self, numbers: dict, batch: dict) -> None:
        """Add a micro-batch's ``numbers`` (``loss_and_numbers``) and its host-side counts to the step's sums."""
        if "exchange_overflow" in numbers:  # defer_overflow: kept apart from the sums (a device bool, ORed)
            # A micro-step replayed from a CUDA graph never ran loss_and_numbers: its record still says "no rerun" (the
            # script counts a rerun step's micro-steps itself).
            self.sums.exchange_reruns = self.sums.exchange_reruns or 0
            numbers = dict(numbers)
            overflow = numbers.pop("exchange_overflow")
            self.overflow = overflow.clone() if self.overflow is None else self.overflow | overflow
        self.sums.add(**numbers, token_slots=batch["input_ids"].numel(), attention_sq=batch["attention_sq"])

    def check(self, nonfinite_steps: NonFiniteSteps, grad_norm, stop_signal: StopSignal | None = None) -> bool:
        """Collective, after the gradient norm and before the optimizer step: the sums over all ranks, then
        whether to skip the step; raises ``NonFiniteStep`` when the run must stop (nonfinite.py).

        ``grad_norm`` (the global norm, a device tensor or a number) is read with the sums, in one copy
        (``self.sums.grad_norm`` then). With ``stop_signal`` its SIGTERM flag is reduced with the sums too, and
        ``stop_signal.stopping`` says whether any rank had it (the same on every rank; StopSignal.decide)."""
        if stop_signal is not None:
            self.sums.add_stop_request(stop_signal.raised)
        sums = self.sums.all_reduce(self.group, grad_norm)
        if stop_signal is not None:
            stop_signal.decide(sums.stop_requests)
        loss = sums.ce_sum / self.label_tokens + self.aux_coef * sums.aux
        return nonfinite_steps.check(self.step, loss, sums.grad_norm, int(sums.nonfinite))
