"""Real data at full speed, on one GPU in one call: ours on synthetic and real records beside transformers' own model.

    python bench/real_data.py --shape qwen3_30b_a3b --layers 12 --out results.jsonl [--runs ours_synthetic,...] [--routing balanced]

``--shape`` is a published model's shape cut to ``--layers`` decoder layers (random bf16 weights written once to
``--dir``, the embedded tiny model's tokenizer): ``qwen3_30b_a3b`` (128 experts of 2048 x 768, top-8),
``deepseek_v2_lite`` (64 routed experts of 2048 x 1408, top-6, 2 shared, MLA attention, the first layer dense),
``gpt_oss_20b`` (32 experts of 2880 x 2880, top-4, attention sinks, sliding window on every other layer, vocabulary
201,088) or ``mixtral`` (Mixtral-8x7B's width). Every run trains ``--seq`` 4096, 1 row x 4 micro-steps per step,
``--warmup`` steps then ``--steps`` measured ones. The runs (``--runs``, in this order by default):

  ours_synthetic   train_fsdp2.py, samples of exactly 4096 tokens (bench_fsdp1's synthetic records: the ceiling)
  ours_alpaca      train_fsdp2.py at its default settings (only --optim adamw_bf16) on data.json (alpaca)
  ours_chat        the same on data_chat.jsonl (chat; tools/make_chat_data.py), under TORCH_LOGS=recompiles
  ours_chat_flex   the same with --attn_implementation flex_attention (auto picks varlen: the comparison)
  ours_chat_varlen the same with --attn_implementation varlen (what auto picks, set explicitly)
  ours_chat_sdpa   the same with --attn_implementation sdpa (the old default)
  ours_chat_expandable  ours_chat with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
  hf_synthetic     transformers' own model (no FSDP, no EP: one GPU) on ours_synthetic's rows, sdpa (flex_attention
                   for a model without sdpa, gpt-oss's sinks; eager on CPU)
  hf_synthetic_flex  the same with flex_attention
  ours_synthetic_layer_wrap, ours_chat_layer_wrap  ours_synthetic, ours_chat with --fsdp_wrap layer (each decoder layer
                   its own FSDP unit: what auto's whole-model unit is measured against at ep = world size)
  ours_synthetic_full_logits, ours_chat_full_logits  ours_synthetic, ours_chat with --chunked_loss false (the loss from
                   full logits: the chunked loss's before/after in the same code)
  ours_synthetic_static, ours_chat_static  ours_synthetic, ours_chat with --ep_capacity_factor 1.25 (at --ep > 1 the
                   static expert exchange, no host sync per layer, overflowed micro-steps rerun exactly: against the
                   exact exchange in the same call; exchange_reruns in the record)
  ours_synthetic_replicated, ours_chat_replicated  ours_synthetic, ours_chat with --fsdp_wrap none (at --ep = GPUs: no
                   FSDP, the dense weights whole on every rank, their gradients averaged once a step; the exact exchange)
  ours_synthetic_placed, ours_chat_placed  ours_synthetic, ours_chat on the checkpoint with its experts placed on the
                   --ep ranks by the loads of the plain run before it in --runs (megablocks_utils/tools/place_experts.py;
                   the same steps' loads: in-sample, busiest_rank_over_mean_placed is the out-of-sample estimate)
  ours_synthetic_graphs_placed, ours_chat_graphs_placed  the *_graphs runs on the checkpoint placed by their loads
  ours_synthetic_segments, ours_chat_segments  ours_synthetic, ours_chat with --cuda_graphs segments (at --ep = GPUs > 1:
                   each layer's norms and attention from CUDA graphs, the MoE blocks from Python, fsdp_wrap none; one
                   GPU: the defaults, whole micro-steps from graphs)
  ours_synthetic_model_wrap, ours_chat_model_wrap  ours_synthetic, ours_chat with --fsdp_wrap model (at --ep = GPUs > 1:
                   the dense weights one FSDP unit, no segment graphs: the default before the segments; one GPU: the defaults)
  ours_synthetic_graphs, ours_chat_graphs  the *_static runs with --fsdp_wrap none --cuda_graphs true: at --ep > 1 the
                   dense weights whole on every rank and each micro-step replayed from a CUDA graph (one GPU: graphs
                   as by default)
  ours_synthetic_numa, ours_chat_numa  ours_synthetic, ours_chat launched with `torchrun --numa-binding node` (each rank
                   and its threads on the CPUs of its GPU's NUMA node: where the host paces the step, its placement may)
  ours_synthetic_swiglu_again, ours_chat_swiglu_again  ours_synthetic, ours_chat with --recompute_swiglu true (the
                   experts' SwiGLU output made again in the backward, not kept: the peak and the step it costs)
  hf_sdpa          transformers' own model on ours_chat's packed rows, sdpa
  hf_flex          the same with flex_attention

transformers' side takes exactly the rows ours trains on, step by step (data.load_training_data, GlobalBatches and
collate with the scripts' settings), bf16 weights, its grouped_mm experts and torch's fused AdamW, the mean
cross-entropy over the step's label tokens, clipping at 1.0; as a user of that model writes the loop (no compile).
Each run is a fresh process.

``--routing`` sets how both sides route (bench/routing_skew.py, the same hooks on transformers' routers and ours):
``own`` (the random weights' own: at Qwen3-30B-A3B's shape the busiest expert takes ~15x the mean, 2026-11-27),
``balanced`` (every expert exactly the same share of each micro-batch) or ``skew:R`` (the busiest expert R times the mean
in every layer, calibrated on each run's first micro-batch). Ours runs under bench/with_routing.py, which puts the hooks
on the model train_fsdp2.py loads.

Measured per run: the step times of every measured step (``metrics.jsonl`` for ours; CUDA-synchronised for
transformers), tokens/s = real (not padding) tokens over the summed time of all measured steps, spikes included;
the median step and the slowest step / median; TFLOPS per GPU by the training scripts' formula (docs/metrics.md,
the same for both sides); the routing reached, each layer's busiest expert over the mean per step, averaged over the
measured steps (ours: metrics.jsonl's expert load; transformers: the routers' choices), and (ours) the busiest ep rank's
rows over the mean at ep 2, 4 and 8 (``rank_loads``; ``busiest_rank_over_mean_placed``: the same with the experts placed
on the ranks by the first half of the steps' loads, ``placed_loads``). Ours: the recompile lines
TORCH_LOGS printed after the warm-up (``recompiles_after_warmup``; each line is tagged with the steps metrics.jsonl
held when it was read, so a late read can only count a warm-up recompile as later, never hide one). One JSON record
per run goes to ``--out``; a table is printed at the end.
"""

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from datetime import date

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
sys.path.insert(0, ROOT)
sys.path.insert(0, BENCH)
from bench_fsdp1 import choices  # noqa: E402  (the script's lines about its choices)
from gpt_oss import GPT_OSS_20B  # noqa: E402  (stdlib only at import: bench/run.py imports this file)

