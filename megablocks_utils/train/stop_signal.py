"""SIGTERM, a scheduler's notice before preemption: every rank stops at the same step's end.
"""

import signal

import torch
import torch.distributed as dist


class StopSignal:
    """SIGTERM (a scheduler's notice before preemption) only raises a flag; the ranks agree at each step's end.

    ``agreed()`` all-reduces a snapshot of the flag and decides on the reduced value alone: a signal that lands
    on one rank between the all-reduce and the decision counts at the next step's end, on every rank. (Reading
    the flag again after the all-reduce would let one rank stop and save alone while the others go on.)
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
