# 23rd session, call B (4 x H200): the done rule on 4 GPUs at HEAD (auto factor 3 at ep 4): the whole GPU suite in lanes.
source bench/device_env.sh || exit 1
export PYTHONPATH=$PWD:$PYTHONPATH
T0=$(date +%s)
LANE_S=${LANE_S:-540} bash tests/gpu/lanes.sh /tmp/lanes > $OUT/lanes_summary.txt 2>&1; echo "lanes rc=$? $(( $(date +%s) - T0 ))s"
cat $OUT/lanes_summary.txt; tail -n 30 /tmp/lanes/a.log; tar -czf $OUT/lanes.tgz -C /tmp lanes
