"""The benchmarks: one command, one named variant per question.

    python bench/run.py VARIANT [options]          (`python bench/run.py -h` lists the variants, `VARIANT -h` its options)

A variant launches the scripts that measure (bench_moe.py, bench_peer_hf.py, bench_fsdp1.py, real_data.py, ...), each
launch a fresh process group on the machine's GPUs (--gpus), appends every record they write, tagged with the variant
and the launch's name, to --out (default bench/results/VARIANT_DATE.jsonl), and prints a table of them at the end. A
launch that fails or runs out of time leaves a record with its status and the end of its output, and the variant goes
on; one that no longer fits in --budget_s is skipped (the lent machines allow 10 minutes a command). --dry_run prints
the commands and runs nothing. On a lent GPU machine: `source bench/device_env.sh` first. The GPU correctness checks
are tests: `python -m pytest -q tests/gpu` (bench/README.md).
"""

import argparse
import importlib.util
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from datetime import date

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
sys.path.insert(0, BENCH)
from bench_fsdp1 import checkpoint_complete  # noqa: E402  (stdlib only at import, as real_data below)

PY = sys.executable
VARIANTS = {}  # name -> (function, its options)
# Ours with every kept lever, as train_fsdp2.py runs on GPUs: fused AdamW, compiled loss, compiled attention and norms.
OURS = ["--config", "ep", "--fused_adamw", "--compile_loss", "--compile_dense"]
PEERS_BATCH = ["--seq", "4096", "--micro_batch", "2", "--grad_accum", "2"]  # 4 sequences of 4096 per GPU per step


def option(*names, **kwargs):
    return names, kwargs


def variant(*options):
    def register(fn):
        VARIANTS[fn.__name__] = (fn, options)
        return fn
    return register


class Session:
    """One variant's run: the GPUs, the time left, the launches and where their records go."""

    def __init__(self, args):
        self.args, self.name = args, args.variant
        self.gpus = args.gpus or gpu_count()
        self.out = os.path.abspath(args.out or os.path.join(BENCH, "results", f"{args.variant}_{date.today().isoformat()}.jsonl"))
        self.part = self.out + ".part"  # what one launch writes, before it is tagged
        self.logs = os.path.join(args.logs, args.variant)
        self.deadline = time.monotonic() + args.budget_s
        self.records = []
        self.env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1",
                        PYTHONUNBUFFERED="1")

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def say(self, text: str) -> None:
        print(f"== {time.strftime('%H:%M:%S')} {text}", flush=True)

    def keep(self, record: dict) -> None:
        self.records.append(record)
        if not self.args.dry_run:
            os.makedirs(os.path.dirname(os.path.abspath(self.out)), exist_ok=True)
            with open(self.out, "a") as f:
                f.write(json.dumps(record) + "\n")

    def read_part(self, log_path: str) -> list[dict]:
        """The records the launch wrote to ``self.part`` (the file is then removed)."""
        if not os.path.exists(self.part):
            return []
        with open(self.part) as f:
            found = [json.loads(line) for line in f if line.strip()]
        os.remove(self.part)
        return found

    def run(self, name: str, command: list[str], limit: float, cwd: str = ROOT, env: dict | None = None, collect=None,
            **tags) -> list[dict]:
        """Run ``command`` for at most ``limit`` seconds, fewer when the budget has less; keep its records (what it wrote
        to ``self.part``, or what ``collect(log_path)`` makes of its output) tagged with the variant, ``name`` and
        ``tags`` (a ``config`` tag replaces the script's), or one record saying why there is none. Returns those kept."""
        timeout = min(limit, self.left() - 10)
        shown = " ".join(shlex.quote(c) for c in command)
        if self.args.dry_run:
            print(f"{name}: {shown}" + (f"   (in {cwd})" if cwd != ROOT else ""))
            return []
        tag = {"variant": self.name, "name": name, **tags}
        if timeout < 60:
            self.say(f"{name}: skipped, {self.left():.0f} s left of the {self.args.budget_s:.0f} s budget")
            self.keep({**tag, "status": "skipped", "error": f"{self.left():.0f} s left of the {self.args.budget_s:.0f} s budget"})
            return []
        # A command the budget gives less than its own limit may be cut short: say so now, and in its record if it is.
        cut = f"the {self.args.budget_s:.0f} s budget gave it {timeout:.0f} of its {limit:.0f} s" if timeout < limit else ""
        self.say(f"{name} (timeout {timeout:.0f} s{'; ' + cut if cut else ''}): {shown}")
        os.makedirs(self.logs, exist_ok=True)
        log_path = os.path.join(self.logs, f"{name}.log")
        if os.path.exists(self.part):
            os.remove(self.part)
        with open(log_path, "w") as log:  # its own session: a timeout stops the launcher and every rank it started
            proc = subprocess.Popen(command, cwd=cwd, env=env or self.env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            try:
                code = proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait()
                code = "timeout"
        found = (collect or self.read_part)(log_path)
        with open(log_path) as f:
            tail = f.read().splitlines()[-40:]
        if not found:
            errors = [line for line in tail if "Error" in line or line.startswith("error")]
            reason = (errors[-1] if errors else f"exit {code}").strip()[:400]
            if code == "timeout" and cut:
                reason = f"cut after {timeout:.0f} s: {cut} (give --budget_s more)"
            found = [{"status": "timeout" if code == "timeout" else "error", "error": reason, "log": log_path}]
            print("\n".join(tail[-12:]), flush=True)
        kept = []
        for record in found:
            record = {**record, **tag}
            self.keep(record)
            kept.append(record)
            print("  " + summary(record), flush=True)
        time.sleep(2)  # the stopped ranks release their GPUs
        return kept

    def torchrun(self, script: str, *args: str, nproc: int | None = None) -> list[str]:
        return [PY, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc or self.gpus}", script, *args]


def gpu_count() -> int:
    try:
        return len(subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=True).stdout.splitlines()) or 1
    except (OSError, subprocess.CalledProcessError):
        return 1


def summary(r: dict) -> str:
    if r.get("status") != "ok":
        return f"{r.get('name')}: {r.get('status')} {str(r.get('error', ''))[:200]}"
    keys = ("step_time_s", "median_step_s", "tokens_per_s_per_gpu", "tokens_per_s", "mfu", "peak_allocated_gib")
    return f"{r.get('name')}: ok " + " ".join(f"{k}={r[k]:.4g}" for k in keys if isinstance(r.get(k), (int, float)))


def mixtral_checkpoint(s: Session, layers: int, hidden: int = 4096, intermediate: int = 14336) -> str:
    """A Mixtral-width checkpoint of ``layers`` layers (random bf16 weights), written once per machine to /tmp."""
    shape = "" if (hidden, intermediate) == (4096, 14336) else f"-h{hidden}-i{intermediate}"
    directory = f"/tmp/mixtral-L{layers}{shape}"
    command = [PY, os.path.join(BENCH, "bench_fsdp1.py"), "write", "--dir", directory, "--layers", str(layers),
               "--hidden", str(hidden), "--intermediate", str(intermediate)]
    if s.args.dry_run:
        print(f"checkpoint (once): {' '.join(command)}")
    elif not checkpoint_complete(directory, layers, hidden, intermediate):
        s.say(f"writing the {layers}-layer checkpoint to {directory}")
        subprocess.run(command, cwd=ROOT, check=True)
    return directory


def bench_moe(s: Session, *flags: str) -> list[str]:
    return s.torchrun(os.path.join("bench", "bench_moe.py"), *flags, *shlex.split(s.args.bench_args), "--out", s.part)


