# 23rd session, call C (4 x H200): full Qwen3-30B-A3B (48 layers) at ep 4 at the defaults of 2012ac4 (auto: the token
# pull at factor 3, whole micro-steps as graphs) beside transformers' FSDP2 + EP on the same checkpoint and rows.
source bench/device_env.sh || exit 1
export PYTHONPATH=$PWD:$PYTHONPATH
T0=$(date +%s)
python bench/run.py ep_scaling --counts 4 --layers 48 --warmup 2 --steps 5 --chat_steps 5 --run_timeout 240 \
  --out $OUT/qwen48.jsonl --budget_s 575 > $OUT/qwen48.txt 2>&1
echo "rc=$? $(( $(date +%s) - T0 ))s"; grep -v "^  " $OUT/qwen48.txt | tail -14
grep -h "ep_capacity_factor auto\|cuda_graphs\|fsdp_wrap\|Error\|error" /tmp/bench_logs/ep_scaling/*.log | sort | uniq -c | head -20
tar -czf $OUT/logs.tgz -C /tmp bench_logs 2>/dev/null
