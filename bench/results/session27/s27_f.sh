# 27th session, call F (2 x H200; call B ran at ep 2 since no 4-GPU machine was lent): how much of ep 4's gap is the random checkpoint's routing skew that placing the experts
# by load removes, at HEAD's defaults (token pull at factor 3, whole micro-steps as graphs)? Synthetic rows, then the same
# rows on the checkpoint placed by their own loads (in-sample: the most a placement could give), then chat records and
# chat on the placement from the synthetic rows' loads (out of sample: what a placement made before a run could give).
# If the placed rows reach 85% of one GPU (0.325 / 0.346 s in the 25th session), an in-run placement (EPLB-like: probe
# the routers on the first batches, load each rank's experts by it, keep the order in checkpoints, undo it at export)
# is the lever for ep 4's target. ~480 s.
source bench/device_env.sh || exit 1
export PYTHONPATH=$PWD:$PYTHONPATH
T0=$(date +%s)
timeout 500 python bench/real_data.py --shape qwen3_30b_a3b --layers 12 --warmup 3 --steps 8 --chat_steps 8 --run_timeout 110 \
  --dir /tmp/qwen3_30b_a3b-L12 --ep 2 --runs ours_synthetic,ours_synthetic_placed,ours_chat,ours_chat_placed \
  --placed_by ours_synthetic --work /tmp/rd_placed --out $OUT/placed.jsonl > $OUT/placed.txt 2>&1
echo "rc=$? $(( $(date +%s) - T0 ))s"; grep -v "^  " $OUT/placed.txt | tail -12
python -c "
import json, sys
for r in map(json.loads, open(sys.argv[1])):
    print(r.get('run'), r.get('status'), r.get('median_step_s'), r.get('busiest_rank_over_mean'), r.get('busiest_rank_over_mean_placed'), [round(x, 4) for x in r.get('losses', [])[:4]], str(r.get('error', ''))[:200])
" $OUT/placed.jsonl
