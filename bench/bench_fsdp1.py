"""Configuration (d) of the side-by-side benchmark: ours through HF Trainer + accelerate FSDP1 + EP.

    python bench/bench_fsdp1.py write --dir /tmp/mixtral-L8 --layers 8       # checkpoint + tokenizer (23 GB at L = 8)
    python bench/bench_fsdp1.py run --dir /tmp/mixtral-L8 --gpus 4 --out bench/results/parity_throughput_megablocks_h100-h200_2026-11-20-21/records.md#h200x4_l8jsonl
    python bench/bench_fsdp1.py view --dir /tmp/mixtral-L4 --source /tmp/mixtral-L8 --layers 4  # first 4 layers, linked

The "Trainer path" is train_fsdp1.py itself, launched as a user launches it (`accelerate launch
--config_file accelerate.yaml train_fsdp1.py --accelerator_config accelerator_config.json ...`), so it
needs what a user has: a checkpoint on disk and a data file.

``write`` makes a Mixtral-8x7B-width checkpoint truncated to L layers in hub layout (bench_loading.py's
``write``: random bf16 weights, vocab 32000) and gives it the embedded tiny model's tokenizer (byte-level
BPE, 512 ids, all valid in the 32000-row embedding).
``run`` writes an alpaca data file in which every sample is longer than ``--seq`` tokens in its response
(its prompt is ~40 tokens), so train_fsdp1's truncation to ``max_length = seq`` makes every sample exactly
``seq`` tokens: no padding, no FLOPs on padding. It launches train_fsdp1.py for ``warmup + steps``
optimizer steps with bench_moe.py's batch (micro batch 1, 4 micro-steps per step per GPU), bf16 compute
with fp32 master weights and fp32 reduction, fused AdamW, global-norm clipping; then reads the run's
metrics.jsonl (per-step ``step_time_s``, ``tokens``) and summary.json (peak memory, the largest over
ranks) and appends one record with bench_moe.py's fields and ``config: fsdp1_ep`` to ``--out``.
``--script train_fsdp2.py`` runs train_fsdp2.py on the same checkpoint and data (``config: fsdp2_ep_script``),
a cross-check of (d) against the plain loop on identical input. ``--train_args`` appends settings to the launched
script's command line (later ones win), ``--name`` names the record's ``config``, and ``--skip_export`` stops the
launch once metrics.jsonl holds every step, before the final export (93 GB of writing at 32 layers; the peak
memory is then rank 0's, from metrics.jsonl). bench/run.py full_size runs it so.

Step time: train_fsdp1 times each optimizer step from Trainer's ``on_step_begin`` (after the step's
micro-batches are fetched, the GPU idle) to ``on_step_end``, once the step's loss all-reduce has been read
back, which waits for the GPU to finish the optimizer step too. The median over the steps after
``--warmup`` is reported.
TFLOPS and MFU use bench_moe.py's Megatron formula and peak (989); the dense bf16 GEMM rate is measured on
GPU 0 in a separate process right before the launch (so it holds no memory during the run).
"""

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from importlib.metadata import version

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
sys.path.insert(0, ROOT)
CONFIG_NAMES = {"train_fsdp1.py": "fsdp1_ep", "train_fsdp2.py": "fsdp2_ep_script"}
# The lines train_fsdp2.py prints about what it chose for ep_capacity_factor and cuda_graphs (not their later progress);
# ``choices`` keeps them in bench/real_data.py's records too.
CHOICE = re.compile(r"^(ep_capacity_factor auto|cuda_graphs (auto|true|segments)):")


def choices(lines: list[str]) -> dict:
    """What a launch's output says it chose: ``launch`` (its "world ..." line: the mesh, FSDP's units, the attention) and
    ``chose`` (``CHOICE``'s lines), for its record."""
    world = next((line for line in lines if "world " in line and "attention " in line), "")
    return {**({"launch": world[:400]} if world else {}), "chose": [line.strip()[:240] for line in lines if CHOICE.match(line)]}


