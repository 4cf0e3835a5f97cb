"""FSDP1 through HF Trainer and accelerate, with the experts left to expert parallelism.

accelerate wraps the model in FSDP1 from the plugin that ``accelerate launch --config_file
accelerate.yaml`` describes; the expert modules go to it as ``ignored_modules``, so FSDP1 flattens
and shards every dense weight and never touches the expert DTensors. What FSDP1 and accelerate
do not do for such a model lives here:

- ``fsdp_on_cpu``: accelerate only selects FSDP on GPU-like devices. On a CPU-only machine it falls
  back to no distribution at all (every rank trains alone), although torch's FSDP1 runs on CPU with gloo.
- ``grad_shard_group``: FSDP1's flat gradients are plain tensors, each rank holding a disjoint shard;
  ``clip_grad_norm_`` needs the group they are sharded over to compute the true global norm.
- ``init_optimizer_state``: accelerate resumes an FSDP1 optimizer by loading the checkpoint into the
  template ``FSDP.optim_state_dict`` returns, which is empty until the optimizer's first step, so
  nothing would be loaded (accelerate 1.15, any FSDP1 model with a sharded state dict).
- ``export_hf_fsdp1``: ``export_hf`` reads full dense tensors, which FSDP1 provides inside
  ``summon_full_params``.
- ``sharding_facts`` and ``weight_checksums``: what shows the sharding is real, for the run's summary.
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import ShardingStrategy
from torch.distributed.tensor import DTensor

from megablocks_utils.config.inputs import fsdp_requested
from megablocks_utils.model.export import export_hf
from megablocks_utils.mesh import MoEMesh


def fsdp_on_cpu(accelerator) -> bool:
    """Put accelerate's shared state on its FSDP path on a CPU-only machine; return whether it did.

    accelerate 1.15 turns an FSDP config into ``DistributedType.FSDP`` only on GPU-like devices; on
    CPU the processes come up as ``MULTI_CPU`` (with ``use_cpu``, over gloo) and the model would be
    wrapped in DDP, which cannot hold the expert DTensors. torch's FSDP1 itself runs on CPU with gloo,
    so we set the public fields accelerate sets on a GPU machine: ``distributed_type`` (of the
    accelerator's and of the process's state) and ``fsdp_plugin``, read from the same ``FSDP_*``
    variables accelerate.yaml produced. From then on accelerate and the Trainer take their GPU FSDP1
    code paths unchanged (wrapping, ``no_sync``, sharded checkpoints). Call it right after the
    Accelerator is created, before anything is prepared.
    """
    from accelerate import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    state = accelerator.state
    if not fsdp_requested() or state.distributed_type == DistributedType.FSDP:
        return False
    if state.distributed_type != DistributedType.MULTI_CPU:
        raise RuntimeError(
            f"accelerate set up {state.distributed_type} although accelerate.yaml asks for FSDP; on a machine "
            "without GPUs pass --use_cpu true so the processes join one gloo process group"
        )
    if state.mixed_precision == "fp16":
        raise RuntimeError("fp16 is not supported on CPU; use --bf16 true or full precision")
    plugin = FullyShardedDataParallelPlugin()
    if plugin.fsdp_version != 1:
        raise RuntimeError(f"accelerate.yaml asks for FSDP{plugin.fsdp_version}; this script runs FSDP1 (fsdp_version: 1)")
    if state.mixed_precision != "no":
        plugin.set_mixed_precision(state.mixed_precision)
    state.fsdp_plugin = plugin
    state.distributed_type = DistributedType.FSDP
    PartialState().distributed_type = DistributedType.FSDP  # as accelerate does at the end of AcceleratorState.__init__
    return True


def _root(model: nn.Module) -> FSDP:
    if isinstance(model, FSDP):
        return model
    wrapped = FSDP.fsdp_modules(model)  # outermost first
    if not wrapped:
        raise ValueError("the model is not wrapped in FSDP1; prepare it with accelerate (or FSDP) first")
    return wrapped[0]


def grad_shard_group(model: nn.Module) -> dist.ProcessGroup | None:
    """The process group FSDP1 shards the dense (plain tensor) gradients over; None when it keeps them whole."""
    root = _root(model)
    return None if root.sharding_strategy == ShardingStrategy.NO_SHARD else root.process_group


def sharding_facts(model: nn.Module) -> dict:
    """What FSDP1 did on this rank: how many modules it wrapped and how many dense values this rank holds."""
    return {
        "fsdp_wrapped_modules": len(FSDP.fsdp_modules(_root(model))),
        "dense_numel_local": sum(p.numel() for p in model.parameters() if not isinstance(p, DTensor)),
    }


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create an optimizer's lazy state (Adam's step, exp_avg, exp_avg_sq) with one step that changes nothing.

    Zero gradients and a learning rate of 0 leave every weight as it is (decoupled weight decay is
    scaled by the learning rate too); the state's values are then replaced by a checkpoint's.
    """
    if optimizer.state:
        return
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    lrs = [group["lr"] for group in optimizer.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p)
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    for p in params:
        p.grad = None


def weight_checksums(model: nn.Module, mesh: MoEMesh) -> dict:
    """Each rank's checksum of the full dense weights and of its local experts, gathered on every rank.

    Ranks that train together agree: the same dense checksum everywhere, the same expert checksum on
    the dp replicas of one ep rank. Ranks that each trained alone would not.
    """
    dense = torch.zeros((), dtype=torch.float64)
    with FSDP.summon_full_params(model, writeback=False, offload_to_cpu=torch.cuda.is_available()):
        for p in model.parameters():
            if not isinstance(p, DTensor):
                dense += p.detach().double().sum().cpu() + p.detach().double().square().sum().cpu()
    experts = sum(float(p.detach().to_local().double().square().sum()) for p in model.parameters() if isinstance(p, DTensor))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (float(dense), experts, mesh.ep_rank))
    return {
        "dense_checksum": [g[0] for g in gathered],
        "expert_checksum": [g[1] for g in gathered],
        "ep_rank": [g[2] for g in gathered],
    }


def export_hf_fsdp1(model: nn.Module, mesh: MoEMesh, out_dir: str, **kwargs) -> None:
    """``export_hf`` for an FSDP1-wrapped model: dense weights gathered whole (to CPU, on rank 0 only)."""
    with FSDP.summon_full_params(model, writeback=False, rank0_only=True, offload_to_cpu=torch.cuda.is_available()):
        export_hf(model, mesh, out_dir, **kwargs)
