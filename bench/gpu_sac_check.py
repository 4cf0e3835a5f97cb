"""GPU check of activation checkpointing: none, full and selective give the same loss and gradients,
and what each costs in peak memory and step time.

    torchrun --nproc_per_node=1 bench/gpu_sac_check.py                 # one GPU, ep 1
    torchrun --nproc_per_node=2 bench/gpu_sac_check.py                 # two GPUs, ep 2 (all-to-alls in the region)
    torchrun --nproc_per_node=2 bench/gpu_sac_check.py --layers 4 --seq 4096 --out bench/results/sac_h200x2.jsonl

A few Mixtral-width layers (hidden 4096, 8 experts of 14336, top-2, 32/8 heads), built the same way
for every run (same seed), sharded with ep = world size, then set up as train_fsdp2.py does it:
activation checkpointing, compile_dense (attention and norms; on by default, so the compiled parts
inside the checkpointed layers are covered), FSDP2 with bf16 or fp32 compute. For each dtype (fp32,
bf16) and mode it runs a warm-up step (compiling), then --steps timed forward+backward steps on
the same batch (no optimizer step, so every step has the same gradients), then one more step with
an op counter around the backward (what the backward recomputed: GEMMs and all-to-alls).

"none" runs twice: the second run measures the run-to-run noise of the GPU kernels (atomics in some
backward kernels), against which full and selective are judged: max relative gradient error within
max(bound, 10 x noise), bound 1e-5 in fp32 and 2e-2 in bf16; the loss the same way. Prints a table;
exits non-zero if a check fails or a run failed (out of memory: try --seq or --layers smaller).
"""

import argparse
import gc
import json
import os
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megablocks_utils import (  # noqa: E402
    causal_lm_loss_sum,
    compile_dense_parts,
    expert_parameters,
    router_stats,
    shard_moe,
)
from megablocks_utils.parallel.activation_checkpointing import (  # noqa: E402
    OpCounter,
    apply_activation_checkpointing,
)

BOUND = {"fp32": 1e-5, "bf16": 2e-2}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
aten = torch.ops.aten


def flag(text: str) -> bool:
    return text.lower() in ("1", "true", "yes", "on")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=14336)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--batch", type=int, default=2, help="samples per rank")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=3, help="timed steps per run (after one warm-up step)")
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--modes", default="none,full,selective")
    p.add_argument("--compile_dense", default="true")
    p.add_argument("--count_ops", default="true", help="one extra step counting the backward's GEMMs and all-to-alls")
    p.add_argument("--out", default="", help="also write one JSON line per run here (rank 0)")
    return p.parse_args()


def build(args, mode: str, compute_dtype: torch.dtype, device: torch.device):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=32, num_key_value_heads=8,
        num_local_experts=args.experts, num_experts_per_tok=2, max_position_embeddings=max(4096, args.seq),
        router_aux_loss_coef=0.02, tie_word_embeddings=False,
    )
    torch.manual_seed(0)  # the same weights for every run
    with device:
        model = MixtralForCausalLM(config)
    mesh = shard_moe(model, dist.get_world_size(), device=device)
    apply_activation_checkpointing(model, mode)
    if flag(args.compile_dense):
        compile_dense_parts(model)
    experts = set(expert_parameters(model))
    mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh.world, mp_policy=mp, ignored_params=experts)
    fully_shard(model, mesh=mesh.world, mp_policy=mp, ignored_params=experts)
    model.train()
    return model, mesh


def step(model, mesh, ids, counter=None):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids)
    stats = router_stats(model, None, mesh.world.get_group())
    loss = causal_lm_loss_sum(out.logits, ids) / (ids.numel() - ids.shape[0]) + 0.02 * stats.local
    if counter is None:
        loss.backward()
    else:
        with counter:
            loss.backward()
    return loss.detach()


def local_grads(model) -> dict:
    return {n: (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).detach().float()
            for n, p in model.named_parameters() if p.grad is not None}


def run(args, dtype_name: str, mode: str, device: torch.device, ids, reference):
    """One run; returns its record, and its gradients (on the host) when ``reference`` is None."""
    model, mesh = build(args, mode, DTYPES[dtype_name], device)
    step(model, mesh, ids)  # warm-up: compiles
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        loss = step(model, mesh, ids)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() / 2**30
    grads = local_grads(model)
    record = {"dtype": dtype_name, "mode": mode, "step_ms": 1e3 * statistics.median(times), "peak_gib": peak}
    loss_sum = loss.float().clone()
    dist.all_reduce(loss_sum)
    record["loss"] = float(loss_sum) / dist.get_world_size()
    if reference is None:
        record["max_rel_grad"] = 0.0
        kept = {n: g.cpu() for n, g in grads.items()}
    else:
        worst = torch.zeros((), device=device)
        for name, ref in reference["grads"].items():
            ref = ref.to(device)
            err = (grads[name] - ref).abs().max() / ref.abs().max().clamp(min=1e-12)
            worst = torch.maximum(worst, err)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        record["max_rel_grad"] = float(worst)
        record["rel_loss"] = abs(record["loss"] - reference["loss"]) / max(abs(reference["loss"]), 1e-12)
        kept = None
    del grads
    if flag(args.count_ops):
        counter = OpCounter()
        step(model, mesh, ids, counter)
        record["bwd_gemms"] = counter.total(aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten._grouped_mm)
        record["bwd_a2a"] = counter.total(torch.ops._c10d_functional.all_to_all_single)
    peak_all = torch.tensor([peak], device=device)
    dist.all_reduce(peak_all, op=dist.ReduceOp.MAX)
    record["peak_gib"] = float(peak_all)  # the largest over ranks
    del model, mesh
    gc.collect()
    torch.cuda.empty_cache()
    return record, kept


