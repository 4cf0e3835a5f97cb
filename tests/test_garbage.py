"""``StepGarbageCollection`` (train/garbage.py): no automatic collection while it runs; each step frees the young
generations' cycles, every ``full_every``-th step also those that had grown old; automatic collection back after."""

import gc
import weakref

from megablocks_utils.train.garbage import StepGarbageCollection


class Node:
    def __init__(self):
        self.me = self  # a reference cycle: only the cyclic collector frees it


def test_collects_young_cycles_each_step_and_old_ones_every_full_every_steps():
    was = gc.isenabled()
    gc.enable()
    collector = StepGarbageCollection(full_every=3)
    try:
        assert not gc.isenabled()
        old = Node()
        gc.collect()  # ``old`` survives a full collection: now in the oldest generation
        old_ref = weakref.ref(old)
        del old
        young_ref = weakref.ref(Node())
        for _ in range(1000):  # enough allocations to trigger an automatic collection, were it on
            Node()
        assert young_ref() is not None, "an automatic collection ran while the collector was on"
        collector.step()  # step 1: the young generations
        assert young_ref() is None and old_ref() is not None
        collector.step()
        assert old_ref() is not None
        collector.step()  # step 3 = full_every: everything
        assert old_ref() is None
    finally:
        collector.close()
    assert gc.isenabled()
    if not was:
        gc.disable()
