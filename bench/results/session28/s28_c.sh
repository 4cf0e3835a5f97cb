# 28th session, call C (one H200): why the chat records' step is ~6% slower than synthetic rows of the same token count
# on one GPU (25th session: 0.346 against 0.325 s, both ~16,350 real tokens a step): the step profiled on each
# (Qwen3 shape, 12 layers, defaults but graphs off so each kernel has its launching operator), then side by side.
source bench/device_env.sh || exit 1
export PYTHONPATH=$PWD:$PYTHONPATH
T0=$(date +%s)
for data in synthetic chat; do
  timeout 260 python bench/profile_steps.py --shape qwen3_30b_a3b --layers 12 --data $data --dir /tmp/qwen3_30b_a3b-L12 \
    --work /tmp/prof_$data --out $OUT/prof_1gpu_$data.jsonl > $OUT/prof_1gpu_$data.txt 2>&1
  echo "$data rc=$? $(( $(date +%s) - T0 ))s"
done
python bench/profile_steps.py --compare $OUT/prof_1gpu_synthetic.jsonl $OUT/prof_1gpu_chat.jsonl 2>&1 | head -30
for data in synthetic chat; do grep -E "^\| " $OUT/prof_1gpu_$data.txt | head -24; done
