"""bench/run.py, the benchmark harness, without a GPU: every variant's commands name scripts that exist, and a launch's
records are kept tagged with the variant and the run, a failed or late launch with its reason. No GPU run here."""

import json
import os
import re
import sys

import pytest
from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "bench"))
import run  # noqa: E402

EXTRA = {"peers": ["--torchtitan", "--overlap", "2", "--base", "/elsewhere"], "levers": ["--base", "/elsewhere"],
         "routing_skew": ["--peer"], "full_size": ["--runs", ",".join(run.FULL_SIZE_RUNS)]}


@pytest.mark.parametrize("variant", sorted(run.VARIANTS))
def test_dry_run_names_only_scripts_that_exist(variant, tmp_path, capsys):
    run.main([variant, "--dry_run", "--gpus", "2", "--out", str(tmp_path / "out.jsonl"), *EXTRA.get(variant, [])])
    printed = capsys.readouterr().out
    commands = [line for line in printed.splitlines() if ": " in line]
    assert commands, printed
    for line in commands:
        for path in re.findall(r"[\w./-]+\.(?:py|sh)\b", line):
            if "(in /elsewhere)" not in line:
                assert os.path.exists(path if os.path.isabs(path) else os.path.join(ROOT, path)), f"{variant}: {line}"
    assert not os.path.exists(tmp_path / "out.jsonl"), "a dry run writes no records"


def session(tmp_path, budget_s=560):
    return run.Session(run.parser().parse_args(["kernels", "--out", str(tmp_path / "records.jsonl"), "--gpus", "1",
                                                "--logs", str(tmp_path / "logs"), "--budget_s", str(budget_s)]))


def records(tmp_path) -> list[dict]:
    return [json.loads(line) for line in open(tmp_path / "records.jsonl")]


def test_a_launch_keeps_its_records_tagged_and_a_failed_one_says_why(tmp_path):
    s = session(tmp_path)
    write = "import json, sys; open(sys.argv[1], 'a').write(json.dumps({'config': 'ep', 'status': 'ok', 'step_time_s': 1.5}) + '\\n')"
    s.run("first", [sys.executable, "-c", write, s.part], 120, routing="skewed")
    s.run("second", [sys.executable, "-c", "print('loading'); raise SystemExit('error: the checkpoint is missing')"], 120)
    first, second = records(tmp_path)
    assert first == {"config": "ep", "status": "ok", "step_time_s": 1.5, "variant": "kernels", "name": "first", "routing": "skewed"}
    assert second["name"] == "second" and second["status"] == "error"
    assert second["error"] == "error: the checkpoint is missing" and os.path.isfile(second["log"])
    assert not os.path.exists(s.part)
    assert s.records == [first, second]


def test_a_launch_that_no_longer_fits_the_budget_is_skipped(tmp_path):
    s = session(tmp_path, budget_s=30)
    s.run("late", [sys.executable, "-c", "raise SystemExit('should not run')"], 120)
    (late,) = records(tmp_path)
    assert late["status"] == "skipped" and "of the 30 s budget" in late["error"]


def test_a_launch_the_budget_cuts_short_says_so(tmp_path, capsys, monkeypatch):
    """A budget that leaves a command less than its own limit: the launch line says so, and the timeout's record names
    the budget, not the command (a one-GPU side on 2026-11-28 died this way and read as "exit timeout")."""
    class Stuck:  # a launch still running when its timeout comes (no minute of waiting in the test)
        pid = -1

        def __init__(self, *args, **kwargs):
            pass

        def wait(self, timeout=None):
            if timeout is not None:
                raise run.subprocess.TimeoutExpired("cmd", timeout)
            return -9

    monkeypatch.setattr(run.subprocess, "Popen", Stuck)
    monkeypatch.setattr(run.os, "killpg", lambda pid, sig: None)
    monkeypatch.setattr(run.time, "sleep", lambda s: None)
    s = session(tmp_path, budget_s=72)
    s.run("cut", [sys.executable, "-c", "pass"], 300)
    (cut,) = records(tmp_path)
    assert cut["status"] == "timeout"
    assert cut["error"].startswith("cut after 6") and "the 72 s budget gave it 6" in cut["error"] and "of its 300 s" in cut["error"]
    assert "of its 300 s" in capsys.readouterr().out


