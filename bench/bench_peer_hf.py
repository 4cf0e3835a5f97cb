"""The peer: transformers' own FSDP2 + expert parallelism (transformers >= 5.23), trained by a plain loop.

    torchrun --nproc_per_node=4 bench/bench_peer_hf.py --dir /tmp/mixtral-L32 --ac --out results.jsonl

transformers shards the model while loading it:
``from_pretrained(dir, distributed_config=DistributedConfig(fsdp_size=N, ep_size=E, ep_implementation="all_to_all"))``
builds two meshes over the same ranks, dense (pp, dp_replicate, fsdp, tp) and expert (pp, dp_replicate, efsdp, ep),
with efsdp = fsdp * tp / ep. The model's ``base_model_ep_plan`` splits the stacked expert weights over ``ep`` (tokens
reach their experts by all-to-all); FSDP2 then shards the experts over ``efsdp`` (1 on one node with ep = N: each
expert whole on one rank), and every decoder layer and the root over ``fsdp`` (lm_head is kept gathered).

The loop is the one a user of that API writes: random token ids (every token a label, the model's own shifted mean
cross-entropy) or, with ``--data``, ours' packed rows (below); ``set_requires_gradient_sync`` on the last micro-step
only (as Trainer's ``_defer_fsdp_gradient_reduction``), the global gradient norm clipped mesh by mesh (as Trainer's
``_mixed_mesh_grad_norm``: ``clip_grad_norm_`` cannot span two meshes), and torch's AdamW in the parameters' dtype,
one parameter group per mesh (fused kernels cannot mix meshes either). ``--precision bf16`` loads bf16 weights (bf16
AdamW state, bf16 gradient reduction, no stochastic rounding); ``fp32_master`` loads fp32 weights and sets
``fsdp_mixed_precision`` (bf16 compute, fp32 reduction).

``--data PATH`` trains on the rows ours trains on at ep = world size: ``load_training_data(PATH, packing=True)`` with
the checkpoint's tokenizer, ``GlobalBatches`` over all ranks (each rank its own rows, real_data.py's seed, epochs
reshuffled when the steps outrun the data) and ``collate`` (packed rows carry per-document position_ids, which
transformers keeps apart). The loss is ours: each rank's summed cross-entropy over the step's label tokens on all
ranks, times the world size before backward because FSDP averages gradients over the ranks (Trainer's
``average_tokens_across_devices`` scales its loss alike). Tokens/s counts real tokens (not padding) of all ranks over
the summed time of the measured steps, per GPU, as real_data.py's records; TFLOPS count each micro-batch's attention
at its documents' span (collate's ``attention_sq``). The record adds ``data``, ``token_fill`` and each step's real
tokens per rank.

    torchrun --nproc_per_node=2 bench/bench_peer_hf.py --dir /tmp/qwen3_30b_a3b-L12 --grad_accum 4 --data data_chat.jsonl

Step time: ``torch.cuda.synchronize`` before the step's first forward and after ``optimizer.step``; the median
over the steps after ``--warmup``. TFLOPS and MFU use bench_moe.py's Megatron formula and peak (989), as
bench_fsdp1.py does for train_fsdp2.py's runs; the record also has the training scripts' own formula
(megablocks_utils.train.metrics). Peak memory is the largest over ranks. Rank 0 appends one JSON record with
``config: hf_native_fsdp2_ep`` to ``--out``.
"""

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from datetime import date

import torch
import torch.distributed as dist

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(BENCH))
sys.path.insert(0, BENCH)


