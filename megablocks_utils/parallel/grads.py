"""Gradients of the global mean loss across two meshes: expert sync and a true global norm clip.

Convention (the same as FSDP's): each rank's loss is ``world_size`` times its share of the global
mean, and FSDP averages dense gradients over all ranks. An expert's gradient after backward holds
only its own ep group's tokens, so it must be summed over the dp replicas and divided by
``world_size`` to match. Under FSDP2 (``parallelize``) the experts' reduce-scatter does that (its
divide factor is ``world_size``). ``sync_expert_grads`` does it by hand for the FSDP1 path, whose
experts stay whole and replicated over dp, once per optimizer step (summing is linear, so
accumulated micro-step gradients can be reduced together).

The clip is two parts: ``grad_norm_and_clip_coef`` (the global norm and the factor that clips it) and the scaling,
which ``train.optim.clipped_step`` leaves to adamw_bf16's update where it can (one pass over the gradients fewer);
``clip_grad_norm_`` does both at once.
"""

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from megablocks_utils.moe.blocks import expert_parameters
from megablocks_utils.mesh import REPLICATED_BUCKET, MoEMesh


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
        _all_reduce_flat(grads, groups)  # one collective instead of two per layer
    for g in grads:
        g.div_(mesh.world_size)


def _all_reduce_flat(grads: list[torch.Tensor], groups, dtype: torch.dtype | None = None, divisor: int = 1) -> None:
    """Sum ``grads`` over each of ``groups`` in turn as one flat tensor (in ``dtype``, default theirs), divide by
    ``divisor`` and write the result back in place."""
    flat = torch.cat([g.reshape(-1).to(dtype or g.dtype) for g in grads])
    for group in groups:
        dist.all_reduce(flat, group=group)
    if divisor != 1:
        flat.div_(divisor)
    for g, reduced in zip(grads, torch.split(flat, [g.numel() for g in grads])):
        g.copy_(reduced.view_as(g))


def average_replicated_grads(parameters, group: dist.ProcessGroup | None = None, touched=None) -> None:
    """Average the gradients of weights every rank holds whole (plain tensors, not DTensors: the dense weights with
    ``fsdp_wrap`` "none") over ``group`` (all ranks), once a step after the last micro-step: what FSDP's reduce does
    for them otherwise (each rank's loss is world_size x its share of the global mean). Summed in fp32 whatever the
    gradients' dtype, as FSDP reduces, a bucket of up to ``REPLICATED_BUCKET`` elements per collective. ``touched``
    (``embedding_rows.TouchedRows``): the input embedding's gradient over the rows the step's tokens touched only.
    Collective."""
    world_size = dist.get_world_size(group)
    skip = None
    if touched is not None and world_size > 1:
        touched.average(group, world_size)
        skip = touched.weight
    grads = [p.grad for p in parameters if p.grad is not None and not isinstance(p.grad, DTensor) and p is not skip]
    if world_size == 1 or not grads:
        return
    bucket, size = [], 0
    for g in grads:
        if bucket and size + g.numel() > REPLICATED_BUCKET:
            _all_reduce_flat(bucket, [group], torch.float32, world_size)
            bucket, size = [], 0
        bucket.append(g)
        size += g.numel()
    _all_reduce_flat(bucket, [group], torch.float32, world_size)


def _copies_in_world(grad: torch.Tensor, world_size: int, sharded_group: dist.ProcessGroup | None) -> float:
    """How many ranks hold each element of ``grad``'s local shard (its replication over the world)."""
    if isinstance(grad, DTensor):
        mesh = grad.device_mesh
        shards = math.prod(mesh.size(i) for i, placement in enumerate(grad.placements) if placement.is_shard())
        return world_size / shards
    if sharded_group is not None:
        return world_size / sharded_group.size()
    return float(world_size)


# Gradients of at least this many elements on a GPU get their sum of squares from sum_squares_kernel.py.
LARGE_GRADIENT = 1 << 22