SHAPES = {
    # Qwen3-30B-A3B's config.json (hidden 2048, 48 layers, 128 experts of 768, top-8, 32 q / 4 kv heads of 128).
    "qwen3_30b_a3b": ("qwen3_moe", dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                                        num_experts_per_tok=8, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                                        vocab_size=151936, norm_topk_prob=True, max_position_embeddings=40960,
                                        rms_norm_eps=1e-6, router_aux_loss_coef=0.001, decoder_sparse_step=1, mlp_only_layers=[],
                                        tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    # DeepSeek-V2-Lite's config.json (27 layers, the first dense of 10944; 64 routed experts of 1408, top-6 by softmax,
    # greedy, 2 shared; MLA: 16 heads, no q low-rank path, kv rank 512, q/k heads of 128 + 64 rope, v heads of 128).
    "deepseek_v2_lite": ("deepseek_v2", dict(hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
                                             n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6,
                                             first_k_dense_replace=1, topk_method="greedy", n_group=1, topk_group=1,
                                             routed_scaling_factor=1.0, norm_topk_prob=False, num_attention_heads=16,
                                             num_key_value_heads=16, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
                                             qk_rope_head_dim=64, v_head_dim=128, vocab_size=102400,
                                             max_position_embeddings=163840, rms_norm_eps=1e-6, attention_bias=False,
                                             mlp_bias=False, tie_word_embeddings=False,
                                             rope_parameters={"rope_type": "yarn", "factor": 40.0, "mscale": 0.707,
                                                              "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096,
                                                              "beta_fast": 32.0, "beta_slow": 1.0, "rope_theta": 10000.0})),
    # gpt-oss-20b's config.json (bench/gpt_oss.py's GPT_OSS_20B); transformers alternates sliding and full layers.
    "gpt_oss_20b": ("gpt_oss", GPT_OSS_20B),
    # Mixtral-8x7B's width (8 experts of 4096 x 14336, top-2, 32 q / 8 kv heads).
    "mixtral": ("mixtral", dict(hidden_size=4096, intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2,
                                num_attention_heads=32, num_key_value_heads=8, vocab_size=32000, max_position_embeddings=32768,
                                rms_norm_eps=1e-5, router_aux_loss_coef=0.02, tie_word_embeddings=False,
                                rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
}
# --shrink (a CPU smoke test): every width tiny, the expert count and top-k kept (so routing behaves as at full size;
# hidden 256 stays above every shape's expert count, which balanced routing needs).
SHRINK = dict(hidden_size=256, intermediate_size=64, moe_intermediate_size=32, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16)
SHRINK_MLA = dict(hidden_size=256, intermediate_size=64, moe_intermediate_size=32, num_attention_heads=4, num_key_value_heads=4,
                  kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)  # q/k heads 24 wide, v 16: as at full size
RUNS = ["ours_synthetic", "ours_alpaca", "ours_chat", "ours_chat_flex", "ours_chat_varlen", "ours_chat_sdpa", "ours_chat_expandable",
        "ours_synthetic_full_logits", "ours_chat_full_logits", "ours_synthetic_layer_wrap", "ours_chat_layer_wrap", "ours_synthetic_static",
        "ours_chat_static", "ours_synthetic_graphs", "ours_chat_graphs", "ours_synthetic_replicated", "ours_chat_replicated", "ours_synthetic_segments", "ours_chat_segments", "ours_synthetic_model_wrap", "ours_chat_model_wrap", "ours_synthetic_placed", "ours_chat_placed", "ours_synthetic_graphs_placed", "ours_chat_graphs_placed", "ours_synthetic_numa", "ours_chat_numa", "ours_synthetic_swiglu_again", "ours_chat_swiglu_again", "hf_synthetic", "hf_synthetic_flex", "hf_sdpa", "hf_flex"]
STATIC_FACTOR = "1.25"  # the *_static and *_graphs runs' ep_capacity_factor (--static_factor): a peer's mean share and a quarter
SEQ, MICRO_BATCH, GRAD_ACCUM, SEED = 4096, 1, 4, 42  # SEED: train_fsdp2.py's default, so both sides draw the same rows


def write_checkpoint(directory: str, shape: str, layers: int, shrink: bool = False) -> float | None:
    """Random bf16 weights of ``shape`` with ``layers`` layers in hub layout (save_pretrained), the tiny tokenizer.
    Returns the seconds it took, None when ``directory`` was complete already. Flushed to disk before returning: the
    kernel writing a fresh checkpoint's dirty pages back during the next run takes the host time that a host-paced
    step at ep > 1 needs."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from megablocks_utils.model.tiny import DEFAULT_NAME, make_tiny_mixtral

    if os.path.isfile(os.path.join(directory, "tokenizer_config.json")):
        return None  # complete: the tokenizer is written last
    tiny = os.path.join(ROOT, DEFAULT_NAME)
    if not os.path.isdir(tiny):
        make_tiny_mixtral(tiny, os.path.join(ROOT, "data.json"))
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    model_type, values = SHAPES[shape]
    if shrink:
        values = dict(values, **(SHRINK_MLA if "kv_lora_rank" in values else SHRINK), vocab_size=len(tokenizer))
    config = AutoConfig.for_model(model_type, **values, num_hidden_layers=layers, pad_token_id=tokenizer.pad_token_id,
                                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    start = time.perf_counter()
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config)
    torch.set_default_dtype(torch.float32)
    model.save_pretrained(directory, max_shard_size="5GB")
    tokenizer.save_pretrained(directory)
    n = sum(p.numel() for p in model.parameters())
    del model
    if torch.cuda.is_available():  # else this process keeps the weights' memory cached while the runs train (their GPU)
        torch.cuda.empty_cache()
    os.sync()  # before any timed run (the docstring says why)
    seconds = time.perf_counter() - start
    print(f"wrote {directory}: {shape}, {layers} layers, {n / 1e9:.2f} B parameters, in {seconds:.0f} s", flush=True)
    return seconds


def data_file(run: str, work: str, directory: str, steps: int, seq: int = SEQ) -> str:
    """The records a run trains on: synthetic ones of exactly ``seq`` tokens (written to ``work``), or the repo's."""
    if "synthetic" in run:
        from bench_fsdp1 import synthetic_alpaca
        from transformers import AutoTokenizer

        path = os.path.join(work, "synthetic.json")
        with open(path, "w") as f:
            json.dump(synthetic_alpaca(AutoTokenizer.from_pretrained(directory), seq, MICRO_BATCH * GRAD_ACCUM * steps,
                                       os.path.join(ROOT, "data.json")), f)
        return path
    return os.path.join(ROOT, "data.json" if "alpaca" in run else "data_chat.jsonl")


def placed_model(run: str, args, work: str) -> str:
    """The checkpoint with its experts placed on --ep ranks by the loads an earlier run of this invocation recorded
    (``*_placed`` needs its plain run first: ours_synthetic before ours_synthetic_placed; with --placed_by R, run R's
    loads: out of sample, e.g. the chat records placed by the alpaca records' loads), written once per call."""
    from megablocks_utils.model.placement import place

    base = args.placed_by or run.removesuffix("_placed")
    loads_file = os.path.join(work, f"{base}.loads.json")
    if not os.path.isfile(loads_file):
        raise SystemExit(f"error: {run} places the experts by {base}'s loads: list {base} before it in --runs")
    with open(loads_file) as f:
        loads = json.load(f)
    placed = f"{args.dir.rstrip('/')}-placed-ep{args.ep}-{base}"
    if not os.path.isfile(os.path.join(placed, "expert_order.json")):
        place(args.dir, placed, loads, args.ep)
        os.sync()  # placed runs of 2026-11-27, without it: first steps 0.62-0.75 s, later ones 0.54 as the plain run's
    return placed




def ours(run: str, args, work: str) -> dict:
    """train_fsdp2.py at its defaults (--optim adamw_bf16, the bench batch), stopped once every step is logged."""
    steps = args.warmup + (args.chat_steps if "chat" in run else args.steps)
    out_dir = os.path.join(work, run)
    shutil.rmtree(out_dir, ignore_errors=True)
    static = ["--ep_capacity_factor", args.static_factor]
    graphs = [*static, "--fsdp_wrap", "none", "--cuda_graphs", "true"]
    extra = {"ours_chat_flex": ["--attn_implementation", "flex_attention"], "ours_chat_varlen": ["--attn_implementation", "varlen"],
             "ours_chat_sdpa": ["--attn_implementation", "sdpa"], "ours_synthetic_full_logits": ["--chunked_loss", "false"],
             "ours_chat_full_logits": ["--chunked_loss", "false"], "ours_synthetic_layer_wrap": ["--fsdp_wrap", "layer"],
             "ours_chat_layer_wrap": ["--fsdp_wrap", "layer"], "ours_synthetic_static": static, "ours_chat_static": static,
             "ours_synthetic_graphs": graphs, "ours_chat_graphs": graphs, "ours_synthetic_replicated": ["--fsdp_wrap", "none"],
             "ours_chat_replicated": ["--fsdp_wrap", "none"], "ours_synthetic_segments": ["--cuda_graphs", "segments"],
             "ours_chat_segments": ["--cuda_graphs", "segments"], "ours_synthetic_model_wrap": ["--fsdp_wrap", "model"],
             "ours_chat_model_wrap": ["--fsdp_wrap", "model"], "ours_synthetic_swiglu_again": ["--recompute_swiglu", "true"],
             "ours_chat_swiglu_again": ["--recompute_swiglu", "true"]}.get(run.removesuffix("_placed"), [])
    if run.endswith(("_segments", "_model_wrap")) and args.ep == 1:  # one GPU: the defaults (whole micro-steps from graphs)
        extra = []
    model_dir = placed_model(run, args, work) if run.endswith("_placed") else args.dir
    # Routing other than the weights' own: the same hooks as transformers' side, put on the model train_fsdp2.py loads.
    launcher = [] if args.routing == "own" else [os.path.join(BENCH, "with_routing.py"), args.routing]
    # --ep N: ours on N GPUs, each with its own rows and 1/N of the experts (the data for N ranks' steps).
    parallel = ["--ep_size", str(args.ep)] if args.ep > 1 else []
    numa = ["--numa-binding", "node"] if run.endswith("_numa") else []  # torchrun's own flag (torch >= 2.9)
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.ep}", *numa, *launcher, os.path.join(ROOT, "train_fsdp2.py"),
               *parallel, "--model_name_or_path", model_dir, "--data_path", data_file(run, work, args.dir, steps * args.ep, args.seq), "--output_dir",
               out_dir, "--max_length", str(args.seq), "--per_device_train_batch_size", str(MICRO_BATCH),
               "--gradient_accumulation_steps", str(GRAD_ACCUM), "--optim", "adamw_bf16", "--learning_rate", "1e-5", "--max_steps",
               str(steps), *extra]
    env = dict(os.environ, TORCH_LOGS="recompiles", PYTHONUNBUFFERED="1")
    if run.endswith("_expandable"):
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    metrics = os.path.join(out_dir, "metrics.jsonl")
    log_lines = []  # (steps logged when read, line)

    def logged() -> int:
        try:
            with open(metrics) as f:
                return sum(1 for _ in f)
        except OSError:
            return 0

    print(f"== {time.strftime('%H:%M:%S')} {run}: {' '.join(command[3:])}", flush=True)
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)

    def read():
        for raw in iter(proc.stdout.readline, b""):
            for line in raw.decode(errors="replace").split("\r"):
                log_lines.append((logged(), line.rstrip()))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.time() + args.run_timeout
    while proc.poll() is None and logged() < steps and time.time() < deadline:
        time.sleep(0.5)
    done = logged()
    if proc.poll() is None:  # every step is logged: the final export (16+ GB) is not what is measured
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    try:  # ranks that outlived torchrun (they take SIGTERM as "save and stop"): none may hold a GPU for the next launch
        os.killpg(proc.pid, signal.SIGKILL)
        for _ in range(40):  # gone once the group has no process left
            time.sleep(0.5)
            os.killpg(proc.pid, 0)
    except (ProcessLookupError, PermissionError):
        pass
    reader.join(5)
    with open(os.path.join(work, f"{run}.log"), "w") as f:
        f.write("\n".join(f"[{n}] {line}" for n, line in log_lines))
    # what the script chose where a setting left it the choice (its mesh and units, the exchange's factor, the graphs)
    record = {"run": run, "steps_logged": done, "steps_asked": steps, **choices([line for _, line in log_lines])}
    if done < steps:
        # the rank's own exception first (torchrun's summary that ends the output names only the exit code)
        raised = [line for _, line in log_lines if re.search(r"\w+(Error|Exception)\b|(^|\s)error:|CUDA error", line)
                  and "torch.distributed.elastic" not in line][:4]
        record.update(status="error", error=" | ".join(raised + [line for _, line in log_lines[-8:]])[-1600:])
        return record
    rows = [json.loads(line) for line in open(metrics)]
    record["losses"] = [round(r["loss"], 4) for r in rows]  # the same rows on every ours_chat* run: kernels compare exactly
    counted = [r["tokens_per_expert"] for r in rows if r.get("tokens_per_expert")]
    if counted:  # every step's rows per expert, summed: what a *_placed run places the experts by
        with open(os.path.join(work, f"{run}.loads.json"), "w") as f:
            json.dump([[float(sum(c)) for c in zip(*layer)] for layer in zip(*counted)], f)
    rows = rows[args.warmup :]
    shutil.rmtree(out_dir, ignore_errors=True)  # a started export (16+ GB) would fill the disk for the next run
    recompiles = [(n, line) for n, line in log_lines if "Recompiling function" in line]
    late = [line for n, line in recompiles if n >= args.warmup]
    times = [r["step_time_s"] for r in rows]
    loads = [[most / mean for most, mean in zip(r["tokens_per_expert_max"], r["tokens_per_expert_mean"])] for r in rows]
    per_expert = [r["tokens_per_expert"] for r in rows if r.get("tokens_per_expert")]
    record.update(status="ok", recompile_lines=len(recompiles), recompiles_after_warmup=len(late), late_recompiles=late[:5],
                  **timing(times, [r["tokens"] for r in rows], [r["token_slots"] for r in rows],
                           [r["tflops_per_device"] * 1e12 * r["step_time_s"] for r in rows]),
                  **routing_reached(loads), **rank_loads(per_expert),
                  peak_allocated_gib=max((r.get("peak_memory_allocated_gb") or 0) for r in rows) or None,
                  alloc_retries=[r.get("alloc_retries") for r in rows])
    if run.removesuffix("_placed").endswith(("_static", "_graphs")):
        record["ep_capacity_factor"] = float(args.static_factor)
    if any("exchange_reruns" in r for r in rows):  # the static exchange: micro-steps rerun exactly, measured steps
        record["exchange_reruns"] = sum(r["exchange_reruns"] for r in rows)
    return record