def write_checkpoint(directory: str, layers: int, hidden: int, intermediate: int) -> None:
    from bench_loading import write
    from transformers import AutoTokenizer

    from megablocks_utils.model.tiny import DEFAULT_NAME, make_tiny_mixtral

    tiny = os.path.join(ROOT, DEFAULT_NAME)
    if not os.path.isdir(tiny):
        make_tiny_mixtral(tiny, os.path.join(ROOT, "data.json"))
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    start = time.perf_counter()
    write(directory, layers, hidden, intermediate, vocab_size=32000, pad_token_id=tokenizer.pad_token_id,
          bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    if len(tokenizer) > 32000:
        raise SystemExit(f"error: the tokenizer of {tiny} has {len(tokenizer)} ids, more than the model's 32000 rows")
    tokenizer.save_pretrained(directory)  # last: its presence marks a complete checkpoint
    os.sync()  # its dirty pages written back now, not during the first timed run (real_data.write_checkpoint)
    print(f"wrote the checkpoint and a {len(tokenizer)}-id tokenizer in {time.perf_counter() - start:.1f} s", flush=True)


def checkpoint_complete(directory: str, layers: int, hidden: int, intermediate: int) -> bool:
    try:
        with open(os.path.join(directory, "config.json")) as f:
            c = json.load(f)
    except OSError:
        return False
    same = (c["num_hidden_layers"], c["hidden_size"], c["intermediate_size"]) == (layers, hidden, intermediate)
    return same and os.path.isfile(os.path.join(directory, "tokenizer_config.json"))


def write_layer_view(directory: str, source: str, layers: int) -> None:
    """A checkpoint of ``source``'s first ``layers`` decoder layers, in seconds and no space: its config with
    ``num_hidden_layers = layers``, its tokenizer, an index of the kept weights, and symbolic links to the
    safetensors files that hold them (write's layout: one file per layer, so no file holds a dropped layer)."""
    with open(os.path.join(source, "model.safetensors.index.json")) as f:
        index = json.load(f)
    layer_of = lambda name: int(name.split(".")[2]) if name.startswith("model.layers.") else -1  # noqa: E731
    kept = {k: v for k, v in index["weight_map"].items() if layer_of(k) < layers}
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory)
    for name in sorted(set(kept.values())):
        os.symlink(os.path.abspath(os.path.join(source, name)), os.path.join(directory, name))
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": kept}, f, indent=1)
    for name in os.listdir(source):
        if name.endswith(".json") and name not in ("config.json", "model.safetensors.index.json") or name.endswith((".model", ".txt")):
            shutil.copy(os.path.join(source, name), directory)
    with open(os.path.join(source, "config.json")) as f:
        config = json.load(f)
    config["num_hidden_layers"] = layers
    if isinstance(config.get("layer_types"), list):
        config["layer_types"] = config["layer_types"][:layers]
    with open(os.path.join(directory, "config.json"), "w") as f:  # last: what checkpoint_complete reads
        json.dump(config, f, indent=1)
    print(f"{directory}: the first {layers} layers of {source} ({len(set(kept.values()))} files linked)", flush=True)


