# 30th session, call B (one H200): ours against transformers 5.24.0's own model (the newest requirements.txt allows),
# Qwen3-30B-A3B's shape, 12 layers, synthetic rows and the chat records at defaults, one call. Carry .whl524 .calls.
mv .whl524 .whl && source bench/device_env.sh || exit 1
export PYTHONPATH=$PWD:$PYTHONPATH
T0=$(date +%s)
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
python -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
timeout 560 python bench/real_data.py --shape qwen3_30b_a3b --layers 12 --runs ours_synthetic,hf_synthetic,ours_chat,hf_flex \
  --warmup 4 --steps 12 --chat_steps 20 --run_timeout 150 --out $OUT/real_data_qwen3_L12.jsonl > $OUT/real_data_qwen3_L12.txt 2>&1
echo "real_data rc=$? $(( $(date +%s) - T0 ))s"
grep -E "^\||tokens/s|transformers" $OUT/real_data_qwen3_L12.txt | tail -14
