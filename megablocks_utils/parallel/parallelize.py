"""All parallelism of a model, applied in one place and in one order.

    mesh = build_mesh(ep_size, ..., shard_experts=..., dp_replicate=...)   # the script owns the mesh
    model, mesh = load_model(model_dir, mesh, ...)                        # 1. EP: each rank loads its experts
    parallelize(model, mesh, ...)                                         # 2-4

1. Expert parallelism: every MoE block becomes ``ExpertParallelMoE``, whose experts are DTensors
   sharded over ``mesh.ep`` (``shard_moe``; ``load_model`` does it while loading, so a rank reads only
   its own experts; ``parallelize`` does it for a model that is still a plain transformers model).
2. Activation checkpointing per decoder layer ("full" or "selective", on all layers or on a count of
   them; ``checkpointing.py``). It wraps the layer's forward, so it comes before FSDP's hooks and before
   compile.
3. compile: each layer's attention and norms (``compile_dense.py``), CUDA only.
4. FSDP2, inner modules first (not where it would shard over one rank and cast nothing, as on one rank
   whose parameters are already the compute dtype: FSDP would only copy every weight and gradient;
   ``needs_fsdp``, ``experts_need_fsdp``): each MoE block's experts over ``mesh.expert_fsdp`` (HSDP:
   replicated over "dp_replicate", sharded over "dp_shard"), then each decoder layer and the root
   over ``mesh.dense``. The experts' reduce-scatter divides by ``world_size`` (not by its dp size):
   an expert's gradient holds only its own ep group's tokens, and each rank's loss is
   ``world_size`` times its share of the global mean (``grads.py``). With ``fsdp_wrap`` "none" (ep = world size,
   weights in the compute dtype) the dense weights stay whole on every rank instead, their gradients averaged once a
   step by the script (``grads.average_replicated_grads``). Experts left out of FSDP (dp = 1: nothing
   to shard) get that division in the backward of the MoE layer's cast of their weights instead
   (``ExpertParallelExperts.grad_divisor``).

docs/parallelism.md says which mesh each parameter lives on and how each gradient is reduced.
"""

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard

from megablocks_utils.model.architectures import decoder_layers
from megablocks_utils.model.build import shard_moe
from megablocks_utils.model.lora import is_adapter_name
from megablocks_utils.moe.blocks import moe_blocks
from megablocks_utils.parallel.activation_checkpointing import (
    apply_activation_checkpointing,
)
from megablocks_utils.parallel.compile_dense import compile_dense_parts
from megablocks_utils.mesh import FSDP_WRAPS, MoEMesh


def parallelize(
    model: nn.Module,
    mesh: MoEMesh,
    *,
    param_dtype: torch.dtype = torch.bfloat16,
    activation_checkpointing: str = "none",
    activation_checkpointing_layers: int = -1,
    checkpoint_experts: bool = False,
    recompute_swiglu: bool = False,
    compile_dense: bool = False,
    fsdp: bool = True,
    reshard_after_forward: bool = True,
    fsdp_wrap: str = "layer",
    device: torch.device | str | None = None,
) -> int:
    """Apply EP (if not yet), activation checkpointing, compile and FSDP2 to ``model`` in place.

    ``param_dtype``: FSDP's compute dtype for all-gathered weights (gradients are reduced in fp32).
    ``activation_checkpointing_layers``: how many decoder layers ``activation_checkpointing`` applies to,
    spread evenly (-1: all). ``recompute_swiglu``: the experts make SwiGLU's output again in the backward.
    ``fsdp_wrap``: the FSDP units of the dense weights (``mesh.FSDP_WRAPS``).
    ``fsdp=False`` stops after compile (train_fsdp1.py: accelerate applies FSDP1 itself). FSDP leaves out what
    it would have nothing to do for: the whole model on one rank with ``param_dtype`` weights (``needs_fsdp``),
    the experts wherever dp = 1 (``experts_need_fsdp``). Returns the number
    of modules compiled (0 unless ``compile_dense`` on CUDA), for the script to print.
    """
    if not moe_blocks(model):  # 1. a plain transformers model: slice each rank's experts out of it
        shard_moe(model, mesh, device=device)
    apply_activation_checkpointing(model, activation_checkpointing, activation_checkpointing_layers, checkpoint_experts,  # 2.
                                   recompute_swiglu)
    compiled = 0
    if compile_dense and mesh.device_type == "cuda":  # 3.
        compiled = compile_dense_parts(model)
    if fsdp:  # 4.
        _apply_fsdp(model, mesh, param_dtype, reshard_after_forward, fsdp_wrap)
    return compiled