def host_cpu() -> str:
    """The host's CPU model and core count: the host's launches pace the steps at ep > 1, so numbers from two hosts
    with the same GPUs differ by it (2 x H200 against 4 x H200 at ep 2, 2026-11-27)."""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        model = ""
    return f"{model or 'unknown'}, {os.cpu_count()} cores"


def timing(times: list[float], tokens: list[int], slots: list[int], flops: list[float]) -> dict:
    """Step times, tokens/s and TFLOPS over the summed time of every measured step."""
    median = statistics.median(times)
    return {"measured_steps": len(times), "median_step_s": median, "mean_step_s": sum(times) / len(times),
            "max_over_median": max(times) / median, "tokens_per_s": sum(tokens) / sum(times), "token_fill": sum(tokens) / sum(slots),
            "tflops": sum(flops) / sum(times) / 1e12, "step_times": [round(t, 4) for t in times]}


def routing_reached(per_step: list[list[float]]) -> dict:
    """``per_step[s][l]``: layer l's busiest expert over the mean in measured step s -> each layer's mean over the
    steps, and their mean and largest."""
    layers = [statistics.mean(steps) for steps in zip(*per_step)]
    if not layers:
        return {}
    return {"busiest_over_mean": statistics.mean(layers), "busiest_over_mean_max": max(layers),
            "busiest_over_mean_per_layer": [round(r, 3) for r in layers]}


