#!/usr/bin/env bash
# Real data at full speed (issue: packing), on the GPUs this call has: train_fsdp2.py at Mixtral width on
# $LAYERS layers, seq 4096, 1 x 4 micro-batches per GPU, adamw_bf16, each a fresh launch (bench/bench_fsdp1.py run):
#   synthetic      samples of exactly 4096 tokens (no padding: the ceiling)
#   packed         data.json's 440 alpaca records, packing on (sdpa with the document mask)
#   packed_flex    the same with attn_implementation flex_attention
#   unpacked       the same records, packing off (one right-padded sample per micro-batch row)
# First bench/gpu_packing_check.py: packed vs one-by-one losses in bf16 on the GPU.
# Usage, from the repo root with .whl carried: bash bench/gpu_packing.sh   (results: $OUT/packing.jsonl, logs)
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/device_env.sh
out=${OUT:-/tmp/packing_out}; mkdir -p "$out"
gpus=${GPUS:-$(nvidia-smi -L | wc -l)}
layers=${LAYERS:-4}
ckpt=/tmp/mixtral-L$layers
echo "== $(date +%T) packing check"
timeout 240 python3 bench/gpu_packing_check.py 2>&1 | grep '^{' | tee "$out/packing_check.jsonl"
common="--dir $ckpt --layers $layers --gpus $gpus --seq 4096 --micro_batch 1 --grad_accum 4 --warmup 2 --steps ${STEPS:-4}
        --skip_export --timeout 200 --out $out/packing.jsonl --script train_fsdp2.py"
lean="--optim adamw_bf16"
run() {  # run NAME ARGS...
  echo "== $(date +%T) $1"
  python3 bench/bench_fsdp1.py run $common --name "$@" --work "$out/work_$1" 2>&1 | grep -E '^(  |\{|error|data)' | cut -c1-600
  cp "$out/work_$1/launch.log" "$out/$1.log" 2>/dev/null
  rm -rf "$out/work_$1"
}
run synthetic --train_args "$lean"
run packed --data data.json --train_args "$lean --packing true"
run unpacked --data data.json --train_args "$lean --packing false"
run packed_flex --data data.json --train_args "$lean --packing true --attn_implementation flex_attention"
python3 - "$out/packing.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
print("| config | status | s/step | real tokens/s per GPU | token fill | MFU (script) | peak GiB |")
print("|---|---|---|---|---|---|---|")
for r in rows:
    mfu = r.get("mfu_script_formula", r.get("mfu"))
    print(f"| {r['config']} | {r['status']} | {r.get('step_time_s', 0):.3f} | {r.get('tokens_per_s_per_gpu', 0):,.0f} | "
          f"{r.get('token_fill', 1.0):.3f} | {mfu if mfu is None else round(100 * mfu, 1)}% | {r.get('peak_allocated_gib', 0):.1f} |")
PY
