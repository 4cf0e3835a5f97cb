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


# A stand-in for accelerate's launcher: its rendezvous fails as torch's does when the port it was given is "1" (taken).
FAKE_LAUNCH = """import sys
port = sys.argv[sys.argv.index('--main_process_port') + 1]
if port == '1':
    print('torch.distributed.DistNetworkError: TCPStore ... port: 1, code: -98, name: EADDRINUSE')
    sys.exit(1)
print('trained on port', port)
"""


def test_launch_together_starts_a_launch_whose_port_was_taken_again():
    import sys

    import pytest

    from tests.gpu.launch import launch_together

    taken = [sys.executable, "-c", FAKE_LAUNCH, "--main_process_port", "1"]
    logs = launch_together({"fsdp1": taken, "fsdp2": [sys.executable, "-c", "print('fsdp2 ran')"]}, timeout=60)
    assert logs["fsdp1"].startswith("trained on port ") and logs["fsdp1"].split()[-1] != "1"
    assert logs["fsdp2"] == "fsdp2 ran\n"
    # Any other failure, and a command without accelerate's port, still fails the test with its output.
    torchrun_taken = [sys.executable, "-c", "import sys; print('TCPStore ... EADDRINUSE'); sys.exit(1)"]
    for command in ([sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"], torchrun_taken):
        with pytest.raises(pytest.fail.Exception, match="exit (3|1)"):
            launch_together({"run": command}, timeout=60)
