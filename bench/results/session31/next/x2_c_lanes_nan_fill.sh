# Prepared in the 31st session for a 2 x H200 call after x2_a_lanes.sh: the same lanes with every tensor allocated
# without values starting as NaN in every process (as s31_c.sh did on one GPU): the static exchanges' padding rows at
# ep 2 (pull and all-to-all), the idle ranks' and experts' rows, must reach no output. Carry .whl.
source bench/device_env.sh || exit 1
export PYTHONPATH=$PWD/bench/results/session31/nanfill:$PWD:$PYTHONPATH NAN_FILL=1 CUBLAS_WORKSPACE_CONFIG=:4096:8
T0=$(date +%s)
LANE_S=540 bash tests/gpu/lanes.sh $OUT/lanes; echo "lanes rc=$? $(( $(date +%s) - T0 ))s"
grep -h "^FAILED\|^ERROR" $OUT/lanes/*.log | head -30
(cd $OUT && tar -czf lanes.tgz lanes && rm -rf lanes)
