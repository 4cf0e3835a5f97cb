# 22nd session, call E (2 x H200): the weight-gradient kernel's division (ep 2 divides the experts' gradients by 2):
# alone, divided by 1, 2 (now times 0.5) and 3 (IEEE division, as every divisor before); then ep 2 at the defaults on
# synthetic rows, d7c7ae4 against this tree, one launch each; then the lanes (the done rule) on this tree.
source bench/device_env.sh || exit 1
export PYTHONPATH=$PWD:$PYTHONPATH
T0=$(date +%s); el() { echo "$1 rc=$2 $(( $(date +%s) - T0 ))s"; }
WG="python bench/weight_grad_bench.py --shapes qwen3 --divisors 1,2,3"
CUDA_VISIBLE_DEVICES=0 $WG --ep 2 --all_to 4 --out $OUT/wg.jsonl > $OUT/wg0.txt 2>&1 &
CUDA_VISIBLE_DEVICES=1 $WG --ep 2 --out $OUT/wg_bal.jsonl > $OUT/wg1.txt 2>&1
wait; el wg $?
RD="bench/real_data.py --shape qwen3_30b_a3b --layers 12 --runs ours_synthetic --ep 2 --warmup 3 --steps 8 --run_timeout 120 --dir /tmp/qwen3_30b_a3b-L12"
for v in base new; do
  dir=$PWD; [ $v = base ] && dir=$PWD/.base
  (cd $dir && PYTHONPATH=$dir:/tmp/site timeout 170 python $RD --work /tmp/rd_$v --out $OUT/ep2_$v.jsonl > $OUT/ep2_$v.txt 2>&1); el ep2_$v $?
done
python - <<'PY'
import json, os
out = os.environ["OUT"]
for f in ("wg.jsonl", "wg_bal.jsonl"):
    for line in open(f"{out}/{f}"):
        r = json.loads(line)
        print(f, r["proj"], "rows", r["rows"], " ".join(f"{k}={r[k]:.3f}" for k in r if k.startswith("ours_acc_div")))
for v in ("base", "new"):
    for line in open(f"{out}/ep2_{v}.jsonl"):
        r = json.loads(line)
        print(v, r.get("status"), r.get("median_step_s"), r.get("tokens_per_s"), r.get("losses", [])[:6], r.get("peak_allocated_gib"), r.get("error", "")[:300])
PY
LANE_S=${LANE_S:-300} bash tests/gpu/lanes.sh /tmp/lanes > $OUT/lanes_summary.txt 2>&1; echo "lanes rc=$? $(( $(date +%s) - T0 ))s"
cat $OUT/lanes_summary.txt; tar -czf $OUT/lanes.tgz -C /tmp lanes
