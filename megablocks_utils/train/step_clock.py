"""``StepClock``: each optimizer step's wall time, without a host sync of its own.

A step's one host wait is its check (``StepLoss.check`` reads the step's sums and gradient norm before the optimizer):
when it returns, the GPU has just finished the step's forwards and backwards. Timing a step by synchronizing after its
optimizer, as a step timer usually does, leaves the GPU idle at every step's start while the host reads and copies the
next batch and launches the first forward (16 ms of a 444 ms step at a 12-layer Qwen3-30B-A3B shape on one H200,
bench/profile_steps.py --phases). Without that sync the host prepares the next step while the GPU still runs the
optimizer.

So a step's time runs from the previous step's check to its own (``lap``): the optimizer of one step is counted in the
next. The laps tile the run: they add up to its training time. Before something that is not training (an eval, a
checkpoint, the end of the run), ``drain`` waits for the GPU and adds the step's optimizer to its own time; the next step
then counts from its own start. In steady state every lap is one step's period, what the throughput numbers need.
"""

import time

import torch


class StepClock:
    def __init__(self, device: torch.device):
        self.device = device
        self.mark = None  # the host time the current lap counts from; None: the next step starts one

    def start(self) -> None:
        """At a step's start: a lap begins here unless one is running (the previous step's check)."""
        if self.mark is None:
            self.mark = time.perf_counter()

    def lap(self) -> float:
        """Right after the step's check (the GPU has caught up there): seconds since the previous lap, or this step's start."""
        now = time.perf_counter()
        elapsed, self.mark = now - self.mark, now
        return elapsed

    def drain(self) -> float:
        """Waits for the GPU to finish the step (its optimizer); returns the seconds since ``lap`` to add to the step's
        time, and the next step counts from its own start (what comes between is not training time)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elapsed, self.mark = time.perf_counter() - self.mark, None
        return elapsed
