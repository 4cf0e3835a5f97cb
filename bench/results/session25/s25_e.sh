# 25th session, call E (4 x H200), from the branch ep4-padding-rows (both levers + the launch retry): the counted rows in
# one call: ours on one GPU (synthetic, chat), then ep 4 and ep 2 (2 of the 4 GPUs) at defaults beside transformers'
# FSDP2 + EP on the same rows.
source bench/device_env.sh || exit 1
export PYTHONPATH=$PWD:$PYTHONPATH
T0=$(date +%s); el() { echo "$1 rc=$2 $(( $(date +%s) - T0 ))s"; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; git log --oneline -1
python bench/run.py ep_scaling --no_peer --counts 1 --runs ours_synthetic,ours_chat --warmup 3 --steps 8 --chat_steps 8 \
  --run_timeout 100 --out $OUT/one_gpu.jsonl --budget_s 230 > $OUT/one_gpu.txt 2>&1; el one $?
python bench/run.py ep_scaling --counts 4 --runs ours_synthetic,ours_chat --warmup 3 --steps 8 --chat_steps 8 \
  --run_timeout 90 --out $OUT/ep4.jsonl --budget_s 200 > $OUT/ep4.txt 2>&1; el ep4 $?
python bench/run.py ep_scaling --counts 2 --runs ours_synthetic,ours_chat --warmup 3 --steps 8 --chat_steps 8 \
  --run_timeout 90 --out $OUT/ep2.jsonl --budget_s $(( 588 - ($(date +%s) - T0) )) > $OUT/ep2.txt 2>&1; el ep2 $?
python - <<'PY'
import json, os, sys
sys.path.insert(0, "bench")
from run import ep_scaling_table
out = os.environ["OUT"]
recs = [json.loads(l) for f in ("one_gpu.jsonl", "ep4.jsonl", "ep2.jsonl") if os.path.exists(f"{out}/{f}") for l in open(f"{out}/{f}")]
print(ep_scaling_table(recs))
for r in recs:
    print(r.get("name"), r.get("run"), r.get("status"), r.get("median_step_s", r.get("step_time_s")), [round(x, 4) for x in r.get("losses", [])[:4]], r.get("peak_allocated_gib"), r.get("chose", ""), str(r.get("error", ""))[:200])
PY
tar -czf $OUT/logs.tgz -C /tmp bench_logs 2>/dev/null; el all 0
