"""The device meshes, described once; every other piece asks them for sizes and groups.

World W = dp x ep ranks, rank = ((replica * S) + shard) * ep + ep_rank, so an ep group is a run of
neighbouring ranks (inside one node) and a node holds whole ep groups.

- ``experts``: 3-D ("dp_replicate", "dp_shard", "ep"). Each rank of an ep group owns
  ``num_experts / ep`` whole experts (DTensors on ``experts["ep"]``, Shard(0)). FSDP2 shards them
  further over "dp_shard" and replicates them over "dp_replicate" (HSDP). With ``shard_experts``
  the shape is (R, dp / R, ep): every expert's weights, gradients and optimizer state exist once
  per replica, so their memory falls as 1 / world_size. Without it the shape is (dp, 1, ep): the
  experts are replicated over dp, as before this option existed.
- ``dense``: FSDP2's mesh for every other weight: 1-D over all ranks, or 2-D ("dp_replicate",
  "dp_shard") = (R, W / R) with HSDP, so the per-layer all-gathers stay inside a node.
- ``world``: 1-D, all ranks (the loss, router statistics and metrics are reduced over it).

``check_ep_size`` and ``check_dp_replicate`` hold the degrees against the world size; the scripts call them
before the process group starts, ``build_mesh`` again on it.

docs/parallelism.md draws these meshes and says how each gradient is reduced.
"""

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from megablocks_utils.errors import InputError


# The FSDP units of the dense weights (parallelize builds them; the fit check and the settings read them here).
# "layer": each decoder layer one unit, gathered before its forward and again before its backward (one layer's weights
# unsharded at a time, the least memory). "model": the whole model one unit,
# gathered at a step's first forward and kept unsharded until its last backward: all dense weights in bf16 at once, but no
# per-layer FSDP hooks, which on the host cost ~1.5 ms a layer forward and ~1.2 ms backward at ep 2 (2 x H200,
# Qwen3-30B-A3B's shape, where the host paces the step: bench/trace_gaps.py, bench/reports/ep2_host_h200x2_2026-11-27.md).
# "none": no FSDP on the dense weights: every rank holds them whole in the compute dtype (--optim adamw_bf16) and their
# gradients are averaged over the ranks once a step (``grads.average_replicated_grads``); only where ep = world size
# (the experts then stay out of FSDP too). Nothing of FSDP runs inside a micro-step, so it can be a CUDA graph
# (train/cuda_graph.py); it costs the dense weights' full size, gradients and optimizer state on every rank.
FSDP_WRAPS = ("layer", "model", "none")
# Elements per collective of ``grads.average_replicated_grads`` ("none"): its fp32 staging buffer is at most 256 MiB.
REPLICATED_BUCKET = 1 << 26
FSDP_UNITS_TEXT = {"layer": "each layer", "model": "the whole model", "none": "none, dense weights whole on every rank"}


@dataclass
class MoEMesh:
    experts: DeviceMesh  # 3-D ("dp_replicate", "dp_shard", "ep")
    dense: DeviceMesh  # 1-D ("dp_shard",) or 2-D ("dp_replicate", "dp_shard") with HSDP
    world: DeviceMesh  # 1-D ("world",), all ranks
    shard_experts: bool  # experts FSDP-sharded over dp (else replicated over dp)
    dp_replicate: int  # HSDP replicas (1: plain FSDP)

    @property
    def ep(self) -> DeviceMesh:
        """The 1-D mesh the expert DTensors are sharded over (one expert block per ep rank)."""
        return self.experts["ep"]

    @property
    def expert_fsdp(self) -> DeviceMesh:
        """FSDP2's mesh for the experts: 2-D (replicate, shard), so fully_shard runs HSDP on it."""
        return self.experts["dp_replicate", "dp_shard"]

    @property
    def ep_size(self) -> int:
        return self.experts["ep"].size()

    @property
    def dp_size(self) -> int:
        return self.world_size // self.ep_size

    @property
    def expert_shard_size(self) -> int:
        """Ranks one expert's weights are split over (1: each ep rank holds its experts whole)."""
        return self.experts["dp_shard"].size()

    @property
    def world_size(self) -> int:
        return self.world.size()

    @property
    def ep_rank(self) -> int:
        return self.experts["ep"].get_local_rank()

    @property
    def dp_rank(self) -> int:
        return self.experts["dp_replicate"].get_local_rank() * self.expert_shard_size + self.experts["dp_shard"].get_local_rank()

    @property
    def ep_group(self) -> dist.ProcessGroup:
        return self.experts["ep"].get_group()

    def expert_dp_groups(self) -> list[dist.ProcessGroup]:
        """The groups that together span one ep rank's dp replicas (for a hand-written gradient sum)."""
        return [self.experts[name].get_group() for name in ("dp_replicate", "dp_shard") if self.experts[name].size() > 1]

    @property
    def device_type(self) -> str:
        return self.world.device_type


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_ep_size(ep_size: int, world_size: int, num_experts: int | None = None, experts_name: str = "num_local_experts") -> int:
    """The expert-parallel degree (``ep_size``, 0 = all ranks), or an InputError naming the valid choices."""
    if ep_size < 0:
        raise InputError(f"ep_size={ep_size} is negative; use 0 (all {world_size} processes) or one of {divisors(world_size)}")
    ep = ep_size or world_size
    given = f"ep_size={ep}" if ep_size else f"ep_size=0 (all {world_size} processes)"
    if world_size % ep != 0:
        raise InputError(
            f"world_size={world_size} is not divisible by {given}; choose ep_size in {divisors(world_size)} "
            f"for {world_size} processes, or launch a multiple of {ep} processes"
        )
    if num_experts is not None and num_experts % ep != 0:
        valid = [d for d in divisors(num_experts) if world_size % d == 0]
        raise InputError(
            f"{experts_name}={num_experts} is not divisible by {given}; choose ep_size in {valid} "
            f"(each rank holds whole experts, and ep_size must divide the {world_size} processes too)"
        )
    return ep