def rank_loads(per_step: list[list[list[int]]], eps: tuple[int, ...] = (2, 4, 8)) -> dict:
    """``per_step[s][l][e]``: the rows expert e of layer l took in step s, over all ranks -> for each ep that divides the
    experts, the busiest ep rank's rows (rank r owns a contiguous block of experts) over the ranks' mean, averaged over
    layers and steps, and the largest layer's. Each layer's exchange waits for its busiest rank, so at ep > 1 this is
    a floor on that layer's expert time against one GPU's, whatever the host does; a one-GPU run says what ep N would
    meet on the same routing. Step sums smooth the micro-steps' own peaks: a lower bound."""
    found = {}
    for ep in eps:
        per_layer = []
        for layers in zip(*per_step):  # one layer's counts, step by step
            ratios = []
            for counts in layers:
                if len(counts) % ep:
                    break
                block = len(counts) // ep
                ratios.append(busiest_over_mean([sum(counts[r * block:(r + 1) * block]) for r in range(ep)]))
            if ratios:
                per_layer.append(statistics.mean(ratios))
        if per_layer:
            found[str(ep)] = (round(statistics.mean(per_layer), 4), round(max(per_layer), 4))
    placed = placed_loads(per_step, eps)
    return ({"busiest_rank_over_mean": found} if found else {}) | ({"busiest_rank_over_mean_placed": placed} if placed else {})


