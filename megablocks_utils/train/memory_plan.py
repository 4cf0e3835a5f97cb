"""Will a training plan fit in GPU memory? An estimate from config.json alone, before any weight is loaded.

Both scripts call ``memory_fit.check_fit`` before any weight is read, and ``python -m megablocks_utils.tools.memory``
prints the same estimate. This module adds one training step's memory up (``estimate_memory``): the parameters' and the
optimizer's bytes (``memory_counts``), the activations and the loss (``memory_activations``), the gathered and
accumulated gradients. Whether it fits, and what would, is ``memory_fit``'s. The layout it models and how the terms add
up to the peak, per GPU (docs/memory.md):

    params + optimizer state + gathered weights + gathered grads + max(grads, activations + logits + accumulated grads) + overhead

(sharded gradients are made layer by layer as that layer's activations are freed, so the peak holds the larger of the
two; experts' gradients reduced at every micro-step exist beside the next micro-step's activations, so they add).
"""

import os
from dataclasses import dataclass

from megablocks_utils.config.inputs import resolve_shard_experts
from megablocks_utils.errors import InputError
from megablocks_utils.model.loading import load_config
from megablocks_utils.model.lora import DEFAULT_TARGETS
from megablocks_utils.model.quantized_base import released_format
from megablocks_utils.mesh import FSDP_WRAPS, REPLICATED_BUCKET, check_ep_size
from megablocks_utils.train.memory_activations import (
    activation_bytes,
    check_checkpointed_layers,
    adapter_activation_bytes,
    checkpointing_mode,
    logits_bytes,
    received_rows,
    swiglu_made_again,
    uncheckpointed_moe_layers,
)
from megablocks_utils.train.memory_counts import (
    ACCUMULATED_GRAD_BYTES,
    COMPUTE_BYTES,
    GATHERED_LAYERS,
    OPTIM_BYTES,
    UNSHARDED_GRAD_BYTES,
    GiB,
    ParamCounts,
    count_params,
    count_text,
    frozen_bytes,
    model_shape,
)

# Not visible to torch's allocator counts, or not modelled term by term: CUDA context, NCCL communicators and their
# buffers, cuBLAS workspaces, compiled kernels (fixed); and the allocator's fragmentation (a fraction of the rest).
# No fitted factor: checked against measured peaks on H100 and H200 (docs/memory.md, "Calibrating").
OVERHEAD_BYTES = 3 * GiB
FRAGMENTATION = 0.05

# The training scripts' defaults (train_fsdp2.py's settings block); tests/test_memory.py checks they agree.
DEFAULTS = dict(
    ep_size=0,
    optim="adamw_torch",
    shard_experts="auto",
    dp_replicate=1,
    nproc_per_node=8,
    max_length=256,
    per_device_train_batch_size=4,
    gradient_accumulation_steps=2,
    activation_checkpointing="none",
    activation_checkpointing_layers=-1,
    finetuning="full",
    lora_r=16,
    lora_dropout=0.0,
    lora_target_modules=DEFAULT_TARGETS,
    chunked_loss=True,
    checkpoint_experts=False,
    recompute_swiglu=False,
    quantize_base="none",
    fsdp_wrap="auto",
    ep_capacity_factor=-1.0,  # auto (train/auto_exchange.py): the tool resolves it as train_fsdp2.py does
    cuda_graphs="auto",
)

