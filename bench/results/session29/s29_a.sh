# 29th session, call A (one H200): where Mixtral-8x7B's width spends a step on one GPU (4 of 32 layers; full Mixtral at
# ep 4 is 30.4% MFU against a 45% target and was never profiled: its expert compute per GPU is one GPU's), then ours
# against transformers' own model on the same rows at today's code (the last such row is the 4th session's).
source bench/device_env.sh || exit 1
export PYTHONPATH=$PWD:$PYTHONPATH
T0=$(date +%s)
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
timeout 240 python bench/profile_steps.py --shape mixtral --layers 4 --wait 4 --active 3 --dir /tmp/mixtral-L4 \
  --work /tmp/prof_mx4 --out $OUT/prof_mixtral4_1gpu.jsonl > $OUT/prof_mixtral4_1gpu.txt 2>&1
echo "profile rc=$? $(( $(date +%s) - T0 ))s"
grep -E "^\||wall|busy" $OUT/prof_mixtral4_1gpu.txt | head -40
python bench/profile_steps.py --compare $OUT/prof_mixtral4_1gpu.jsonl 2>&1 | head -20
left=$(( 570 - ($(date +%s) - T0) ))
timeout $left python bench/real_data.py --shape mixtral --layers 4 --dir /tmp/mixtral-L4 --runs ours_synthetic,hf_synthetic,ours_chat,hf_flex \
  --warmup 3 --steps 10 --chat_steps 12 --run_timeout 120 --out $OUT/real_data_mixtral4.jsonl > $OUT/real_data_mixtral4.txt 2>&1
echo "real_data rc=$? $(( $(date +%s) - T0 ))s"
grep -E "^\||tokens/s" $OUT/real_data_mixtral4.txt | tail -14