def table(records: list[dict], extra: tuple = ()) -> str:
    """The throughput table: one row per record; ``extra`` are (header, function of the record) columns."""
    head = ["run", "status", *[h for h, _ in extra], "s/step", "tokens/s/GPU", "MFU", "peak alloc GiB"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in records:
        cells = [str(r.get("name")), str(r.get("status")), *[str(f(r)) for _, f in extra]]
        if r.get("status") == "ok":
            mfu = r.get("mfu", r.get("mfu_script_formula"))
            cells += [f"{r['step_time_s']:.3f}", f"{r['tokens_per_s_per_gpu']:,.0f}", f"{mfu:.1%}" if mfu else "",
                      f"{r['peak_allocated_gib']:.1f}" if r.get("peak_allocated_gib") else ""]
        else:
            cells += [str(r.get("error", ""))[:80], "", "", ""]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def routing(r: dict) -> str:
    loads = r.get("expert_load_max_over_mean")
    if r.get("routing_skew_target") and isinstance(loads, list):
        return f"skew {r['routing_skew_target']}: {sum(loads) / len(loads):.2f}"
    return "own"


BENCH_ARGS = option("--bench_args", default="", help="more bench_moe.py flags, appended (e.g. --hidden 64 --intermediate 128 --seq 128)")


@variant(option("--layers", type=int, default=8), option("--configs", default="eager,grouped_mm,ep,megablocks"),
         option("--micro_batch", type=int, default=2), option("--grad_accum", type=int, default=2),
         option("--steps", type=int, default=10), option("--warmup", type=int, default=3),
         option("--profile", default="", help="also write a torch.profiler table of ours (ep) to this file"), BENCH_ARGS)
def moe_layer(s: Session) -> str:
    """The MoE layer against transformers' experts under FSDP2 (bench_moe.py's configurations).

    Mixtral width: (a) FSDP2 + transformers' eager experts, (b) its grouped_mm experts, (c) ours, (e) megablocks (where
    it imports); same global batch, compiled attention and norms, fused AdamW."""
    a = s.args
    for config in a.configs.split(","):
        if config == "megablocks" and importlib.util.find_spec("megablocks") is None and not a.dry_run:
            s.keep({"variant": s.name, "name": config, "status": "skipped", "error": "megablocks does not import (docs/megablocks.md)"})
            continue
        flags = ["--config", config, "--layers", str(a.layers), "--micro_batch", str(a.micro_batch), "--grad_accum",
                 str(a.grad_accum), "--steps", str(a.steps), "--warmup", str(a.warmup), "--fused_adamw", "--compile_dense"]
        flags += ["--compile_loss"] if config in ("ep", "megablocks") else []
        flags += ["--profile", a.profile] if config == "ep" and a.profile else []
        s.run(config, bench_moe(s, *flags), 300)
    return table(s.records)


LEVERS = {  # name: (flags of OURS left out, flags added)
    "all": ((), ()),
    "no_compile_elementwise": ((), ("--no_compile",)),
    "no_compile_dense": (("--compile_dense",), ()),
    "no_compile_loss": (("--compile_loss",), ()),
    "no_fused_adamw": (("--fused_adamw",), ()),
    "no_reshard": ((), ("--no_reshard",)),
    "overlap_chunks_2": ((), ("--overlap_chunks", "2")),
    "compile_layers": ((), ("--compile_layers",)),
}


@variant(option("--layers", type=int, default=4), option("--levers", default=",".join(LEVERS)),
         option("--rounds", type=int, default=1, help="repeat the list, alternating, so drift between launches shows"),
         option("--base", default="", help="a copy of an earlier commit (git archive C | tar -x -C DIR): its code as a row"),
         option("--steps", type=int, default=6), option("--warmup", type=int, default=3), BENCH_ARGS)
def levers(s: Session) -> str:
    """Ours with every kept lever, then each lever switched off or on alone (bench_moe.py --config ep).

    Mixtral width; with --base the same at an earlier commit (before/after in one call)."""
    a = s.args
    common = ["--layers", str(a.layers), *PEERS_BATCH, "--steps", str(a.steps), "--warmup", str(a.warmup)]
    names = a.levers.split(",") + (["base"] if a.base else [])
    for _ in range(a.rounds):
        for name in names:
            if name == "base":
                s.run("base", bench_moe(s, *OURS, *common), 300, cwd=os.path.abspath(a.base), config="ep_base")
                continue
            drop, add = LEVERS[name]
            s.run(name, bench_moe(s, *[f for f in OURS if f not in drop], *add, *common), 300)
    return table(s.records)


def peer(s: Session, checkpoint: str, *flags: str, nproc: int | None = None) -> list[str]:
    return s.torchrun(os.path.join("bench", "bench_peer_hf.py"), "--dir", checkpoint, *flags, "--out", s.part, nproc=nproc)


def torchtitan(s: Session, checkpoint: str, layers: int, steps: int) -> None:
    """torchtitan's transformers backend on the same shape (bench/torchtitan_mixtral.py), where torchtitan imports."""
    probe = subprocess.run([PY, "-c", "import torchtitan"], capture_output=True, text=True, env=s.env)
    if probe.returncode != 0 and not s.args.dry_run:
        error = (probe.stderr.strip().splitlines() or ["?"])[-1]
        s.keep({"variant": s.name, "name": "torchtitan", "status": "not run", "error": f"torchtitan does not import: {error}"})
        return
    data = "/tmp/tt_data"
    if not s.args.dry_run:
        os.makedirs(data, exist_ok=True)
        with open(os.path.join(ROOT, "data.json")) as f, open(os.path.join(data, "data.jsonl"), "w") as out:
            for r in json.load(f):  # torchtitan has no synthetic-token dataset: text records
                out.write(json.dumps({"text": " ".join(filter(None, (r["instruction"], r.get("input", ""), r["output"])))}) + "\n")
        with open(os.path.join(checkpoint, "config.json")) as f:
            config = json.load(f)
        if not config.get("architectures"):
            config["architectures"] = ["MixtralForCausalLM"]
            with open(os.path.join(checkpoint, "config.json"), "w") as f:
                json.dump(config, f, indent=1)
    env = dict(s.env, PYTHONPATH=os.pathsep.join(filter(None, [BENCH, s.env.get("PYTHONPATH")])), HF_HUB_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", TT_HF_DIR=checkpoint, TT_DATA_DIR=data, TT_LAYERS=str(layers))
    dump = os.path.join(s.logs, "torchtitan")
    command = [PY, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={s.gpus}", "-m", "torchtitan.train",
               "--module", "torchtitan_mixtral", "--config", "mixtral_bench", "--hf-assets-path", checkpoint,
               "--training.seq_len", "4096", "--training.local_batch_size", "2", "--training.global_batch_size",
               str(4 * s.gpus), "--training.steps", str(steps), "--parallelism.expert_parallel_degree", str(s.gpus),
               "--training.disable_cuda_graphs", "--metrics.log_freq", "1", "--dump_folder", dump]
    s.run("torchtitan", command, 300, env=env, collect=torchtitan_record, config="torchtitan")


def torchtitan_record(log_path: str) -> list[dict]:
    """torchtitan writes no record: one from its log, the median tokens/s per GPU ("tps") after 3 steps (not yet run:
    the log's format is read from torchtitan 0.3.0's metrics code)."""
    import re

    with open(log_path) as f:
        tps = [float(t.replace(",", "")) for t in re.findall(r"tps:\s*([\d,]+)", f.read())]
    if len(tps) <= 3:
        return []
    return [{"status": "ok (log)", "tokens_per_s_per_gpu": statistics.median(tps[3:]), "steps_logged": len(tps)}]


@variant(option("--layers", type=int, default=8), option("--skew", type=float, default=2.38,
         help="the busiest expert's load over the mean in every layer (2.38: this project's real-text record)"),
         option("--routings", default="uniform,skewed"),
         option("--overlap", type=int, default=0, help="also ours with --overlap_chunks C"),
         option("--base", default="", help="also ours at an earlier commit (a copy of it, e.g. git archive C | tar -x -C DIR)"),
         option("--torchtitan", action="store_true", help="also torchtitan's transformers backend (needs torch >= 2.14)"),
         option("--steps", type=int, default=6), option("--warmup", type=int, default=3), BENCH_ARGS)
def peers(s: Session) -> str:
    """Ours (c) beside transformers' own FSDP2 + EP model (f); torchtitan with --torchtitan.

    bench_peer_hf.py, fp32 master weights, bf16 compute, on a checkpoint of the same shape, at the random weights' own
    routing and at skewed routing."""
    a = s.args
    checkpoint = mixtral_checkpoint(s, a.layers)
    batch = [*PEERS_BATCH, "--warmup", str(a.warmup), "--steps", str(a.steps)]
    for name in a.routings.split(","):
        skew = ["--skew", str(a.skew)] if name == "skewed" else []
        s.run(f"ours_{name}", bench_moe(s, *OURS, "--layers", str(a.layers), *batch, *skew), 240)
        if a.overlap:
            s.run(f"ours_overlap{a.overlap}_{name}", bench_moe(s, *OURS, "--layers", str(a.layers), *batch, *skew,
                  "--overlap_chunks", str(a.overlap)), 240, config=f"ep_overlap{a.overlap}")
        if a.base:
            s.run(f"ours_base_{name}", bench_moe(s, *OURS, "--layers", str(a.layers), *batch, *skew), 240,
                  cwd=os.path.abspath(a.base), config="ep_base")
        s.run(f"transformers_{name}", peer(s, checkpoint, "--precision", "fp32_master", *batch, *skew), 240)
    if a.torchtitan:
        torchtitan(s, checkpoint, a.layers, a.warmup + a.steps)
    return table(s.records, (("routing (busiest/mean)", routing),))


@variant(option("--layers", type=int, default=4), option("--skews", default="0,1.5,2.38,3.0", help="0: the weights' own routing"),
         option("--peer", action="store_true", help="also transformers' FSDP2 + EP at each skew"),
         option("--steps", type=int, default=6), option("--warmup", type=int, default=3), BENCH_ARGS)
def routing_skew(s: Session) -> str:
    """Ours (and with --peer transformers' FSDP2 + EP) as routing gets more uneven.

    bench/routing_skew.py's hooks push the busiest expert to the asked multiple of the mean in every layer."""
    a = s.args
    checkpoint = mixtral_checkpoint(s, a.layers) if a.peer else ""
    batch = [*PEERS_BATCH, "--warmup", str(a.warmup), "--steps", str(a.steps)]
    for skew in a.skews.split(","):
        flags = ["--skew", skew] if float(skew) else []
        s.run(f"ours_skew{skew}", bench_moe(s, *OURS, "--layers", str(a.layers), *batch, *flags), 240)
        if a.peer:
            s.run(f"transformers_skew{skew}", peer(s, checkpoint, "--precision", "fp32_master", *batch, *flags), 240)
    return table(s.records, (("routing (busiest/mean)", routing),))


@variant(option("--shape", default="qwen3_30b_a3b", help="qwen3_30b_a3b, deepseek_v2_lite, gpt_oss_20b or mixtral"),
         option("--layers", type=int, default=12),
         option("--runs", default="", help="real_data.py's runs, comma-separated (default: all)"),
         option("--routing", default="own", help="both sides: own, balanced or skew:R (bench/routing_skew.py)"),
         option("--warmup", type=int, default=4), option("--steps", type=int, default=16), option("--chat_steps", type=int, default=46),
         option("--run_timeout", type=float, default=300), option("--shrink", action="store_true", help="a tiny shape (CPU smoke)"),
         option("--base", default="", help="also the same runs at an earlier commit (a copy of it, e.g. git archive C | tar -x -C DIR)"),
         option("--base_runs", default="", help="--base: only these runs at the earlier commit (default: --runs)"),
         option("--ep", type=int, default=1, help="ours on this many GPUs, ep_size = N (ours' runs only)"),
         option("--static_factor", default="", help="the *_static and *_graphs runs' ep_capacity_factor (real_data.py's default: empty)"),
         option("--repeats", type=int, default=1, help="ours' runs (and --base's) this many times, interleaved; "
                "transformers' once: a summary of the median over repeats of each run's median step"))
def real_data(s: Session) -> str:
    """One GPU: ours on synthetic and on real records beside transformers' own model on the same rows and routing
    (--ep N: ours alone on N GPUs).

    bench/real_data.py: synthetic full-length rows, real alpaca and chat records, every attention kernel; --routing
    balanced or skew:R routes both sides alike; with --base the same runs again with an earlier commit's code (its rows
    named "base ..."): before/after in one call. Ours' step time moves by up to ±10% from one launch to the next on a
    lent H200 (its forwards are paced by the host): --repeats R alternates the two sides R times."""
    from real_data import RUNS
    from real_data import table as real_data_table

    a = s.args
    runs = a.runs or ",".join(RUNS)
    base_runs = a.base_runs or runs
    routing = "" if a.routing == "own" else "_" + a.routing.replace(":", "")
    for repeat in range(a.repeats):
        suffix = f"_r{repeat + 1}" if a.repeats > 1 else ""
        ours_only = lambda names, first=repeat == 0: names if first else ",".join(r for r in names.split(",") if not r.startswith("hf"))  # noqa: E731
        these = ours_only(runs)
        command = [PY, os.path.join("bench", "real_data.py"), "--shape", a.shape, "--layers", str(a.layers), "--runs", these,
                   "--routing", a.routing, "--warmup", str(a.warmup), "--steps", str(a.steps), "--chat_steps", str(a.chat_steps),
                   "--run_timeout", str(a.run_timeout), "--out", s.part, *(["--shrink"] if a.shrink else []), "--ep", str(a.ep),
                   *(["--static_factor", a.static_factor] if a.static_factor else [])]
        if these:
            s.run(f"{a.shape}_L{a.layers}{routing}{suffix}", command, a.run_timeout * (len(these.split(",")) + 1))
        if a.base and ours_only(base_runs):  # its own real_data.py and train_fsdp2.py; the same checkpoint and rows
            command[command.index("--runs") + 1] = ours_only(base_runs)
            s.run(f"base_{a.shape}_L{a.layers}{routing}{suffix}", command, a.run_timeout * (len(base_runs.split(",")) + 1),
                  cwd=os.path.abspath(a.base))
    rows = [dict(r, run=("base " if r["name"].startswith("base_") else "") + r.get("run", r["name"])) for r in s.records]
    return real_data_table(rows) + (("\n\n" + repeats_summary(rows)) if a.repeats > 1 else "")


@variant(option("--shape", default="qwen3_30b_a3b", help="qwen3_30b_a3b, deepseek_v2_lite, gpt_oss_20b or mixtral"),
         option("--layers", type=int, default=12),
         option("--counts", default="1,2", help="GPU counts, comma-separated; ep = the count"),
         option("--runs", default="ours_synthetic,ours_chat", help="real_data.py's runs of ours at each count"),
         option("--warmup", type=int, default=3), option("--steps", type=int, default=8), option("--chat_steps", type=int, default=8),
         option("--no_peer", action="store_true", help="leave transformers' side out"),
         option("--routing", default="own", help="ours (and transformers on one GPU): own, balanced or skew:R; not own: no "
                "peer at N GPUs (bench_peer_hf.py has no balanced routing). Balanced against own tells the ranks' uneven "
                "loads apart from the cost of every layer's exchange"),
         option("--run_timeout", type=float, default=300), option("--shrink", action="store_true", help="a tiny shape (CPU smoke)"),
         option("--static_factor", default="", help="the *_static and *_graphs runs' ep_capacity_factor (real_data.py's default: empty)"),
         option("--placed_by", default="", help="real_data.py's --placed_by: the *_placed runs placed by this run's loads"))
def ep_scaling(s: Session) -> str:
    """Tokens/s per GPU at each GPU count with ep = the count: ours on synthetic rows and chat records at defaults
    (bench/real_data.py --ep N) and transformers' FSDP2 + EP on the same checkpoint and batch (bench/bench_peer_hf.py on N
    GPUs, 1 x 4096 x 4 per GPU, bf16, with --data: ours' synthetic rows, which real_data.py writes in ``work``, and ours'
    packed chat rows; until 2026-11-28 its synthetic side ran on random token ids; on one GPU its own model on
    ours' rows, real_data.py's hf_synthetic and hf_sdpa), in one call: per GPU against ours on one GPU (issue #40's 85%
    target) and ours against transformers on the same kind of rows at each count (its 2x target)."""
    from real_data import GRAD_ACCUM, MICRO_BATCH, SEQ

    a = s.args
    checkpoint = f"/tmp/{a.shape}-L{a.layers}{'-shrunk' if a.shrink else ''}"  # real_data.py writes it on its first run
    seq = 256 if a.shrink else SEQ  # shrunk: 256 keeps all but 3 chat records (at 64, one)
    work = f"/tmp/ep_scaling_{a.shape}-L{a.layers}"  # real_data.py's --work: the synthetic rows it writes, the peer's too
    synthetic = any("synthetic" in run for run in a.runs.split(","))
    for n in (int(c) for c in a.counts.split(",")):
        # One GPU: transformers' own model (no FSDP, no EP) on ours' synthetic and chat rows, in real_data.py's own launch
        runs = a.runs + (",hf_synthetic,hf_sdpa" if n == 1 and not a.no_peer else "")
        command = [PY, os.path.join("bench", "real_data.py"), "--shape", a.shape, "--layers", str(a.layers), "--dir", checkpoint,
                   "--runs", runs, "--warmup", str(a.warmup), "--steps", str(a.steps), "--chat_steps", str(a.chat_steps),
                   "--run_timeout", str(a.run_timeout), "--out", s.part, "--work", work, "--ep", str(n), "--seq", str(seq),
                   "--routing", a.routing, *(["--shrink"] if a.shrink else []),
                   *(["--static_factor", a.static_factor] if a.static_factor else []),
                   *(["--placed_by", a.placed_by] if a.placed_by else [])]
        s.run(f"ours_{n}gpu", command, a.run_timeout * (len(runs.split(",")) + 1), gpus_used=n)
        if n > 1 and not a.no_peer and a.routing == "own":
            flags = ["--seq", str(seq), "--micro_batch", str(MICRO_BATCH), "--grad_accum", str(GRAD_ACCUM), "--warmup", str(a.warmup),
                     "--precision", "bf16"]
            if synthetic:  # on the rows ours' synthetic runs trained on (written by its launch above)
                rows = ["--data", os.path.join(work, "synthetic.json"), "--steps", str(a.steps)]
                s.run(f"transformers_{n}gpu", peer(s, checkpoint, *flags, *rows, nproc=n), a.run_timeout, gpus_used=n,
                      run="transformers")
            chat = ["--data", os.path.join(ROOT, "data_chat.jsonl"), "--steps", str(a.chat_steps)]
            s.run(f"transformers_chat_{n}gpu", peer(s, checkpoint, *flags, *chat, nproc=n), a.run_timeout, gpus_used=n,
                  run="transformers_chat")
    return ep_scaling_table(s.records)


# transformers' own model on one GPU (real_data.py's runs) under the name of its FSDP2 + EP launches on more.
ONE_GPU_PEERS = {"hf_synthetic": "transformers", "hf_sdpa": "transformers_chat"}


def peer_of(run: str) -> str | None:
    """The transformers run on the same kind of rows as ours' ``run``: chat records or synthetic rows."""
    return "transformers_chat" if "chat" in run else "transformers" if "synthetic" in run else None


def plain_run(run: str) -> str:
    """ours_synthetic for ours_synthetic_static, _graphs, _replicated, _segments, _model_wrap, _placed or _numa: the run they
    vary (the same on one GPU)."""
    for suffix in ("_static", "_graphs", "_replicated", "_segments", "_model_wrap", "_placed", "_numa"):
        run = run.removesuffix(suffix)
    return run


def ep_scaling_table(records: list[dict]) -> str:
    """Per run and GPU count: tokens/s per GPU, against the same run on one GPU, and ours against transformers on the
    same kind of rows (ours_chat against transformers_chat, ours_synthetic against transformers)."""
    per_gpu = {}
    for r in records:
        if r.get("status") != "ok":
            continue
        n = r["gpus_used"]
        run = ONE_GPU_PEERS.get(r["run"], r["run"])
        if "tokens_per_s_per_gpu" in r:  # bench_peer_hf.py: FSDP2 + EP on n GPUs
            per_gpu[(run, n)] = (r["tokens_per_s_per_gpu"], r["step_time_s"])
        elif "tokens_per_s" in r:  # real_data.py: real tokens over all GPUs
            per_gpu[(run, n)] = (r["tokens_per_s"] / n, r["median_step_s"])
    lines = ["| run | GPUs (ep) | s/step | tokens/s per GPU | of one GPU | ours / transformers |", "|---|---|---|---|---|---|"]
    for (run, n), (tps, step) in sorted(per_gpu.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        # a variant of a plain run (the same as it on one GPU) against the plain run's one GPU
        one = per_gpu.get((run, 1)) or per_gpu.get((plain_run(run), 1))
        peer_tps = per_gpu.get((peer_of(run), n)) if not run.startswith("transformers") else None
        ratio = f"{tps / peer_tps[0]:.2f}x" if peer_tps else ""
        lines.append(f"| {run} | {n} | {step:.3f} | {tps:,.0f} | {f'{tps / one[0]:.0%}' if one else ''} | {ratio} |")
    failed = [f"{r.get('name')}: {r.get('status')} {str(r.get('error', ''))[:120]}" for r in records if r.get("status") != "ok"]
    return "\n".join(lines + failed + ep_scaling_notes(records))


def ep_scaling_notes(records: list[dict]) -> list[str]:
    """What else ours' records say, a line per run that has any of it: the busiest ep rank's rows over the mean at
    its GPU count (real_data.py's rank_loads) and with the experts placed on the ranks by load (placed_loads), the
    micro-steps rerun on the exact exchange (the *_static runs), the host's CPU (it paces the step at ep > 1), and at
    ep > 1 what the run chose (FSDP's units, the exchange's factor, the graphs): the row's mode, not only its flags."""
    notes = []
    for r in records:
        if r.get("status") != "ok" or "tokens_per_s" not in r:
            continue
        n, facts = r["gpus_used"], []
        if n > 1:
            units = re.search(r"FSDP units: ([^;)]+)", r.get("launch", ""))
            chose = [line.split(" (")[0].replace(" after the warm-up steps", "") for line in r.get("chose", [])]
            facts += ([f"FSDP units: {units.group(1)}"] if units else []) + chose
        load = r.get("busiest_rank_over_mean", {}).get(str(n))
        if load:
            facts.append(f"busiest rank / mean {load[0]:.2f} (largest layer {load[1]:.2f})")
        placed = r.get("busiest_rank_over_mean_placed", {}).get(str(n))
        if placed:
            facts.append(f"experts placed by load {placed[0]:.2f} ({placed[1]:.2f})")
        if "exchange_reruns" in r:
            facts.append(f"{r['exchange_reruns']} micro-steps rerun exactly")
        if r.get("host_cpu"):
            facts.append(f"host {r['host_cpu']}")
        if facts:
            notes.append(f"{r['run']} on {n} GPU{'s' if n > 1 else ''}: {'; '.join(facts)}")
    return notes


def repeats_summary(rows: list[dict]) -> str:
    """Per run (ours, "base ours", transformers), the median over launches of each launch's median step."""
    steps = {}
    for r in rows:
        if r.get("status") == "ok" and "median_step_s" in r:
            steps.setdefault(r["run"], []).append(r["median_step_s"])
    lines = ["| run | launches | median of medians s/step | each launch's median |", "|---|---|---|---|"]
    for run, values in steps.items():
        lines.append(f"| {run} | {len(values)} | {statistics.median(values):.3f} | {', '.join(f'{v:.3f}' for v in values)} |")
    return "\n".join(lines)


@variant(option("--shape", default="qwen3_30b_a3b"), option("--layers", type=int, default=12),
         option("--data", default="synthetic,chat", help="synthetic and/or chat: one profile each"),
         option("--wait", type=int, default=6), option("--active", type=int, default=3))
def profile(s: Session) -> str:
    """One GPU: where a steady-state step's GPU time goes, by part (bench/profile_steps.py; read its caveat on host time)."""
    from profile_steps import render

    a = s.args
    for data in a.data.split(","):
        command = [PY, os.path.join("bench", "profile_steps.py"), "--shape", a.shape, "--layers", str(a.layers), "--data", data,
                   "--wait", str(a.wait), "--active", str(a.active), "--out", s.part]
        s.run(f"{a.shape}_L{a.layers}_{data}", command, 400)
    return "\n\n".join(render(r) for r in s.records if r.get("parts_s_per_step"))


# Seconds per micro-step of 4096 tokens at 48 layers on one H200 (BENCHMARKS.md, issue #28: 1.866 and 4.206 s per step
# of 4), for --dry_run's estimate; ours with checkpointing is not yet measured: a guess (a recomputed forward, a third
# of the step's work without one). A model's build and start are guessed at 80 s at 48 layers.
LORA_MICRO_STEP_S = {"ours:none": 0.47, "ours:selective": 0.55, "ours:full": 0.63, "peft:full": 1.05}
# A run's checkpointing may carry ours' options, joined by "+": "experts" (--checkpoint_experts), "bf16"
# (--adapter_dtype bf16: bf16 adapters trained by adamw_bf16), "fp8" (--quantize_base fp8: the frozen base in FP8),
# "L<n>" (--ac_layers n). E.g. ours:none+experts+bf16.
LORA_OPTIONS = {"experts": ["--checkpoint_experts"], "bf16": ["--adapter_dtype", "bf16"], "fp8": ["--quantize_base", "fp8"]}


def lora_options(mods: list[str]) -> list[str]:
    """bench/lora_peft.py's flags for a run's "+" options (LORA_OPTIONS)."""
    flags = []
    for mod in mods:
        if mod in LORA_OPTIONS:
            flags += LORA_OPTIONS[mod]
        elif mod[:1] == "L" and mod[1:].isdigit():
            flags += ["--ac_layers", mod[1:]]
        else:
            raise SystemExit(f"error: unknown LoRA run option {mod!r}; use {', '.join(LORA_OPTIONS)} or L<layers>")
    return flags
LORA_BUILD_S = 80


@variant(option("--layers", type=int, default=48), option("--runs", default="ours:none,peft:full",
                                                             help="variant:checkpointing pairs (ours: none/full/selective, "
                                                                  "with +experts, +bf16, +L<n>: LORA_OPTIONS)"),
         option("--quality", action="store_true", help="the loss over 200 steps of real records: ours' fall against PEFT's"),
         option("--data", default="", help="random, chat or alpaca (default random; --quality: chat)"),
         option("--steps", type=int, default=0, help="measured steps (default 6; --quality: 200)"),
         option("--warmup", type=int, default=-1, help="warm-up steps (default 2; --quality: 0)"),
         option("--grad_accum", type=int, default=0, help="micro-steps per step (default 4; --quality: 1)"),
         option("--seq", type=int, default=4096), option("--micro_batch", type=int, default=1),
         option("--lr", type=float, default=1e-4),
         option("--model_config", default="", help="a config directory (default bench/lora_peft.py's: Qwen3-30B-A3B's)"),
         option("--gpu_memory_gib", type=float, default=0.0, help="cap each run's GPU memory (a smaller GPU); 0: the whole GPU"))
def lora(s: Session) -> str:
    """One GPU: LoRA on every expert, ours against transformers + PEFT (target_parameters), Qwen3-30B-A3B's shape
    (bench/lora_peft.py: the same weights, adapters and packed rows on both sides).

    Speed by default (random tokens, 1 x 4 micro-steps, 2 warm-up + 6 measured steps); --quality trains 200 steps of one
    row on the chat records at a constant lr and compares how far the loss falls (first 10 steps' mean less the last
    10's), ours over PEFT's, on the same rows."""
    a = s.args
    data = a.data or ("chat" if a.quality else "random")
    steps = a.steps or (200 if a.quality else 6)
    warmup = a.warmup if a.warmup >= 0 else (0 if a.quality else 2)
    grad_accum = a.grad_accum or (1 if a.quality else 4)
    micro_steps = (warmup + steps) * grad_accum * a.micro_batch * a.seq / 4096
    total = 0.0
    for run in a.runs.split(","):
        side, checkpointing = run.split(":")
        ac, *mods = checkpointing.split("+")
        estimate = (LORA_BUILD_S + micro_steps * LORA_MICRO_STEP_S.get(f"{side}:{ac}", 1.05)) * a.layers / 48
        total += estimate
        name = f"{side}_{'_'.join([ac, *mods])}" + (f"_{data}" if data != "random" else "") + f"_L{a.layers}"
        command = s.torchrun(os.path.join("bench", "lora_peft.py"), "--variant", side, "--ac", ac, *lora_options(mods), "--layers", str(a.layers),
                             "--seq", str(a.seq), "--micro_batch", str(a.micro_batch), "--grad_accum", str(grad_accum),
                             "--steps", str(steps), "--warmup", str(warmup), "--data", data, "--lr", str(a.lr), "--out", s.part,
                             *(["--model_config", a.model_config] if a.model_config else []),
                             *(["--gpu_memory_gib", str(a.gpu_memory_gib)] if a.gpu_memory_gib else []), nproc=1)
        s.run(name, command, max(300, 2 * estimate), side=side)  # the harness's tag "variant" is "lora"
    if a.dry_run:
        print(f"estimate: about {total:.0f} s in all on one H200 (budget {a.budget_s:.0f} s; LORA_MICRO_STEP_S in bench/run.py)")
    return lora_quality_table(s.records) if a.quality else lora_speed_table(s.records)


def lora_speed_table(records: list[dict]) -> str:
    lines = ["| run | status | s/step | tokens/s | peak alloc GiB | first / last loss |", "|---|---|---|---|---|---|"]
    for r in records:
        if r.get("status") != "ok":
            lines.append(f"| {r.get('name')} | {r.get('status')} | {str(r.get('error', ''))[:80]} | | | |")
            continue
        lines.append(f"| {r['name']} | ok | {r['step_time_s']:.3f} | {r['tokens_per_s']:,.0f} | {r['peak_allocated_gib']:.1f} | "
                     f"{r['losses'][0]:.4f} / {r['losses'][-1]:.4f} |")
    return "\n".join(lines)


def lora_quality_table(records: list[dict]) -> str:
    """How far each run's loss fell, and ours' fall over PEFT's on the same data (the issue's bar: at least 0.98)."""
    lines = ["| run | status | steps | loss, first 10 | loss, last 10 | fall | fall / PEFT's | s/step |", "|---|---|---|---|---|---|---|---|"]
    for r in records:
        if r.get("status") != "ok":
            lines.append(f"| {r.get('name')} | {r.get('status')} | {str(r.get('error', ''))[:80]} | | | | | |")
            continue
        peft = next((x for x in records if x.get("side") == "peft" and x.get("status") == "ok" and x.get("data") == r.get("data")), None)
        ratio = f"{r['loss_fall'] / peft['loss_fall']:.4f}" if peft and peft["loss_fall"] else ""
        lines.append(f"| {r['name']} | ok | {len(r['losses'])} | {r['loss_first10_mean']:.4f} | {r['loss_last10_mean']:.4f} | "
                     f"{r['loss_fall']:.4f} | {ratio} | {r['step_time_s']:.3f} |")
    return "\n".join(lines)


FULL_SIZE_RUNS = ("hf", "ours_sel", "ours_full", "ours_part", "ours_part_pull", "ours_none", "ours_none_swiglu_again", "emul16",
                  "hf_emul16", "ours_lora", "hf_lora")
LORA_R = 16  # the ours_lora and hf_lora runs: train_fsdp2.py's default LoRA rank and targets (attention, every expert)


@variant(option("--layers", type=int, default=32, help="Mixtral-8x7B's 32"),
         option("--runs", default="hf,ours_full", help=f"any of {', '.join(FULL_SIZE_RUNS)}"),
         option("--part_layers", type=int, default=0, help="(ours_part) checkpointed layers; default half"),
         option("--emul_gib", type=float, default=78, help="(emul16) each GPU capped here: an 80 GB H100's usable memory"),
         option("--seq", type=int, default=4096), option("--hidden", type=int, default=4096),
         option("--intermediate", type=int, default=14336))
def full_size(s: Session) -> str:
    """Full-size Mixtral-8x7B: speed and memory per GPU, ours at each checkpointing choice against transformers.

    Random weights; ours = train_fsdp2.py, adamw_bf16, experts FSDP-sharded; transformers' FSDP2 + EP in pure bf16,
    every layer checkpointed; 1 x 4 micro-batches
    of --seq tokens per GPU, 2 warm-up + 3 measured steps; the 16-layer emulation of 32 layers on 8 x 80 GB.
    train_fsdp2 runs stop after their last step, before the final export: their peak memory is rank 0's."""
    a = s.args
    full, half = a.layers, a.layers // 2
    ours_common = f"--ep_size {s.gpus} --optim adamw_bf16 --shard_experts true"
    ours = {"ours_sel": f"{ours_common} --activation_checkpointing selective",
            "ours_full": f"{ours_common} --activation_checkpointing full",
            "ours_part": f"{ours_common} --activation_checkpointing full --activation_checkpointing_layers {a.part_layers or half}",
            # ours_part with the token pull at factor 3 (no host sync per layer; checkpointing keeps the graphs off, so
            # auto takes the exact exchange here): whether the pull pays without graphs where each layer's work is large
            "ours_part_pull": (f"{ours_common} --activation_checkpointing full --activation_checkpointing_layers "
                               f"{a.part_layers or half} --ep_capacity_factor 3"),
            "ours_none": f"{ours_common} --activation_checkpointing none",
            # no checkpointing with the experts' SwiGLU output made again in the backward (where its ep guard allows)
            "ours_none_swiglu_again": f"{ours_common} --activation_checkpointing none --recompute_swiglu true",
            "emul16": f"{ours_common} --activation_checkpointing selective --gpu_memory_gib {a.emul_gib}",
            # LoRA: the weights frozen in bf16, fp32 adapters (adamw_torch); every layer checkpointed, as the peer
            "ours_lora": f"--ep_size {s.gpus} --finetuning lora --lora_r {LORA_R} --activation_checkpointing full"}
    batch = ["--seq", str(a.seq), "--micro_batch", "1", "--grad_accum", "4", "--warmup", "2", "--steps", "3"]
    unknown = set(a.runs.split(",")) - set(FULL_SIZE_RUNS)
    if unknown:
        raise SystemExit(f"error: unknown full_size run {', '.join(sorted(unknown))}; choose from {', '.join(FULL_SIZE_RUNS)}")
    whole = mixtral_checkpoint(s, full, a.hidden, a.intermediate)
    for name in a.runs.split(","):
        layers, checkpoint = (half, f"{whole}-first{half}") if name.endswith("emul16") else (full, whole)
        if layers != full and not a.dry_run and not checkpoint_complete(checkpoint, layers, a.hidden, a.intermediate):
            # the first half of the full checkpoint: links, no copy
            subprocess.run([PY, os.path.join(BENCH, "bench_fsdp1.py"), "view", "--dir", checkpoint, "--source", whole,
                            "--layers", str(layers)], cwd=ROOT, check=True)
        if name.startswith("hf"):
            extra = ["--gpu_memory_gib", str(a.emul_gib)] if name == "hf_emul16" else []
            if name == "hf_lora":  # PEFT cannot adapt experts sharded over ep (bench_peer_hf.py): FSDP only, ep 1
                extra = ["--lora", str(LORA_R), "--ep_size", "1"]
            s.run(name, peer(s, checkpoint, *batch, "--precision", "bf16", "--ac", *extra), 200 if name == "hf_emul16" else 240,
                  layers=layers)
        else:
            work = f"/tmp/full_size_work/{name}"
            shutil.rmtree(work, ignore_errors=True)
            limit = 300 if name != "emul16" else 240
            timeout = int(min(limit, s.left() - 10) - 40)
            s.run(name, [PY, os.path.join("bench", "bench_fsdp1.py"), "run", "--script", "train_fsdp2.py", "--dir", checkpoint,
                         "--layers", str(layers), "--gpus", str(s.gpus), *batch, "--hidden", str(a.hidden), "--intermediate",
                         str(a.intermediate), "--train_args", ours[name], "--name", name, "--skip_export", "--timeout",
                         str(max(timeout, 60)), "--work", work, "--out", s.part], limit)
            shutil.rmtree(work, ignore_errors=True)  # the run's output (a partial export too)
    return full_size_table(s.records)


def full_size_table(records: list[dict]) -> str:
    """full_size's table: step time, throughput, MFU, memory, per variant."""
    lines = [f"{'variant':<10} {'L':>3} {'AC':>9} {'s/step':>7} {'tok/s/GPU':>9} {'TFLOPS':>6} {'MFU':>6} {'alloc':>6} "
             f"{'reserved':>8} {'loss':>6}  memory of / status"]
    for r in records:
        name = r.get("name") or r["config"]
        ac = r.get("activation_checkpointing")
        ac = {True: "full", False: "none", None: "?"}.get(ac, ac)
        head = f"{name:<10} {r.get('layers', '?'):>3} {ac:>9}"
        if r.get("status") != "ok":
            lines.append(f"{head} {r.get('status', '?')}: {str(r.get('error', ''))[:150]}")
            continue
        alloc, reserved = r.get("peak_allocated_gib"), r.get("peak_reserved_gib")
        memory = f"{alloc:6.1f} {reserved:8.1f}" if alloc is not None else f"{'':6} {'':8}"
        lines.append(f"{head} {r['step_time_s']:7.3f} {r['tokens_per_s_per_gpu']:9.0f} {r['tflops_per_gpu']:6.0f} {r['mfu']:6.1%} "
                     f"{memory} {r.get('final_loss', float('nan')):6.3f}  {r.get('peak_memory_of', '')}")
    return "\n".join(lines)


@variant(option("--layers", type=int, default=8), option("--runs", default="fsdp1,fsdp2_script,ours"),
         option("--steps", type=int, default=10), option("--warmup", type=int, default=3), BENCH_ARGS)
def fsdp1(s: Session) -> str:
    """Configuration (d): train_fsdp1.py (Trainer + FSDP1 + EP) beside train_fsdp2.py and ours (c).

    Mixtral width, launched as a user launches it (bench_fsdp1.py), train_fsdp2.py on the same checkpoint and data, and
    bench_moe.py with fused AdamW; the same batch."""
    a = s.args
    checkpoint = mixtral_checkpoint(s, a.layers)
    batch = ["--micro_batch", "1", "--grad_accum", "4", "--steps", str(a.steps), "--warmup", str(a.warmup)]
    for name in a.runs.split(","):
        if name == "ours":
            s.run(name, bench_moe(s, "--config", "ep", "--fused_adamw", "--layers", str(a.layers), *batch), 240)
            continue
        work = f"/tmp/bench_fsdp1_work/{name}"
        script = "train_fsdp1.py" if name == "fsdp1" else "train_fsdp2.py"
        s.run(name, [PY, os.path.join("bench", "bench_fsdp1.py"), "run", "--script", script, "--dir", checkpoint, "--layers",
                     str(a.layers), "--gpus", str(s.gpus), *batch, "--timeout", "240", "--work", work, "--out", s.part], 300)
        shutil.rmtree(work, ignore_errors=True)
    return table(s.records)


@variant(option("--rows", type=int, default=16384), option("--rows_per_expert", type=int, default=8192),
         option("--pieces", default="swiglu,weigh,experts", help="any of swiglu,weigh,experts,gathers"))
def kernels(s: Session) -> str:
    """One GPU: the MoE layer's pieces (bench/kernel_bench.py).

    Mixtral width: SwiGLU and the combine's weighting eager and compiled, the expert GEMMs grouped_mm against one
    cuBLAS GEMM per expert. ``--pieces gathers``: the token gathers of dispatch.py (the dispatch's backward, the
    combine's forward and backward, each alone) at Qwen3-30B-A3B's and Mixtral's shapes, compiled against Triton."""
    a = s.args
    s.run("kernels", [PY, os.path.join("bench", "kernel_bench.py"), "--rows", str(a.rows), "--rows_per_expert",
                      str(a.rows_per_expert), "--pieces", a.pieces, "--out", s.part], 400)
    lines = ["| piece | variant | rows / local experts | ms (fwd + bwd; gathers: the one op) | GB/s or TFLOP/s |", "|---|---|---|---|---|"]
    for r in s.records:
        if r.get("status") in ("error", "timeout", "skipped"):
            lines.append(f"| {r['name']} | {r['status']}: {r.get('error', '')[:80]} | | | |")
            continue
        ms = r.get("ms_fwd_bwd", r.get("ms_gemms_fwd_bwd", r.get("ms")))
        rate = f"{r['gb_per_s']:.0f} GB/s" if "gb_per_s" in r else f"{r.get('tflops', 0):.0f} TFLOP/s"
        size = r.get("local_experts", r.get("rows", ""))
        lines.append(f"| {r['piece']} | {r['variant']} | {size} | {ms:.3f} | {rate} |" if ms else f"| {r['piece']} | {r['variant']} | | | {rate} |")
    return "\n".join(lines)


@variant(option("--layers", type=int, default=2), option("--steps", type=int, default=4), option("--warmup", type=int, default=2),
         option("--grad_accum", type=int, default=2), BENCH_ARGS)
def megablocks(s: Session) -> str:
    """The megablocks backend (e) beside the native one (c).

    bench_moe.py at Mixtral width; needs megablocks (bench/megablocks_build.sh)."""
    a = s.args
    if importlib.util.find_spec("megablocks") is None and not a.dry_run:
        raise SystemExit("error: megablocks does not import; build it with bench/megablocks_build.sh (docs/megablocks.md)")
    for config in ("ep", "megablocks"):
        s.run(config, bench_moe(s, "--config", config, "--layers", str(a.layers), "--grad_accum", str(a.grad_accum),
                                "--steps", str(a.steps), "--warmup", str(a.warmup)), 240)
    return table(s.records)


@variant(option("--layers", type=int, default=8), option("--parts", default="sharding,checkpointing"),
         option("--steps", type=int, default=8), option("--warmup", type=int, default=3), BENCH_ARGS)
def sharding(s: Session) -> str:
    """What sharding experts over dp costs inside one node, and activation checkpointing's price.

    ep = gpus / 2, dp = 2: experts FSDP-sharded against replicated, ep = gpus as the reference; checkpointing full
    and selective (none is ep_all)."""
    a = s.args
    common = [*OURS, "--layers", str(a.layers), *PEERS_BATCH, "--steps", str(a.steps), "--warmup", str(a.warmup)]
    runs = {"sharding": [("ep_all", ["--ep", str(s.gpus)]),
                         ("ep_half_sharded", ["--ep", str(max(1, s.gpus // 2)), "--shard_experts", "true"]),
                         ("ep_half_replicated", ["--ep", str(max(1, s.gpus // 2)), "--shard_experts", "false"])],
            "checkpointing": [("ac_full", ["--ep", str(s.gpus), "--ac"]), ("ac_selective", ["--ep", str(s.gpus), "--ac", "--selective_ac"])]}
    for part in a.parts.split(","):
        for name, flags in runs[part]:
            s.run(name, bench_moe(s, *common, *flags), 240)
    shard = lambda r: f"ep {r.get('ep', '')}, {'sharded' if r.get('shard_experts') else 'replicated'}"  # noqa: E731
    ac = lambda r: ("selective" if r.get("selective_ac") else "full") if r.get("activation_checkpointing") else "none"  # noqa: E731
    return table(s.records, (("experts", shard), ("checkpointing", ac)))


@variant(option("--layers", type=int, default=4), option("--seq", type=int, default=2048),
         option("--ours", default="gpt_oss_ours_fsdp2=;gpt_oss_ours_fsdp2_nocompile=--compile_dense false",
                help="ours' rows: NAME=train_fsdp2.py settings, ';'-separated"))
def gpt_oss(s: Session) -> str:
    """One GPU: gpt-oss-20b's shape, train_fsdp2.py against transformers' own model.

    Cut to --layers layers, random bf16 weights; transformers pure bf16 with torch AdamW, ours bf16 AdamW with
    stochastic rounding; eager attention (the sinks), 4 micro-batches of --seq tokens, 2 warm-up + 3 measured steps."""
    a = s.args
    checkpoint = f"/tmp/gpt-oss-L{a.layers}"
    write = [PY, os.path.join("bench", "gpt_oss.py"), "write", "--dir", checkpoint, "--layers", str(a.layers)]
    if a.dry_run:
        print(f"checkpoint (once): {' '.join(write)}")
    elif not os.path.isfile(os.path.join(checkpoint, "tokenizer_config.json")):
        subprocess.run(write, cwd=ROOT, check=True)
    batch = ["--seq", str(a.seq), "--grad_accum", "4", "--warmup", "2", "--steps", "3"]
    s.run("transformers", peer(s, checkpoint, *batch, "--precision", "bf16", "--attn_implementation", "eager", nproc=1), 150)
    for entry in filter(None, a.ours.split(";")):
        name, _, extra = entry.partition("=")
        work = "/tmp/gpt_oss_work"
        shutil.rmtree(work, ignore_errors=True)
        s.run(name, [PY, os.path.join("bench", "bench_fsdp1.py"), "run", "--script", "train_fsdp2.py", "--dir", checkpoint,
                     "--layers", str(a.layers), "--hidden", "2880", "--intermediate", "2880", "--gpus", "1", *batch,
                     "--train_args", f"--attn_implementation eager --optim adamw_bf16 {extra}", "--name", name,
                     "--skip_export", "--timeout", "110", "--work", work, "--out", s.part], 170)
    return table(s.records)


@variant(option("--steps", type=int, default=200), option("--optims", default="adamw_torch,adamw_bf16,adamw_torch_8bit"),
         option("--hidden", type=int, default=1024), option("--intermediate", type=int, default=3584),
         option("--layers", type=int, default=4))
def optim_quality(s: Session) -> str:
    """One GPU: the lean optimizers' loss against adamw_torch's, from scratch and fine-tuning.

    train_fsdp2.py on data.json, a mid-size Mixtral shape, --steps steps, from scratch (seeded random weights, lr 1e-3) and fine-tuning (from the scratch adamw_torch
    run's model, lr 2e-5: updates far below a bf16 weight's spacing)."""
    a = s.args
    work = "/tmp/optim_quality_runs"
    model = os.path.join(work, "mixtral-mid")
    make = [PY, "-c", "import sys; from megablocks_utils.model.tiny import make_tiny_mixtral; make_tiny_mixtral(sys.argv[1], "
            f"'data.json', hidden_size={a.hidden}, intermediate_size={a.intermediate}, num_attention_heads=8, "
            f"num_key_value_heads=4, num_hidden_layers={a.layers}, max_position_embeddings=1024)", model]
    if a.dry_run:
        print(f"model: {' '.join(make)}")
    else:
        os.makedirs(work, exist_ok=True)
        subprocess.run(make, cwd=ROOT, check=True)
    common = ["--data_path", "data.json", "--max_steps", str(a.steps), "--warmup_steps", "10", "--lr_scheduler_type", "cosine",
              "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2", "--max_length", "512",
              "--logging_steps", "50", "--overwrite_output_dir", "true", "--seed", "7"]
    for regime, source, lr in (("scratch", model, "1e-3"), ("finetune", os.path.join(work, "scratch_adamw_torch", "final"), "2e-5")):
        for optim in a.optims.split(","):
            out_dir = os.path.join(work, f"{regime}_{optim}")
            s.run(f"{regime}_{optim}", s.torchrun("train_fsdp2.py", *common, "--model_name_or_path", source, "--learning_rate",
                                                  lr, "--optim", optim, "--output_dir", out_dir, nproc=1), 300,
                  collect=lambda log, out_dir=out_dir: quality_record(out_dir), regime=regime, optim=optim)
    lines = ["| regime | optim | first loss | final loss | mean of last 20 | vs adamw_torch | bytes/param | peak GiB | s/step |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in s.records:
        if r.get("status") != "ok":
            continue
        ref = next((x for x in s.records if x.get("regime") == r["regime"] and x.get("optim") == "adamw_torch"
                    and x.get("status") == "ok"), None)
        vs = f"{(r['last20_mean'] / ref['last20_mean'] - 1) * 100:+.2f}%" if ref else "-"
        lines.append(f"| {r['regime']} | {r['optim']} | {r['first_loss']:.4f} | {r['final_loss']:.4f} | {r['last20_mean']:.4f} | "
                     f"{vs} | {r['bytes_per_param']:.2f} | {r['peak_allocated_gb']} | {r['step_s_median']:.3f} |")
    return "\n".join(lines)


def quality_record(out_dir: str) -> list[dict]:
    """A training run writes metrics.jsonl and summary.json, not a bench record: one from them (none if it failed)."""
    try:
        with open(os.path.join(out_dir, "metrics.jsonl")) as f:
            steps = [json.loads(line) for line in f if line.strip()]
        with open(os.path.join(out_dir, "summary.json")) as f:
            done = json.load(f)
    except OSError:
        return []
    losses = [r["ce_loss"] for r in steps]
    return [{"status": "ok", "steps": len(steps), "first_loss": losses[0], "final_loss": losses[-1],
             "last20_mean": statistics.mean(losses[-20:]), "bytes_per_param": done["bytes_per_param"],
             "peak_allocated_gb": done.get("peak_memory_allocated_gb"),
             "step_s_median": statistics.median(r["step_time_s"] for r in steps[5:] or steps)}]


MEMORY_RUNS = ("torch_none=--optim adamw_torch;torch_selective=--optim adamw_torch --activation_checkpointing selective;"
               "torch_full=--optim adamw_torch --activation_checkpointing full;bf16_full=--optim adamw_bf16 --activation_checkpointing full")


@variant(option("--layers", type=int, default=4), option("--seq", type=int, default=4096),
         option("--runs", default=MEMORY_RUNS, help="NAME=train_fsdp2.py settings, ';'-separated (adamw_torch at 4 layers needs an H200)"))
def memory(s: Session) -> str:
    """One GPU: the fit check's estimate against the peak memory each setting reaches.

    train_fsdp2.py prints the estimate before loading; on a Mixtral-width checkpoint, 1 x --seq tokens x 4 micro-steps, 2 warm-up + 2 measured steps.
    tests/gpu/test_memory_estimate.py checks one of them with a bound."""
    a = s.args
    checkpoint = mixtral_checkpoint(s, a.layers)
    for entry in a.runs.split(";"):
        name, _, extra = entry.partition("=")
        work = f"/tmp/memory_work/{name}"
        shutil.rmtree(work, ignore_errors=True)

        def with_estimate(log_path: str, work: str = work) -> list[dict]:
            """bench_fsdp1.py's record, with the fit check's estimate that train_fsdp2.py printed before loading."""
            try:
                with open(os.path.join(work, "launch.log")) as f:
                    estimate = next(float(line.split()[1]) for line in f if line.startswith("  peak "))
            except (OSError, StopIteration):
                estimate = None
            return [dict(r, estimate_gib=estimate) for r in s.read_part(log_path)]

        s.run(name, [PY, os.path.join("bench", "bench_fsdp1.py"), "run", "--script", "train_fsdp2.py", "--dir", checkpoint,
                     "--layers", str(a.layers), "--gpus", "1", "--seq", str(a.seq), "--grad_accum", "4", "--warmup", "2",
                     "--steps", "2", "--train_args", extra, "--name", name, "--skip_export", "--timeout", "150", "--work", work,
                     "--out", s.part], 200, collect=with_estimate)
    lines = ["| run | status | estimate GiB | peak allocated | peak reserved | estimate / reserved | s/step |", "|---|---|---|---|---|---|---|"]
    for r in s.records:
        if r.get("status") != "ok":
            lines.append(f"| {r['name']} | {r.get('status')}: {str(r.get('error', ''))[:80]} | | | | | |")
            continue
        est = r.get("estimate_gib")
        ratio = f"{est / r['peak_reserved_gib']:.2f}" if est else ""
        lines.append(f"| {r['name']} | ok | {est} | {r['peak_allocated_gib']:.1f} | {r['peak_reserved_gib']:.1f} | {ratio} | "
                     f"{r['step_time_s']:.3f} |")
    return "\n".join(lines)


@variant(option("--layers", type=int, default=4))
def loading(s: Session) -> str:
    """Expert loading speed against the disk's sequential read (bench/bench_loading.py).

    load_model on every GPU (each rank reads the dense weights and its own experts) against one plain sequential read
    of the same files, page cache dropped where the machine allows it."""
    checkpoint = mixtral_checkpoint(s, s.args.layers)
    s.run("load", s.torchrun(os.path.join("bench", "bench_loading.py"), "load", "--dir", checkpoint, "--out", s.part), 300)
    lines = ["| GPUs | load s | GB/s all ranks | disk sequential GB/s | ratio | page cache dropped |", "|---|---|---|---|---|---|"]
    for r in s.records:
        if "load_seconds" in r:
            lines.append(f"| {r['gpus']} | {r['load_seconds']:.2f} | {r['load_gb_s_all_ranks']:.2f} | {r['disk_sequential_gb_s']:.2f} | "
                         f"{r['ratio']:.2f} | {r['page_cache_dropped']} |")
        else:
            lines.append(f"| {r.get('status')}: {str(r.get('error', ''))[:80]} | | | | | |")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="variant", required=True, metavar="VARIANT")
    for name, (fn, options) in VARIANTS.items():
        v = sub.add_parser(name, help=fn.__doc__.split("\n")[0], description=fn.__doc__)
        v.add_argument("--out", default="", help="where the records go (default bench/results/VARIANT_DATE.jsonl)")
        v.add_argument("--gpus", type=int, default=0, help="GPUs per launch (default: all of the machine's)")
        v.add_argument("--budget_s", type=float, default=560, help="skip a launch that no longer fits this many seconds from the start")
        v.add_argument("--logs", default="/tmp/bench_logs", help="each launch's output, VARIANT/NAME.log")
        v.add_argument("--dry_run", action="store_true", help="print the commands, run nothing")
        for names, kwargs in options:
            v.add_argument(*names, **kwargs)
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    s = Session(args)
    fn = VARIANTS[args.variant][0]
    if not args.dry_run:
        s.say(f"{args.variant} on {s.gpus} GPU(s), records to {s.out}")
    text = fn(s)
    if not args.dry_run:
        s.say(f"done in {args.budget_s - s.left():.0f} s")
        print(text, flush=True)


if __name__ == "__main__":
    main()
