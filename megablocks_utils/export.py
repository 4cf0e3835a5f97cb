"""Write a Hugging Face checkpoint in hub layout (one tensor per expert), without gathering experts.

Each ep rank of the first dp replica writes its own experts to its own safetensors file; rank 0
writes the dense weights (gathered from FSDP one tensor at a time), the index, the config and the
tokenizer. The directory appears under its final name only when every file is written.
"""

import json
import os
import shutil

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn
from torch.distributed.tensor import DTensor

from .mesh import MoEMesh
from .models import MoESpec, decoder_layers, spec_for
from .moe_layer import ExpertParallelMoE

INDEX_NAME = "model.safetensors.index.json"


def shard_file_name(i: int, n: int) -> str:
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def dense_hub_name(name: str, spec: MoESpec) -> str:
    """transformers 5 dense name -> hub name (only the router moves)."""
    return name.replace(f".{spec.block_attr}.{spec.router_attr}.", f".{spec.hub_block_name}.{spec.router_attr}.")


def expert_hub_names(spec: MoESpec, layer: int, expert: int) -> tuple[str, str, str]:
    """Hub names of one expert's (gate, up, down) projections."""
    prefix = f"model.layers.{layer}.{spec.hub_block_name}.experts.{expert}"
    return tuple(f"{prefix}.{p}.weight" for p in (spec.hub_gate, spec.hub_up, spec.hub_down))


def expert_hub_tensors(spec: MoESpec, layer: int, first_expert: int, gate_up: torch.Tensor, down: torch.Tensor) -> dict:
    """Per-expert hub tensors of experts first_expert.. from fused [El, 2I, H] / [El, H, I] blocks."""
    intermediate = down.shape[-1]
    out = {}
    for i in range(gate_up.shape[0]):
        gate, up, down_name = expert_hub_names(spec, layer, first_expert + i)
        out[gate] = gate_up[i, :intermediate].contiguous()
        out[up] = gate_up[i, intermediate:].contiguous()
        out[down_name] = down[i].contiguous()
    return out


def write_index(out_dir: str, weight_map: dict, total_size: int) -> None:
    with open(os.path.join(out_dir, INDEX_NAME), "w") as f:
        json.dump({"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)


def write_shards(out_dir: str, shards: list[dict]) -> None:
    """Write tensors as model-0000i-of-0000n.safetensors files plus the index."""
    weight_map, total = {}, 0
    for i, tensors in enumerate(shards):
        name = shard_file_name(i, len(shards))
        save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, os.path.join(out_dir, name), metadata={"format": "pt"})
        for key, value in tensors.items():
            weight_map[key] = name
            total += value.numel() * value.element_size()
    write_index(out_dir, weight_map, total)


def hub_state_dict(model: nn.Module) -> dict:
    """A single-process transformers MoE model's weights in hub layout (used to write test models)."""
    spec = spec_for(model.config)
    out = {}
    for name, value in model.state_dict().items():
        if f".{spec.block_attr}.{spec.experts_attr}." not in name:
            out[dense_hub_name(name, spec)] = value
    for index, layer in enumerate(decoder_layers(model)):
        experts = getattr(getattr(layer, spec.block_attr), spec.experts_attr)
        out.update(expert_hub_tensors(spec, index, 0, experts.gate_up_proj.data, experts.down_proj.data))
    return out


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def export_hf(
    model: nn.Module,
    mesh: MoEMesh,
    out_dir: str,
    *,
    config=None,
    tokenizer=None,
    dtype: torch.dtype | None = None,
) -> None:
    """Save a live expert-parallel (and possibly FSDP-sharded) model as a hub-layout HF checkpoint.

    Collective: every rank must call it. ``config`` defaults to ``model.config``; ``dtype`` casts
    the saved weights (default: as trained).
    """
    spec = spec_for(model.config)
    rank = dist.get_rank()
    tmp_dir = out_dir.rstrip("/") + ".tmp"
    if rank == 0:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        os.makedirs(tmp_dir)
    dist.barrier()
    n_files = 1 + mesh.ep_size
    cast = (lambda t: t.to(dtype)) if dtype is not None else (lambda t: t)

    # Dense weights: all ranks join each gather; rank 0 keeps them on CPU.
    experts = {id(p) for b in model.modules() if isinstance(b, ExpertParallelMoE) for p in b.experts.parameters()}
    dense = {}
    for name, p in model.named_parameters():
        if id(p) in experts:
            continue
        full = _full(p.detach())
        if rank == 0:
            dense[dense_hub_name(name, spec)] = cast(full).cpu()

    # Experts: each ep rank of dp replica 0 writes its own.
    layers = decoder_layers(model)
    local_experts = None
    expert_files = {}
    for index, layer in enumerate(layers):
        block = getattr(layer, spec.block_attr)
        if not isinstance(block, ExpertParallelMoE):
            continue
        local_experts = block.experts.num_local_experts
        for e in range(block.experts.num_experts):
            owner = e // local_experts
            expert_files.update({n: shard_file_name(1 + owner, n_files) for n in expert_hub_names(spec, index, e)})
    if mesh.dp_rank == 0:
        tensors = {}
        for index, layer in enumerate(layers):
            block = getattr(layer, spec.block_attr)
            if isinstance(block, ExpertParallelMoE):
                gate_up = block.experts.gate_up_proj.to_local().detach()
                down = block.experts.down_proj.to_local().detach()
                tensors.update(expert_hub_tensors(spec, index, mesh.ep_rank * local_experts, cast(gate_up).cpu(), cast(down).cpu()))
        save_file(tensors, os.path.join(tmp_dir, shard_file_name(1 + mesh.ep_rank, n_files)), metadata={"format": "pt"})

    if rank == 0:
        save_file({k: v.contiguous() for k, v in dense.items()}, os.path.join(tmp_dir, shard_file_name(0, n_files)), metadata={"format": "pt"})
        weight_map = {name: shard_file_name(0, n_files) for name in dense}
        weight_map.update(expert_files)
        element_size = torch.empty(0, dtype=dtype or next(iter(dense.values())).dtype).element_size()
        total = sum(v.numel() * v.element_size() for v in dense.values())
        total += _expert_numel(model, spec) * element_size
        write_index(tmp_dir, weight_map, total)
        (config or model.config).save_pretrained(tmp_dir)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp_dir)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(out_dir, ignore_errors=True)
        os.replace(tmp_dir, out_dir)
    dist.barrier()


def _expert_numel(model: nn.Module, spec: MoESpec) -> int:
    return sum(
        b.experts.gate_up_proj.numel() + b.experts.down_proj.numel()
        for b in model.modules()
        if isinstance(b, ExpertParallelMoE)
    )
