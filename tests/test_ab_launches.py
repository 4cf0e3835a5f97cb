"""bench/ab_launches.sh, the helper of A/B device calls, without a GPU: each launch runs bench/real_data.py from its own
tree with that tree first on the path, late launches are skipped, and the records print and pack. The trees here hold a
stand-in real_data.py that writes one record saying which tree and which arguments it ran with."""

import os
import subprocess
import tarfile

from conftest import ROOT

STAND_IN = '''import json, os, sys
args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
with open(args["--out"], "w") as f:
    f.write(json.dumps({"run": args["--runs"], "status": "ok", "median_step_s": 0.1 * int(args["--ep"]),
                        "losses": [12.345678], "chose": [os.environ["PYTHONPATH"].split(":")[0], args["--shape"]]}) + "\\n")
print("ran")
'''


def tree(tmp_path, name):
    path = tmp_path / name
    (path / "bench").mkdir(parents=True)
    (path / "bench" / "real_data.py").write_text(STAND_IN)
    return str(path)


def shell(script, out, **env):
    return subprocess.run(["bash", "-c", f"source {ROOT}/bench/ab_launches.sh; {script}"], capture_output=True, text=True,
                          env=dict(os.environ, OUT=str(out), **env), timeout=60)


def test_launches_from_each_tree_print_and_pack(tmp_path):
    base, branch, out = tree(tmp_path, "base"), tree(tmp_path, "branch"), tmp_path / "out"
    out.mkdir()
    done = shell(f"ab_run main_a {base} 2 ours_synthetic; ab_run both_a {branch} 4 ours_chat; ab_records; ab_pack", out,
                 AB_ARGS="--shape tiny")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("main_a rc=0 ") and lines[1].startswith("both_a rc=0 ")
    assert lines[2] == f"both_a ours_chat ok 0.4 [12.3457] None ['{branch}', 'tiny'] "
    assert lines[3] == f"main_a ours_synthetic ok 0.2 [12.3457] None ['{base}', 'tiny'] "
    with tarfile.open(out / "records.tgz") as packed:
        assert sorted(os.path.basename(n) for n in packed.getnames()) == ["both_a.jsonl", "both_a.txt", "main_a.jsonl",
                                                                          "main_a.txt"]
    assert sorted(os.listdir(out)) == ["records.tgz"]


def test_a_launch_past_the_time_is_skipped(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    done = shell(f"ab_run late {tree(tmp_path, 'base')} 2 ours_synthetic", out, AB_SKIP_AFTER_S="-1")
    assert done.returncode == 0 and done.stdout == "late skipped (time)\n", done.stdout + done.stderr
    assert not os.listdir(out)
