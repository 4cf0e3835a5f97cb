"""The (dp x ep) device mesh, described once; every other piece asks it for sizes and groups.

Every rank reads its own slice of the data. Dense parameters are sharded by FSDP over all ranks
(the 1-D ``world`` mesh). Expert weights are split over ``ep`` (each rank of an ep group owns
``num_experts / ep`` whole experts) and replicated over ``dp``.
"""

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .inputs import check_ep_size


@dataclass
class MoEMesh:
    """The 2-D ("dp", "ep") mesh for experts and the 1-D "world" mesh FSDP shards dense weights over."""

    mesh: DeviceMesh  # 2-D, dims ("dp", "ep")
    world: DeviceMesh  # 1-D, dim ("fsdp",), all ranks

    @property
    def dp_size(self) -> int:
        return self.mesh["dp"].size()

    @property
    def ep_size(self) -> int:
        return self.mesh["ep"].size()

    @property
    def world_size(self) -> int:
        return self.world.size()

    @property
    def ep_rank(self) -> int:
        return self.mesh["ep"].get_local_rank()

    @property
    def dp_rank(self) -> int:
        return self.mesh["dp"].get_local_rank()

    @property
    def ep_group(self) -> dist.ProcessGroup:
        return self.mesh["ep"].get_group()

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self.mesh["dp"].get_group()

    @property
    def device_type(self) -> str:
        return self.mesh.device_type


def build_mesh(
    ep_size: int,
    device_type: str | None = None,
    num_experts: int | None = None,
    experts_name: str = "num_local_experts",
    timeout: timedelta | None = None,
) -> MoEMesh:
    """Build the meshes on an initialised process group; ``dp = world_size // ep_size``.

    ``timeout`` bounds every collective on the mesh's groups. Pass the one the process group was
    started with: a group torch creates for a mesh dimension gets the backend's default timeout
    (30 min on gloo, 10 on NCCL), not the process group's. Without it the groups are torch's.
    """
    if not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialised: launch with torchrun (or call "
            "torch.distributed.init_process_group) before shard_moe"
        )
    world_size = dist.get_world_size()
    ep_size = check_ep_size(ep_size, world_size, num_experts, experts_name)  # 0: all ranks
    if device_type is None:
        device_type = "cuda" if dist.get_backend() == "nccl" and torch.cuda.is_available() else "cpu"
    shape = (world_size // ep_size, ep_size)
    if timeout is None:
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=("dp", "ep"))
    else:
        grid = torch.arange(world_size).view(shape)  # rank = dp_rank * ep_size + ep_rank, as init_device_mesh lays it out
        groups = [_own_group(grid.T.tolist(), timeout), _own_group(grid.tolist(), timeout)]  # dp: a column, ep: a row
        mesh = DeviceMesh.from_group(groups, device_type, mesh=grid, mesh_dim_names=("dp", "ep"))
    world = init_device_mesh(device_type, (world_size,), mesh_dim_names=("fsdp",))  # the default group
    return MoEMesh(mesh=mesh, world=world)


def _own_group(rank_lists: list[list[int]], timeout: timedelta) -> dist.ProcessGroup:
    """This rank's group among ``rank_lists`` (every rank creates all of them, as ``new_group`` requires)."""
    if len(rank_lists[0]) == dist.get_world_size():
        return dist.group.WORLD  # no second communicator over all ranks; it has the process group's timeout
    group, _ = dist.new_subgroups_by_enumeration(rank_lists, timeout=timeout)
    return group
