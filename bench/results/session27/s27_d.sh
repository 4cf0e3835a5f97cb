# 27th session, call D (2 x H200, nvidia-h200-x2): branch ep-small-levers (checkout) against main (.base/, git archive
# of 7d2b083) at ep 2, Qwen3 shape, 12 layers, defaults (ep 2: token pull at factor 2 + whole micro-steps as graphs; the
# SwiGLU bounded over padded rows, and the embedding's touched rows, both apply), alternating launches; past 470 s a
# launch is skipped.
source bench/device_env.sh || exit 1
T0=$(date +%s); el() { echo "$1 rc=$2 $(( $(date +%s) - T0 ))s"; }
RD="bench/real_data.py --shape qwen3_30b_a3b --layers 12 --warmup 3 --steps 8 --chat_steps 8 --run_timeout 110 --dir /tmp/qwen3_30b_a3b-L12"
run() {  # name, dir, ep, runs
  if (( $(date +%s) - T0 > 470 )); then echo "$1 skipped (time)"; return; fi
  (cd $2 && PYTHONPATH=$2:/tmp/site timeout 150 python $RD --ep $3 --runs $4 --work /tmp/rd_$1 --out $OUT/$1.jsonl > $OUT/$1.txt 2>&1); el $1 $?
}
run main2_a $PWD/.base 2 ours_synthetic; run both2_a $PWD 2 ours_synthetic
run main2_b $PWD/.base 2 ours_synthetic; run both2_b $PWD 2 ours_synthetic
run main2_chat $PWD/.base 2 ours_chat; run both2_chat $PWD 2 ours_chat
run main2_c $PWD/.base 2 ours_synthetic; run both2_c $PWD 2 ours_synthetic
python - <<'PY'
import json, os, glob
out = os.environ["OUT"]
for f in sorted(glob.glob(f"{out}/*.jsonl")):
    for line in open(f):
        r = json.loads(line)
        print(os.path.basename(f), r.get("run"), r.get("status"), r.get("median_step_s"), [round(x, 4) for x in r.get("losses", [])[:6]],
              r.get("peak_allocated_gib"), r.get("chose"), str(r.get("error", ""))[:200])
PY
grep -rh "input embedding" $OUT/both2_a.txt /tmp/rd_both2_a 2>/dev/null | head -2
cd $OUT && tar -czf records.tgz *.jsonl *.txt && rm -f *.jsonl *.txt