def grad_norm_and_clip_coef(
    parameters, max_norm: float, *, sharded_group: dist.ProcessGroup | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The true global 2-norm of all gradients and the clip's coefficient, without touching the gradients.

    Returns ``(norm, coef)``, 0-dim fp32 tensors on the device of the collective (nothing is read on the host):
    ``coef = min(1, max_norm / (norm + 1e-6))``, the factor that brings the norm to ``max_norm``, or None when
    ``max_norm`` <= 0 (no clipping). Apart so that an optimizer can apply ``coef`` as it reads each gradient
    (``clipped_step``) instead of a pass of its own over all of them; ``clip_grad_norm_`` applies it at once.

    ``torch.nn.utils.clip_grad_norm_`` cannot mix DTensors of different meshes (FSDP's dense mesh and
    the experts' mesh). Here each rank squares the norm of its local shards, each divided by the
    number of ranks that hold the same elements (a DTensor's replicated mesh dims, and the ranks
    outside its mesh: an ep-only expert is the same on every dp replica), and one all-reduce over
    all ranks sums them. Plain tensors are taken as replicated on every rank, unless
    ``sharded_group`` is given: then they are disjoint shards over that group (FSDP1's flat
    parameters). Norms are taken in fp32 whatever the gradient dtype. Collective: call it on every rank.
    """
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    grads = [p.grad for p in parameters if p.grad is not None]
    device = _collective_device(dist.group.WORLD) if world_size > 1 else (grads[0].device if grads else torch.device("cpu"))
    # Local shards grouped by (replication, device, dtype): one multi-tensor launch per group, not a few small kernels
    # per tensor (135 tensors of a 12-layer Qwen3 shape: 23 ms of host time and 26 ms of GPU time per step that way).
    groups: dict[tuple, list[torch.Tensor]] = {}
    for g in grads:
        local = g.to_local() if isinstance(g, DTensor) else g
        if local.numel():
            groups.setdefault((_copies_in_world(g, world_size, sharded_group), local.device, local.dtype), []).append(local)
    squared = torch.zeros((), dtype=torch.float32, device=device)
    for (copies, _, _), tensors in groups.items():
        # Large CUDA gradients (the experts'): a Triton reduction each, at twice _foreach_norm's bandwidth
        # (sum_squares_kernel.py); the many small ones in one multi-tensor launch.
        large = [t for t in tensors if t.is_cuda and t.numel() >= LARGE_GRADIENT and t.is_contiguous()]
        if large:
            from megablocks_utils.parallel.sum_squares_kernel import sum_of_squares  # Triton: imported where a GPU runs it

            squared = squared + sum_of_squares(large).to(device) / copies
            taken = {id(t) for t in large}
            tensors = [t for t in tensors if id(t) not in taken]
        if tensors:
            # torch._foreach_norm: the multi-tensor norm torch's own clip_grad_norm_ uses; its dtype argument (fp32
            # whatever the gradients' dtype) has no public equivalent (torch.nn.utils.get_total_norm returns the
            # gradients' dtype).
            norms = torch._foreach_norm(tensors, 2.0, dtype=torch.float32)
            squared = squared + torch.stack(norms).square().sum().to(device) / copies
    if world_size > 1:
        dist.all_reduce(squared)
    total = squared.sqrt()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0) if max_norm > 0 else None
    return total, coef


def scale_grads_(parameters, coef: torch.Tensor) -> None:
    """Multiply every gradient by ``coef`` in place, in the gradient's dtype (``coef`` cast to it first, as torch's
    clip does), on the local shards: one multi-tensor launch per device and dtype."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for p in parameters:
        if p.grad is not None:
            local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            if local.numel():
                groups.setdefault((local.device, local.dtype), []).append(local)
    for (device, dtype), tensors in groups.items():
        # torch._foreach_mul_ with a tensor scale: what torch.nn.utils.clip_grads_with_norm_ runs, on the local shards
        # (that public function takes parameters, and one foreach call cannot mix DTensors of two meshes).
        torch._foreach_mul_(tensors, coef.to(device, dtype))


def clip_grad_norm_(
    parameters, max_norm: float, foreach: bool | None = None, *, sharded_group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Clip all gradients by their true global 2-norm and return it (a plain fp32 tensor, before clipping).

    ``grad_norm_and_clip_coef`` (the norm over both meshes; ``sharded_group`` is its), then ``scale_grads_``.
    Collective: call it on every rank. ``foreach`` is accepted for torch's signature and not used.
    """
    parameters = list(parameters)
    total, coef = grad_norm_and_clip_coef(parameters, max_norm, sharded_group=sharded_group)
    if coef is not None:
        scale_grads_(parameters, coef)
    return total


def _collective_device(group: dist.ProcessGroup) -> torch.device:
    """Where a tensor must be for a collective on ``group``: the current GPU for NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
