"""Writing a model in Hugging Face hub layout (one tensor per expert).

The hub layout is the model's own format (``model/loading`` reads it, by the model table's names), so its writer
lives in ``model/`` beside the reader, where ``model/tiny``, ``parallel/fsdp1`` and the scripts take it from.
A training checkpoint is turned into this layout by ``train/checkpoint_export``, beside the checkpoint's own
module (``train/checkpoint``), with the writers here.

``export_hf`` writes without gathering experts: each ep rank of the first dp replica writes its own experts
(gathered over dp where FSDP shards them) to its own safetensors file (a model whose hub layout stacks a layer's
experts in one tensor, Granite, gathers one layer at a time to rank 0 instead); rank 0 writes the dense weights
(gathered from FSDP one tensor at a time), the index, the config and the tokenizer. The directory appears under
its final name only when every file is written.
"""

import json
import os
import shutil

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn
from torch.distributed.tensor import DTensor

from megablocks_utils.model.architectures import MoESpec, decoder_layers, spec_for
from megablocks_utils.model.build import local_expert_weights
from megablocks_utils.moe.layer import ExpertParallelMoE
from megablocks_utils.mesh import MoEMesh

INDEX_NAME = "model.safetensors.index.json"


def shard_file_name(i: int, n: int) -> str:
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def dense_hub_name(name: str, spec: MoESpec) -> str:
    """transformers 5 dense name -> hub name (only the router moves)."""
    return spec.model_to_hub(name)


def expert_hub_names(spec: MoESpec, layer: int, expert: int) -> tuple[str, str, str]:
    """Hub names of one expert's (gate, up, down) projections."""
    return spec.hub_expert_names(layer, expert)


def expert_hub_tensors(
    spec: MoESpec, layer: int, first_expert: int, gate_up: torch.Tensor, down: torch.Tensor, *biases: torch.Tensor
) -> dict:
    """Hub tensors of experts first_expert.. from fused [El, 2I, H] / [El, H, I] blocks (and the expert
    biases [El, 2I] / [El, H] where the row has them, ``expert_tensors()`` order).

    A stacked hub layout (Granite, gpt-oss) keeps the blocks as they are, so they must hold all the layer's experts.
    """
    if spec.hub_stacked is not None:
        if first_expert != 0:
            raise ValueError(f"{spec.model_type} stores each layer's experts in one tensor; pass all of them")
        gate_up_name, down_name = spec.hub_stacked_names(layer)
        out = {gate_up_name: gate_up.contiguous(), down_name: down.contiguous()}
        if spec.expert_bias:  # gpt-oss's hub layout is transformers' fused one, biases under their fused names
            out.update({name: b.contiguous() for name, b in zip(spec.fused_bias_names(layer), biases, strict=True)})
        return out
    if biases:
        raise ValueError(f"{spec.model_type}: expert biases in a per-expert hub layout are not supported")
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
        experts = getattr(getattr(layer, spec.block_attr), spec.experts_attr, None)
        if experts is None:  # a dense layer between MoE layers (Qwen2-MoE's mlp_only_layers)
            continue
        tensors = [experts.gate_up_proj, experts.down_proj]
        if spec.expert_bias:
            tensors += [experts.gate_up_proj_bias, experts.down_proj_bias]
        out.update(expert_hub_tensors(spec, index, 0, *(t.data for t in tensors)))
    return out


def is_score_bias(name: str, spec: MoESpec) -> bool:
    """Whether ``name`` is a router's own selection bias (DeepSeek-V3), which the hub layout keeps in fp32."""
    return spec.score_bias is not None and name.endswith(f".{spec.block_attr}.{spec.router_attr}.{spec.score_bias}")


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
    n_files = 2 if spec.hub_stacked is not None else 1 + mesh.ep_size
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
    if rank == 0:  # the routers' own selection bias (DeepSeek-V3), kept in fp32 as transformers keeps it;
        # a bias our balancing added to another model (TopKRouter.ADDED_BIAS) has no place in its checkpoint
        dense.update({name: _full(b.detach()).float().cpu() for name, b in model.named_buffers() if is_score_bias(name, spec)})

    layers = decoder_layers(model)
    if spec.hub_stacked is not None:
        expert_files = _write_stacked_experts(layers, spec, rank, tmp_dir, n_files, cast)
    else:
        expert_files = _write_local_experts(layers, spec, mesh, tmp_dir, n_files, cast)

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


def _write_stacked_experts(layers, spec: MoESpec, rank: int, tmp_dir: str, n_files: int, cast) -> dict:
    """Stacked hub layout (Granite): a layer's experts are one tensor, which cannot be split over
    files, so all ranks join the gather of one layer at a time and rank 0 writes them all."""
    tensors = {}
    for index, layer in enumerate(layers):
        block = getattr(layer, spec.block_attr)
        if isinstance(block, ExpertParallelMoE):
            full = [t.detach().full_tensor() for t in block.experts.expert_tensors()]
            if rank == 0:
                tensors.update(expert_hub_tensors(spec, index, 0, *(cast(t).cpu() for t in full)))
    if rank != 0:
        return {}
    save_file(tensors, os.path.join(tmp_dir, shard_file_name(1, n_files)), metadata={"format": "pt"})
    return {n: shard_file_name(1, n_files) for n in tensors}


def _write_local_experts(layers, spec: MoESpec, mesh: MoEMesh, tmp_dir: str, n_files: int, cast) -> dict:
    """Each ep rank of dp replica 0 writes its own experts (per-expert hub layout); returns the weight map."""
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
    tensors = {}
    for index, layer in enumerate(layers):
        block = getattr(layer, spec.block_attr)
        if isinstance(block, ExpertParallelMoE):
            local = local_expert_weights(block.experts)  # every rank joins a gather over dp
            if mesh.dp_rank == 0:
                tensors.update(expert_hub_tensors(spec, index, mesh.ep_rank * local_experts, *(cast(t).cpu() for t in local)))
    if mesh.dp_rank == 0:
        save_file(tensors, os.path.join(tmp_dir, shard_file_name(1 + mesh.ep_rank, n_files)), metadata={"format": "pt"})
    return expert_files


def _expert_numel(model: nn.Module, spec: MoESpec) -> int:
    return sum(t.numel() for b in model.modules() if isinstance(b, ExpertParallelMoE) for t in b.experts.expert_tensors())
