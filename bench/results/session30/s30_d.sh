# 30th session, call D (one H200): gpt-oss-20b's shape (12 of 24 layers) against transformers 5.24.0's own model, as
# BENCHMARKS' 5.23 rows: balanced routing on synthetic rows (both sides flex_attention: the sinks), then the weights'
# own routing on the chat records at defaults. Carry .whl524 .calls.
mv .whl524 .whl && source bench/device_env.sh || exit 1
export PYTHONPATH=$PWD:$PYTHONPATH
T0=$(date +%s)
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
python -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
timeout 300 python bench/real_data.py --shape gpt_oss_20b --layers 12 --routing balanced --runs ours_synthetic,hf_synthetic_flex \
  --warmup 4 --steps 12 --run_timeout 120 --dir /tmp/gptoss-L12 --out $OUT/gptoss_L12_balanced.jsonl > $OUT/gptoss_L12_balanced.txt 2>&1
echo "balanced rc=$? $(( $(date +%s) - T0 ))s"
grep -E "^\|" $OUT/gptoss_L12_balanced.txt | tail -3
left=$(( 575 - ($(date +%s) - T0) ))
timeout $left python bench/real_data.py --shape gpt_oss_20b --layers 12 --runs ours_chat,hf_flex \
  --warmup 4 --chat_steps 20 --run_timeout 120 --dir /tmp/gptoss-L12 --out $OUT/gptoss_L12_chat.jsonl > $OUT/gptoss_L12_chat.txt 2>&1
echo "chat rc=$? $(( $(date +%s) - T0 ))s"
grep -E "^\|" $OUT/gptoss_L12_chat.txt | tail -3
