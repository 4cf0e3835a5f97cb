#!/usr/bin/env bash
# Quality of the lean `optim` choices against adamw_torch (issue: full-size memory), on one GPU, real text
# (data.json's alpaca records), a mid-size Mixtral shape (4 layers, hidden 1024, 8 experts of 3584), 200 steps:
#   scratch   every optim from the same seeded random weights, lr 1e-3 (the loss falls from ~6.3)
#   finetune  every optim from the scratch adamw_torch run's final model, lr 2e-5: updates far below a bf16
#             weight's spacing, where bf16 weights without stochastic rounding would stop learning
# Each run is train_fsdp2.py itself (so bytes_per_param in summary.json is the run's own measurement).
# Usage, from the repo root with .whl carried (torchao, datasets): bash bench/optim_quality.sh
# Results: $OUT/optim_quality.jsonl, $OUT/<regime>_<optim>.log, a table printed last.
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/device_env.sh
out=${OUT:-/tmp/optim_quality}; mkdir -p "$out"
work=${WORK:-/tmp/optim_quality_runs}; mkdir -p "$work"
steps=${STEPS:-200}
optims=${OPTIMS:-adamw_torch adamw_bf16 adamw_torch_8bit}
model=$work/mixtral-mid
python3 -c "
from megablocks_utils.model.tiny import make_tiny_mixtral
make_tiny_mixtral('$model', 'data.json', hidden_size=${HIDDEN:-1024}, intermediate_size=${INTERMEDIATE:-3584},
                  num_attention_heads=8, num_key_value_heads=4, num_hidden_layers=${LAYERS:-4}, max_position_embeddings=1024)
" || exit 1
common="--data_path data.json --max_steps $steps --warmup_steps 10 --lr_scheduler_type cosine --per_device_train_batch_size 4
        --gradient_accumulation_steps 2 --max_length 512 --logging_steps 50 --overwrite_output_dir true --seed 7"
train() {  # train REGIME OPTIM MODEL LR
  echo "== $(date +%T) $1 $2"
  timeout 300 torchrun --nproc_per_node 1 train_fsdp2.py $common --model_name_or_path "$3" --learning_rate "$4" \
    --optim "$2" --output_dir "$work/$1_$2" >"$out/$1_$2.log" 2>&1 || { echo "   failed:"; tail -5 "$out/$1_$2.log"; }
}
for o in $optims; do train scratch "$o" "$model" 1e-3; done
for o in $optims; do train finetune "$o" "$work/scratch_adamw_torch/final" 2e-5; done
python3 - "$work" "$out/optim_quality.jsonl" "$optims" <<'PY'
import json, os, statistics, sys
work, path, optims = sys.argv[1], sys.argv[2], sys.argv[3].split()
rows = []
for regime in ("scratch", "finetune"):
    for optim in optims:
        run = os.path.join(work, f"{regime}_{optim}")
        try:
            recs = [json.loads(l) for l in open(os.path.join(run, "metrics.jsonl"))]
            summary = json.load(open(os.path.join(run, "summary.json")))
        except OSError as e:
            rows.append({"regime": regime, "optim": optim, "status": f"failed: {e}"}); continue
        losses = [r["ce_loss"] for r in recs]
        rows.append({"regime": regime, "optim": optim, "status": "ok", "steps": len(recs), "first_loss": losses[0],
                     "final_loss": losses[-1], "last20_mean": statistics.mean(losses[-20:]),
                     "bytes_per_param": summary["bytes_per_param"], "peak_allocated_gb": summary.get("peak_memory_allocated_gb"),
                     "step_s_median": statistics.median(r["step_time_s"] for r in recs[5:])})
with open(path, "w") as f:
    for r in rows:
        f.write(json.dumps(r) + "\n")
print("| regime | optim | first loss | final loss | mean of last 20 | vs adamw_torch (last 20) | bytes/param | peak GiB | s/step |")
print("|---|---|---|---|---|---|---|---|---|")
for r in rows:
    if r["status"] != "ok":
        print(f"| {r['regime']} | {r['optim']} | {r['status']} |"); continue
    ref = next((x for x in rows if x["regime"] == r["regime"] and x["optim"] == "adamw_torch" and x["status"] == "ok"), None)
    rel = f"{(r['last20_mean'] / ref['last20_mean'] - 1) * 100:+.2f}%" if ref else "-"
    print(f"| {r['regime']} | {r['optim']} | {r['first_loss']:.4f} | {r['final_loss']:.4f} | {r['last20_mean']:.4f} | {rel} | "
          f"{r['bytes_per_param']:.2f} | {r['peak_allocated_gb']} | {r['step_s_median']:.3f} |")
PY