def busiest_over_mean(ranks: list[float]) -> float:
    """The busiest rank's rows over the ranks' mean (1.0 where none has any)."""
    return max(ranks) / (sum(ranks) / len(ranks)) if sum(ranks) else 1.0


def placed_loads(per_step: list[list[list[int]]], eps: tuple[int, ...] = (2, 4, 8)) -> dict:
    """What expert placement by load could do: per layer, the experts placed on the ranks by their load over the first
    half of the steps (``balanced_placement``), then the busiest rank over the mean in each step of the second half (as
    ``rank_loads``: the layers' mean and largest). Loads measured earlier decide, so a placement that only fits the steps
    it is judged on does not count (``python -m megablocks_utils.tools.place_experts`` writes such a placement). Empty
    with fewer than 2 steps."""
    from megablocks_utils.model.placement import balanced_placement  # what the placement tool would write

    half = len(per_step) // 2
    if half == 0:
        return {}
    found = {}
    for ep in eps:
        per_layer = []
        for layers in zip(*per_step):
            if len(layers[0]) % ep:
                break
            placement = balanced_placement([sum(c) for c in zip(*layers[:half])], ep)
            ratios = [busiest_over_mean([sum(counts[e] for e in experts) for experts in placement]) for counts in layers[half:]]
            per_layer.append(statistics.mean(ratios))
        if per_layer:
            found[str(ep)] = (round(statistics.mean(per_layer), 4), round(max(per_layer), 4))
    return found