# ----------------------------------------------------------------------------- the estimate
@dataclass(frozen=True)
class Plan:
    """The settings an estimate was made for (``ep_size`` and ``shard_experts`` as given)."""

    world_size: int
    ep_size: int
    optim: str
    shard_experts: object
    dp_replicate: int
    nproc_per_node: int
    max_length: int
    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    activation_checkpointing: object
    activation_checkpointing_layers: int = -1  # how many decoder layers it applies to (-1: all)
    finetuning: str = "full"  # or "lora": frozen weights in the compute dtype, adapters train
    lora_r: int = 16
    lora_dropout: float = 0.0
    lora_target_modules: str = DEFAULT_TARGETS
    chunked_loss: bool = True  # the loss inside lm_head's forward, over chunks of rows (train/loss.py)
    checkpoint_experts: bool = False  # the routed experts of layers not checkpointed are recomputed
    recompute_swiglu: bool = False  # the experts' SwiGLU output made again in the backward (where it applies)
    fsdp_wrap: str = "layer"  # "model": every layer's dense weights gathered at once (mesh.FSDP_WRAPS)
    ep_capacity_factor: float = 0.0  # > 0: the static exchange, every MoE layer's received rows at this x the mean
    quantize_base: str = "none"  # LoRA: "fp8" holds the frozen experts and decoder linear layers in FP8 (model/quantized_base.py)
    released: str | None = None  # how the checkpoint is quantized as released (loading.checkpoint_quantization): "mxfp4" experts stay so
    cuda_graphs: bool = False  # whole micro-steps as CUDA graphs (where no FSDP runs): their pool holds activations + logits again



def frozen_formats(quantize_base: str, released: str | None) -> str:
    """How a LoRA plan holds its frozen weights, in words."""
    if quantize_base != "fp8":
        return "bf16"
    return "mxfp4 (experts, as released) and fp8 (linear layers)" if released == "mxfp4" else "fp8 (experts, linear layers)"

@dataclass
class MemoryEstimate:
    """Peak bytes per GPU, by kind (see the module docstring for how they add up)."""

    name: str
    plan: Plan
    counts: ParamCounts
    ep: int  # the resolved expert-parallel degree
    shard_experts: bool  # resolved
    checkpointing: str  # resolved mode
    checkpointed: int  # decoder layers it applies to (0 with mode "none")
    params: float
    grads: float
    optimizer_state: float
    gathered_weights: float  # bf16 copies: the root for the whole step, GATHERED_LAYERS layers' dense weights and local experts
    gathered_grads: float  # unsharded gradients of the layer being reduce-scattered, and the root's lm_head gradient
    accumulated_grads: float  # unsharded fp32 gradients kept across micro-steps without gradient sync
    activations: float
    logits: float
    overhead: float
    total: float
    config: object = None
    shape: object = None  # the config's ModelShape (memory_counts.model_shape), read once
    fsdp: bool = True  # False: one rank with bf16 weights (parallelize.needs_fsdp), gradients accumulated in place
    expert_grads_persist: bool = False  # expert gradients live across micro-steps, next to the activations
    adapters: int = 0  # LoRA's adapter parameters (global); 0 for a full fine-tune
    graph_pool: float = 0.0  # CUDA graphs' private pool: a micro-step's activations and logits beside the eager steps' blocks

    def describe(self, on_gpus: bool = True) -> str:
        """The model, the plan and (``on_gpus``) the peak per GPU by kind; on CPU ranks the first two only."""
        p = self.plan
        lines = [
            f"{self.name}: {count_text(self.counts.total)} params ({count_text(self.counts.active)} active; "
            f"{count_text(self.counts.expert)} in {self.counts.num_experts} experts x {self.counts.moe_layers} layers, top-{self.counts.top_k})",
            f"plan: {p.world_size} {'GPUs' if on_gpus else 'CPU ranks'}, ep {self.ep} x dp {p.world_size // self.ep}"
            + (f" (dp_replicate {p.dp_replicate})" if p.dp_replicate > 1 else "")
            + f", shard_experts {str(self.shard_experts).lower()}, optim {p.optim}, micro batch {p.per_device_train_batch_size}"
            f" x {p.max_length} tokens, grad accumulation {p.gradient_accumulation_steps}, activation checkpointing "
            f"{checkpointing_text(self)}" + {"model": ", FSDP units: the whole model", "none": ", dense weights whole on every rank (no FSDP)"}.get(p.fsdp_wrap, "")
            + (f", LoRA r {p.lora_r} ({self.adapters / 1e6:.1f} M adapter params train; the weights are frozen in "
               f"{frozen_formats(p.quantize_base, p.released)})" if p.finetuning == "lora" else ""),
        ]
        if not on_gpus:
            return "\n".join(lines)
        lines.append("per GPU                GiB")
        for label, value in [
            ("params", self.params),
            ("optimizer state", self.optimizer_state),
            ("gathered weights", self.gathered_weights),
            ("gathered grads", self.gathered_grads),
            ("grads (sharded)", self.grads),
            ("activations", self.activations),
            ("logits", self.logits),
            ("accumulated grads", self.accumulated_grads),
            ("overhead", self.overhead),
        ] + [("CUDA graphs' pool", self.graph_pool)] * (self.graph_pool > 0):
            lines.append(f"  {label:<19}{value / GiB:7.1f}")
        if not self.fsdp and p.gradient_accumulation_steps > 1:
            where = "dense weights whole on every rank" if p.fsdp_wrap == "none" and p.world_size > 1 else "one rank"
            why = f"no FSDP ({where}): grads accumulate in place and meet the next micro-step's activations + logits"
        elif self.expert_grads_persist:
            why = ("expert grads live across micro-steps, next to activations + logits + accumulated grads; dense grads "
                   "overlap those: the larger counts")
        else:
            why = "grads overlap activations + logits + accumulated grads: the larger counts"
        lines.append(f"  {'peak':<19}{self.total / GiB:7.1f}   ({why})")
        return "\n".join(lines)