def needs_fsdp(model: nn.Module, mesh: MoEMesh, param_dtype: torch.dtype) -> bool:
    """False on one rank when every parameter is already ``param_dtype``: FSDP2 would shard over one rank and
    cast nothing, yet still copy each layer's weights into its all-gather buffer at every forward (and again
    in backward) and each gradient through its reduce buffer (measured on one H100 with gpt-oss's shape:
    ~0.15 s of a 0.95 s step). Without it, gradients accumulate over micro-steps in the parameters' own
    dtype (FSDP accumulates unsharded dense gradients in fp32): with bf16 parameters that is what plain
    transformers training does. With fp32 parameters and bf16 compute (``adamw_torch`` on a GPU) FSDP stays:
    its mixed precision is the cast. LoRA adapters do not count: they cast themselves (``model/lora.py``)."""
    return _fsdp_has_work(mesh.dense.size(), [p for n, p in model.named_parameters() if not is_adapter_name(n)], param_dtype)


def _fsdp_has_work(mesh_size: int, params, param_dtype: torch.dtype) -> bool:
    """FSDP over ``mesh_size`` ranks shards (more than one rank) or casts (a parameter not in ``param_dtype``)."""
    return mesh_size > 1 or any(p.dtype != param_dtype for p in params)


def fsdp_left_out(model: nn.Module, mesh: MoEMesh, param_dtype: torch.dtype) -> str:
    """What FSDP leaves alone here and why, for the script to print ("" when it manages everything)."""
    dtype = str(param_dtype).removeprefix("torch.")
    if not needs_fsdp(model, mesh, param_dtype):
        return f"one rank with {dtype} weights: FSDP not applied (nothing to shard or cast)"
    if moe_blocks(model) and not experts_need_fsdp(mesh):
        cast = "" if all(p.dtype == param_dtype for b in moe_blocks(model) for p in b.experts.parameters()) else f", the layer casts them to {dtype}"
        return f"dp = 1: the experts stay out of FSDP (nothing to shard{cast}; its backward divides their gradients)"
    return ""


def check_replicated_dense(model: nn.Module, mesh: MoEMesh, param_dtype: torch.dtype) -> None:
    """``fsdp_wrap`` "none" is for ep = world size with weights already in the compute dtype: FSDP would otherwise
    still shard the experts over dp, or be the only cast of fp32 weights to ``param_dtype``."""
    if mesh.expert_fsdp.size() > 1:
        raise ValueError(f"fsdp_wrap none needs ep = world size (here ep {mesh.ep_size} of {mesh.world_size} ranks: the "
                         "experts are sharded over dp by FSDP); use --fsdp_wrap auto, or --ep_size equal to the GPU count")
    wrong = sorted({str(p.dtype).removeprefix("torch.") for n, p in model.named_parameters()
                    if not is_adapter_name(n) and p.dtype != param_dtype})
    if wrong:
        raise ValueError(f"fsdp_wrap none keeps the weights as they are, but some are {', '.join(wrong)} and the compute dtype is "
                         f"{str(param_dtype).removeprefix('torch.')} (FSDP would cast them); use --optim adamw_bf16, or --fsdp_wrap auto")


def experts_need_fsdp(mesh: MoEMesh) -> bool:
    """False where the experts' FSDP mesh has one rank (dp = 1: ep = world size, or one GPU): there is nothing
    to shard, and FSDP would still copy each layer's experts into a one-rank all-gather (and cast them), twice
    per micro-step, and pass every gradient through a one-rank reduce and back (2 x H200, fp32 weights: ~12% of
    the step in copies). Left out, they are DTensors on the ep mesh alone; the layer casts fp32 weights to the
    compute dtype itself (``ExpertParallelExperts._local_weights``; that bf16 copy is kept for the backward of
    layers that are not checkpointed, as FSDP without resharding would), their gradients accumulate in place
    in the weights' dtype, divided by world size in the cast's backward as FSDP's reduce did (``grad_divisor``)."""
    return mesh.expert_fsdp.size() > 1