def test_real_data_repeats_alternate_the_two_sides_and_run_transformers_once(capsys, tmp_path):
    """--repeats 2 with --base: ours, base, ours, base; transformers' runs only in the first launch of each side."""
    run.main(["real_data", "--runs", "ours_synthetic,hf_synthetic", "--base", "/elsewhere", "--repeats", "2", "--dry_run",
              "--gpus", "1", "--out", str(tmp_path / "out.jsonl")])
    launches = [line for line in capsys.readouterr().out.splitlines() if "real_data.py" in line]
    names = [line.split(":")[0] for line in launches]
    assert names == ["qwen3_30b_a3b_L12_r1", "base_qwen3_30b_a3b_L12_r1", "qwen3_30b_a3b_L12_r2", "base_qwen3_30b_a3b_L12_r2"], names
    assert ["hf_synthetic" in line for line in launches] == [True, True, False, False], launches


def test_repeats_summary_takes_the_median_of_each_runs_medians():
    rows = [{"run": "ours_synthetic", "status": "ok", "median_step_s": v} for v in (0.61, 0.58, 0.66)]
    rows += [{"run": "base ours_synthetic", "status": "ok", "median_step_s": 0.60}, {"run": "ours_synthetic", "status": "timeout"}]
    lines = run.repeats_summary(rows).splitlines()
    assert lines[2] == "| ours_synthetic | 3 | 0.610 | 0.610, 0.580, 0.660 |", lines
    assert lines[3] == "| base ours_synthetic | 1 | 0.600 | 0.600 |", lines


def test_ep_scaling_table_divides_real_data_tokens_by_the_gpus_and_compares_each_count():
    from run import ep_scaling_table

    records = [
        {"status": "ok", "gpus_used": 1, "run": "ours_synthetic", "tokens_per_s": 48000.0, "median_step_s": 0.34},
        {"status": "ok", "gpus_used": 1, "run": "hf_synthetic", "tokens_per_s": 27000.0, "median_step_s": 0.6},
        {"status": "ok", "gpus_used": 2, "run": "ours_synthetic", "tokens_per_s": 60000.0, "median_step_s": 0.55},
        {"status": "ok", "gpus_used": 2, "run": "transformers", "tokens_per_s_per_gpu": 20000.0, "step_time_s": 0.82},
        {"status": "error", "gpus_used": 4, "name": "ours_4gpu", "error": "CUDA out of memory"},
    ]
    lines = ep_scaling_table(records).splitlines()
    assert "| ours_synthetic | 1 | 0.340 | 48,000 | 100% | 1.78x |" in lines
    assert "| ours_synthetic | 2 | 0.550 | 30,000 | 62% | 1.50x |" in lines  # 60,000 over 2 GPUs
    assert "| transformers | 1 | 0.600 | 27,000 | 100% |  |" in lines  # one GPU: its own model (real_data.py's hf_synthetic)
    assert "| transformers | 2 | 0.820 | 20,000 | 74% |  |" in lines
    assert lines[-1].startswith("ours_4gpu: error CUDA out of memory")


