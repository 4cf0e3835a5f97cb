"""Expert loading speed: ``load_model`` on every rank against a plain sequential read of the same files.

    python bench/bench_loading.py write --dir /tmp/mixtral-L4 --layers 4        # once, on the local disk
    torchrun --nproc_per_node=N bench/bench_loading.py load --dir /tmp/mixtral-L4 --out bench/results/loading.jsonl

``write`` makes a Mixtral-8x7B-width checkpoint truncated to L layers, in hub layout (one tensor per
expert and projection, bf16, several safetensors files), with random weights.
``load`` first reads every file of the checkpoint once with plain sequential reads (rank 0 alone:
the disk's own rate), then times ``load_model`` on all ranks together (each reads the dense weights
and its own experts) and reports both rates in GB/s. The page cache is dropped before each
measurement when the machine allows it (root, /proc/sys/vm/drop_caches); the record says whether.
"""

import argparse
import json
import os
import sys
import time
from datetime import date

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def drop_page_cache() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def write(directory: str, layers: int, hidden: int, intermediate: int, **config_overrides) -> None:
    """The checkpoint (safetensors, index, config.json last); ``config_overrides`` go to ``MixtralConfig``."""
    from safetensors.torch import save_file
    from transformers import MixtralConfig

    from megablocks_utils.model.architectures import MOE_SPECS
    from megablocks_utils.model.export import expert_hub_names, write_index

    spec = MOE_SPECS["mixtral"]
    config = MixtralConfig(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=intermediate,
                           num_attention_heads=max(1, hidden // 128), num_key_value_heads=max(1, hidden // 512), dtype="bfloat16",
                           **config_overrides)
    h, i, e, v = config.hidden_size, config.intermediate_size, config.num_local_experts, config.vocab_size
    kv = config.num_key_value_heads * (h // config.num_attention_heads)
    os.makedirs(directory, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    rand = lambda *shape: (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)  # noqa: E731
    weight_map, total, n_files = {}, 0, 1 + layers

    def save(n: int, tensors: dict) -> None:  # each file as soon as it is made: host memory holds one layer, not the model
        nonlocal total
        name = f"model-{n + 1:05d}-of-{n_files:05d}.safetensors"
        save_file(tensors, os.path.join(directory, name), metadata={"format": "pt"})
        weight_map.update({k: name for k in tensors})
        total += sum(t.numel() * t.element_size() for t in tensors.values())

    save(0, {"model.embed_tokens.weight": rand(v, h), "lm_head.weight": rand(v, h), "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)})
    for layer in range(layers):
        p = f"model.layers.{layer}"
        tensors = {
            f"{p}.self_attn.q_proj.weight": rand(h, h), f"{p}.self_attn.k_proj.weight": rand(kv, h),
            f"{p}.self_attn.v_proj.weight": rand(kv, h), f"{p}.self_attn.o_proj.weight": rand(h, h),
            f"{p}.input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
            f"{p}.post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
            f"{p}.block_sparse_moe.gate.weight": rand(e, h),
        }
        expert = rand(i, h)  # one random block reused: content does not matter for read speed
        for x in range(e):
            gate, up, down = expert_hub_names(spec, layer, x)
            tensors.update({gate: expert.clone(), up: expert.clone(), down: expert.t().contiguous()})
        save(1 + layer, tensors)
    write_index(directory, weight_map, total)
    config.save_pretrained(directory)
    print(f"wrote {total / 1e9:.1f} GB to {directory}")


def sequential_read(directory: str) -> tuple[int, float]:
    size, start = 0, time.perf_counter()
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            with open(os.path.join(directory, name), "rb", buffering=0) as f:
                while chunk := f.read(64 << 20):
                    size += len(chunk)
    return size, time.perf_counter() - start


def load(directory: str, out: str) -> None:
    from megablocks_utils import load_model
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    cold = drop_page_cache() if rank == 0 else False
    disk_bytes, disk_time = sequential_read(directory) if rank == 0 else (0, 0.0)
    if rank == 0:
        cold = drop_page_cache() and cold
    dist.barrier()
    start = time.perf_counter()
    model, mesh = load_model(directory, world, device=device, dtype=torch.bfloat16)
    if cuda:
        torch.cuda.synchronize()
    dist.barrier()
    elapsed = time.perf_counter() - start
    # What this rank read: every dense weight and its own experts (bf16 on disk and in memory).
    local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() * 2 for p in model.parameters())
    read_bytes = torch.tensor([local], dtype=torch.float64, device=device)
    dist.all_reduce(read_bytes)
    if rank == 0:
        record = {
            "what": "load_model", "gpus": world, "device": torch.cuda.get_device_name() if cuda else "cpu",
            "date": date.today().isoformat(), "page_cache_dropped": cold, "checkpoint_bytes": disk_bytes,
            "disk_sequential_gb_s": disk_bytes / disk_time / 1e9, "load_seconds": elapsed,
            "bytes_read_all_ranks": float(read_bytes), "load_gb_s_all_ranks": float(read_bytes) / elapsed / 1e9,
        }
        record["ratio"] = record["load_gb_s_all_ranks"] / record["disk_sequential_gb_s"]
        with open(out, "a") as f:
            f.write(json.dumps(record) + "\n")
        print(json.dumps(record), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["write", "load"])
    parser.add_argument("--dir", required=True)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=14336)
    parser.add_argument("--out", default="bench/results/loading.jsonl")
    args = parser.parse_args()
    write(args.dir, args.layers, args.hidden, args.intermediate) if args.mode == "write" else load(args.dir, args.out)
