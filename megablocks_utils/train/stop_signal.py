"""SIGTERM, a scheduler's notice before preemption: every rank stops at the same step's end.
"""

import os
import signal
import sys

import torch
import torch.distributed as dist


class StopSignal:
    """SIGTERM (a scheduler's notice before preemption) only raises a flag; the ranks agree on it once a step.

    Each rank reads the flag once, the snapshots are reduced over ranks, and every rank decides on the reduced value
    alone (``decide``): a signal that lands on one rank after its snapshot counts at the next step, on every rank.
    (Reading the flag again after the reduction would let one rank stop and save alone while the others go on.)
    train_fsdp2.py reduces the snapshot with the step's sums (``StepLoss.check(..., stop_signal)``: no collective or
    host sync of its own); ``agreed()`` is the same with an all_reduce of its own (train_fsdp1.py, at each step's end).
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.raised = False  # this rank had the signal
        self.stopping = False  # the last decision: some rank had it (the same on every rank)
        signal.signal(signal.SIGTERM, self._raise)

    def _raise(self, signum, frame) -> None:
        self.raised = True

    def decide(self, ranks_raised: float) -> bool:
        """The decision from the reduced snapshots: how many ranks had the signal (the same number on every rank)."""
        self.stopping = ranks_raised > 0
        return self.stopping

    def agreed(self, group=None) -> bool:
        """Whether any rank had the signal by now. Collective: every rank calls it at the same point."""
        seen = torch.tensor([1.0 if self.raised else 0.0], device=self.device)
        dist.all_reduce(seen, op=dist.ReduceOp.MAX, group=group)
        return self.decide(seen.item())


def exit_stopped() -> None:
    """Leave after a SIGTERM stop whose checkpoint is saved: the process group closed, stdout and stderr flushed, then
    ``os._exit(0)`` without the interpreter's teardown. The metrics and TensorBoard writers flush every record, and a
    scheduler's SIGTERM precedes its SIGKILL, so nothing is left to finalise; the teardown itself raced a C++
    background thread and aborted ranks that had saved ("terminate called without an active exception", exit -6: the
    test suite's SIGTERM runs, 2026-11-23 and 2026-11-24), a clean stop reported as a crash."""
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