def test_ep_scaling_table_compares_ours_chat_with_transformers_on_the_same_chat_rows():
    """ours_chat against transformers_chat (one GPU: real_data.py's hf_sdpa), ours_synthetic against transformers (one
    GPU: hf_synthetic), whatever order the records come in."""
    from run import ep_scaling_table

    records = [
        {"status": "ok", "gpus_used": 1, "run": "hf_sdpa", "tokens_per_s": 20000.0, "median_step_s": 0.7},
        {"status": "ok", "gpus_used": 1, "run": "ours_synthetic", "tokens_per_s": 48000.0, "median_step_s": 0.34},
        {"status": "ok", "gpus_used": 1, "run": "ours_chat", "tokens_per_s": 30000.0, "median_step_s": 0.5},
        {"status": "ok", "gpus_used": 1, "run": "hf_synthetic", "tokens_per_s": 24000.0, "median_step_s": 0.6},
        {"status": "ok", "gpus_used": 2, "run": "ours_synthetic", "tokens_per_s": 60000.0, "median_step_s": 0.55},
        {"status": "ok", "gpus_used": 2, "run": "ours_chat", "tokens_per_s": 40000.0, "median_step_s": 0.8},
        {"status": "ok", "gpus_used": 2, "run": "transformers", "tokens_per_s_per_gpu": 20000.0, "step_time_s": 0.82},
        {"status": "ok", "gpus_used": 2, "run": "transformers_chat", "tokens_per_s_per_gpu": 10000.0, "step_time_s": 1.2},
    ]
    lines = ep_scaling_table(records).splitlines()
    assert "| ours_chat | 1 | 0.500 | 30,000 | 100% | 1.50x |" in lines  # against hf_sdpa, not hf_synthetic
    assert "| ours_chat | 2 | 0.800 | 20,000 | 67% | 2.00x |" in lines
    assert "| ours_synthetic | 1 | 0.340 | 48,000 | 100% | 2.00x |" in lines
    assert "| ours_synthetic | 2 | 0.550 | 30,000 | 62% | 1.50x |" in lines
    assert "| transformers | 1 | 0.600 | 24,000 | 100% |  |" in lines
    assert "| transformers_chat | 1 | 0.700 | 20,000 | 100% |  |" in lines
    assert "| transformers_chat | 2 | 1.200 | 10,000 | 50% |  |" in lines
    assert len(lines) == 2 + len(records)  # a header, then one row per record: none taken for another


def test_ep_scaling_runs_the_peer_on_ours_chat_rows_and_checkpoint(capsys, tmp_path):
    """At 2 GPUs the peer trains on ours' synthetic rows, then on data_chat.jsonl for --chat_steps; at 1 GPU real_data.py
    adds hf_sdpa; every launch reads the one checkpoint (--shrink's too)."""
    run.main(["ep_scaling", "--shrink", "--chat_steps", "5", "--dry_run", "--gpus", "2", "--out", str(tmp_path / "out.jsonl")])
    launches = dict(line.split(": ", 1) for line in capsys.readouterr().out.splitlines() if line.startswith(("ours_", "transformers_")))
    assert sorted(launches) == ["ours_1gpu", "ours_2gpu", "transformers_2gpu", "transformers_chat_2gpu"], launches
    assert "--runs ours_synthetic,ours_chat,hf_synthetic,hf_sdpa " in launches["ours_1gpu"]
    assert "--runs ours_synthetic,ours_chat " in launches["ours_2gpu"]
    chat = launches["transformers_chat_2gpu"]
    assert f"--data {os.path.join(ROOT, 'data_chat.jsonl')} --steps 5" in chat and "--nproc_per_node=2" in chat
    # the peer's synthetic side trains on the rows ours' synthetic runs wrote in real_data.py's --work
    work = re.search(r"--work (\S+)", launches["ours_2gpu"]).group(1)
    assert f"--work {work} " in launches["ours_1gpu"]
    assert f"--data {os.path.join(work, 'synthetic.json')} --steps 8" in launches["transformers_2gpu"]
    checkpoints = {re.search(r"--dir (\S+)", command).group(1) for command in launches.values()}
    assert checkpoints == {"/tmp/qwen3_30b_a3b-L12-shrunk"}, checkpoints


def test_ep_scaling_without_a_synthetic_run_of_ours_runs_no_synthetic_peer(capsys, tmp_path):
    run.main(["ep_scaling", "--shrink", "--counts", "2", "--runs", "ours_chat", "--dry_run", "--gpus", "2", "--out",
              str(tmp_path / "out.jsonl")])
    launches = [line.split(": ", 1)[0] for line in capsys.readouterr().out.splitlines() if line.startswith(("ours_", "transformers_"))]
    assert launches == ["ours_2gpu", "transformers_chat_2gpu"], launches


