#!/usr/bin/env bash
# The fit check's estimate against the measured peak, one GPU, one call: train_fsdp2.py on a Mixtral-width checkpoint of
# $LAYERS layers (random bf16 weights, written once per machine), 1 x $SEQ tokens x 4 micro-steps, 2 warm-up + 2
# measured steps, once per entry of $RUNS (name=train_fsdp2 settings, ';'-separated). Each run prints the plan
# (megablocks_utils/tools/memory.py) before loading; the table last puts its peak beside the measured one.
# Usage, from the repo root with .whl carried: [LAYERS=4] [RUNS=...] bash bench/gpu_memory_check.sh
# Results: $OUT/memory_check.jsonl (bench_fsdp1.py records plus the estimate), launch logs beside.
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/device_env.sh
out=${OUT:-/tmp/memory_out}; mkdir -p "$out"; out=$(cd "$out" && pwd)
layers=${LAYERS:-4}; seq=${SEQ:-4096}; ckpt=${CKPT:-/tmp/mixtral-L$layers}
results=$out/memory_check.jsonl
RUNS=${RUNS:-"torch_none=--optim adamw_torch;torch_selective=--optim adamw_torch --activation_checkpointing selective;torch_full=--optim adamw_torch --activation_checkpointing full;bf16_full=--optim adamw_bf16 --activation_checkpointing full"}
echo "== $(date +%T) $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1); torch $(python3 -c 'import torch; print(torch.__version__)')"
python3 -c "import sys; sys.path.insert(0, 'bench'); from bench_fsdp1 import checkpoint_complete as c; sys.exit(0 if c('$ckpt', $layers, 4096, 14336) else 1)" \
  || python3 bench/bench_fsdp1.py write --dir "$ckpt" --layers "$layers" 2>&1 | grep -vi warn | tail -1
IFS=';' read -ra runs <<<"$RUNS"
for r in "${runs[@]}"; do
  name=${r%%=*}; extra=${r#*=}
  echo "== $(date +%T) $name: $extra"
  rm -rf /tmp/memory_work
  python3 bench/bench_fsdp1.py run --script train_fsdp2.py --dir "$ckpt" --layers "$layers" --gpus 1 --seq "$seq" --grad_accum 4 \
    --warmup 2 --steps 2 --train_args "$extra" --name "$name" --skip_export --timeout "${T_RUN:-150}" --work /tmp/memory_work \
    --out "$out/runs.jsonl" >"$out/$name.log" 2>&1
  cp /tmp/memory_work/launch.log "$out/${name}_launch.log" 2>/dev/null
  estimate=$(grep -m1 -E '^  peak ' "$out/${name}_launch.log" | awk '{print $2}')
  python3 - "$out/runs.jsonl" "$results" "$name" "${estimate:-nan}" <<'PY'
import json, sys
runs, results, name, estimate = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
record = [r for r in map(json.loads, open(runs)) if r.get("config") == name][-1]
record["estimate_gib"] = estimate
open(results, "a").write(json.dumps(record) + "\n")
print(name, record.get("status"), "estimate", estimate, "allocated", record.get("peak_allocated_gib"), "reserved", record.get("peak_reserved_gib"),
      "s/step", record.get("step_time_s"), record.get("error", "")[:200])
PY
  sleep 2
done
echo "== $(date +%T) done in $SECONDS s"