def clip_grad_norm_by_mesh(params, max_norm: float) -> torch.Tensor:
    """The global gradient norm over gradients on several meshes (dense on ``fsdp``, experts on ``(efsdp, ep)``),
    clipped to ``max_norm``: one norm per mesh, each reduced over its own mesh, then combined (Trainer's
    ``_mixed_mesh_grad_norm`` in transformers 5.23)."""
    from torch.distributed.tensor import DTensor
    from torch.nn.utils import clip_grads_with_norm_, get_total_norm

    by_mesh = defaultdict(list)
    for p in params:
        if p.grad is not None:
            by_mesh[p.grad.device_mesh if isinstance(p.grad, DTensor) else None].append(p)
    norms = []
    for group in by_mesh.values():
        norm = get_total_norm([p.grad for p in group])
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total = torch.linalg.vector_norm(torch.stack([n.float() for n in norms]))
    for group in by_mesh.values():
        clip_grads_with_norm_(group, max_norm, total)
    return total


def packed_rows(directory: str, path: str, seq: int, micro_batch: int, grad_accum: int, world: int, rank: int):
    """The rows ours trains on (train_fsdp2.py at ep = world size, real_data.py's seed): the packed rows, the pad id
    and which of them this rank takes at each step."""
    from real_data import SEED
    from transformers import AutoTokenizer

    from megablocks_utils.data.batches import GlobalBatches, load_training_data

    tokenizer = AutoTokenizer.from_pretrained(directory)
    data = load_training_data(path, tokenizer, seq, packing=True, seed=SEED)
    schedule = GlobalBatches(data.train, micro_batch, grad_accum, world, rank, SEED, unit="packed rows")
    return data.train, tokenizer.pad_token_id, schedule


def step_counts(batches: list[dict], config, n_active: int) -> list[float]:
    """One step's real tokens, token slots and FLOPs (Megatron's formula, then the training scripts'), each micro-batch's
    attention at its documents' mean span: the padding after the last document counts as work, as real_data.py."""
    from bench_moe import megatron_flops_per_token

    from megablocks_utils.train.metrics import flops_per_token

    real = sum(float(b["real"].sum()) for b in batches)
    slots = sum(b["input_ids"].numel() for b in batches)
    spans = [(b["attention_sq"] / b["input_ids"].numel(), b["input_ids"].numel()) for b in batches]
    return [real, slots, sum(megatron_flops_per_token(config, span) * n for span, n in spans),
            sum(flops_per_token(n_active, config, span) * n for span, n in spans)]


# transformers 5.23 + PEFT 0.21 (CPU, 2 gloo ranks, 2026-11-27): an expert adapter's delta is a plain tensor that PEFT adds
# to the expert weight, which DistributedConfig's ep keeps a DTensor in the forward.
PEFT_UNDER_EP = ("PEFT cannot put LoRA on experts that DistributedConfig shards over ep (its first forward fails: "
                 "'aten.baddbmm.default got mixed torch.Tensor and DTensor')")


def lora_under_fsdp(model, directory: str, r: int):
    """``model`` (FSDP-sharded by transformers) with PEFT's LoRA on train_fsdp2.py's default targets, alpha 2r, the rest
    frozen. FSDP gathers the weights before each forward, so PEFT's delta meets plain tensors; the adapters are plain
    tensors outside FSDP, on every rank: drawn from one seed, their gradients averaged by hand (``average_replicated_grads``)."""
    from peft import get_peft_model

    from megablocks_utils.model.lora import LoraSettings, find_targets, meta_model, peft_config

    settings = LoraSettings(r=r, alpha=2.0 * r, dropout=0.0, targets=("auto",))
    targets = find_targets(meta_model(model.config), settings.targets)
    torch.manual_seed(0)  # the same initial adapters on every rank (PEFT draws them from the global generator)
    return get_peft_model(model, peft_config(settings, targets, directory, inference_mode=False))


