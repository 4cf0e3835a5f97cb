# 22nd session, call B (2 x H200): the weight-gradient kernel alone on routings like the random checkpoint's (every token
# to the same top-k experts: 8 x 4096 rows on one GPU, 3-6 experts x 8192 rows on an ep 2 rank), in index order,
# longest first and split into chunks; then ep 2 at the defaults on synthetic rows: d7c7ae4 (before), and this tree
# with WEIGHT_GRAD_SPLITS 1, 2 and 4, one launch each, interleaved as listed.
source bench/device_env.sh || exit 1
export PYTHONPATH=$PWD:$PYTHONPATH
T0=$(date +%s); el() { echo "$1 rc=$2 $(( $(date +%s) - T0 ))s"; }
WG="python bench/weight_grad_bench.py --shapes qwen3 --splits 2,4 --out"
( export CUDA_VISIBLE_DEVICES=0
  $WG $OUT/wg0.jsonl --ep 1 --all_to 8 > $OUT/wg0.txt 2>&1
  $WG $OUT/wg0.jsonl --ep 2 --all_to 4 >> $OUT/wg0.txt 2>&1
  $WG $OUT/wg0.jsonl --ep 2 --all_to 6 >> $OUT/wg0.txt 2>&1
  $WG $OUT/wg0.jsonl --ep 1 >> $OUT/wg0.txt 2>&1; el wg0 $? ) &
( export CUDA_VISIBLE_DEVICES=1
  $WG $OUT/wg1.jsonl --ep 2 --all_to 5 --configs 128x256x64x8x3,128x128x64x8x3,128x128x64x4x4 > $OUT/wg1.txt 2>&1
  $WG $OUT/wg1.jsonl --ep 2 --all_to 3 >> $OUT/wg1.txt 2>&1
  $WG $OUT/wg1.jsonl --ep 2 >> $OUT/wg1.txt 2>&1; el wg1 $? ) &
wait
for v in 1 2 4; do
  mkdir -p /tmp/s$v && tar --exclude=./.git --exclude=./.whl --exclude=./bench/results -cf - . | tar -xf - -C /tmp/s$v
  sed -i "s/^WEIGHT_GRAD_SPLITS = 1$/WEIGHT_GRAD_SPLITS = $v/" /tmp/s$v/megablocks_utils/moe/weight_grad.py
  grep -n "^WEIGHT_GRAD_SPLITS" /tmp/s$v/megablocks_utils/moe/weight_grad.py
done
RD="bench/real_data.py --shape qwen3_30b_a3b --layers 12 --runs ours_synthetic --ep 2 --warmup 3 --steps 8 --run_timeout 120 --dir /tmp/qwen3_30b_a3b-L12"
for v in base 1 2 4; do
  dir=/tmp/s$v; [ $v = base ] && dir=$PWD/.base
  (cd $dir && PYTHONPATH=$dir:/tmp/site timeout 170 python $RD --work /tmp/rd_$v --out $OUT/ep2_$v.jsonl > $OUT/ep2_$v.txt 2>&1); el ep2_$v $?
done
python - <<'PY'
import json, os, glob
out = os.environ["OUT"]
for f in sorted(glob.glob(f"{out}/wg*.jsonl")):
    for line in open(f):
        r = json.loads(line)
        keys = [k for k in r if k.startswith("ours_acc") and k.endswith("_ms") or k.startswith("ours_acc_ms[")]
        print(r["proj"], "ep", r["ep"], "all_to", r["all_to"], "rows", r["rows"], " ".join(f"{k.replace('ours_acc_', '')}={r[k]:.3f}" for k in keys),
              "torch_dw=%.3f" % r["torch_dw_ms"], {k: r[k] for k in r if k.startswith("split") and k.endswith(("twice", "unsplit"))})
for v in ("base", "1", "2", "4"):
    for line in open(f"{out}/ep2_{v}.jsonl"):
        r = json.loads(line)
        print(v, r.get("status"), r.get("median_step_s"), r.get("tokens_per_s"), r.get("losses", [])[:4], r.get("peak_allocated_gib"), r.get("error", "")[:300])
PY
