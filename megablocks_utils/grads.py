"""Gradients of the global mean loss across two meshes: expert sync and a true global norm clip.

Convention (the same as FSDP's): each rank's loss is ``world_size`` times its share of the global
mean, and FSDP averages dense gradients over all ranks. An expert's gradient after backward holds
only its own ep group's tokens, so it must be summed over the dp replicas and divided by
``world_size`` to match. Under FSDP2 (``parallelize``) the experts' reduce-scatter does that (its
divide factor is ``world_size``). ``sync_expert_grads`` does it by hand for the FSDP1 path, whose
experts stay whole and replicated over dp, once per optimizer step (summing is linear, so
accumulated micro-step gradients can be reduced together).
"""

from collections import defaultdict

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from .mesh import MoEMesh
from .shard import expert_parameters


def sync_expert_grads(model: nn.Module, mesh: MoEMesh) -> None:
    """Sum each expert gradient over its dp replicas and divide by world_size (experts not under FSDP)."""
    params = [p for p in expert_parameters(model) if p.grad is not None]
    if any(p.device_mesh.ndim > 1 for p in params):
        raise RuntimeError("these experts are under FSDP, whose reduce-scatter already averages their gradients; "
                           "sync_expert_grads is for experts that FSDP leaves alone (the FSDP1 path)")
    grads = [p.grad.to_local() for p in params]
    if not grads:
        return
    groups = mesh.expert_dp_groups()
    if groups:
        flat = torch.cat([g.reshape(-1) for g in grads])  # one collective instead of two per layer
        for group in groups:
            dist.all_reduce(flat, group=group)
        for g, reduced in zip(grads, torch.split(flat, [g.numel() for g in grads])):
            g.copy_(reduced.view_as(g))
    for g in grads:
        g.div_(mesh.world_size)


def _mesh_key(grad: torch.Tensor):
    if isinstance(grad, DTensor):
        return (id(grad.device_mesh), tuple(grad.placements))
    return None


def clip_grad_norm_(
    parameters, max_norm: float, foreach: bool | None = None, *, sharded_group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Clip all gradients by their true global 2-norm and return it (a plain tensor).

    ``torch.nn.utils.clip_grad_norm_`` cannot mix DTensors of different meshes (FSDP's 1-D mesh and
    the experts' (dp, ep) mesh). Here each group of gradients with the same mesh and placements gets
    its norm from ``get_total_norm`` (DTensor reduces it correctly over its own mesh), and the groups'
    norms are combined. Plain tensors are taken as replicated, unless ``sharded_group`` is given: then
    they are disjoint shards over that group (FSDP1's flat parameters, which are plain tensors) and
    their squared norms are summed over it. Collective: with ``sharded_group``, call it on every rank.
    """
    groups = defaultdict(list)
    if sharded_group is not None:
        groups[None] = []  # every rank joins the all-reduce below, even one without plain gradients
    for p in parameters:
        if p.grad is not None:
            groups[_mesh_key(p.grad)].append(p.grad)
    if not groups:
        return torch.tensor(0.0)
    norms = []
    for key, grads in groups.items():
        if grads:
            norm = torch.nn.utils.get_total_norm(grads, 2.0, foreach=foreach)
            norm = norm.full_tensor() if isinstance(norm, DTensor) else norm.to(torch.float32)
        else:
            norm = torch.zeros(())
        if key is None and sharded_group is not None:
            squared = norm.square().to(_collective_device(sharded_group))
            dist.all_reduce(squared, group=sharded_group)
            norm = squared.sqrt()
        norms.append(norm)
    device = norms[0].device
    total = torch.linalg.vector_norm(torch.stack([n.to(device, torch.float32) for n in norms]))
    if max_norm > 0:
        clip_coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for grads in groups.values():
            for g in grads:
                local = g.to_local() if isinstance(g, DTensor) else g
                local.mul_(clip_coef.to(local.device, local.dtype))
    return total


def _collective_device(group: dist.ProcessGroup) -> torch.device:
    """Where a tensor must be for a collective on ``group``: the current GPU for NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