def main():
    args = parse_args()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    # A rank that fails inside a collective ends the others with an error after this long, not a hang.
    dist.init_process_group("nccl", timeout=timedelta(seconds=300))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch._dynamo.config.recompile_limit = 64  # every run builds a new model; the compiled code is reused
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if "none" not in modes:
        modes.insert(0, "none")
    modes = ["none", "none"] + [m for m in modes if m != "none"]  # the second none measures the noise
    g = torch.Generator().manual_seed(1 + rank)
    ids_cpu = torch.randint(1, args.vocab, (args.batch, args.seq), generator=g)
    records = []
    for dtype_name in [d.strip() for d in args.dtypes.split(",") if d.strip()]:
        ids = ids_cpu.to(device)
        reference = None
        for i, mode in enumerate(modes):
            label = "none (again)" if i == 1 else mode
            if rank == 0:
                print(f"[{dtype_name}] {label} ...", flush=True)
            try:
                record, grads = run(args, dtype_name, mode, device, ids, reference)
                failed = torch.zeros(1, device=device)
            except torch.OutOfMemoryError:
                record, grads = {"dtype": dtype_name, "mode": mode, "error": "out of memory"}, None
                failed = torch.ones(1, device=device)
                gc.collect()
                torch.cuda.empty_cache()
            dist.all_reduce(failed, op=dist.ReduceOp.MAX)
            if failed.item() and "error" not in record:
                record = {"dtype": dtype_name, "mode": mode, "error": "failed on another rank"}
            record["mode"] = label
            if reference is None:
                if "error" in record:
                    records.append(record)
                    break  # nothing to compare with
                reference = {"loss": record["loss"], "grads": grads}
            records.append(record)
        reference = None
        gc.collect()

    ok = report(records, rank, world, args)
    dist.destroy_process_group()
    sys.exit(0 if ok else 1)


def report(records, rank, world, args) -> bool:
    ok = True
    noise = {}
    for r in records:
        if r["mode"] == "none (again)" and "error" not in r:
            noise[r["dtype"]] = (r["max_rel_grad"], r["rel_loss"])
    none_ms = {r["dtype"]: r["step_ms"] for r in records if r["mode"] == "none" and "error" not in r}
    lines = [f"activation checkpointing check: {world} GPU(s), ep {world}, {args.layers} layers, hidden {args.hidden}, "
             f"{args.experts} experts of {args.intermediate}, batch {args.batch} x seq {args.seq} per rank, "
             f"compile_dense {flag(args.compile_dense)}",
             f"{'dtype':5} {'mode':13} {'loss':>10} {'rel_loss':>9} {'max_rel_grad':>12} {'peak_GiB':>8} {'step_ms':>8} "
             f"{'vs_none':>7} {'bwd_gemms':>9} {'bwd_a2a':>7}  check"]
    for r in records:
        if "error" in r:
            ok = False
            lines.append(f"{r['dtype']:5} {r['mode']:13} {r['error']}  FAIL")
            continue
        check = ""
        if r["mode"] in ("full", "selective"):
            grad_noise, loss_noise = noise.get(r["dtype"], (0.0, 0.0))
            passed = (r["max_rel_grad"] <= max(BOUND[r["dtype"]], 10 * grad_noise)
                      and r["rel_loss"] <= max(BOUND[r["dtype"]], 10 * loss_noise))
            check = "ok" if passed else "FAIL"
            ok = ok and passed
        speed = r["step_ms"] / none_ms[r["dtype"]] if r["dtype"] in none_ms else float("nan")
        lines.append(
            f"{r['dtype']:5} {r['mode']:13} {r['loss']:10.6f} {r.get('rel_loss', 0.0):9.2e} {r['max_rel_grad']:12.2e} "
            f"{r['peak_gib']:8.2f} {r['step_ms']:8.1f} {speed:6.2f}x {r.get('bwd_gemms', '-'):>9} {r.get('bwd_a2a', '-'):>7}  {check}"
        )
    lines.append("bwd_gemms/bwd_a2a: GEMMs and all-to-alls run in the backward (gradients plus recompute); selective should "
                 "add no all-to-alls to none's. With compile_dense on, the attention projections inside the compiled "
                 "attention are recomputed by selective too (see megablocks_utils/parallel/activation_checkpointing.py).")
    lines.append("PASS" if ok else "FAIL")
    if rank == 0:
        print("\n".join(lines), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                for r in records:
                    f.write(json.dumps({**r, "world": world, "layers": args.layers, "seq": args.seq, "batch": args.batch,
                                        "compile_dense": flag(args.compile_dense)}) + "\n")
    return ok


if __name__ == "__main__":
    main()
