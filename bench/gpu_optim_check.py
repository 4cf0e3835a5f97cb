"""GPU check of the ``optim`` options (megablocks_utils/train/optim.py) with EP + FSDP2, and of the known 8-bit limit.

    torchrun --nproc_per_node=2 bench/gpu_optim_check.py [--steps 30] [--hidden 1024]
    (needs torchao: pip install --no-deps torchao==0.18.0)

For every option and for ep = N and ep = 1 (dp = N): a small random Mixtral trains on one fixed batch.
Prints one JSON line per run: first and last loss, median step time after the compile steps, peak memory,
parameter and moment dtypes, measured moment bytes per parameter (8-bit: codes + scales over the
parameters of the quantised tensors, and over all parameters), and whether a DCP save / load round trip
gives back the same state. Then probes torchao's AdamW8bit on bf16 DTensor parameters, which fails on
CPU with "OptimState8bit dispatch: ... aten.view.dtype" (optim.py says why): "probe" says whether it does
on this GPU too. Exits non-zero when a check fails.
"""

import argparse
import json
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megablocks_utils import (  # noqa: E402
    causal_lm_loss_sum,
    clip_grad_norm_,
    expert_parameters,
    shard_moe,
    sync_expert_grads,
)
from megablocks_utils.train.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from megablocks_utils.train.optim import OPTIMIZERS, build_optimizer, param_dtype  # noqa: E402

MOMENTS = ("exp_avg", "exp_avg_sq")


def local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def moment_bytes(m) -> int:
    m = local(m)
    return m.codes.nbytes + m.scale.nbytes if hasattr(m, "codes") else m.nbytes


def state_copy(optimizer):
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            for k in MOMENTS:
                m = local(optimizer.state[p][k])
                out += [m.codes.clone(), m.scale.clone()] if hasattr(m, "codes") else [m.clone()]
            out.append(local(p).detach().clone())
    return out


def build(args, dtype, ep_size, device):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "mixtral", vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 2,
        num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4, num_local_experts=8,
        num_experts_per_tok=2, max_position_embeddings=512, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    mesh = shard_moe(model, ep_size, device=device)
    experts = expert_parameters(model)
    ignored = set(experts)
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh.world, mp_policy=mp_policy, ignored_params=ignored)
    fully_shard(model, mesh=mesh.world, mp_policy=mp_policy, ignored_params=ignored)
    return model, mesh, [{"params": [p for p in model.parameters() if p not in ignored]}, {"params": experts}]


def run(args, optim, ep_size, device, root):
    from transformers import get_scheduler

    rank, world = dist.get_rank(), dist.get_world_size()
    model, mesh, groups = build(args, param_dtype(optim), ep_size, device)
    optimizer = build_optimizer(optim, groups, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01, device_type="cuda")
    scheduler = get_scheduler("constant", optimizer)
    ids = torch.randint(1, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(rank)).to(device)
    tokens = (args.seq - 1) * args.batch * world

    def step():
        loss = world * causal_lm_loss_sum(model(input_ids=ids).logits, ids) / tokens
        loss.backward()
        sync_expert_grads(model, mesh)
        clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        loss = loss.detach() / world
        dist.all_reduce(loss)
        return float(loss)

    torch.cuda.reset_peak_memory_stats(device)
    losses, times = [], []
    for _ in range(args.steps):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        losses.append(step())
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    params = [p for g in groups for p in g["params"]]
    numel = sum(local(p).numel() for p in params)
    moments = [optimizer.state[p][k] for p in params for k in MOMENTS]
    quantised = [p for p in params if hasattr(local(optimizer.state[p]["exp_avg"]), "codes")]
    record = {
        "optim": optim, "dp": mesh.dp_size, "ep": mesh.ep_size, "first_loss": losses[0], "last_loss": losses[-1],
        "step_s_median": sorted(times[3:])[len(times[3:]) // 2], "first_step_s": times[0],
        "peak_allocated_gb": torch.cuda.max_memory_allocated(device) / 2**30,
        "param_dtypes": sorted({str(p.dtype) for p in params}),
        "moment_types": sorted({f"{type(local(m)).__name__}:{local(m).dtype}" for m in moments}),
        "moment_bytes_per_param": sum(moment_bytes(m) for m in moments) / numel,
        "quantised_share": sum(local(p).numel() for p in quantised) / numel,
        "quantised_moment_bytes_per_param": (sum(moment_bytes(optimizer.state[p][k]) for p in quantised for k in MOMENTS)
                                             / max(1, sum(local(p).numel() for p in quantised))),
    }
    saved = state_copy(optimizer)
    path = save_checkpoint(os.path.join(root, f"{optim}_ep{ep_size}"), args.steps, model, optimizer, scheduler, {}, 1)
    step()
    load_checkpoint(path, model, optimizer, scheduler)
    record["dcp_round_trip_equal"] = all(torch.equal(a, b) for a, b in zip(saved, state_copy(optimizer)))
    record["ok"] = (losses[-1] < losses[0] and record["dcp_round_trip_equal"]
                    and record["param_dtypes"] == [str(param_dtype(optim))])
    if rank == 0:
        print(json.dumps(record), flush=True)
    del model, optimizer
    torch.cuda.empty_cache()
    return record["ok"]


def probe_8bit_on_bf16_dtensors(args, device):
    """torchao's AdamW8bit straight on bf16 DTensor parameters (what build_optimizer refuses)."""
    from torchao.optim import AdamW8bit

    model, mesh, groups = build(args, torch.bfloat16, dist.get_world_size(), device)
    optimizer = AdamW8bit(groups, lr=args.lr)
    ids = torch.randint(1, args.vocab, (args.batch, args.seq), device=device)
    causal_lm_loss_sum(model(input_ids=ids).logits, ids).backward()
    try:
        optimizer.step()
        result = "works"
    except Exception as e:  # noqa: BLE001 (we report whatever it is)
        result = f"fails: {type(e).__name__}: {str(e).splitlines()[0][:300]}"
    if dist.get_rank() == 0:
        print(json.dumps({"probe": "AdamW8bit on bf16 DTensor params", "result": result}), flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl")
    import torchao

    if dist.get_rank() == 0:
        print(json.dumps({"torch": torch.__version__, "torchao": torchao.__version__, "gpu": torch.cuda.get_device_name(),
                          "world": dist.get_world_size()}), flush=True)
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        root = [tmp]
        dist.broadcast_object_list(root)
        for optim in OPTIMIZERS:
            for ep_size in sorted({dist.get_world_size(), 1}, reverse=True):
                ok &= run(args, optim, ep_size, device, root[0])
        dist.barrier()
    probe_8bit_on_bf16_dtensors(args, device)
    dist.destroy_process_group()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