def synthetic_alpaca(tokenizer, seq: int, count: int, source_path: str) -> list[dict]:
    """``count`` alpaca records whose tokenized sample (<bos> prompt response <eos>) is longer than ``seq``
    in its response, while the prompt alone is far shorter: truncated to ``seq`` each is exactly ``seq``
    tokens, nearly all of them labels. The text is data.json's, rotated so the samples differ."""
    from megablocks_utils.data.records import (
        format_prompt,
        read_alpaca,
        tokenize_record,
    )

    corpus = " ".join(" ".join(filter(None, (r["instruction"], r.get("input", ""), r["output"]))) for r in read_alpaca(source_path))
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    chars_per_token = len(corpus) / len(encode(corpus))
    records = []
    for i in range(count):
        record = {"instruction": f"Continue the text (sample {i}).", "input": ""}
        prompt = 1 + len(encode(format_prompt(record)))  # with <bos>
        if prompt >= seq:
            raise ValueError(f"seq={seq} is not longer than the prompt ({prompt} tokens); raise seq")
        start = (i * 7919) % len(corpus)
        rotated = corpus[start:] + " " + corpus[:start]
        chars = int((seq - prompt + 16) * chars_per_token * 1.1)
        text = (rotated + " ") * (chars // len(rotated) + 1)
        while len(encode(text[:chars])) < seq - prompt + 8:  # some response tokens beyond seq: truncation, not padding
            chars = int(chars * 1.25)
            text = (rotated + " ") * (chars // len(rotated) + 1)
        record["output"] = text[:chars]
        sample = tokenize_record(record, tokenizer, seq)
        assert len(sample["input_ids"]) == seq and sample["num_label_tokens"] >= seq - prompt - 1, (i, len(sample["input_ids"]))
        records.append(record)
    return records


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def probe() -> dict:
    """Device, software and the dense bf16 GEMM rate now (bench_moe.dense_gemm_tflops on GPU 0); run in its own process."""
    import torch
    from bench_moe import dense_gemm_tflops

    cuda = torch.cuda.is_available()
    return {
        "cuda": cuda, "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
        "dense_gemm_tflops": dense_gemm_tflops(torch.device("cuda", 0)) if cuda else None,
    }


def launch_command(args, cuda: bool, data: str, out_dir: str) -> list[str]:
    steps = args.warmup + args.steps
    common = [
        "--model_name_or_path", args.dir, "--data_path", data, "--max_length", str(args.seq),
        "--per_device_train_batch_size", str(args.micro_batch), "--gradient_accumulation_steps", str(args.grad_accum),
        "--max_steps", str(steps), "--learning_rate", "1e-5", "--ep_size", str(args.ep_size),
        "--activation_checkpointing", "true" if args.ac else "false", "--output_dir", out_dir, "--overwrite_output_dir", "true",
    ]
    if args.script == "train_fsdp2.py":  # fused AdamW on GPU is built in; dtype auto = bf16 on GPU, fp32 on CPU
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.gpus),
                "train_fsdp2.py", *common, *shlex.split(args.train_args)]
    optim = args.optim or "adamw_torch_fused"
    return [
        sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(args.gpus),
        "--main_process_port", str(free_port()), "--config_file", "accelerate.yaml", "train_fsdp1.py",
        "--accelerator_config", "accelerator_config.json", *common, "--optim", optim,
        *(["--bf16", "true"] if cuda else []), *shlex.split(args.train_args),
    ]


def steps_logged(metrics_path: str) -> int:
    try:
        with open(metrics_path) as f:
            return sum(1 for line in f if line.strip())
    except OSError:
        return 0


def wait_for_launch(proc, args, metrics_path: str):
    """The launch's exit status, or why it was stopped: after ``--timeout`` seconds, or (``--skip_export``) once
    metrics.jsonl holds every step. Stopping kills the launcher's session: it and every rank it started."""
    deadline = time.perf_counter() + args.timeout
    while proc.poll() is None:
        stop = None
        if time.perf_counter() > deadline:
            stop = f"timeout after {args.timeout:.0f} s"
        elif args.skip_export and steps_logged(metrics_path) >= args.warmup + args.steps:
            stop = "stopped after the last step (--skip_export)"
        if stop:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return stop
        time.sleep(1)
    return proc.returncode


