#!/usr/bin/env bash
# Issue #17's table in one device call: ours (c) beside transformers' own FSDP2 + EP (f), each at the random weights'
# own (near-uniform) routing and at skewed routing (bench/routing_skew.py: the busiest expert at $SKEW x the mean in
# every layer; 2.38 is this project's real-text record). Mixtral width, $LAYERS layers, 4096 tokens x 2 sequences x
# 2 micro-steps per GPU, fp32 master weights with bf16 compute, fused AdamW, clipping; 3 warm-up + 6 measured steps.
#   ours: bench/bench_moe.py --config ep with every kept lever (as bench/gpu_perf_suite.sh's table)
#   (f):  bench/bench_peer_hf.py --precision fp32_master on a checkpoint of the same shape ($CKPT, written once)
# With BASE=dir (a copy of an earlier commit, e.g. `git archive C | tar -x -C .base`, carried), ours also runs with that
# code at each routing, as "ep_base": the levers since then, measured before/after in the same call.
# With OVERLAP=C, ours also runs with --overlap_chunks C (the all-to-all overlap lever) at each routing, as "ep_overlapC".
# ROUTINGS picks the routings to run (default "uniform skewed"), e.g. to split the table over two calls.
# Usage, from the repo root with .whl carried (transformers 5.23):
#   [SKEW=2.38] [LAYERS=8] [BASE=dir] [OVERLAP=2] [ROUTINGS=uniform] bash bench/peers.sh
# Results: $OUT/peers.jsonl and a table printed last.
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/device_env.sh
out=${OUT:-/tmp/peers_out}; mkdir -p "$out"; out=$(cd "$out" && pwd)  # absolute: BASE runs elsewhere
layers=${LAYERS:-8}; skew=${SKEW:-2.38}; ckpt=${CKPT:-/tmp/mixtral-L$layers}
gpus=$(nvidia-smi -L | wc -l)
results=$out/peers.jsonl
batch="--seq 4096 --micro_batch 2 --grad_accum 2 --warmup 3 --steps 6"
ours="torchrun --standalone --nproc_per_node=$gpus bench/bench_moe.py --config ep --fused_adamw --compile_loss --compile_dense"
peer="torchrun --standalone --nproc_per_node=$gpus bench/bench_peer_hf.py --dir $ckpt --precision fp32_master"
keep() { grep -E '^\{|Error|error' | cut -c1-300; }
# append_as NAME FILE: FILE's records into $results under config NAME, then FILE removed
append_as() { python3 -c "import json,sys; [print(json.dumps(dict(json.loads(l), config=sys.argv[2]))) for l in open(sys.argv[1])]" "$2" "$1" >>"$results" && rm -f "$2"; }
echo "== $(date +%T) $gpus x $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); torch $(python3 -c 'import torch; print(torch.__version__)'), transformers $(python3 -c 'import transformers; print(transformers.__version__)')"
python3 -c "import sys; sys.path.insert(0, 'bench'); from bench_fsdp1 import checkpoint_complete as c; sys.exit(0 if c('$ckpt', $layers, 4096, 14336) else 1)" \
  || python3 bench/bench_fsdp1.py write --dir "$ckpt" --layers "$layers" 2>&1 | grep -vi warn | tail -1
for routing in ${ROUTINGS:-uniform skewed}; do
  extra=""; [ "$routing" = skewed ] && extra="--skew $skew"
  echo "== $(date +%T) ours, $routing routing"
  timeout -k 10 240 $ours --layers "$layers" $batch $extra --out "$results" 2>&1 | keep
  if [ -n "${OVERLAP:-}" ]; then
    echo "== $(date +%T) ours with --overlap_chunks $OVERLAP, $routing routing"
    timeout -k 10 240 $ours --layers "$layers" $batch $extra --overlap_chunks "$OVERLAP" --out "$results.overlap" 2>&1 | keep
    append_as "ep_overlap$OVERLAP" "$results.overlap"
  fi
  if [ -n "${BASE:-}" ]; then
    echo "== $(date +%T) ours with $BASE's code, $routing routing"
    (cd "$BASE" && timeout -k 10 240 $ours --layers "$layers" $batch $extra --out "$results.base" 2>&1 | keep)
    append_as ep_base "$results.base"
  fi
  echo "== $(date +%T) transformers FSDP2 + EP, $routing routing"
  timeout -k 10 240 $peer $batch $extra --out "$results" 2>&1 | keep
done
echo "== $(date +%T) done in $SECONDS s"
python3 - "$results" <<'PY'
import json, sys
print("| configuration | routing (busiest/mean, layer mean) | s/step | tokens/s/GPU | MFU | peak allocated GiB |")
print("|---|---|---|---|---|---|")
for r in map(json.loads, open(sys.argv[1])):
    loads = r.get("expert_load_max_over_mean")
    routing = f"skew {r['routing_skew_target']}: {sum(loads) / len(loads):.2f}" if r.get("routing_skew_target") else "own"
    if r.get("status") != "ok":
        print(f"| {r['config']} | {routing} | {r.get('status')}: {r.get('error', '')[:80]} | | | |")
        continue
    print(f"| {r['config']} | {routing} | {r['step_time_s']:.3f} | {r['tokens_per_s_per_gpu']:,.0f} | {r['mfu']:.1%} | {r.get('peak_allocated_gib', 0):.1f} |")
PY
