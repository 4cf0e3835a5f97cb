# 22nd session, call A (2 x H200): where ep 2's step goes, by kernel name (the graphs' kernels included), under the
# weights' own routing and balanced, at ep 2 and on one GPU; and the weight-gradient kernel alone with one hot expert,
# the experts launched in index order against longest first. Code: HEAD + the launch order (working tree).
source bench/device_env.sh || exit 1
export PYTHONPATH=$PWD:$PYTHONPATH
T0=$(date +%s); mkdir -p $OUT/prof
el() { echo "$1 rc=$2 $(( $(date +%s) - T0 ))s"; }
(cd bench && python -c "from real_data import write_checkpoint; print('checkpoint', write_checkpoint('/tmp/qwen3_30b_a3b-L12', 'qwen3_30b_a3b', 12))")
el checkpoint $?
# GPU 0: the kernel alone, then one GPU's balanced profile; GPU 1 meanwhile: one GPU's own-routing profile
( CUDA_VISIBLE_DEVICES=0 python bench/weight_grad_bench.py --shapes qwen3 --ep 2 --hot 16 --hot_at last --out $OUT/wg.jsonl > $OUT/wg.txt 2>&1
  CUDA_VISIBLE_DEVICES=0 python bench/weight_grad_bench.py --shapes qwen3 --ep 2 --hot 16 --hot_at mid --out $OUT/wg.jsonl >> $OUT/wg.txt 2>&1
  CUDA_VISIBLE_DEVICES=0 python bench/weight_grad_bench.py --shapes qwen3 --ep 1 --hot 16 --hot_at mid --out $OUT/wg.jsonl >> $OUT/wg.txt 2>&1
  el weight_grad_bench $?
  CUDA_VISIBLE_DEVICES=0 PET_MASTER_PORT=29511 python bench/profile_steps.py --cuda_graphs auto --routing balanced --wait 5 --active 3 \
    --work /tmp/ps_bal1 --out $OUT/prof/ep1_balanced.jsonl --top 60 > $OUT/prof/ep1_balanced.txt 2>&1; el ep1_balanced $? ) &
CUDA_VISIBLE_DEVICES=1 PET_MASTER_PORT=29512 python bench/profile_steps.py --cuda_graphs auto --wait 5 --active 3 \
  --work /tmp/ps_own1 --out $OUT/prof/ep1_own.jsonl --top 60 > $OUT/prof/ep1_own.txt 2>&1; el ep1_own $?
wait
for r in own balanced; do
  timeout 200 python bench/profile_steps.py --ep 2 --cuda_graphs auto --routing $r --wait 5 --active 3 --work /tmp/ps_$r \
    --out $OUT/prof/ep2_$r.jsonl --top 60 > $OUT/prof/ep2_$r.txt 2>&1; el ep2_$r $?
done
python - <<'PY'
import json, os
out = os.environ["OUT"]
for line in open(f"{out}/wg.jsonl"):
    r = json.loads(line)
    print(r["proj"], "ep", r["ep"], r["hot_at"], "max", r["max_rows"], "acc %.3f ordered %.3f torch_dw %.3f equal %s" % (
        r["ours_acc_ms[128x256x64x8x3]"], r.get("ours_acc_ordered_ms", 0), r["torch_dw_ms"], r.get("ours_ordered_equal")))
for name in ("ep1_own", "ep1_balanced", "ep2_own", "ep2_balanced"):
    for line in open(f"{out}/prof/{name}.jsonl"):
        r = json.loads(line)
        wall = sum(r["wall_s_per_step"]) / len(r["wall_s_per_step"])
        print(f"{name} rank {r['rank']}: wall {wall*1e3:.0f} ms, kernels union {r['kernels_union_s_per_step']*1e3:.0f} ms")
        for k, (s, n) in list(r["kernels_s_per_step_and_count"].items())[:14]:
            print(f"   {s*1e3:8.2f} ms {n:6g}  {k[:80]}")
PY
