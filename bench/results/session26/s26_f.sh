# 26th session, call F (one H200): the bounded SwiGLU forward (branch swiglu-forward-bound) on one GPU: its kernel timed
# (bench/swiglu_bench.py: ep 1 rows, and 3x rows with the valid third = the static exchange at ep 4), the MoE layer's GPU
# tests (the forward equals the compiled one to the bit), and ep 1 training, main (.base/ = git archive of main) against
# the branch, alternating (at ep 1 the grouped-GEMM path passes the valid rows too, so the Triton forward runs there).
source bench/device_env.sh || exit 1
T0=$(date +%s); el() { echo "$1 rc=$2 $(( $(date +%s) - T0 ))s"; }
PYTHONPATH=$PWD:$PYTHONPATH timeout 120 python bench/swiglu_bench.py --out $OUT/swiglu.jsonl > $OUT/swiglu.txt 2>&1; el swiglu $?
cat $OUT/swiglu.jsonl
PYTHONPATH=$PWD:$PYTHONPATH timeout 150 python -m pytest -q -p no:cacheprovider tests/gpu/test_moe_layer.py > $OUT/moe_layer.txt 2>&1; el moe_layer $?
tail -3 $OUT/moe_layer.txt
RD="bench/real_data.py --shape qwen3_30b_a3b --layers 12 --warmup 3 --steps 8 --run_timeout 90 --dir /tmp/qwen3_30b_a3b-L12"
run() {  # name, dir; skipped past 470 s
  if (( $(date +%s) - T0 > 470 )); then echo "$1 skipped (time)"; return; fi
  (cd $2 && PYTHONPATH=$2:/tmp/site timeout 110 python $RD --ep 1 --runs ours_synthetic --work /tmp/rd_$1 --out $OUT/$1.jsonl > $OUT/$1.txt 2>&1); el $1 $?
}
run main1_a $PWD/.base; run fwd1_a $PWD; run main1_b $PWD/.base; run fwd1_b $PWD
python - <<'PY'
import json, os, glob
out = os.environ["OUT"]
for f in sorted(glob.glob(f"{out}/*1_*.jsonl")):
    for line in open(f):
        r = json.loads(line)
        print(os.path.basename(f), r.get("run"), r.get("status"), r.get("median_step_s"), [round(x, 4) for x in r.get("losses", [])[:6]],
              r.get("peak_allocated_gib"), str(r.get("error", ""))[:200])
PY
cd $OUT && tar -czf records.tgz *.jsonl *.txt && rm -f *.jsonl *.txt
