"""Bad input to train_fsdp2.py: one clear message, a non-zero exit, nothing of an earlier run overwritten."""

import os
import shutil

import pytest
from conftest import run_script


def bad_model_dir(tmp_path, tiny_model_dir):
    path = tmp_path / "no-weights"
    shutil.copytree(tiny_model_dir, path, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    return str(path)


CASES = {
    "missing data": (1, lambda tmp, model: ["--data_path", str(tmp / "nope.json")], "does not exist; set data_path"),
    "not json": (1, lambda tmp, model: ["--data_path", _write(tmp, "{oops")], "is not valid JSON"),
    "missing output field": (1, lambda tmp, model: ["--data_path", _write(tmp, '[{"instruction": "a"}]')], "has no 'output' field"),
    "prompt longer than max_length": (1, lambda tmp, model: ["--max_length", "8"], "raise max_length"),
    "no safetensors": (1, lambda tmp, model: ["--model_name_or_path", bad_model_dir(tmp, model)], "saved with safetensors"),
    "ep_size does not divide world": (2, lambda tmp, model: ["--ep_size", "3"], "world_size=2 is not divisible by ep_size=3"),
    "unknown setting": (1, lambda tmp, model: ["--ep_sise", "2"], "unknown setting --ep_sise"),
}


def _write(tmp, text):
    path = tmp / "data.json"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_fails_clearly(tiny_model_dir, tmp_path, case):
    nproc, make_args, message = CASES[case]
    out = tmp_path / "out"
    args = ["--model_name_or_path", tiny_model_dir, "--output_dir", str(out), "--max_steps", "2"]
    result = run_script("train_fsdp2.py", nproc, *args, *make_args(tmp_path, tiny_model_dir), timeout=120)
    assert result.returncode != 0
    assert message in result.stderr, result.stderr[-3000:]
    assert not out.exists() or not os.listdir(out), "a failed run left output behind"


def test_earlier_results_are_not_overwritten(tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.jsonl").write_text("earlier run\n")
    args = ["--model_name_or_path", tiny_model_dir, "--output_dir", str(out), "--max_steps", "2"]
    result = run_script("train_fsdp2.py", 1, *args, timeout=120)
    assert result.returncode != 0
    assert "already holds a run's results" in result.stderr
    assert (out / "metrics.jsonl").read_text() == "earlier run\n"
