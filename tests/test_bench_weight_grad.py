"""bench/weight_grad_bench.py's row counts per expert: the routings its ``--hot`` and ``--all_to`` stand for (the
timings run on a GPU)."""

import importlib.util
import os
import sys

import pytest
from conftest import ROOT

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="the bench imports triton (requirements-test.txt)")
sys.path.insert(0, os.path.join(ROOT, "bench"))


def test_row_counts_even_one_hot_expert_and_every_token_to_a_few():
    from weight_grad_bench import row_counts

    even = row_counts(128, 32768 + 5, 0, "last", 4096).tolist()
    assert sum(even) == 32768 + 5 and max(even) - min(even) == 1
    # ep 2: 64 local experts, 32768 rows, one expert 16x the mean (512) capped at every token of both ranks (8192)
    hot = row_counts(64, 32768, 16, "mid", 8192).tolist()
    assert sum(hot) == 32768 and hot[32] == 8192 and max(hot[:32] + hot[33:]) <= 391
    assert row_counts(64, 32768, 16, "last", 8192).tolist()[-1] == 8192
    assert row_counts(64, 32768, 16, "first", 8192).tolist()[0] == 8192
    # the random checkpoint's router: 4 experts take a row of every token of both ranks, the others 2 rows
    few = row_counts(64, 32768, 0, "last", 8192, all_to=4).tolist()
    assert few[:4] == [8192] * 4 and few[4:] == [2] * 60