# The ``fsdp_wrap`` setting's values: the FSDP units a run may build (mesh.FSDP_WRAPS) or "auto"
# (``resolve_fsdp_wrap``).
FSDP_WRAP_SETTINGS = ("auto", *FSDP_WRAPS)


def estimate_memory(
    config_or_dir,
    *,
    world_size: int,
    ep_size: int = DEFAULTS["ep_size"],
    optim: str = DEFAULTS["optim"],
    shard_experts="auto",
    dp_replicate: int = 1,
    nproc_per_node: int = 8,
    max_length: int,
    per_device_train_batch_size: int,
    gradient_accumulation_steps: int = 1,
    activation_checkpointing="none",
    activation_checkpointing_layers: int = -1,
    finetuning: str = "full",
    lora_r: int = 16,
    lora_dropout: float = 0.0,
    lora_target_modules: str = DEFAULT_TARGETS,
    chunked_loss: bool = True,
    checkpoint_experts: bool = False,
    fsdp_wrap: str = "layer",
    ep_capacity_factor: float = 0.0,
    recompute_swiglu: bool = False,
    quantize_base: str = "none",
    cuda_graphs: bool = False,
) -> MemoryEstimate:
    """Peak memory per GPU of a training plan; ``config_or_dir``: a config, a config.json dict or a model directory."""
    if fsdp_wrap not in FSDP_WRAPS:
        raise ValueError(f"fsdp_wrap={fsdp_wrap!r}: give the units the run builds, {', '.join(map(repr, FSDP_WRAPS))} (resolve_fsdp_wrap)")
    config = load_config(config_or_dir)
    released = released_format(config_or_dir) if isinstance(config_or_dir, (str, os.PathLike)) else None
    plan = Plan(world_size=world_size, ep_size=ep_size, optim=optim, shard_experts=shard_experts, dp_replicate=dp_replicate,
                nproc_per_node=nproc_per_node, max_length=max_length, per_device_train_batch_size=per_device_train_batch_size,
                gradient_accumulation_steps=gradient_accumulation_steps, activation_checkpointing=activation_checkpointing,
                activation_checkpointing_layers=activation_checkpointing_layers, finetuning=finetuning, lora_r=lora_r,
                lora_dropout=lora_dropout, lora_target_modules=lora_target_modules, chunked_loss=chunked_loss,
                checkpoint_experts=checkpoint_experts, fsdp_wrap=fsdp_wrap, ep_capacity_factor=ep_capacity_factor,
                recompute_swiglu=recompute_swiglu, quantize_base=quantize_base, released=released, cuda_graphs=cuda_graphs)
    return estimate_plan(config, plan)


