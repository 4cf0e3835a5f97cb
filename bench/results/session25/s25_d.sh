# 25th session, call D (4 x H200, right after C, from the branch checkout): ep 4 profiled with both levers beside the
# 24th session's profile of main, then the whole GPU suite in lanes (the done rule; 1-GPU files on one GPU each, 2-GPU
# files on pairs, 4-GPU on all four).
source bench/device_env.sh || exit 1
export PYTHONPATH=$PWD:$PYTHONPATH
T0=$(date +%s); el() { echo "$1 rc=$2 $(( $(date +%s) - T0 ))s"; }
timeout 110 python bench/profile_steps.py --cuda_graphs auto --ep 4 --wait 5 --active 3 --out $OUT/prof_ep4_both.jsonl > $OUT/prof_ep4_both.txt 2>&1; el prof $?
python bench/profile_steps.py --compare bench/results/session24/b_profile_ep4_h200x4/prof_ep4_own.jsonl $OUT/prof_ep4_both.jsonl
LANE_S=${LANE_S:-450} bash tests/gpu/lanes.sh $OUT/lanes; echo "lanes rc=$? $(( $(date +%s) - T0 ))s"
cd $OUT && tar -czf lanes.tgz lanes && rm -rf lanes
