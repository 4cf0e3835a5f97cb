"""Steps whose loss or gradient norm is NaN or inf: stop the run there, or skip the step.

Both training scripts call ``NonFiniteSteps.check`` once per optimizer step (through
``StepLoss.check``, step.py), after the gradient clip and before the optimizer step, with numbers
every rank holds identically: the loss from the step's all-reduced sums, the count of micro-batch
losses that were not finite (all-reduced with them) and the global gradient norm (itself reduced
over every rank). So every rank takes the same decision without another collective, and a NaN on
one rank stops or skips the step on all.

Skipping a step means no optimizer update at all: the weights and the optimizer state (AdamW's
moments and step count) stay as they were, the gradients are dropped. The learning-rate schedule
and the data position still advance: a skipped step is spent, as if its batch had given no gradient.
"""

import math

from megablocks_utils.errors import NonFiniteStep

MODES = ("stop", "skip")


class NonFiniteSteps:
    """The stop-or-skip decision for steps with a non-finite loss or gradient norm, and the skip counts."""

    def __init__(self, mode: str, max_consecutive_skips: int):
        if mode not in MODES:
            raise ValueError(f"nonfinite={mode!r} is unknown; choose stop or skip")
        self.mode = mode
        self.max_consecutive_skips = max_consecutive_skips
        self.skipped = 0  # steps skipped in the whole run
        self.in_a_row = 0  # steps skipped since the last good one

    def check(self, step: int, loss: float, grad_norm: float, nonfinite_losses: int = 0) -> bool:
        """Whether to skip ``step`` (counted from 1); raises ``NonFiniteStep`` when the run must stop.

        ``nonfinite_losses``: how many micro-batch losses (over all ranks) were not finite, which
        catches a bad loss even when the summed loss that is logged looks finite.
        """
        problems = []
        if nonfinite_losses or not math.isfinite(loss):
            problems.append(f"the loss is {loss}" if not math.isfinite(loss) else f"{nonfinite_losses} micro-batch losses are not finite")
        if not math.isfinite(grad_norm):
            problems.append(f"the gradient norm is {grad_norm}")
        if not problems:
            self.in_a_row = 0
            return False
        what = f"step {step}: {' and '.join(problems)}"
        if self.mode == "stop":
            raise NonFiniteStep(step, what)
        if 0 < self.max_consecutive_skips <= self.in_a_row:
            raise NonFiniteStep(step, f"{what}, after {self.in_a_row} skipped steps in a row (max_consecutive_skips={self.max_consecutive_skips})")
        self.skipped += 1
        self.in_a_row += 1
        return True


def where_to_continue(bad_step: int, checkpoints: list[tuple[int, str]], resume_flag: str, save_flags: str) -> str:
    """For the stop message: the newest complete checkpoint before the bad step, and how to go on from it.

    ``checkpoints``: (step, path) of the complete checkpoints, oldest first; one of a later step is
    another run's, left there when this one resumed from an earlier checkpoint.
    """
    found = [path for step, path in checkpoints if step < bad_step]
    if not found:
        return f"no checkpoint was saved before it ({save_flags} keeps some); rerun, with --nonfinite skip to skip such steps"
    return (f"the last good checkpoint is {found[-1]}; continue with {resume_flag} {found[-1]} --nonfinite skip "
            "(a resumed run repeats the same batches, so this step may fail again without skip)")