def param_groups_by_mesh(model) -> list[dict]:
    from torch.distributed.tensor import DTensor

    groups = defaultdict(list)
    for p in model.parameters():
        if p.requires_grad:
            groups[p.device_mesh if isinstance(p, DTensor) else None].append(p)
    return [{"params": g} for g in groups.values()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", required=True, help="a hub-layout checkpoint (bench_fsdp1.py write or bench_loading.py write)")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--micro_batch", type=int, default=1)
    p.add_argument("--grad_accum", type=int, default=4, help="micro-steps per optimizer step")
    p.add_argument("--steps", type=int, default=3, help="measured optimizer steps")
    p.add_argument("--warmup", type=int, default=2, help="optimizer steps before the measured ones")
    p.add_argument("--ep_size", type=int, default=0, help="0 = all ranks")
    p.add_argument("--precision", choices=["bf16", "fp32_master"], default="bf16",
                   help="bf16: bf16 weights, gradients and AdamW state; fp32_master: fp32 weights and state, bf16 compute")
    p.add_argument("--ac", action="store_true", help="activation checkpointing of every decoder layer (activation_checkpointing_enable)")
    p.add_argument("--experts_implementation", default="", help="transformers' experts kernel; empty = its default (grouped_mm)")
    p.add_argument("--ep_implementation", default="all_to_all")
    p.add_argument("--attn_implementation", default="", help="transformers' attention kernel; empty = its default for the model")
    p.add_argument("--max_grad_norm", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--optimizer", choices=["fused", "foreach"], default="fused", help="torch AdamW kernel (fused on GPU only)")
    p.add_argument("--gpu_memory_gib", type=float, default=0.0,
                   help="cap each GPU's memory at this many GiB (to emulate a smaller GPU, as train_fsdp2's setting); 0 = all")
    p.add_argument("--skew", type=float, default=0.0,
                   help="skewed routing: the busiest expert's load over the mean, per layer (routing_skew.py); 0 = the weights' own")
    p.add_argument("--data", default="", help="train on these records' packed rows, as ours (e.g. data_chat.jsonl); "
                   "empty = random token ids")
    p.add_argument("--lora", type=int, default=0,
                   help="LoRA of this rank (alpha 2r) on train_fsdp2.py's default targets (attention and every expert) by PEFT, "
                   "the rest frozen; 0 = full fine-tuning. Needs --ep_size 1 (FSDP only): see lora_under_fsdp")
    p.add_argument("--out", default="bench/results.jsonl")
    args = p.parse_args()
    ep = args.ep_size or int(os.environ.get("WORLD_SIZE", 1))
    if args.lora and ep > 1:  # before anything starts: the peer cannot do it (PEFT_UNDER_EP)
        raise SystemExit(f"--lora with ep {ep}: {PEFT_UNDER_EP}; use --ep_size 1 (the experts FSDP-sharded instead)")

    from bench_moe import PEAK_TFLOPS, dense_gemm_tflops, megatron_flops_per_token
    from real_data import host_cpu
    from transformers import AutoModelForCausalLM, DistributedConfig
    from transformers import __version__ as transformers_version

    from megablocks_utils.data.batches import collate
    from megablocks_utils.parallel.grads import average_replicated_grads
    from megablocks_utils.train.loss import causal_lm_loss_sum
    from megablocks_utils.train.metrics import active_params, flops_per_token

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        if args.gpu_memory_gib > 0:  # the caching allocator refuses to grow past this share of the GPU
            torch.cuda.set_per_process_memory_fraction(min(1.0, args.gpu_memory_gib * 2**30 / torch.cuda.get_device_properties().total_memory))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    # Ours to start (bound to the GPU, as transformers' own start does), so the GEMM probe runs before loading.
    dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    rank, world = dist.get_rank(), dist.get_world_size()
    ep = args.ep_size or world
    gemm = dense_gemm_tflops(device)
    distributed_config = DistributedConfig(fsdp_size=world, ep_size=ep, ep_implementation=args.ep_implementation,
                                           fsdp_mixed_precision=args.precision == "fp32_master")
    record = {
        "config": "hf_native_fsdp2_ep", "gpus": world, "device": torch.cuda.get_device_name() if cuda else "cpu", "host_cpu": host_cpu(),
        "seq": args.seq, "micro_batch": args.micro_batch, "grad_accum": args.grad_accum, "activation_checkpointing": args.ac,
        "precision": args.precision, "max_grad_norm": args.max_grad_norm,
        "ep_size": ep, "fsdp_size": distributed_config.fsdp_size, "efsdp_size": distributed_config.efsdp_size,
        "ep_implementation": args.ep_implementation, "date": date.today().isoformat(), "torch": torch.__version__,
        "transformers": transformers_version, "dense_gemm_tflops": gemm, "gpu_memory_gib": args.gpu_memory_gib or None,
        **({"data": args.data} if args.data else {}),
    }
    # The data before the model, so a problem with it shows before a large model is read.
    rows, pad_token_id, schedule = (packed_rows(args.dir, args.data, args.seq, args.micro_batch, args.grad_accum, world, rank)
                                    if args.data else (None, None, None))
    try:
        start = time.perf_counter()
        extra = {"experts_implementation": args.experts_implementation} if args.experts_implementation else {}
        if args.attn_implementation:
            extra["attn_implementation"] = args.attn_implementation
        model = AutoModelForCausalLM.from_pretrained(
            args.dir, dtype=torch.bfloat16 if args.precision == "bf16" else torch.float32,
            distributed_config=distributed_config, **extra,
        )
        dist.barrier()
        config = model.config
        record.update(load_s=time.perf_counter() - start, layers=config.num_hidden_layers, hidden=config.hidden_size,
                      experts_implementation=config._experts_implementation,
                      attn_implementation=config._attn_implementation,
                      output_router_logits=bool(getattr(config, "output_router_logits", False)))
        # On one rank transformers applies neither FSDP nor EP (fsdp_size = ep_size = 1): the plain model trains.
        fsdp_applied = hasattr(model, "set_requires_gradient_sync")
        record["fsdp_applied"] = fsdp_applied
        if not fsdp_applied:  # nor does it place the model: it stays where it was loaded (CPU)
            model.to(device)
        if args.ac:
            model.activation_checkpointing_enable()
        if args.lora:
            model = lora_under_fsdp(model, args.dir, args.lora)
            record.update(lora_r=args.lora, adapter_params=sum(q.numel() for q in model.parameters() if q.requires_grad))
        model.train()
        if args.skew:  # the same hooks as bench_moe.py's ours, calibrated on a batch of their own
            from bench_moe import skew_routing_once

            record.update(skew_routing_once(model, config, args.skew, device, args.micro_batch, args.seq, rank))
        expert_params = [q for n, q in model.named_parameters() if ".experts." in n]
        n_active = active_params(model, config, expert_params)
        groups = param_groups_by_mesh(model)
        kernel = "fused" if args.optimizer == "fused" and cuda else "foreach"
        optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0, **{kernel: True})
        record.update(optimizer=f"torch AdamW ({kernel}), {len(groups)} parameter groups", param_meshes=[
            str(getattr(g["params"][0], "device_mesh", None)) for g in groups])
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        generator = torch.Generator(device=device).manual_seed(1 + rank)
        times, losses, norms, counts = [], [], [], []
        for step in range(args.warmup + args.steps):
            if rows is None:
                batches = [torch.randint(0, config.vocab_size, (args.micro_batch, args.seq), device=device, generator=generator)
                           for _ in range(args.grad_accum)]
            else:  # this rank's rows of the step, collated as train_fsdp2.py does (position_ids, no mask: any kernel)
                indices, label_tokens = schedule.micro_batches(step)
                batches = [collate([rows[j] for j in m], pad_token_id, device, args.seq, "sdpa") for m in indices]
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            step_loss = torch.zeros((), device=device)
            for i, batch in enumerate(batches):
                # Gradients are reduced on the last micro-step only (Trainer's _defer_fsdp_gradient_reduction).
                if fsdp_applied:
                    model.set_requires_gradient_sync(i == len(batches) - 1)
                if rows is None:
                    loss = model(input_ids=batch, labels=batch, use_cache=False).loss / len(batches)
                    loss.backward()
                else:
                    # Ours: summed over this rank's label tokens, over the step's on all ranks. FSDP averages gradients
                    # over the ranks (transformers divides the experts' by dp_size to match): times world, the gradient
                    # of that global mean (Trainer's average_tokens_across_devices scales its loss the same way).
                    loss = causal_lm_loss_sum(model(**batch["model_inputs"]).logits, batch["labels"]) / label_tokens
                    (loss * world).backward()
                step_loss += loss.detach()
            if args.lora:  # the adapters are plain tensors on every rank, outside FSDP: averaged here, as DDP would
                average_replicated_grads(model.parameters())
            norm = clip_grad_norm_by_mesh(model.parameters(), args.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
            dist.all_reduce(step_loss)
            losses.append(float(step_loss) / (world if rows is None else 1))  # rows: already the mean over all ranks' tokens
            norms.append(float(norm))
            if rows is not None:  # each rank fills its own row: after the sum every rank has every rank's counts
                by_rank = torch.zeros(world, 4, dtype=torch.float64, device=device)
                by_rank[rank] = torch.tensor(step_counts(batches, config, n_active), dtype=torch.float64)
                dist.all_reduce(by_rank)
                counts.append(by_rank.cpu())
            if step >= args.warmup:
                times.append(elapsed)
            if rank == 0:
                print(f"step {step + 1}: {elapsed:.3f} s, loss {losses[-1]:.4f}, grad norm {norms[-1]:.3f}", flush=True)
        step_time = statistics.median(times)
        if rows is None:  # every token real, every step alike
            tokens_per_gpu = args.grad_accum * args.micro_batch * args.seq / step_time
            tflops = megatron_flops_per_token(config, args.seq) * tokens_per_gpu / 1e12
            tflops_script = flops_per_token(n_active, config, args.seq) * tokens_per_gpu / 1e12
        else:  # real tokens and FLOPs of all ranks over the summed time of the measured steps, per GPU
            real, slots, flops, flops_script = torch.stack(counts[args.warmup:]).sum(dim=(0, 1)).tolist()
            tokens_per_gpu = real / sum(times) / world
            tflops, tflops_script = (f / sum(times) / world / 1e12 for f in (flops, flops_script))
            record.update(token_fill=real / slots, steps_per_epoch=schedule.steps_per_epoch,
                          real_tokens_per_rank=[[int(n) for n in c[:, 0]] for c in counts])
        record.update(
            status="ok", step_time_s=step_time, tokens_per_s_per_gpu=tokens_per_gpu, tflops_per_gpu=tflops,
            mfu=tflops / PEAK_TFLOPS, mfu_vs_dense_gemm=tflops / gemm if gemm else None, steps_measured=len(times),
            step_times_s=times, tflops_per_gpu_script_formula=tflops_script,
            losses=losses, grad_norms=norms, final_loss=losses[-1],
        )
        if args.lora:  # the adapters after training, the largest and smallest sum over ranks: equal where they stayed in sync
            total = torch.stack([q.detach().double().sum() for q in model.parameters() if q.requires_grad]).sum().reshape(1)
            spread = torch.cat([total, -total])
            dist.all_reduce(spread, op=dist.ReduceOp.MAX)
            record["adapter_sum_max_min"] = [float(spread[0]), -float(spread[1])]
    except torch.OutOfMemoryError as e:
        record.update(status="OOM", error=str(e).splitlines()[0][:300])
    if cuda:  # the largest over ranks (an OOM rank's too)
        memory = torch.tensor([torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()], dtype=torch.float64, device=device)
        dist.all_reduce(memory, op=dist.ReduceOp.MAX)
        record.update(peak_allocated_gib=float(memory[0]) / 2**30, peak_reserved_gib=float(memory[1]) / 2**30,
                      peak_memory_of="largest over ranks, training steps")
    if rank == 0:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "a") as f:
            f.write(json.dumps(record) + "\n")
        print(json.dumps(record), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
