#!/usr/bin/env bash
# The MoE layer's levers since $BASE's commit on one GPU, before/after in one call, alternating (base, head, base,
# head) so drift between launches shows: bench/bench_moe.py --config ep (ours, fp32 master weights, bf16 compute,
# every kept lever as in bench/peers.sh) at Mixtral width, $LAYERS layers, 4096 tokens x 2 sequences x 2 micro-steps,
# 3 warm-up + 6 measured steps. One GPU is ep = 1: what can change is the layer's own code (dispatch, host syncs) and
# the experts' gradient reduce (FSDP stays on one rank here: fp32 weights need its cast), not the all-to-all.
# Usage, from the repo root: BASE=dir [LAYERS=4] bash bench/gpu_levers_one_gpu.sh   (results: $OUT/levers_one_gpu.jsonl)
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/device_env.sh
out=${OUT:-/tmp/levers_out}; mkdir -p "$out"; out=$(cd "$out" && pwd)
results=$out/levers_one_gpu.jsonl
base=${BASE:?"BASE=dir: a copy of the earlier commit (git archive C | tar -x -C dir)"}
run="torchrun --standalone --nproc_per_node=1 bench/bench_moe.py --config ep --fused_adamw --compile_loss --compile_dense"
run="$run --layers ${LAYERS:-4} --seq 4096 --micro_batch 2 --grad_accum 2 --warmup 3 --steps 6"
echo "== $(date +%T) $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); torch $(python3 -c 'import torch; print(torch.__version__)')"
for round in 1 2; do
  for side in base head; do
    dir=.; [ "$side" = base ] && dir=$base
    echo "== $(date +%T) $side, round $round"
    (cd "$dir" && timeout -k 10 200 $run --out "$out/$side.jsonl" 2>&1 | grep -E '^\{|Error|error' | cut -c1-300)
  done
done
python3 - "$out" "$results" <<'PY'
import json, sys
out, results = sys.argv[1], sys.argv[2]
with open(results, "w") as sink:
    for side in ("base", "head"):
        for r in map(json.loads, open(f"{out}/{side}.jsonl")):
            r["config"] = f"ep_{side}"
            sink.write(json.dumps(r) + "\n")
            print(side, r.get("status", "ok"), {k: r.get(k) for k in ("step_time_s", "tokens_per_s_per_gpu", "mfu", "peak_allocated_gib")})
PY
echo "== $(date +%T) done in $SECONDS s"
