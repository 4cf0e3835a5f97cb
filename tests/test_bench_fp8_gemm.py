"""bench/fp8_gemm_bench.py's row counts per expert: even, and drawn per row (the timings run on a GPU)."""

import os
import sys

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "bench"))


def test_routed_offsets_even_and_drawn_per_row():
    from fp8_gemm_bench import routed_offsets

    even = routed_offsets(128, 32768, "even", device="cpu")
    assert even.tolist() == [256 * (e + 1) for e in range(128)]
    drawn = routed_offsets(128, 32768, "uniform", device="cpu")
    counts = drawn.diff(prepend=drawn.new_zeros(1))
    assert int(drawn[-1]) == 32768 and int(counts.min()) >= 0
    assert 150 < int(counts.min()) < 256 < int(counts.max()) < 380  # scattered around the mean, as uniform draws are
    assert drawn.equal(routed_offsets(128, 32768, "uniform", device="cpu"))  # seeded