HF_RUNS = {"hf_synthetic": ("synthetic", None), "hf_synthetic_flex": ("synthetic", "flex_attention"),
           "hf_sdpa": ("chat", "sdpa"), "hf_flex": ("chat", "flex_attention")}  # run -> (rows, attention; None: sdpa if it has it)


def hf(run: str, args) -> dict:
    """transformers' own model on one GPU, trained on the rows ours trains on (in a fresh process)."""
    import torch
    from routing_skew import RouterCounts, control_routing
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from megablocks_utils.data.batches import GlobalBatches, collate, load_training_data
    from megablocks_utils.model.architectures import spec_for
    from megablocks_utils.train.loss import causal_lm_loss_sum
    from megablocks_utils.train.metrics import active_params, flops_per_token

    rows, attn = HF_RUNS[run]
    spec = spec_for(AutoConfig.from_pretrained(args.dir))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # No sdpa (gpt-oss's sinks): flex_attention, or on CPU, where flex has no backward, eager (as ours' auto).
    attn = attn or ("sdpa" if spec.supports_sdpa else "flex_attention" if device.type == "cuda" else "eager")
    measured = args.steps if rows == "synthetic" else args.chat_steps
    path = data_file("hf_synthetic", args.work, args.dir, args.warmup + args.steps, args.seq) if rows == "synthetic" else \
        os.path.join(ROOT, "data_chat.jsonl")  # synthetic: the very file ours_synthetic trains on
    tokenizer = AutoTokenizer.from_pretrained(args.dir)
    data = load_training_data(path, tokenizer, args.seq, packing=True, seed=SEED)
    batches = GlobalBatches(data.train, MICRO_BATCH, GRAD_ACCUM, 1, 0, SEED, unit="packed rows")
    model = AutoModelForCausalLM.from_pretrained(args.dir, dtype=torch.bfloat16, attn_implementation=attn,
                                                 experts_implementation="grouped_mm").to(device)
    model.train()
    config = model.config
    control_routing(model, args.routing)  # skew: calibrated by the first micro-batch, as ours
    counts = RouterCounts(model, getattr(config, spec.num_experts_attr))
    n_active = active_params(model, config, [p for name, p in model.named_parameters() if f".{spec.experts_attr}." in name])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, betas=(0.9, 0.95), weight_decay=0.0, fused=device.type == "cuda")
    times, tokens, slots, flops, loads = [], [], [], [], []
    for step in range(args.warmup + measured):
        micro_batches, label_tokens = batches.micro_batches(step)
        batches_here = [collate([data.train[j] for j in m], tokenizer.pad_token_id, device, args.seq, attn) for m in micro_batches]
        sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
        sync()
        start = time.perf_counter()
        for batch in batches_here:
            out = model(**batch["model_inputs"])
            (causal_lm_loss_sum(out.logits, batch["labels"]) / label_tokens).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync()
        elapsed = time.perf_counter() - start
        step_loads = counts.take()
        if step >= args.warmup:
            times.append(elapsed)
            tokens.append(sum(int(b["real"].sum()) for b in batches_here))
            slots.append(sum(b["input_ids"].numel() for b in batches_here))
            flops.append(sum(flops_per_token(n_active, config, b["attention_sq"] / b["input_ids"].numel()) * b["input_ids"].numel()
                             for b in batches_here))
            loads.append(step_loads)
    return {"run": run, "status": "ok", "attention": attn, "experts_implementation": config._experts_implementation,
            **timing(times, tokens, slots, flops), **routing_reached(loads),
            "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None}


def table(records: list[dict]) -> str:
    lines = ["| run | status | median s/step | tokens/s (all measured steps) | TFLOPS | busiest / mean expert | busiest / mean rank "
             "at ep 2, 4, 8 | slowest / median | token fill | recompiles after warm-up | peak GiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        if r.get("status") != "ok":
            lines.append(f"| {r['run']} | {r.get('status')} | | | | | | | | | |")
            continue
        peak = f"{r['peak_allocated_gib']:.1f}" if r.get("peak_allocated_gib") else ""
        load = f"{r['busiest_over_mean']:.2f} (max {r['busiest_over_mean_max']:.2f})" if r.get("busiest_over_mean") else ""
        ranks = ", ".join(f"{mean:.2f}" for mean, _ in r.get("busiest_rank_over_mean", {}).values())
        lines.append(f"| {r['run']} | ok | {r['median_step_s']:.3f} | {r['tokens_per_s']:,.0f} | {r.get('tflops', 0):.0f} | {load} | "
                     f"{ranks} | {r['max_over_median']:.2f} | {r['token_fill']:.3f} | {r.get('recompiles_after_warmup', '')} | {peak} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3_30b_a3b")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--dir", default="", help="the checkpoint (written if missing); default /tmp/<shape>-L<layers>")
    p.add_argument("--runs", default=",".join(RUNS))
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--steps", type=int, default=16, help="measured steps (synthetic and alpaca runs)")
    p.add_argument("--chat_steps", type=int, default=46, help="measured steps of the chat runs (4 + 46 = 50 with TORCH_LOGS)")
    p.add_argument("--run_timeout", type=float, default=300)
    p.add_argument("--work", default="/tmp/real_data")
    p.add_argument("--out", default="bench/results.jsonl")
    p.add_argument("--routing", default="own", help="both sides: own, balanced or skew:R (bench/routing_skew.py)")
    p.add_argument("--placed_by", default="", help="the *_placed runs place the experts by this earlier run's loads (default: "
                   "each by its own plain run's, in-sample)")
    p.add_argument("--static_factor", default=STATIC_FACTOR, help="the *_static and *_graphs runs' --ep_capacity_factor")
    p.add_argument("--seq", type=int, default=SEQ, help="tokens per row (4096; shorter for a CPU smoke test)")
    p.add_argument("--shrink", action="store_true", help="a tiny version of the shape (a CPU smoke test of this script)")
    p.add_argument("--ep", type=int, default=1, help="ours on this many GPUs with ep_size = N (tokens/s: all of them; TFLOPS: "
                   "per GPU); transformers' side runs on one GPU, so its runs are refused with N > 1")
    p.add_argument("--hf_run", default="", help=argparse.SUPPRESS)  # internal: one transformers run in this process
    args = p.parse_args()
    if args.ep > 1 and any(run.startswith("hf_") for run in args.runs.split(",")):
        p.error(f"--ep {args.ep}: transformers' model runs on one GPU here; give only ours' runs (--runs ours_synthetic,...) "
                "and compare TFLOPS per GPU")
    args.dir = args.dir or f"/tmp/{args.shape}-L{args.layers}"
    from routing_skew import parse_routing  # torch: not at this file's import (bench/run.py reads RUNS)

    try:
        parse_routing(args.routing)
    except ValueError as e:
        p.error(str(e))
    if args.hf_run:
        print("RECORD " + json.dumps(hf(args.hf_run, args)), flush=True)
        return
    import torch

    os.makedirs(args.work, exist_ok=True)
    written_s = write_checkpoint(args.dir, args.shape, args.layers, args.shrink)
    common = {"shape": args.shape, "layers": args.layers, "seq": args.seq, "micro_batch": MICRO_BATCH, "grad_accum": GRAD_ACCUM,
              "warmup": args.warmup, "routing": args.routing, "ep": args.ep, "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "host_cpu": host_cpu(),
              "torch": torch.__version__, "date": str(date.today())}
    if written_s is not None:
        common["checkpoint_written_s"] = round(written_s, 1)
    records = []
    for run in args.runs.split(","):
        started = time.perf_counter()
        if run.startswith("hf_"):
            print(f"== {time.strftime('%H:%M:%S')} {run}", flush=True)
            try:
                proc = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--hf_run", run], cwd=ROOT, capture_output=True,
                                      text=True, timeout=args.run_timeout)
                found = [line[7:] for line in proc.stdout.splitlines() if line.startswith("RECORD ")]
                record = json.loads(found[0]) if found else {"run": run, "status": "error", "error": (proc.stderr or proc.stdout)[-800:]}
            except subprocess.TimeoutExpired:
                record = {"run": run, "status": "timeout", "error": f"no record within --run_timeout {args.run_timeout:.0f} s"}
        else:
            record = ours(run, args, args.work)
        record = {**common, **record, "wall_s": round(time.perf_counter() - started, 1)}
        records.append(record)
        print(json.dumps({k: v for k, v in record.items() if k not in ("step_times", "losses")}), flush=True)
        with open(args.out, "a") as f:
            f.write(json.dumps(record) + "\n")
    print(table(records), flush=True)


if __name__ == "__main__":
    main()