def checkpointing_text(e: "MemoryEstimate") -> str:
    """"full", or "full on 16 of 32 layers" where only some layers are checkpointed; with ``checkpoint_experts``, what
    the other layers recompute; with ``recompute_swiglu``, whether it applies (``swiglu_made_again``)."""
    layers = e.config.num_hidden_layers
    if e.checkpointing == "none" or e.checkpointed == layers:
        text = e.checkpointing
    else:
        text = f"{e.checkpointing} on {e.checkpointed} of {layers} layers"
    if e.plan.checkpoint_experts and (e.checkpointing == "none" or e.checkpointed < layers):
        text += (" (" if text == "none" else ", ") + "the routed experts recomputed" + (")" if text == "none" else " in the others")
    if e.plan.recompute_swiglu:
        from megablocks_utils.moe.experts import RECOMPUTE_SWIGLU_RAN_AT_EP

        if e.ep > RECOMPUTE_SWIGLU_RAN_AT_EP:
            text += f"; recompute_swiglu off at ep {e.ep} (run on GPUs at ep <= {RECOMPUTE_SWIGLU_RAN_AT_EP} so far)"
        else:
            text += "; recompute_swiglu " + ("on" if swiglu_made_again(e.shape, e.ep, _adapters(e.config, e.plan))
                                             else "(nothing to make again here)")
    return text