def _expert_shard_dim(param: nn.Parameter) -> Shard:
    # Dim 0 holds this rank's experts, often fewer than the dp ranks (1 at ep = 8 of 8 experts), so
    # FSDP splits each expert's rows instead (dim 1: 2I for gate_up, H for down), evenly.
    return Shard(1)


def _apply_fsdp(model: nn.Module, mesh: MoEMesh, param_dtype: torch.dtype, reshard_after_forward: bool, fsdp_wrap: str = "layer") -> None:
    if fsdp_wrap not in FSDP_WRAPS:
        raise ValueError(f"fsdp_wrap={fsdp_wrap!r}: choose one of {', '.join(FSDP_WRAPS)}")
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    # The experts' inputs include the fp32 router weights: FSDP must not cast them to bf16 (it casts a
    # module's forward inputs, but not again when activation checkpointing recomputes the layer).
    expert_mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)
    left_out = set()  # expert parameters FSDP does not manage (experts_need_fsdp)
    for block in moe_blocks(model):
        if not experts_need_fsdp(mesh):
            left_out.update(block.experts.parameters())
            block.experts.grad_divisor = mesh.world_size  # FSDP's division, in the cast's backward
            continue
        experts = fully_shard(
            block.experts, mesh=mesh.expert_fsdp, mp_policy=expert_mp_policy, reshard_after_forward=reshard_after_forward,
            shard_placement_fn=_expert_shard_dim,
        )
        experts.set_gradient_divide_factor(float(mesh.world_size))
        if mesh.device_type != "cuda" and mesh.expert_shard_size > 1:
            # gloo has no pre-multiplied sum (NCCL's way to divide by a custom factor): a plain sum,
            # then a division. Not with one shard: torch (2.13) then divides twice on that path.
            experts.set_force_sum_reduction_for_comms(True)
    if not needs_fsdp(model, mesh, param_dtype):
        return
    if fsdp_wrap == "none":  # replicated dense weights (mesh.FSDP_WRAPS); the script averages their gradients
        check_replicated_dense(model, mesh, param_dtype)
        return
    if fsdp_wrap == "model":  # one unit: gathered at the forward, kept through the backward (set_gradient_sync: the step)
        fully_shard(model, mesh=mesh.dense, mp_policy=mp_policy, reshard_after_forward=False, ignored_params=left_out or None)
        return
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh.dense, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward,
                    ignored_params=left_out & set(layer.parameters()) or None)
    fully_shard(model, mesh=mesh.dense, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward, ignored_params=left_out or None)


def set_gradient_sync(model: nn.Module, mesh: MoEMesh, last_micro_step: bool) -> None:
    """Before each micro-step's backward: when FSDP reduces gradients, and whether the root unit reshards after it.

    Dense gradients are reduced once per optimizer step, on the last micro-step (they wait unsharded in
    fp32 until then; dense layers are small). Expert gradients are reduced at every micro-step, except
    when that means an all-reduce over dp replicas (``shard_experts`` off): waiting would keep every
    layer's unsharded fp32 expert gradient alive across micro-steps, the very memory that sharding
    saves (measured on the full Mixtral: it does not fit 4 x H200 with it).

    The root unit (the model itself: embeddings and head, or every dense weight with ``fsdp_wrap`` "model") stays
    gathered from one micro-step's backward to the next one's forward and reshards after the step's last backward,
    with no more memory at the peak (which falls inside a micro-step). With "model" it is then gathered once a step
    instead of once a micro-step; with "layer" (whose root reshards after its forward, as asked of every unit) the
    later micro-steps skip its forward gather only.
    """
    experts = {id(block.experts) for block in moe_blocks(model)}
    experts_every_step = mesh.expert_shard_size > 1 or mesh.experts["dp_replicate"].size() == 1
    for module in model.modules():
        if isinstance(module, FSDPModule):
            every_step = id(module) in experts and experts_every_step
            module.set_requires_gradient_sync(last_micro_step or every_step, recurse=False)
            if module is model:
                module.set_reshard_after_backward(last_micro_step, recurse=False)
