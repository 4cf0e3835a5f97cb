"""tests/gpu/lanes.sh runs the GPU suite as five pytest processes, each over named files: a new GPU test module that no
lane names would never run there. Every module in tests/gpu is in exactly one lane."""

import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_gpu_test_module_is_in_one_lane():
    with open(os.path.join(ROOT, "tests", "gpu", "lanes.sh")) as f:
        named = re.findall(r"\$G/(test_\w+\.py)", f.read())
    modules = sorted(os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "tests", "gpu", "test_*.py")))
    assert len(modules) > 10
    assert sorted(named) == modules, (set(modules) ^ set(named), [m for m in set(named) if named.count(m) > 1])
