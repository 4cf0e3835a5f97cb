# 24th session, call C (2 x H200): the counted ep 2 comparison at HEAD (cc9e864): ours on one GPU (synthetic, chat), then
# ep 2 at the defaults (synthetic, chat) beside transformers' FSDP2 + EP at 2 GPUs on the same checkpoint and rows.
source bench/device_env.sh || exit 1
export PYTHONPATH=$PWD:$PYTHONPATH
T0=$(date +%s); el() { echo "$1 rc=$2 $(( $(date +%s) - T0 ))s"; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; git log --oneline -1
python bench/run.py ep_scaling --no_peer --counts 1 --runs ours_synthetic,ours_chat --warmup 3 --steps 8 --chat_steps 8 \
  --run_timeout 100 --out $OUT/one_gpu.jsonl --budget_s 140 > $OUT/one_gpu.txt 2>&1; el one $?
grep -v "^  " $OUT/one_gpu.txt | tail -4
python bench/run.py ep_scaling --counts 2 --runs ours_synthetic,ours_chat --warmup 3 --steps 8 --chat_steps 8 \
  --run_timeout 100 --out $OUT/ep2.jsonl --budget_s $(( 375 - ($(date +%s) - T0) )) > $OUT/ep2.txt 2>&1; el ep2 $?
python - <<'PY'
import json, os, sys
sys.path.insert(0, "bench")
from run import ep_scaling_table
out = os.environ["OUT"]
recs = [json.loads(l) for f in ("one_gpu.jsonl", "ep2.jsonl") if os.path.exists(f"{out}/{f}") for l in open(f"{out}/{f}")]
print(ep_scaling_table(recs))
for r in recs:
    print(r.get("name"), r.get("run"), r.get("status"), r.get("median_step_s", r.get("step_time_s")), [round(x, 4) for x in r.get("losses", [])[:4]], r.get("peak_allocated_gib"), r.get("chose", ""), str(r.get("error", ""))[:200])
PY
el all 0