def _positive(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InputError(f"{name}={value!r} must be a positive integer")

def _adapters(config, plan: Plan):
    """LoRA's adapter counts for the plan (``model/lora.py``, from the model built on the meta device), or None."""
    if plan.finetuning == "full":
        return None
    if plan.finetuning != "lora":
        raise InputError(f"finetuning={plan.finetuning!r} is unknown; choose full or lora")
    _positive("lora_r", plan.lora_r)
    from megablocks_utils.model.lora import adapter_counts

    return adapter_counts(config, plan.lora_target_modules, plan.lora_r)

def estimate_plan(config, plan: Plan) -> MemoryEstimate:
    """The estimate of ``plan`` for ``config`` (``estimate_memory`` makes the plan from its settings)."""
    for name in ("world_size", "dp_replicate", "nproc_per_node", "max_length", "per_device_train_batch_size", "gradient_accumulation_steps"):
        _positive(name, getattr(plan, name))
    if plan.optim not in OPTIM_BYTES:
        raise InputError(f"optim={plan.optim!r} is unknown; choose one of {', '.join(OPTIM_BYTES)}")
    s = model_shape(config)  # read once, passed down
    spec = s.spec
    counts = count_params(s)
    w = plan.world_size
    ep = check_ep_size(plan.ep_size, w, counts.num_experts, spec.num_experts_attr)
    dp = w // ep
    r = plan.dp_replicate
    if dp % r != 0:
        raise InputError(
            f"dp_replicate={r} must divide dp = world_size / ep_size = {w} / {ep} = {dp} (experts are sharded over "
            f"dp / dp_replicate); choose dp_replicate in {[d for d in range(1, dp + 1) if dp % d == 0]}"
        )
    shard = resolve_shard_experts(plan.shard_experts, w, plan.nproc_per_node)
    mode = checkpointing_mode(plan.activation_checkpointing)
    checkpointed = check_checkpointed_layers(plan.activation_checkpointing_layers, config.num_hidden_layers)
    if mode == "none":
        checkpointed = 0

    param_b, grad_b, state_b = OPTIM_BYTES[plan.optim]
    # What trains (every weight; with LoRA the adapters) has gradients and optimizer state; LoRA's frozen weights
    # are kept in the compute dtype and have neither (megablocks_utils/model/lora.py).
    lora = _adapters(config, plan)
    # fsdp_wrap "none": the dense weights whole on every rank (mesh.FSDP_WRAPS), nothing gathered or reduced
    # inside a micro-step; their gradients accumulate in place and are averaged once a step
    replicated_dense = plan.fsdp_wrap == "none" and w > 1
    if replicated_dense and ep != w:  # (and weights in the compute dtype: parallelize.check_replicated_dense)
        raise InputError(f"fsdp_wrap none (dense weights whole on every rank, no FSDP) needs ep = world size ({w}, here ep {ep}); "
                         "use --fsdp_wrap auto")
    dense_shards = 1 if replicated_dense else w // r  # HSDP: sharded over W / R, replicated over R
    expert_shards = ep * (dp // r) if shard else ep
    trained = counts if lora is None else lora
    local_params = trained.dense / dense_shards + trained.expert / expert_shards
    expert_biases = counts.moe_layers * s.num_experts * (2 * s.expert_inter + s.hidden) if s.expert_bias else 0
    frozen = 0.0 if lora is None else frozen_bytes(counts, plan.quantize_base, dense_shards, expert_shards, plan.released, expert_biases,
                                                    routed_rows=plan.per_device_train_batch_size * plan.max_length * counts.top_k)

    local_experts_layer = counts.expert_layer / ep  # this rank's experts of one layer, unsharded
    trained_experts_layer = trained.expert_layer / ep
    # lm_head's gradient: from the first step of the backward to the root's reduce-scatter (frozen with LoRA)
    lm_head = counts.vocab * counts.hidden if lora is None else 0
    # dense weights unsharded at once: the root and two layers (the one computing, the one prefetched), or all of them
    # (fsdp_wrap "model")
    gathered_dense = counts.dense if plan.fsdp_wrap == "model" else counts.root + GATHERED_LAYERS * counts.dense_layer
    if dp > 1:  # experts under FSDP (parallelize.experts_need_fsdp)
        gathered_weights = COMPUTE_BYTES * (gathered_dense + GATHERED_LAYERS * local_experts_layer)
        gathered_grads = UNSHARDED_GRAD_BYTES * trained.dense_layer + UNSHARDED_GRAD_BYTES * trained_experts_layer + COMPUTE_BYTES * lm_head
    else:  # left out: nothing gathered, their gradients land in place
        casts = 0.0
        if param_b != COMPUTE_BYTES:  # fp32 weights: the layer's bf16 cast is saved for the backward of each layer not
            # checkpointed, and exists for one checkpointed layer at a time (its recompute)
            kept = uncheckpointed_moe_layers(s, mode, checkpointed) + (1 if mode != "none" and checkpointed else 0)
            casts = COMPUTE_BYTES * trained_experts_layer * kept
        gathered_weights = COMPUTE_BYTES * gathered_dense + casts
        # one layer's bf16 gradient as the backward makes it, and its copy divided by world size in the weights'
        # dtype (the backward of the layer's cast, moe/cast.py's _CastDivided), before it is added in place
        gathered_grads = UNSHARDED_GRAD_BYTES * trained.dense_layer + (COMPUTE_BYTES + grad_b) * trained_experts_layer + COMPUTE_BYTES * lm_head
    accumulated = 0.0
    if plan.gradient_accumulation_steps > 1:
        # Dense gradients wait unsharded in fp32 until the last micro-step; so do experts replicated over
        # dp. Others are reduced at every micro-step (parallelize.set_gradient_sync).
        replicated = not shard and dp > 1
        accumulated = ACCUMULATED_GRAD_BYTES * (trained.dense + (trained.expert / ep if replicated else 0))

    tokens = plan.per_device_train_batch_size * plan.max_length
    received = received_rows(ep, plan.ep_capacity_factor)
    swiglu_kept = not (plan.recompute_swiglu and swiglu_made_again(s, ep, lora))
    activations = activation_bytes(s, tokens, mode, checkpointed, plan.checkpoint_experts, received, swiglu_kept)
    if ep > 1 and plan.ep_capacity_factor > 0:  # the static exchange's two shared buffers: rows sent, rows received
        activations += COMPUTE_BYTES * counts.hidden * counts.top_k * tokens * (1 + received)
    if lora is not None:
        activations += adapter_activation_bytes(s, lora, tokens, mode, checkpointed, plan.lora_dropout, plan.checkpoint_experts)
    lm_head_adapter = plan.finetuning == "lora" and "lm_head" in [t.strip() for t in plan.lora_target_modules.split(",")]
    logits = logits_bytes(s, tokens, plan.chunked_loss, lm_head_adapter)
    params, grads, state = param_b * local_params + frozen, grad_b * local_params, state_b * local_params
    during_backward = max(grads, activations + logits + accumulated)
    expert_grads_persist = plan.gradient_accumulation_steps > 1 and (shard or dp == 1)  # reduced at every micro-step
    if expert_grads_persist:
        # Expert gradients are reduced into their sharded gradients at every micro-step (or accumulate there in
        # place, experts left out of FSDP), so from the second micro-step on they exist next to its activations.
        expert_grads = grad_b * trained.expert / expert_shards
        during_backward = expert_grads + max(grads - expert_grads, activations + logits + accumulated)
    # one rank: no FSDP where it would cast nothing (bf16 weights, or LoRA, whose adapters cast themselves)
    fsdp = not (w == 1 and (param_b == COMPUTE_BYTES or lora is not None)) and not replicated_dense
    if not fsdp:
        # parallelize.needs_fsdp: one rank with bf16 weights has no FSDP, so nothing is gathered or reduced; the
        # gradients accumulate in place from the first micro-step, so from the second on they meet the activations.
        gathered_weights = gathered_grads = accumulated = 0.0
        if replicated_dense:  # the fp32 bucket average_replicated_grads stages each collective in, after the backward
            gathered_grads = 4.0 * min(trained.dense, REPLICATED_BUCKET)
        during_backward = grads + activations + logits if plan.gradient_accumulation_steps > 1 else max(grads, activations + logits)
        if replicated_dense:
            # Averaged during the last backward (parallel/replicated_grads.ReplicatedGradSync, whenever no whole
            # micro-step is a graph), each bucket's fp32 copy is kept until the step's finish: at the backward's end every
            # dense gradient has one (4 bytes each) beside the gradients, while the activations are gone.
            during_backward = max(during_backward, grads + 4.0 * trained.dense)
    # The graphs' pool (memory_fit.graphs_memory_blocker) beside the blocks the eager warm-up steps left in the allocator
    graph_pool = activations + logits if plan.cuda_graphs and not fsdp else 0.0
    allocated = params + state + gathered_weights + gathered_grads + during_backward + graph_pool
    overhead = OVERHEAD_BYTES + FRAGMENTATION * allocated
    return MemoryEstimate(
        name=getattr(config, "_memory_name", "") or getattr(config, "_name_or_path", "") or config.model_type,
        plan=plan,
        counts=counts,
        ep=ep,
        shard_experts=shard,
        checkpointing=mode,
        checkpointed=checkpointed,
        params=params,
        grads=grads,
        optimizer_state=state,
        gathered_weights=gathered_weights,
        gathered_grads=gathered_grads,
        accumulated_grads=accumulated,
        activations=activations,
        logits=logits,
        overhead=overhead,
        total=allocated + overhead,
        config=config,
        shape=s,
        fsdp=fsdp,
        expert_grads_persist=expert_grads_persist and fsdp,
        adapters=0 if lora is None else lora.dense + lora.expert,
        graph_pool=graph_pool,
    )