def test_ep_scaling_routing_reaches_ours_and_leaves_the_peer_out(capsys, tmp_path):
    """--routing balanced: every real_data.py launch routes so (one GPU's transformers run too); no launch of
    bench_peer_hf.py, which cannot balance its routers; own routing (the default) passes own."""
    run.main(["ep_scaling", "--shrink", "--routing", "balanced", "--dry_run", "--gpus", "2", "--out", str(tmp_path / "a.jsonl")])
    launches = dict(line.split(": ", 1) for line in capsys.readouterr().out.splitlines() if line.startswith(("ours_", "transformers_")))
    assert sorted(launches) == ["ours_1gpu", "ours_2gpu"], launches
    assert all(command.endswith("--routing balanced --shrink") for command in launches.values()), launches
    run.main(["ep_scaling", "--shrink", "--dry_run", "--gpus", "2", "--out", str(tmp_path / "b.jsonl")])
    launches = dict(line.split(": ", 1) for line in capsys.readouterr().out.splitlines() if line.startswith("ours_"))
    assert all("--routing own " in command for command in launches.values()), launches


def test_ep_scaling_table_compares_a_static_run_with_its_exact_runs_one_gpu_and_notes_loads_and_reruns():
    """ours_synthetic_static runs only at 2+ GPUs: its "of one GPU" is ours_synthetic's one GPU; a line per run gives the
    busiest ep rank at its own GPU count, the reruns and the host."""
    from run import ep_scaling_table

    records = [
        {"status": "ok", "gpus_used": 1, "run": "ours_synthetic", "tokens_per_s": 48000.0, "median_step_s": 0.34,
         "busiest_rank_over_mean": {"2": [1.1, 1.3], "4": [1.2, 1.5]}, "host_cpu": "AMD EPYC, 64 cores"},
        {"status": "ok", "gpus_used": 2, "run": "ours_synthetic_static", "tokens_per_s": 72000.0, "median_step_s": 0.45,
         "busiest_rank_over_mean": {"2": [1.05, 1.25], "4": [1.2, 1.5]}, "exchange_reruns": 3,
         "busiest_rank_over_mean_placed": {"2": [1.01, 1.04]}},
    ]
    lines = ep_scaling_table(records).splitlines()
    assert "| ours_synthetic_static | 2 | 0.450 | 36,000 | 75% | 1.50x |" not in lines  # no peer: no ratio
    assert "| ours_synthetic_static | 2 | 0.450 | 36,000 | 75% |  |" in lines  # 36,000 / 48,000
    assert lines[-2] == "ours_synthetic on 1 GPU: host AMD EPYC, 64 cores"  # one GPU: no ep rank to name
    assert lines[-1] == ("ours_synthetic_static on 2 GPUs: busiest rank / mean 1.05 (largest layer 1.25); experts placed by "
                         "load 1.01 (1.04); 3 micro-steps rerun exactly")


def test_ep_scaling_notes_say_what_each_ep_run_chose():
    """At ep > 1 a run's line names FSDP's units and what auto chose (from the launch line and the script's own notes):
    the 23rd session's full Qwen3 row fell to FSDP's per-layer units and the exact exchange without its table saying so."""
    from run import ep_scaling_notes

    record = {"status": "ok", "gpus_used": 4, "run": "ours_synthetic", "tokens_per_s": 96000.0, "median_step_s": 2.7,
              "launch": "world 4 = dp 1 x ep 4 (experts sharded over dp, dp_replicate 1; FSDP units: each layer); optim adamw_bf16",
              "chose": ["ep_capacity_factor auto: 0, the exact exchange (with its buffers the dense weights do not fit whole on "
                        "every rank within 90% of the GPU; fsdp_wrap auto: layer)",
                        "cuda_graphs auto: off (FSDP shards the dense weights)"]}
    graphs = dict(record, run="ours_chat", launch=record["launch"].replace("each layer", "none, dense weights whole on every rank"),
                  chose=["ep_capacity_factor auto: 3 (ep 4 = world size on one node: the static exchange read from the peers' "
                         "memory, each micro-step one CUDA graph)",
                         "cuda_graphs auto: each micro-step replayed from a CUDA graph after the warm-up steps"])
    one_gpu = dict(record, gpus_used=1, run="ours_alpaca")
    assert ep_scaling_notes([record, graphs, one_gpu]) == [
        "ours_synthetic on 4 GPUs: FSDP units: each layer; ep_capacity_factor auto: 0, the exact exchange; cuda_graphs auto: off",
        "ours_chat on 4 GPUs: FSDP units: none, dense weights whole on every rank; ep_capacity_factor auto: 3; "
        "cuda_graphs auto: each micro-step replayed from a CUDA graph"]
