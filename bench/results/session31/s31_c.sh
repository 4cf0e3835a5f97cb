# 31st session, call C (one H200): tests/gpu with every tensor allocated without values starting as NaN in every
# process (sitecustomize from bench/results/session31/nanfill; torch's fill_uninitialized_memory under deterministic algorithms,
# warn_only), so that a value leaking from an unwritten row (padding, rows past a grouped GEMM's last offset, an
# expert without rows) fails a test every run. The CPU suite found one such leak in the pull exchange's torch
# transport (4919dca). Carry .whl .calls.
source bench/device_env.sh || exit 1
export PYTHONPATH=$PWD/bench/results/session31/nanfill:$PWD:$PYTHONPATH NAN_FILL=1 CUBLAS_WORKSPACE_CONFIG=:4096:8
python -c "import torch; print('deterministic', torch.are_deterministic_algorithms_enabled(), 'fill', torch.utils.deterministic.fill_uninitialized_memory); print(torch.empty(3, device='cuda'))"
T0=$(date +%s)
LANE_S=500 bash tests/gpu/lanes.sh $OUT/lanes; echo "lanes rc=$? $(( $(date +%s) - T0 ))s"
grep -h "^FAILED\|^ERROR" $OUT/lanes/*.log | head -30
(cd $OUT && tar -czf lanes.tgz lanes && rm -rf lanes)
