"""Side-by-side training-step benchmark at Mixtral-8x7B width (one configuration per launch).

    torchrun --nproc_per_node=N bench/bench_moe.py --config ep --layers 4 --out bench/results.jsonl

Configurations (same global batch, same model width, bf16 compute with fp32 master weights, AdamW):
  eager       FSDP2 over all ranks, transformers' experts with experts_implementation="eager"
  grouped_mm  FSDP2 over all ranks, transformers' experts with experts_implementation="grouped_mm"
  ep          ours: shard_moe (--ep, default all ranks) + parallelize (FSDP2 on the dense weights and the experts)
  megablocks  the same with moe_backend="megablocks" (megablocks' dropless MoE + grouped_gemm; docs/megablocks.md)
Weights are random, created on the GPUs (no checkpoint). Appends one JSON line per run to --out.
Configuration (d), FSDP1 + EP through HF Trainer (train_fsdp1.py itself), is bench/bench_fsdp1.py.

FLOPs: Megatron-LM's formula for a gated MoE transformer, per token (forward + backward):
  12 L H^2 [ (1 + G/A + S/H) + (F/H) k 3/2 ] + 6 H V
(L layers, H hidden, A heads, G KV heads, S sequence, F expert width, k experts per token, V vocab).
MFU is against 989 TFLOP/s (H100/H200 dense bf16) and against the dense bf16 GEMM rate measured here.
"""

import argparse
import json
import os
import statistics
import sys
import time
from datetime import date

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PEAK_TFLOPS = 989.0


def megatron_flops_per_token(c, seq: int) -> float:
    h, layers = c.hidden_size, c.num_hidden_layers
    attention = 1 + c.num_key_value_heads / c.num_attention_heads + seq / h
    mlp = c.intermediate_size / h * c.num_experts_per_tok * 1.5
    return 12 * layers * h * h * (attention + mlp) + 6 * h * c.vocab_size


def dense_gemm_tflops(device) -> float:
    """The bf16 GEMM rate this GPU reaches right now (8192^3, median of 10)."""
    if device.type != "cuda":
        return None
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    times = []
    for i in range(13):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) / 1e3)
    return 2 * 8192**3 / statistics.median(times) / 1e12


