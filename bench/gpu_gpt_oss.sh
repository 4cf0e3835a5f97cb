#!/usr/bin/env bash
# gpt-oss-20b's shape cut to $LAYERS layers (default 4, 4.4 B parameters) on one GPU, in one call:
#   1. a random bf16 checkpoint in save_pretrained's layout (bench/gpt_oss.py write), once per machine;
#   2. parity with transformers on its first 2 layers: fp32 ours = transformers, and in bf16 ours no further from
#      the fp32 truth than transformers' own bf16 model (bench/gpt_oss.py parity);
#   3. speed: transformers' own model trained by bench_peer_hf.py (pure bf16, torch AdamW; on one GPU transformers
#      applies neither FSDP nor EP), then train_fsdp2.py (our layer, bf16 AdamW with stochastic rounding) once per
#      entry of $OURS (default: as is, and with --compile_dense false); the same batch for all: $SEQ tokens x 4
#      micro-batches per step, eager attention (gpt-oss's sinks), 2 warmup + 3 measured steps.
# An entry of $OURS named base_* runs $BASE's code instead (a copy of an earlier commit, e.g. `git archive C | tar -x -C .base`,
# carried): before and after in one call.
# Usage, from the repo root with .whl carried: [STAGES="parity speed"] [OURS=...] [BASE=dir] bash bench/gpu_gpt_oss.sh
# (results: $OUT/gpt_oss.jsonl, logs beside; the speed stage runs both sides, so they share the call)
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/device_env.sh
out=${OUT:-/tmp/gpt_oss_out}; mkdir -p "$out"
layers=${LAYERS:-4}; seq=${SEQ:-2048}; ckpt=${CKPT:-/tmp/gpt-oss-L$layers}
results=$out/gpt_oss.jsonl
batch="--seq $seq --grad_accum 4 --warmup 2 --steps 3"
echo "== $(date +%T) $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); torch $(python3 -c 'import torch; print(torch.__version__)'), transformers $(python3 -c 'import transformers; print(transformers.__version__)')"
[ -f "$ckpt/tokenizer_config.json" ] || python3 bench/gpt_oss.py write --dir "$ckpt" --layers "$layers" 2>&1 | grep -v -i warn | tail -2
stages=${STAGES:-parity speed}
if [[ " $stages " == *" parity "* ]]; then
  echo "== $(date +%T) parity (first 2 layers)"
  timeout -k 10 170 torchrun --standalone --nproc_per_node=1 bench/gpt_oss.py parity --dir "$ckpt" --layers 2 --out "$results" >"$out/parity.log" 2>&1
  grep -E "^(fp32|bf16|loss)|Error" "$out/parity.log" | tail -8 | cut -c1-400
fi
[[ " $stages " == *" speed "* ]] || exit 0
echo "== $(date +%T) transformers: bench_peer_hf.py"
timeout -k 10 150 torchrun --standalone --nproc_per_node=1 bench/bench_peer_hf.py --dir "$ckpt" $batch --precision bf16 \
  --attn_implementation eager --out "$results" >"$out/peer.log" 2>&1
grep -E '^step |Error' "$out/peer.log" | tail -6 | cut -c1-400
sleep 3
# Ours, once per entry of $OURS (name=extra train_fsdp2 settings, ';'-separated).
IFS=';' read -ra variants <<<"${OURS:-gpt_oss_ours_fsdp2=;gpt_oss_ours_fsdp2_nocompile=--compile_dense false}"
for v in "${variants[@]}"; do
  name=${v%%=*}; extra=${v#*=}
  echo "== $(date +%T) ours: train_fsdp2.py $extra ($name)"
  rm -rf /tmp/gpt_oss_work
  root=.; [[ $name == base_* ]] && root=${BASE:?"an OURS entry named base_* needs BASE=dir"}
  python3 "$root/bench/bench_fsdp1.py" run --script train_fsdp2.py --dir "$ckpt" --layers "$layers" --hidden 2880 --intermediate 2880 --gpus 1 \
    $batch --train_args "--attn_implementation eager --optim adamw_bf16 $extra" --name "$name" --skip_export --timeout "${T_OURS:-110}" \
    --work /tmp/gpt_oss_work --out "$results" >"$out/$name.log" 2>&1
  grep -E '^  |Error|error' "$out/$name.log" | tail -4 | cut -c1-300
  cp /tmp/gpt_oss_work/launch.log "$out/${name}_launch.log" 2>/dev/null
  sleep 3
done
echo "== $(date +%T) done in $SECONDS s"
python3 - "$results" <<'PY'
import json, sys
for r in map(json.loads, open(sys.argv[1])):
    if r["config"] == "gpt_oss_parity":
        print("parity:", r["status"], {k: r[k] for k in ("fp32_ours_vs_transformers", "bf16_vs_fp32_truth")})
    else:
        keys = ("status", "step_time_s", "tokens_per_s_per_gpu", "tflops_per_gpu_script_formula", "peak_allocated_gib", "peak_reserved_gib", "final_loss", "error")
        print(r.get("config"), {k: r.get(k) for k in keys if k in r})
PY
