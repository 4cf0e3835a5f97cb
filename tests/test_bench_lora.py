"""bench/lora_peft.py on a CPU rank: ours and transformers + PEFT train on the same real (chat) rows to the same
losses, step by step, and the record says how far the loss fell. bench/run.py lora --quality compares those falls."""

import json
import os
import statistics
import subprocess
import sys

from conftest import ROOT, tiny_moe_config

sys.path.insert(0, os.path.join(ROOT, "bench"))
import run  # noqa: E402


def test_ours_and_peft_train_the_same_chat_rows_to_the_same_losses(tmp_path, tiny_model_dir):
    config = str(tmp_path / "qwen3-tiny")
    tiny_moe_config("qwen3_moe", vocab_size=512, max_position_embeddings=256).save_pretrained(config)
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    launches = {}
    for variant in ("ours", "peft"):  # at once: one core each
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
                   os.path.join(ROOT, "bench", "lora_peft.py"), "--variant", variant, "--model_config", config, "--layers", "1",
                   "--seq", "256", "--steps", "3", "--warmup", "1", "--attn", "sdpa", "--data", "chat", "--tokenizer",
                   tiny_model_dir, "--lr", "1e-3", "--out", str(tmp_path / f"{variant}.jsonl")]
        launches[variant] = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    records = {}
    for variant, proc in launches.items():
        output = proc.communicate(timeout=120)[0]
        assert proc.returncode == 0, output[-2000:]
        (records[variant],) = [json.loads(line) for line in (tmp_path / f"{variant}.jsonl").read_text().splitlines()]
    ours, peft = records["ours"], records["peft"]
    for r in (ours, peft):
        assert r["status"] == "ok" and r["data"] == "chat" and r["data_rows"] > 0 and len(r["losses"]) == 4
        assert r["loss_first10_mean"] == statistics.mean(r["losses"][:10])
        assert r["loss_last10_mean"] == statistics.mean(r["losses"][-10:])
        assert r["loss_fall"] == r["loss_first10_mean"] - r["loss_last10_mean"]
    for a, b in zip(ours["losses"], peft["losses"]):
        assert abs(a - b) <= 1e-4, (ours["losses"], peft["losses"])
    assert ours["losses"][0] != ours["losses"][1], "every step trains on rows of its own"


def test_quality_table_gives_ours_fall_over_peft_fall(tmp_path):
    s = run.Session(run.parser().parse_args(["lora", "--quality", "--out", str(tmp_path / "records.jsonl"), "--gpus", "1",
                                             "--logs", str(tmp_path / "logs")]))
    write = "import json, sys; open(sys.argv[1], 'a').write(sys.argv[2] + '\\n')"
    common = {"status": "ok", "data": "chat", "losses": [0.0] * 200, "loss_first10_mean": 12.0, "step_time_s": 0.5}
    for side, last, fall in (("ours", 9.0, 3.0), ("peft", 9.5, 2.5)):  # as lora_peft.py writes them: "variant" is the side
        record = dict(common, variant=side, loss_last10_mean=last, loss_fall=fall)
        s.run(f"{side}_chat_L48", [sys.executable, "-c", write, s.part, json.dumps(record)], 120, side=side)
    s.keep({"name": "ours_full_chat_L48", "side": "ours", "status": "timeout", "error": "exit timeout"})
    rows = run.lora_quality_table(s.records).splitlines()[2:]
    assert rows[0].split(" | ")[5:7] == ["3.0000", "1.2000"]
    assert rows[1].split(" | ")[5:7] == ["2.5000", "1.0000"]
    assert "timeout" in rows[2]


def test_quality_dry_run_trains_200_steps_of_chat_rows_within_the_budget(capsys):
    run.main(["lora", "--quality", "--dry_run"])
    printed = capsys.readouterr().out.splitlines()
    commands = [line for line in printed if "lora_peft.py" in line]
    assert len(commands) == 2 and all("--data chat" in c and "--steps 200 --warmup 0" in c for c in commands)
    estimate = float(printed[-1].split("about ")[1].split(" s")[0])
    assert estimate < 560, printed[-1]


def test_ours_trains_over_random_weights_read_as_released(tmp_path):
    """bench/lora_peft.py --release: random weights read layer by layer as from an FP8 release (Qwen3's layout, kept as
    released) and from gpt-oss's MXFP4 release (its published config, quantization_config and all, at tiny sizes), under
    --quantize_base fp8: the frozen base is the release's format and the adapters train (finite losses that move)."""
    import json as json_

    configs = {"fp8": tiny_moe_config("qwen3_moe", hidden_size=128, moe_intermediate_size=128, head_dim=32, vocab_size=512)}
    gpt_oss = json_.load(open(os.path.join(ROOT, "tests", "configs", "gpt-oss-120b", "config.json")))
    gpt_oss.update(hidden_size=64, intermediate_size=32, num_local_experts=4, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, vocab_size=512, layer_types=["sliding_attention", "full_attention"])
    from transformers import AutoConfig

    configs["mxfp4"] = AutoConfig.for_model("gpt_oss", **{k: v for k, v in gpt_oss.items() if k != "model_type"})
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    launches = {}
    for release, config in configs.items():
        folder = str(tmp_path / release)
        config.save_pretrained(folder)
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
                   os.path.join(ROOT, "bench", "lora_peft.py"), "--variant", "ours", "--model_config", folder, "--layers", "2",
                   "--seq", "128", "--steps", "3", "--warmup", "0", "--attn", "eager", "--release", release, "--quantize_base",
                   "fp8", "--lr", "1e-2", "--out", str(tmp_path / f"{release}.jsonl")]
        launches[release] = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for release, proc in launches.items():
        output = proc.communicate(timeout=180)[0]
        assert proc.returncode == 0, output[-3000:]
        (record,) = [json.loads(line) for line in (tmp_path / f"{release}.jsonl").read_text().splitlines()]
        assert record["status"] == "ok" and record["release"] == release and record["quantize_base"] == "fp8", record
        assert f"experts in {release}" in record["base"] and "linear layers in fp8" in record["base"], record["base"]
        assert all(x == x for x in record["losses"]) and record["losses"][0] != record["losses"][-1], record["losses"]