def skew_routing_once(model, config, target: float, device, micro_batch: int, seq: int, rank: int) -> dict:
    """routing_skew.py's hooks on every router, calibrated by one forward without gradients on a batch of random
    ids (each rank its own; the loads are summed over ranks). Returns the record's routing fields."""
    from routing_skew import skew_routing

    skew = skew_routing(model, target, config.num_local_experts, config.num_experts_per_tok)
    generator = torch.Generator(device=device).manual_seed(1000 + rank)
    with torch.no_grad():
        model(input_ids=torch.randint(0, config.vocab_size, (micro_batch, seq), device=device, generator=generator))
    return {"routing_skew_target": target, "expert_load_max_over_mean": skew.ratios,
            "expert_load_max_over_mean_unskewed": skew.uniform_ratios}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--config", choices=["eager", "grouped_mm", "ep", "megablocks"], required=True)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--micro_batch", type=int, default=1)
    p.add_argument("--grad_accum", type=int, default=4, help="micro-steps per optimizer step")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--ac", action="store_true", help="activation checkpointing of every decoder layer")
    p.add_argument("--fused_adamw", action="store_true", help="torch.optim.AdamW(fused=True) instead of foreach")
    p.add_argument("--no_compile", action="store_true", help="(ep) eager element-wise steps in the MoE layer (no torch.compile)")
    p.add_argument("--compile_dense", action="store_true",
                   help="torch.compile each decoder layer's attention (with its rotary embedding) and RMSNorms")
    p.add_argument("--compile_layers", action="store_true",
                   help="(ep) torch.compile each whole decoder layer's forward (a lever; graph breaks at the MoE layer's host sync)")
    p.add_argument("--compile_loss", action="store_true", help="torch.compile the cross-entropy (fp32 upcast of the logits fused)")
    p.add_argument("--no_reshard", action="store_true", help="FSDP2 reshard_after_forward=False for the decoder layers")
    p.add_argument("--overlap_chunks", type=int, default=1,
                   help="(ep) tokens through each MoE layer in this many chunks, one's all-to-all beside another's experts")
    p.add_argument("--ep", type=int, default=0, help="(ep, megablocks) expert-parallel degree; 0 = all ranks")
    p.add_argument("--shard_experts", choices=["true", "false"], default="true",
                   help="(ep, megablocks) FSDP-shard experts over dp too, or replicate them over dp")
    p.add_argument("--selective_ac", action="store_true", help="(ep, megablocks) selective instead of full checkpointing with --ac")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=14336)
    p.add_argument("--skew", type=float, default=0.0,
                   help="skewed routing: the busiest expert's load over the mean, per layer (routing_skew.py); 0 = the random weights' own")
    p.add_argument("--out", default="bench/results.jsonl")
    p.add_argument("--profile", default="", help="write a torch.profiler table of 2 measured steps to this file (rank 0)")
    args = p.parse_args()

    from contextlib import nullcontext

    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoModelForCausalLM, MixtralConfig

    from megablocks_utils import (
        build_mesh,
        causal_lm_loss_sum,
        compile_dense_parts,
        expert_parameters,
        router_stats,
        shard_moe,
    )
    from megablocks_utils.parallel.grads import clip_grad_norm_
    from megablocks_utils.parallel.parallelize import parallelize, set_gradient_sync

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    heads = max(1, args.hidden // 128)
    config = MixtralConfig(
        vocab_size=32000, hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
        num_attention_heads=heads, num_key_value_heads=max(1, heads // 4), num_local_experts=8, num_experts_per_tok=2,
        max_position_embeddings=max(4096, args.seq), use_cache=False,
    )
    gemm = dense_gemm_tflops(device)
    record = {
        "config": args.config, "gpus": world, "device": torch.cuda.get_device_name() if cuda else "cpu",
        "layers": args.layers, "hidden": args.hidden, "seq": args.seq, "micro_batch": args.micro_batch,
        "grad_accum": args.grad_accum,
        "activation_checkpointing": args.ac, "fused_adamw": args.fused_adamw,
        "compile_dense": args.compile_dense, "compile_loss": args.compile_loss, "reshard_after_forward": not args.no_reshard,
        "compile_elementwise": args.config == "ep" and not args.no_compile, "date": date.today().isoformat(), "torch": torch.__version__,
        "ep": args.ep or world, "shard_experts": args.shard_experts == "true", "selective_ac": args.selective_ac,
        "overlap_chunks": args.overlap_chunks, "compile_layers": args.compile_layers,
        "dense_gemm_tflops": gemm,
    }
    try:
        torch.manual_seed(0)
        sharded = args.config in ("ep", "megablocks")
        impl = {"experts_implementation": args.config} if not sharded else {}
        with device:
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, **impl)
        experts = set()
        compute_dtype = torch.bfloat16 if cuda else torch.float32
        if sharded:  # ours: the same parallelize() as train_fsdp2.py
            mesh = build_mesh(args.ep or world, device.type, shard_experts=args.shard_experts == "true")
            shard_moe(model, mesh, device=device, moe_backend="megablocks" if args.config == "megablocks" else "native",
                      compile_elementwise=not args.no_compile, overlap_chunks=args.overlap_chunks)
            ac = ("selective" if args.selective_ac else "full") if args.ac else "none"
            parallelize(model, mesh, param_dtype=compute_dtype, activation_checkpointing=ac, compile_dense=args.compile_dense,
                        reshard_after_forward=not args.no_reshard)
            if args.compile_layers:  # the forward only: FSDP's hooks stay outside, on __call__
                for layer in model.model.layers:
                    layer.forward = torch.compile(layer.forward)
            experts = set(expert_parameters(model))
        else:
            from torch.distributed.device_mesh import init_device_mesh

            fsdp_mesh = init_device_mesh(device.type, (world,))
            if args.compile_dense:
                compile_dense_parts(model)
            if args.ac:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
            for layer in model.model.layers:
                fully_shard(layer, mesh=fsdp_mesh, mp_policy=mp, reshard_after_forward=not args.no_reshard)
            fully_shard(model, mesh=fsdp_mesh, mp_policy=mp)
        if args.skew:
            record.update(skew_routing_once(model, config, args.skew, device, args.micro_batch, args.seq, rank))
        groups = [{"params": [q for q in model.parameters() if q not in experts]}]
        if experts:
            groups.append({"params": list(experts)})
        optimizer = torch.optim.AdamW(groups, lr=1e-5, **({"fused": True} if args.fused_adamw else {}))
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        loss_fn = torch.compile(causal_lm_loss_sum) if args.compile_loss else causal_lm_loss_sum
        generator = torch.Generator(device=device).manual_seed(1 + rank)
        times = []
        profiler = None
        for step in range(args.warmup + args.steps):
            if args.profile and step == args.warmup:
                profiler = torch.profiler.profile(
                    activities=[torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
                )
                profiler.__enter__()
            if profiler is not None and step == args.warmup + 2:
                profiler.__exit__(None, None, None)
                if rank == 0:
                    sort = "cuda_time_total" if cuda else "cpu_time_total"
                    with open(args.profile, "w") as f:
                        f.write(profiler.key_averages().table(sort_by=sort, row_limit=40, max_name_column_width=70))
                        f.write("\n\nBy self time:\n")
                        f.write(profiler.key_averages().table(sort_by="self_" + sort, row_limit=60, max_name_column_width=90))
                profiler = None
            batches = [torch.randint(0, config.vocab_size, (args.micro_batch, args.seq), device=device, generator=generator)
                       for _ in range(args.grad_accum)]
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            with nullcontext():
                for i, ids in enumerate(batches):
                    if sharded:
                        set_gradient_sync(model, mesh, i == len(batches) - 1)
                    else:
                        model.set_requires_gradient_sync(i == len(batches) - 1)
                    logits = model(input_ids=ids).logits
                    loss = loss_fn(logits, ids) / (ids.numel() * len(batches))
                    if sharded:
                        loss = world * loss + world * 0.02 * router_stats(model, None, mesh.world.get_group()).local / len(batches)
                    loss.backward()
                    del logits, loss
            clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()
            if step >= args.warmup:
                times.append(time.perf_counter() - start)
        step_time = statistics.median(times)
        tokens_per_gpu = args.grad_accum * args.micro_batch * args.seq / step_time
        tflops = megatron_flops_per_token(config, args.seq) * tokens_per_gpu / 1e12
        record.update(
            status="ok", step_time_s=step_time, tokens_per_s_per_gpu=tokens_per_gpu, tflops_per_gpu=tflops,
            mfu=tflops / PEAK_TFLOPS, mfu_vs_dense_gemm=tflops / gemm if gemm else None,
            steps_measured=len(times),
        )
        if cuda:
            record.update(
                peak_allocated_gib=torch.cuda.max_memory_allocated() / 2**30,
                peak_reserved_gib=torch.cuda.max_memory_reserved() / 2**30,
            )
    except torch.OutOfMemoryError as e:
        record.update(status="OOM", error=str(e).splitlines()[0][:200])
    status = torch.tensor([0 if record["status"] == "ok" else 1], device=device)
    dist.all_reduce(status)
    if rank == 0:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "a") as f:
            f.write(json.dumps(record) + "\n")
        print(json.dumps(record), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
