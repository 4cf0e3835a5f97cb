# 24th session, call B (4 x H200): where ep 4 loses against one GPU at the new defaults (token pull + graphs): kernels by
# name, one record per rank, own and balanced routing, then one GPU.
source bench/device_env.sh || exit 1
export PYTHONPATH=$PWD:$PYTHONPATH
T0=$(date +%s); el() { echo "$1 rc=$2 $(( $(date +%s) - T0 ))s"; }
for r in own balanced; do
  timeout 200 python bench/profile_steps.py --cuda_graphs auto --ep 4 --routing $r --wait 5 --active 3 --out $OUT/prof_ep4_$r.jsonl > $OUT/prof_ep4_$r.txt 2>&1; el ep4_$r $?
done
timeout 150 python bench/profile_steps.py --cuda_graphs auto --ep 1 --wait 5 --active 3 --out $OUT/prof_ep1.jsonl > $OUT/prof_ep1.txt 2>&1; el ep1 $?
tail -n 40 $OUT/prof_ep4_own.txt
