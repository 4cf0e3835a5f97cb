#!/usr/bin/env bash
# train_fsdp1.py on 2 GPUs (NCCL): fp32 equals train_fsdp2.py step by step, resume from a mid-run Trainer
# checkpoint repeats the later losses, and a bf16 + activation-checkpointing run trains. Writes
# fsdp1.jsonl, fsdp2.jsonl, resumed.jsonl, bf16.jsonl and summary.json (of the fp32 run) to $1.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-/tmp/gpu_fsdp1}
work=$(mktemp -d)
mkdir -p "$out"
[ -d tiny-mixtral ] || python3 -c "from megablocks_utils.tiny_model import make_tiny_mixtral; make_tiny_mixtral('tiny-mixtral', 'data.json')"
launch="python3 -m accelerate.commands.launch --num_processes 2 --config_file accelerate.yaml train_fsdp1.py --accelerator_config accelerator_config.json"
args="--max_steps 6 --ep_size 2 --per_device_train_batch_size 2 --gradient_accumulation_steps 2 --warmup_steps 1"
$launch $args --output_dir "$work/fsdp1" --save_strategy steps --save_steps 3 2>&1 | grep -E "accelerate:|summary:|error" || true
$launch $args --output_dir "$work/resumed" --resume_from_checkpoint "$work/fsdp1/checkpoint-3" 2>&1 | grep -E "summary:|error" || true
torchrun --standalone --nproc_per_node 2 train_fsdp2.py $args --dtype fp32 --output_dir "$work/fsdp2" 2>&1 | grep -E "summary:|error" || true
$launch $args --output_dir "$work/bf16" --bf16 true --activation_checkpointing true 2>&1 | grep -E "summary:|error" || true
for run in fsdp1 fsdp2 resumed bf16; do cp "$work/$run/metrics.jsonl" "$out/$run.jsonl"; done
cp "$work/fsdp1/summary.json" "$out/summary.json"
python3 - "$out" <<'EOF'
import json, sys
load = lambda name: [json.loads(line) for line in open(f"{sys.argv[1]}/{name}.jsonl")]
fsdp1, fsdp2, resumed, bf16 = (load(n) for n in ("fsdp1", "fsdp2", "resumed", "bf16"))
for a, b in zip(fsdp1, fsdp2):
    print(f"step {a['step']}: fsdp1 loss {a['loss']:.7f} gnorm {a['grad_norm']:.6f} | fsdp2 loss {b['loss']:.7f} gnorm {b['grad_norm']:.6f}"
          f" | rel {abs(a['loss'] - b['loss']) / b['loss']:.2e}")
for r in resumed:
    a = next(x for x in fsdp1 if x["step"] == r["step"])
    print(f"resumed step {r['step']}: {r['loss']:.7f} vs uninterrupted {a['loss']:.7f}")
print("bf16 + activation checkpointing losses:", [round(r["loss"], 4) for r in bf16])
EOF
