#!/usr/bin/env bash
# Where one GPU's time goes for gpt-oss-20b's shape (bench/gpu_gpt_oss.sh's checkpoint and batch): train_fsdp2.py and
# transformers' own model (bench_peer_hf.py), each under torch.profiler (bench/profile_run.py), 3 steps each.
# Writes $OUT/prof_ours.txt and $OUT/prof_peer.txt (operators by total device time).
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/device_env.sh
out=${OUT:-/tmp/gpt_oss_out}; mkdir -p "$out"
layers=${LAYERS:-4}; seq=${SEQ:-2048}; ckpt=${CKPT:-/tmp/gpt-oss-L$layers}
[ -f "$ckpt/tokenizer_config.json" ] || python3 bench/gpt_oss.py write --dir "$ckpt" --layers "$layers" 2>&1 | grep -v -i warn | tail -1
python3 -c "import sys, json; sys.path.insert(0, 'bench'); from bench_fsdp1 import synthetic_alpaca; from transformers import AutoTokenizer
json.dump(synthetic_alpaca(AutoTokenizer.from_pretrained('$ckpt'), $seq, 12, 'data.json'), open('/tmp/gpt_oss_syn.json', 'w'))"
echo "== $(date +%T) ours"
rm -rf /tmp/gpt_oss_prof
timeout -k 10 ${T_OURS:-200} torchrun --standalone --nproc_per_node=1 bench/profile_run.py --out "$out/prof_ours.txt" train_fsdp2.py \
  --model_name_or_path "$ckpt" --data_path /tmp/gpt_oss_syn.json --max_length "$seq" --per_device_train_batch_size 1 \
  --gradient_accumulation_steps 4 --max_steps 3 --learning_rate 1e-5 --attn_implementation eager --optim adamw_bf16 \
  --output_dir /tmp/gpt_oss_prof ${OURS_ARGS:-} >"$out/prof_ours.log" 2>&1
grep -E "^summary|^error" "$out/prof_ours.log" | cut -c1-300
echo "== $(date +%T) transformers"
timeout -k 10 ${T_PEER:-150} torchrun --standalone --nproc_per_node=1 bench/profile_run.py --out "$out/prof_peer.txt" bench/bench_peer_hf.py \
  --dir "$ckpt" --seq "$seq" --grad_accum 4 --warmup 1 --steps 2 --precision bf16 --attn_implementation eager --out "$out/peer.jsonl" >"$out/prof_peer.log" 2>&1
grep -E "^step " "$out/prof_peer.log"
echo "== $(date +%T) done in $SECONDS s"
head -c 5000 "$out/prof_ours.txt"; echo; head -c 5000 "$out/prof_peer.txt"