def check_dp_replicate(dp_replicate: int, dp: int, ep: int) -> int:
    """The HSDP replica count, or an InputError naming the valid choices (it must divide dp = world / ep)."""
    if dp_replicate < 1 or dp % dp_replicate != 0:
        raise InputError(
            f"dp_replicate={dp_replicate} must divide dp={dp} (world_size / ep_size={ep}); choose one of "
            f"{divisors(dp)} (usually the number of nodes, so FSDP's all-gathers stay inside a node)"
        )
    return dp_replicate


def build_mesh(
    ep_size: int,
    device_type: str | None = None,
    num_experts: int | None = None,
    experts_name: str = "num_local_experts",
    timeout: timedelta | None = None,
    *,
    shard_experts: bool = True,
    dp_replicate: int = 1,
) -> MoEMesh:
    """Build the meshes on an initialised process group; ``dp = world_size // ep_size``.

    ``dp_replicate`` (HSDP): replicas of the FSDP shards; it must divide dp (a node should hold
    ``world_size / dp_replicate`` ranks). ``timeout`` bounds every collective on the meshes' groups.
    Pass the one the process group was started with: a group torch creates for a mesh dimension
    gets the backend's default timeout (30 min on gloo, 10 on NCCL), not the process group's.
    """
    if not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialised: launch with torchrun (or call "
            "torch.distributed.init_process_group) before building the mesh"
        )
    world_size = dist.get_world_size()
    ep_size = check_ep_size(ep_size, world_size, num_experts, experts_name)  # 0: all ranks
    dp = world_size // ep_size
    dp_replicate = check_dp_replicate(dp_replicate, dp, ep_size)
    if device_type is None:
        device_type = "cuda" if dist.get_backend() == "nccl" and torch.cuda.is_available() else "cpu"
    expert_shape = (dp_replicate, dp // dp_replicate, ep_size) if shard_experts else (dp, 1, ep_size)
    experts = _mesh(device_type, expert_shape, ("dp_replicate", "dp_shard", "ep"), timeout)
    world = _mesh(device_type, (world_size,), ("world",), timeout)
    if dp_replicate == 1:
        dense = world
    else:
        dense = _mesh(device_type, (dp_replicate, world_size // dp_replicate), ("dp_replicate", "dp_shard"), timeout)
    return MoEMesh(experts=experts, dense=dense, world=world, shard_experts=shard_experts, dp_replicate=dp_replicate)


def _mesh(device_type: str, shape: tuple[int, ...], names: tuple[str, ...], timeout: timedelta | None) -> DeviceMesh:
    if timeout is None:
        return init_device_mesh(device_type, shape, mesh_dim_names=names)
    grid = torch.arange(dist.get_world_size()).view(shape)  # row-major, as init_device_mesh lays ranks out
    groups = [_own_group(grid.movedim(d, -1).reshape(-1, shape[d]).tolist(), timeout) for d in range(len(shape))]
    return DeviceMesh.from_group(groups, device_type, mesh=grid, mesh_dim_names=names)


def _own_group(rank_lists: list[list[int]], timeout: timedelta) -> dist.ProcessGroup:
    """This rank's group among ``rank_lists`` (every rank creates all of them, as ``new_group`` requires)."""
    if len(rank_lists[0]) == dist.get_world_size():
        return dist.group.WORLD  # no second communicator over all ranks; it has the process group's timeout
    group, _ = dist.new_subgroups_by_enumeration(rank_lists, timeout=timeout)
    return group