def run(args) -> None:
    from bench_moe import PEAK_TFLOPS, megatron_flops_per_token
    from transformers import AutoConfig, AutoTokenizer

    if not checkpoint_complete(args.dir, args.layers, args.hidden, args.intermediate):
        write_checkpoint(args.dir, args.layers, args.hidden, args.intermediate)
    work = args.work or tempfile.mkdtemp(prefix="bench_fsdp1_")
    os.makedirs(work, exist_ok=True)
    data, out_dir, log_path = (os.path.join(work, n) for n in ("data.json", "run", "launch.log"))
    shutil.rmtree(out_dir, ignore_errors=True)  # an earlier run's metrics.jsonl would read as this run's steps

    # Enough distinct samples for every step: one epoch, no sample seen twice.
    per_step = args.micro_batch * args.grad_accum * args.gpus
    tokenizer = AutoTokenizer.from_pretrained(args.dir)
    start = time.perf_counter()
    if args.data:  # real records as they come (their lengths, padding or packing as the script's settings say)
        shutil.copyfile(args.data, data)
        print(f"data: {args.data}", flush=True)
    else:
        records = synthetic_alpaca(tokenizer, args.seq, per_step * (args.warmup + args.steps), os.path.join(ROOT, "data.json"))
        with open(data, "w") as f:
            json.dump(records, f)
        print(f"{len(records)} samples of exactly {args.seq} tokens in {data} ({time.perf_counter() - start:.1f} s)", flush=True)

    found = json.loads(subprocess.run([sys.executable, __file__, "probe"], cwd=ROOT, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
    gemm_text = f"{found['dense_gemm_tflops']:.0f} TFLOP/s" if found["dense_gemm_tflops"] else "not measured (no GPU)"
    print(f"{found['device']}: dense bf16 GEMM {gemm_text}", flush=True)
    command = launch_command(args, found["cuda"], data, out_dir)
    env = dict(os.environ)
    if not found["cuda"]:
        env.setdefault("OMP_NUM_THREADS", "1")
    print("launch:", " ".join(command), flush=True)
    start = time.perf_counter()
    with open(log_path, "w") as log:
        # Its own session, so a timeout stops the launcher and every rank it started, nothing else.
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        returncode = wait_for_launch(proc, args, os.path.join(out_dir, "metrics.jsonl"))
    launch_s = time.perf_counter() - start
    with open(log_path) as f:
        lines = f.read().splitlines()
    for line in lines:
        if line.startswith(("world ", "accelerate:", "summary:", "error")) or CHOICE.match(line):
            print("  " + line[:400], flush=True)

    config = AutoConfig.from_pretrained(args.dir)
    # train_fsdp2.py uses fused AdamW on GPU only; train_fsdp1.py whatever --optim names.
    fused_adamw = found["cuda"] if args.script == "train_fsdp2.py" else (args.optim or "adamw_torch_fused") == "adamw_torch_fused"
    train_args = shlex.split(args.train_args)
    ac = train_args[train_args.index("--activation_checkpointing") + 1] if "--activation_checkpointing" in train_args else args.ac
    record = {
        "config": args.name or CONFIG_NAMES[args.script], "gpus": args.gpus, "device": found["device"], "layers": args.layers,
        "hidden": args.hidden, "seq": args.seq, "micro_batch": args.micro_batch, "grad_accum": args.grad_accum,
        "activation_checkpointing": ac, "fused_adamw": fused_adamw, "train_args": args.train_args,
        "date": date.today().isoformat(), "torch": found["torch"], "transformers": version("transformers"),
        "accelerate": version("accelerate"), "dense_gemm_tflops": found["dense_gemm_tflops"],
        "script": args.script, "ep_size": args.ep_size or args.gpus, "launch_wall_s": launch_s, "data": args.data or "synthetic",
        **choices(lines),
    }
    metrics_path, summary_path = os.path.join(out_dir, "metrics.jsonl"), os.path.join(out_dir, "summary.json")
    steps = [json.loads(line) for line in open(metrics_path)] if os.path.isfile(metrics_path) else []
    measured = [r for r in steps if r["step"] > args.warmup]
    record["launch_exit"] = returncode
    if len(measured) < args.steps:
        text = "\n".join(lines)
        oom = "OutOfMemoryError" in text or "CUDA out of memory" in text
        # The scripts' own message ("error: ...") first, else the last exception (not the launcher's ChildFailedError).
        last_error = next((line for line in lines if line.startswith("error")), None) or next(
            (line for line in reversed(lines) if "Error" in line and "ChildFailedError" not in line), f"exit {returncode}")
        record.update(status="OOM" if oom else "error", error=last_error.strip()[:300], steps_done=len(steps))
        print("\n".join(lines[-40:]), flush=True)
    elif args.data:  # real records: real tokens per second and the script's own MFU (attention over document spans)
        real, slots, seconds = (sum(r[k] for r in measured) for k in ("tokens", "token_slots", "step_time_s"))
        record.update(
            status="ok", step_time_s=statistics.median(r["step_time_s"] for r in measured),
            tokens_per_s_per_gpu=real / seconds / args.gpus, token_fill=real / slots,
            mfu_script_formula=statistics.median(r["mfu"] for r in measured) if measured[0]["mfu"] is not None else None,
            tflops_per_gpu_script_formula=statistics.median(r["tflops_per_device"] for r in measured),
            steps_measured=len(measured), step_times_s=[r["step_time_s"] for r in steps], final_loss=steps[-1]["loss"],
        )
        source = json.load(open(summary_path)) if os.path.isfile(summary_path) else steps[-1]
        if "peak_memory_allocated_gb" in source:
            record.update(peak_allocated_gib=source["peak_memory_allocated_gb"], peak_reserved_gib=source["peak_memory_reserved_gb"])
    else:  # every step measured (the launch may still have failed or timed out later, in the final export)
        tokens_per_step = measured[0]["tokens"]
        if any(r["tokens"] != per_step * args.seq for r in measured):
            raise SystemExit(f"error: a step trained {tokens_per_step} tokens, not {per_step} samples x {args.seq}; the data has padding")
        step_time = statistics.median(r["step_time_s"] for r in measured)
        tokens_per_gpu = tokens_per_step / args.gpus / step_time
        tflops = megatron_flops_per_token(config, args.seq) * tokens_per_gpu / 1e12
        gemm = found["dense_gemm_tflops"]
        # Expert load over the measured steps: the busiest expert's count over a perfect balance, mean over layers.
        imbalance = statistics.mean(m / a for r in measured for m, a in zip(r["tokens_per_expert_max"], r["tokens_per_expert_mean"]))
        record.update(
            status="ok", step_time_s=step_time, tokens_per_s_per_gpu=tokens_per_gpu, tflops_per_gpu=tflops,
            mfu=tflops / PEAK_TFLOPS, mfu_vs_dense_gemm=tflops / gemm if gemm else None, steps_measured=len(measured),
            step_times_s=[r["step_time_s"] for r in steps], tokens_per_step=tokens_per_step,
            tflops_per_gpu_script_formula=statistics.median(r["tflops_per_device"] for r in measured),
            expert_load_max_over_mean=imbalance, final_loss=steps[-1]["loss"],
        )
        # Peak memory: summary.json's is the largest over ranks (the whole run, loading included; training
        # dominates); without it (the run did not finish) rank 0's at its last step, from metrics.jsonl.
        summary = json.load(open(summary_path)) if os.path.isfile(summary_path) else None
        source = summary or steps[-1]
        of = "largest over ranks, whole run (summary.json)" if summary else "rank 0, up to the last step (metrics.jsonl)"
        if "peak_memory_allocated_gb" in source:
            record.update(peak_allocated_gib=source["peak_memory_allocated_gb"], peak_reserved_gib=source["peak_memory_reserved_gb"], peak_memory_of=of)
        else:
            record.update(peak_rss_gib=source["peak_rss_gb"], peak_memory_of="host RSS: " + of)
    if not args.keep:  # the run's final/ export is the full model in fp32 (45 GB at L = 8): do not leave it behind
        shutil.rmtree(os.path.join(out_dir, "final"), ignore_errors=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "a") as f:
        f.write(json.dumps(record) + "\n")
    print(json.dumps(record), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=["write", "view", "run", "probe"])
    p.add_argument("--dir", help="the checkpoint directory (made by write or view; run writes it if missing)")
    p.add_argument("--source", help="(view) the checkpoint whose first --layers layers --dir shows")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=14336)
    p.add_argument("--gpus", type=int, default=4, help="processes (one per GPU)")
    p.add_argument("--ep_size", type=int, default=0, help="0 = all ranks, as bench_moe.py")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--micro_batch", type=int, default=1)
    p.add_argument("--grad_accum", type=int, default=4, help="micro-steps per optimizer step")
    p.add_argument("--steps", type=int, default=10, help="measured optimizer steps")
    p.add_argument("--warmup", type=int, default=3, help="optimizer steps before the measured ones")
    p.add_argument("--ac", action="store_true", help="activation checkpointing of every decoder layer")
    p.add_argument("--optim", default="", help="Trainer's --optim (default adamw_torch_fused, as bench_moe --fused_adamw)")
    p.add_argument("--script", choices=sorted(CONFIG_NAMES), default="train_fsdp1.py")
    p.add_argument("--data", default="", help="a data file to train on as it is (default: synthetic samples of exactly --seq tokens)")
    p.add_argument("--train_args", default="", help="more settings for the launched script, one string (appended last: they win)")
    p.add_argument("--name", default="", help="the record's config (default: fsdp1_ep or fsdp2_ep_script)")
    p.add_argument("--skip_export", action="store_true", help="stop the launch once every step is logged, before its final export")
    p.add_argument("--work", default="", help="data file, launch log and the run's output dir (default: a new temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the run's final/ model export")
    p.add_argument("--timeout", type=float, default=3600, help="seconds before the launch is stopped")
    p.add_argument("--out", default="bench/results.jsonl")
    args = p.parse_args()
    if args.mode == "probe":
        print(json.dumps(probe()))
    elif not args.dir:
        p.error("--dir is required")
    elif args.mode == "write":
        write_checkpoint(args.dir, args.layers, args.hidden, args.intermediate)
    elif args.mode == "view":
        if not args.source:
            p.error("view needs --source, the checkpoint to take the first --layers layers of")
        write_layer_view(args.dir, args.source, args.layers)
    else:
        run(args)


if __name__ == "__main__":
    main()
