# 25th session, call C (4 x H200): the ep 4 levers of branch ep4-padding-rows against main, in one call. Run from a
# checkout of the branch's HEAD (ep4-padding-rows: lever 1 + lever 2) with two carried copies made beforehand:
#   .base/ = main (git archive main, without bench/results; made in the 24th session at 092d467)
#   .lever1/ = ep4-padding-rows~1 (lever 1 only: padding rows unwritten; made at 8927fa6)
# Qwen3 shape, 12 layers, ep 4 at the defaults (token pull at factor 3 + whole micro-steps as graphs), synthetic rows,
# each side its own launch (alternating: main, lever1, both, main, both), then chat rows for main and both (~450 s).
# Then s25_d.sh (the profile of both + lanes) if the levers pay: the done rule.
source bench/device_env.sh || exit 1
T0=$(date +%s); el() { echo "$1 rc=$2 $(( $(date +%s) - T0 ))s"; }
RD="bench/real_data.py --shape qwen3_30b_a3b --layers 12 --ep 4 --warmup 3 --steps 8 --chat_steps 8 --run_timeout 110 --dir /tmp/qwen3_30b_a3b-L12"
run() {  # name, dir, runs
  (cd $2 && PYTHONPATH=$2:/tmp/site timeout 150 python $RD --runs $3 --work /tmp/rd_$1 --out $OUT/$1.jsonl > $OUT/$1.txt 2>&1); el $1 $?
}
run main_a $PWD/.base ours_synthetic; run lever1 $PWD/.lever1 ours_synthetic; run both_a $PWD ours_synthetic
run main_b $PWD/.base ours_synthetic; run both_b $PWD ours_synthetic
run main_chat $PWD/.base ours_chat; run both_chat $PWD ours_chat
python - <<'PY'
import json, os, glob
out = os.environ["OUT"]
for f in sorted(glob.glob(f"{out}/*.jsonl")):
    for line in open(f):
        r = json.loads(line)
        print(os.path.basename(f), r.get("run"), r.get("status"), r.get("median_step_s"), [round(x, 4) for x in r.get("losses", [])[:6]],
              r.get("peak_allocated_gib"), r.get("chose"), str(r.get("error", ""))[:200])
PY
