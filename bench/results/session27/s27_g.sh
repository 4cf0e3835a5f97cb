# 27th session, call G (2 x H200): branch in-run-placement, expert_placement first_step (the experts placed in the run by
# its first step's routing) against the checkpoint as it is, ep 2, Qwen3 shape, 12 layers, defaults; chat first (the
# records a placement from other records did not help), in one launch of real_data.py; cut at 235 s.
source bench/device_env.sh || exit 1
export PYTHONPATH=$PWD:$PYTHONPATH
T0=$(date +%s)
timeout 235 python bench/real_data.py --shape qwen3_30b_a3b --layers 12 --warmup 3 --steps 8 --chat_steps 8 --run_timeout 100 \
  --dir /tmp/qwen3_30b_a3b-L12 --ep 2 --runs ours_chat_first_step,ours_chat,ours_synthetic_first_step,ours_synthetic \
  --work /tmp/rd_first --out $OUT/first_step.jsonl > $OUT/first_step.txt 2>&1
echo "rc=$? $(( $(date +%s) - T0 ))s"
python -c "
import json, sys
for r in map(json.loads, open(sys.argv[1])):
    print(r.get('run'), r.get('status'), r.get('median_step_s'), r.get('chose')[-1:], [round(x, 4) for x in r.get('losses', [])[:6]], str(r.get('error', ''))[:300])
" $OUT/first_step.jsonl
