# One H200: the whole GPU suite at this code (five lanes at once), then the fwd+bwd GEMM table at Mixtral's width
# (torch's bf16 against torchao's FP8 training GEMMs: the dense Linear, compiled, and the experts' grouped GEMM).
source bench/device_env.sh || exit 1
T0=$(date +%s)
LANE_S=390 bash tests/gpu/lanes.sh /tmp/lanes; echo "lanes rc=$? after $(( $(date +%s) - T0 )) s"
tar czf $OUT/lanes_logs.tar.gz -C /tmp lanes
left=$(( 575 - ($(date +%s) - T0) ))
timeout $left python bench/fp8_gemm_bench.py --table --shapes mixtral > $OUT/table_mixtral.jsonl 2> $OUT/table_mixtral.err
echo "table rc=$? after $(( $(date +%s) - T0 )) s"; grep -v Warning $OUT/table_mixtral.err | tail -n 3 | cut -c1-300
cat $OUT/table_mixtral.jsonl
