# 23rd session, call D (2 x H200): auto's factor that does not fit (the cap set between the plan with factor 2 and without:
# 3.0301 / 3.0233 GiB estimated, 90% of 3.363 = 3.0267) falls back to the units of a run without it (whole dense weights,
# the segments' graphs) and trains; then the graphed ep 2 tests (the defaults at ep 2) at this tree.
source bench/device_env.sh || exit 1
export PYTHONPATH=$PWD:$PYTHONPATH
T0=$(date +%s)
timeout 100 torchrun --nproc_per_node=2 train_fsdp2.py --optim adamw_bf16 --gpu_memory_gib 3.363 --max_steps 6 --output_dir /tmp/fallback > $OUT/fallback.txt 2>&1
echo "fallback rc=$? $(( $(date +%s) - T0 ))s"; grep -v "it/s\]" $OUT/fallback.txt | grep -i "auto\|units\|segments\|summary\|error" | head -12
timeout 200 python -m pytest -q -p no:cacheprovider tests/gpu/test_graphs_ep.py > $OUT/graphs_ep.txt 2>&1; echo "graphs_ep rc=$? $(( $(date +%s) - T0 ))s"; tail -3 $OUT/graphs_ep.txt
