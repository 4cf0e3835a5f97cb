"""``StepGarbageCollection``: Python's cyclic garbage collector run once per step, where the host has time to spare.

Left automatic, the collector runs whenever enough Python objects were made, in the middle of the forwards that launch
the GPU's work: on a DeepSeek-V2-Lite step (20 layers, 4 micro-steps, one H200) some 90 young-generation and 8 older
collections a step, 1.5-5 ms each for the older ones (a probe of gc.callbacks in train_fsdp2.py), and the host is
what paces those forwards. So collection is switched off during training and run here instead, once per step right
after the optimizer is launched (the GPU then has ~50 ms of optimizer to run, the host nothing to launch): the young
generations every step, everything every ``full_every`` steps (what survives the young collections is still freed).
The same idea as torchtitan's periodic collection.
"""

import gc


class StepGarbageCollection:
    def __init__(self, full_every: int = 50):
        self.full_every = full_every
        self.steps = 0
        self.was_enabled = gc.isenabled()
        gc.collect()
        gc.disable()

    def step(self) -> None:
        """After a step's optimizer is launched: the young generations, and every ``full_every`` steps all of them."""
        self.steps += 1
        gc.collect(2 if self.steps % self.full_every == 0 else 1)

    def close(self) -> None:
        """Automatic collection as it was before."""
        if self.was_enabled:
            gc.enable()
