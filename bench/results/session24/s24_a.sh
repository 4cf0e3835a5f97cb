# 24th session, call A (4 x H200): full Qwen3-30B-A3B (48 layers) at ep 4 at HEAD, where auto's factor 3 does not fit and
# resolve_wrap_and_factor should keep the segments (the run prints "ep_capacity_factor auto: 0 ... fsdp_wrap auto: none"),
# beside transformers' FSDP2 + EP on the same checkpoint and rows (~470 s).
source bench/device_env.sh || exit 1
export PYTHONPATH=$PWD:$PYTHONPATH
T0=$(date +%s)
python bench/run.py ep_scaling --counts 4 --layers 48 --warmup 2 --steps 5 --chat_steps 5 --run_timeout 240 \
  --out $OUT/qwen48.jsonl --budget_s 575 > $OUT/qwen48.txt 2>&1
echo "rc=$? $(( $(date +%s) - T0 ))s"; grep -v "^  " $OUT/qwen48.txt | tail -10
python -c "import json,sys; [print(r.get('run'), r.get('launch','')[:160]) for r in map(json.loads, open(sys.argv[1]))]" $OUT/qwen48.jsonl
tar -czf $OUT/logs.tgz -C /tmp bench_logs 2>/dev/null
