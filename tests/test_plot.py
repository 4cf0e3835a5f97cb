"""`python -m megablocks_utils.tools.plot <run_dir>` draws a real run's metrics.jsonl."""

import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import ROOT, read_jsonl

from megablocks_utils.tools.plot import PLOTS, expert_fractions, main


def plot_command(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megablocks_utils.tools.plot", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def assert_real_pictures(plot_dir: str) -> None:
    import matplotlib.image

    for name in PLOTS:
        path = os.path.join(plot_dir, name)
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n", name
        assert os.path.getsize(path) > 10_000, name
        pixels = matplotlib.image.imread(path)[..., :3]
        assert pixels.std() > 0.05, name  # not one colour
        assert len(np.unique(pixels.reshape(-1, 3), axis=0)) > 50, name  # lines, text and a colour map, not a blank frame


@pytest.fixture
def run_dir(one_rank_run):
    """A real run: conftest's standard 1-rank run (4 steps), shared with other test files."""
    return one_rank_run


def test_plot_command_draws_a_real_run(run_dir):
    result = plot_command(run_dir)
    assert result.returncode == 0, result.stderr
    plot_dir = os.path.join(run_dir, "plots")
    assert result.stdout.split() == [word for name in PLOTS for word in ("wrote", os.path.join(plot_dir, name))]
    assert_real_pictures(plot_dir)  # MFU is None on CPU: its panel says so instead of failing


def test_heatmap_is_each_layers_share_of_routed_tokens(run_dir):
    records = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    fractions = expert_fractions(records[-2:])
    counts = np.array(records[-1]["tokens_per_expert"]) + np.array(records[-2]["tokens_per_expert"])
    assert fractions.shape == (4, 8)
    np.testing.assert_allclose(fractions.sum(axis=1), 1.0)
    np.testing.assert_allclose(fractions, counts / counts.sum(axis=1, keepdims=True))


def test_run_dir_without_metrics_is_a_clear_error(tmp_path, capsys):
    assert main([str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: {tmp_path}/metrics.jsonl not found; pass the output_dir of a train_fsdp2.py or train_fsdp1.py run"
    )
