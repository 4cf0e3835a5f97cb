# Sourced by a device call that sets trees of this repository side by side, each launch its own process (A/B), from
# the repo root after `source bench/device_env.sh`. The trees are copies carried with the checkout, made beforehand with
# `git archive REF | tar -x -C .name && rm -rf .name/bench/results` (and the name in .git/info/exclude). Why launches:
# two trees cannot share one process, and alternating them (a, b, a, b) spreads the machine's drift over both sides.
#   AB_ARGS      bench/real_data.py's arguments without --ep, --runs, --work, --out (default: Qwen3 shape, 12 layers)
#   ab_run NAME TREE EP RUNS   one launch of bench/real_data.py from TREE into $OUT/NAME.jsonl and NAME.txt; skipped
#                              once AB_SKIP_AFTER_S (default 470) seconds have passed since this file was sourced
#   ab_records   one line per record of $OUT/*.jsonl: launch, run, status, median s/step, first losses, peak, auto's notes
#   ab_pack      $OUT's records and logs into $OUT/records.tgz
AB_T0=$(date +%s)
AB_ARGS=${AB_ARGS:-"--shape qwen3_30b_a3b --layers 12 --warmup 3 --steps 8 --chat_steps 8 --run_timeout 110 --dir /tmp/qwen3_30b_a3b-L12"}
ab_run() {
  local name=$1 tree=$2 ep=$3 runs=$4
  if (( $(date +%s) - AB_T0 > ${AB_SKIP_AFTER_S:-470} )); then echo "$name skipped (time)"; return 0; fi
  (cd "$tree" && PYTHONPATH=$tree${PYTHONPATH:+:$PYTHONPATH} timeout "${AB_LAUNCH_S:-150}" python bench/real_data.py $AB_ARGS \
    --ep "$ep" --runs "$runs" --work "/tmp/ab_$name" --out "$OUT/$name.jsonl" > "$OUT/$name.txt" 2>&1)
  echo "$name rc=$? $(( $(date +%s) - AB_T0 ))s"
}
ab_records() {
  python - "$OUT" <<'PY'
import glob, json, os, sys
for path in sorted(glob.glob(os.path.join(sys.argv[1], "*.jsonl"))):
    for line in open(path):
        r = json.loads(line)
        print(os.path.basename(path)[:-6], r.get("run"), r.get("status"), r.get("median_step_s"),
              [round(x, 4) for x in (r.get("losses") or [])[:6]], r.get("peak_allocated_gib"), r.get("chose"),
              str(r.get("error", ""))[:200])
PY
}
ab_pack() {
  (cd "$OUT" && tar -czf records.tgz ./*.jsonl ./*.txt && rm -f ./*.jsonl ./*.txt)
}
