# 26th session, call A (4 x H200): branch dense-average-in-graph (the dense gradients' all-reduces captured in the last
# micro-step's graph, beside its backward) against main, in one call. Run from a checkout of the branch with one carried
# copy made beforehand: .base/ = main (git archive main, without bench/results).
# Qwen3 shape, 12 layers, at defaults: ep 4 (token pull at factor 3 + whole micro-steps as graphs) synthetic rows twice
# each, alternating, chat once each; then ep 2 on 2 of the 4 GPUs, synthetic once each (~480 s).
# The 25th session's profile put the all-reduce after the graphs at 15 ms of a 404 ms ep 4 step.
source bench/device_env.sh || exit 1
T0=$(date +%s); el() { echo "$1 rc=$2 $(( $(date +%s) - T0 ))s"; }
RD="bench/real_data.py --shape qwen3_30b_a3b --layers 12 --warmup 3 --steps 8 --chat_steps 8 --run_timeout 110 --dir /tmp/qwen3_30b_a3b-L12"
run() {  # name, dir, ep, runs; skipped past 500 s, so that the records are packed before the 600 s limit
  if (( $(date +%s) - T0 > 500 )); then echo "$1 skipped (time)"; return; fi
  (cd $2 && PYTHONPATH=$2:/tmp/site timeout 150 python $RD --ep $3 --runs $4 --work /tmp/rd_$1 --out $OUT/$1.jsonl > $OUT/$1.txt 2>&1); el $1 $?
}
run main4_a $PWD/.base 4 ours_synthetic; run avg4_a $PWD 4 ours_synthetic
run main4_b $PWD/.base 4 ours_synthetic; run avg4_b $PWD 4 ours_synthetic
run main4_chat $PWD/.base 4 ours_chat; run avg4_chat $PWD 4 ours_chat
run main2 $PWD/.base 2 ours_synthetic; run avg2 $PWD 2 ours_synthetic
python - <<'PY'
import json, os, glob
out = os.environ["OUT"]
for f in sorted(glob.glob(f"{out}/*.jsonl")):
    for line in open(f):
        r = json.loads(line)
        print(os.path.basename(f), r.get("run"), r.get("status"), r.get("median_step_s"), [round(x, 4) for x in r.get("losses", [])[:6]],
              r.get("peak_allocated_gib"), r.get("chose"), str(r.get("error", ""))[:200])
PY
cd $OUT && tar -czf records.tgz *.jsonl *.txt && rm -f *.jsonl *.txt
