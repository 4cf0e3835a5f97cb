# 30th session, call C (one H200): DeepSeek-V2-Lite's shape (20 of 27 layers) against transformers 5.24.0's own model
# (5.24 keeps DSV2's routers in fp32: the one model whose building changed); balanced routing on synthetic rows, the
# weights' own routing on the chat records at defaults, as BENCHMARKS' 5.23 rows. Carry .whl524 .calls.
mv .whl524 .whl && source bench/device_env.sh || exit 1
export PYTHONPATH=$PWD:$PYTHONPATH
T0=$(date +%s)
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
python -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
timeout 300 python bench/real_data.py --shape deepseek_v2_lite --layers 20 --routing balanced --runs ours_synthetic,hf_synthetic \
  --warmup 4 --steps 12 --run_timeout 120 --dir /tmp/dsv2-L20 --out $OUT/dsv2_L20_balanced.jsonl > $OUT/dsv2_L20_balanced.txt 2>&1
echo "balanced rc=$? $(( $(date +%s) - T0 ))s"
grep -E "^\|" $OUT/dsv2_L20_balanced.txt | tail -3
left=$(( 575 - ($(date +%s) - T0) ))
timeout $left python bench/real_data.py --shape deepseek_v2_lite --layers 20 --runs ours_chat,hf_flex \
  --warmup 4 --chat_steps 20 --run_timeout 120 --dir /tmp/dsv2-L20 --out $OUT/dsv2_L20_chat.jsonl > $OUT/dsv2_L20_chat.txt 2>&1
echo "chat rc=$? $(( $(date +%s) - T0 ))s"
grep -E "^\|" $OUT/dsv2_L20_chat.txt | tail -3
