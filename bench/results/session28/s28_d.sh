# 28th session, call D (one H200): the chat records' step at the defaults (whole micro-steps as CUDA graphs), against
# synthetic rows: where the GPU idles (call C found the chat step's kernels no longer than synthetic's). profile_steps
# with --cuda_graphs auto and a chrome trace, then bench/trace_gaps.py on each trace (the traces stay on the machine).
source bench/device_env.sh || exit 1
export PYTHONPATH=$PWD:$PYTHONPATH
T0=$(date +%s)
for data in synthetic chat; do
  timeout 220 python bench/profile_steps.py --shape qwen3_30b_a3b --layers 12 --data $data --dir /tmp/qwen3_30b_a3b-L12 \
    --cuda_graphs auto --work /tmp/prof_$data --out $OUT/prof_graphs_$data.jsonl --trace /tmp/trace_$data.json \
    > $OUT/prof_graphs_$data.txt 2>&1
  echo "$data rc=$? $(( $(date +%s) - T0 ))s"; grep -E "step .* ms wall" $OUT/prof_graphs_$data.txt
  python bench/trace_gaps.py /tmp/trace_$data.json --top 15 --out $OUT/gaps_$data.jsonl > $OUT/gaps_$data.txt 2>&1
  head -45 $OUT/gaps_$data.txt
done
