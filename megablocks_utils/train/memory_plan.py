"""Will a training plan fit in GPU memory? An estimate from config.json alone, before any weight is loaded.

The fit check of a training run: both scripts call ``check_fit`` before any weight is read, and the command
line ``python -m megablocks_utils.tools.memory`` prints the same estimate. It lives in ``train/`` because what it
plans is one training step's memory: the optimizer's bytes per parameter (``OPTIM_BYTES``, which
``train/optim.py`` reads back), the gradients, the activations and the loss of a step. It reads the rooms below
it (the model table and LoRA's adapters in ``model/``, the mesh's degrees and the checkpointed layers in
``parallel/``, the loss's chunks in ``train/loss.py``), and none of those reads it back.

The layout modelled (docs/memory.md draws it): dense weights FSDP2-sharded over all W ranks (HSDP: over
W / dp_replicate); experts split over ep (num_experts / ep whole experts per rank) and, with
``shard_experts``, FSDP2-sharded over dp as well. One decoder layer's weights are gathered in bf16 at a
time (plus one prefetched); embeddings and lm_head (FSDP's root) stay gathered for the whole step.

The per-GPU peak is

    params + optimizer state + gathered weights + gathered grads + max(grads, activations + logits + accumulated grads) + overhead

Sharded gradients are created during the backward (``zero_grad(set_to_none=True)`` freed them), layer by
layer as that layer's activations are freed, so the peak holds the larger of the two, not their sum: at
the start of the backward every activation is alive and no gradient is; at its end the reverse. Except with
gradient accumulation for the experts' gradients: reduced at every micro-step, they exist from the second
micro-step on next to its activations, so they are added, and only the dense gradients overlap (docs/memory.md).

Every byte constant is below, named, with its reasoning; they are first estimates from what autograd
saves, to be calibrated against measured ``max_memory_reserved`` on GPUs (target: within 10%).
"""

import os
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from megablocks_utils.config.inputs import fail, parse_bool, resolve_shard_experts
from megablocks_utils.errors import InputError
from megablocks_utils.model.architectures import spec_for
from megablocks_utils.model.loading import load_config
from megablocks_utils.model.lora import DEFAULT_TARGETS
from megablocks_utils.model.quantized_base import released_format
from megablocks_utils.parallel.activation_checkpointing import checkpointed_layers
from megablocks_utils.parallel.mesh import FSDP_WRAPS, REPLICATED_BUCKET, check_ep_size
from megablocks_utils.train.loss import loss_chunk_rows

GiB = 2**30

# ----------------------------------------------------------------------------- constants (calibrate here)
# Persistent state, bytes per parameter: (param, grad, optimizer state).
OPTIM_BYTES = {
    "adamw_torch": (4, 4, 4 + 4),  # fp32 master, fp32 grad, fp32 exp_avg and exp_avg_sq
    "adamw_bf16": (2, 2, 2 + 2),  # torchao _AdamW(bf16_stochastic_round=True): everything bf16
    "adamw_torch_8bit": (4, 4, 1 + 1 + 2 * 4 / 256),  # torchao AdamW8bit: two 8-bit states, an fp32 scale per 256-block each
}
# The dtype each optimizer keeps the parameters in (their bytes above): train/optim.param_dtype reads it.
PARAM_DTYPE = {"adamw_torch": torch.float32, "adamw_bf16": torch.bfloat16, "adamw_torch_8bit": torch.float32}
COMPUTE_BYTES = 2  # bf16: FSDP's param_dtype, the gathered weight copies and every activation element
GATHERED_LAYERS = 2  # decoder layers whose weights are gathered at once: the one computing and the one prefetched
# A layer's gradient before reduce-scatter: as the backward produces it (bf16) and its fp32 copy (reduce_dtype).
UNSHARDED_GRAD_BYTES = 2 + 4
# Gradient accumulation with set_requires_gradient_sync(False): FSDP2 keeps every parameter's unsharded
# gradient, upcast to reduce_dtype (fp32), from the first micro-step until the last one reduce-scatters it.
ACCUMULATED_GRAD_BYTES = 4

# Activations: bytes per element of the tensor each one names (widths from the config), per token.
ACT = COMPUTE_BYTES  # a bf16 activation element
# RMSNorm's saved input. compile_dense (on by default on GPU) compiles the norms, which then save only their
# bf16 input and a per-row fp32 1/rms; an eager transformers RMSNorm saves the fp32 upcast and the bf16
# normalised value instead (6 per element).
NORM_SAVED = 2
NORM_ROW = 4  # fp32 1/rms per row
SDPA_LSE = 4  # flash / memory-efficient SDPA keeps q, k, v, the output and an fp32 logsumexp per head
ROUTER_PROB = 4  # fp32 softmax over all experts, per expert (also kept for the load-balancing loss)
ROUTED_COPY_INDEX = 3 * 8 + 2 * 4  # per token copy: int64 expert, sort order and copy row; fp32 weight (+ renormalised)
# Rows an ep rank's experts receive, relative to the average (k per token): routers are not balanced, and
# the busiest rank sets the peak. Applies to the grouped-GEMM side (rows in, gate_up out, SwiGLU out).
EXPERT_LOAD_IMBALANCE = 1.25
# Gradients of the layer being differentiated (and the element-wise recomputes feeding them), in units of
# that layer's activations saved without checkpointing. Largest term: SwiGLU's backward holds the gradient
# of gate_up [rows, 2I] next to the saved gate_up.
BACKWARD_WORKING_LAYERS = 0.5
# Per token per vocabulary entry: bf16 logits (lm_head output, kept by the training loop), the fp32 log-probs
# cross-entropy saves after its upcast, and their gradient in fp32, then bf16 (``chunked_loss`` false, or Granite).
LOGITS_BYTES = 2 + 4 + 4 + 2
# The chunked loss (train/loss.py, the default), per vocabulary entry of one chunk of rows (loss_chunk_rows): its
# bf16 logits and their bf16 gradient (the element-wise step compiled, as compile_dense is on GPUs). Per token: the
# hidden states' bf16 gradient, made in the forward. lm_head's weight gradient, also made in the forward, is counted
# in gathered_grads (the root's lm_head term), as before. Not yet checked against a GPU peak (the checks below ran
# with full logits).
CHUNKED_LOGITS_BYTES = 2 + 2

# Not visible to torch's allocator counts, or not modelled term by term: CUDA context, NCCL communicators and
# their buffers, cuBLAS workspaces, compiled kernels (fixed); and the caching allocator's fragmentation
# (a fraction of everything else).
# Checked against GPU peaks, no fitted factor (2026-11-23): 4 x H200, Mixtral-8x7B width, ep 4, adamw_bf16,
# seq 4096, micro batch 1 x 4, selective checkpointing (bench/run.py full_size emul16, 2026-11-22, experts then under
# FSDP at dp = 1): 16 layers estimated 73.3 GiB for that layout (71.2 for today's, experts left out), measured
# 71.8 GiB allocated; 32 layers estimated 135.0 (132.9), and that run ran out of memory at 132 GiB allocated on a
# 139.8 GiB GPU, so there the estimate is low by some percent (not measured how many).
# One H100, gpt-oss-20b's shape cut to 4 layers, adamw_bf16, no checkpointing, 1 x 2048 x 4 (bench/run.py gpt_oss,
# 2026-11-23): estimated 44.4 GiB, measured 44.7 allocated.
OVERHEAD_BYTES = 3 * GiB
FRAGMENTATION = 0.05

# ----------------------------------------------------------------------------- settings
CHECKPOINTING = ("none", "selective", "full")  # weakest to strongest
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


def checkpointing_mode(setting) -> str:
    """``activation_checkpointing`` as the scripts give it (a bool, or none/selective/full) -> a mode name."""
    flag = parse_bool(setting)
    if flag is not None:
        return "full" if flag else "none"
    text = str(setting).lower()
    if text not in CHECKPOINTING:
        raise InputError(f"activation_checkpointing={setting!r} is unknown; choose none, selective or full (true = full, false = none)")
    return text


# ----------------------------------------------------------------------------- the model's shape
@dataclass(frozen=True)
class ParamCounts:
    """Parameter counts of a model (global, not a rank's share)."""

    total: int
    dense: int  # all but the routed experts: attention, norms, routers, shared/dense MLPs, embeddings, lm_head
    expert: int  # routed experts of every MoE layer
    active: int  # what one token passes through (embeddings included, as model cards count)
    root: int  # embeddings, final norm and lm_head: FSDP's root, gathered for the whole step
    dense_layer: int  # the largest decoder layer's dense parameters (gathered one layer at a time)
    expert_layer: int  # one MoE layer's routed experts, all of them
    moe_layers: int  # how many decoder layers hold an MoE block
    num_experts: int
    top_k: int
    hidden: int
    vocab: int


@dataclass(frozen=True)
class _Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    num_experts: int
    top_k: int
    expert_inter: int  # routed expert width
    moe_layers: tuple  # which layers hold an MoE block (the others a dense MLP of dense_inter)
    dense_inter: int
    shared_inter: int  # always-on MLP next to the experts in MoE layers (0: none)
    shared_gate: bool  # Qwen2-MoE: sigmoid(Linear(H, 1)) on the shared expert
    qk_norm: str | None
    mla: tuple | None  # DeepSeek's latent attention: (q_lora_rank or None, kv_lora_rank, rope dim, nope dim, v dim)
    qkv_bias: bool
    o_bias: bool
    tied: bool
    expert_bias: bool = False  # gpt-oss: per-expert biases (2I + H), a router bias (E) and attention sinks (one per head)
    router_bias: bool = False
    sinks: bool = False


def _shape(config) -> _Shape:
    spec = spec_for(config)
    hidden, layers, heads = config.hidden_size, config.num_hidden_layers, config.num_attention_heads
    num_experts = getattr(config, spec.num_experts_attr)
    # Qwen-style configs can make some layers dense: listed in mlp_only_layers, or off the decoder_sparse_step.
    mlp_only = set(getattr(config, "mlp_only_layers", None) or ())
    step = getattr(config, "decoder_sparse_step", 1) or 1
    # DeepSeek-style configs make the first N layers dense (spec.dense_layers_attr).
    first_moe = (getattr(config, spec.dense_layers_attr, 0) or 0) if spec.dense_layers_attr else 0
    moe_layers = tuple(
        i for i in range(first_moe, layers) if i not in mlp_only and num_experts > 0 and (i + 1) % step == 0
    )
    shared_inter = getattr(config, spec.shared_intermediate_attr, 0) or 0 if spec.shared_intermediate_attr else 0
    if spec.shared_count_attr:  # DeepSeek: n_shared_experts experts of moe_intermediate_size, as one MLP
        shared_inter *= getattr(config, spec.shared_count_attr, 1) or 0
    mla = None
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if spec.attention == "mla":
        mla = (config.q_lora_rank, config.kv_lora_rank, config.qk_rope_head_dim, config.qk_nope_head_dim, config.v_head_dim)
        head_dim, kv_heads = config.qk_rope_head_dim + config.qk_nope_head_dim, heads  # for the activation estimate
    attention_bias = bool(getattr(config, "attention_bias", False))
    return _Shape(
        hidden=hidden,
        layers=layers,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        vocab=config.vocab_size,
        num_experts=num_experts,
        top_k=getattr(config, spec.top_k_attr),
        expert_inter=getattr(config, spec.intermediate_attr),
        moe_layers=moe_layers,
        dense_inter=getattr(config, "intermediate_size", 0),
        shared_inter=shared_inter,
        shared_gate=spec.shared_gate_attr is not None and shared_inter > 0,
        qk_norm=spec.qk_norm or ("per_head" if getattr(config, "use_qk_norm", False) else None),  # GLM-4.5's switch
        mla=mla,
        # Qwen2-MoE: qkv_bias on q, k, v; the others: attention_bias on all four projections (GLM-4.5: q, k, v).
        qkv_bias=bool(getattr(config, "qkv_bias", attention_bias)),
        o_bias=attention_bias and spec.o_proj_bias,
        tied=bool(getattr(config, "tie_word_embeddings", False)),
        expert_bias=spec.expert_bias,
        router_bias=spec.router_bias,
        sinks=spec.attention_sinks,
    )


def _attention_params(s: _Shape) -> int:
    if s.mla is not None:
        return _mla_params(s)
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    weights = s.hidden * q + 2 * s.hidden * kv + q * s.hidden
    biases = (q + 2 * kv if s.qkv_bias else 0) + (s.hidden if s.o_bias else 0)
    qk_norm = {"per_head": 2 * s.head_dim, "all_heads": q + kv, None: 0}[s.qk_norm]
    sinks = s.heads if s.sinks else 0
    return weights + biases + qk_norm + sinks + 2 * s.hidden  # + input and post-attention RMSNorm


def _mla_params(s: _Shape) -> int:
    """DeepSeek's latent attention: q through a rank-q_lora bottleneck (or one projection), k and v through
    one shared rank-kv_lora latent plus a rope key; attention_bias on the down projections and o_proj."""
    q_lora, kv_lora, rope, nope, v = s.mla
    bias = s.o_bias
    qk = s.heads * (rope + nope)
    q = s.hidden * qk if q_lora is None else s.hidden * q_lora + (q_lora if bias else 0) + q_lora + q_lora * qk
    kv = s.hidden * (kv_lora + rope) + ((kv_lora + rope) if bias else 0) + kv_lora + kv_lora * s.heads * (nope + v)
    o = s.heads * v * s.hidden + (s.hidden if bias else 0)
    return q + kv + o + 2 * s.hidden  # + input and post-attention RMSNorm


def count_params(config) -> ParamCounts:
    """Parameter counts from the config's fields and the model table (no weights, no model built)."""
    s = _shape(config)
    attention = _attention_params(s)
    per_expert = 3 * s.hidden * s.expert_inter + (2 * s.expert_inter + s.hidden if s.expert_bias else 0)  # gate, up, down
    moe_dense = s.num_experts * (s.hidden + (1 if s.router_bias else 0)) + 3 * s.hidden * s.shared_inter + (s.hidden if s.shared_gate else 0)  # router, shared MLP
    dense_mlp = 3 * s.hidden * s.dense_inter
    n_moe = len(s.moe_layers)
    n_dense = s.layers - n_moe
    root = s.vocab * s.hidden * (1 if s.tied else 2) + s.hidden
    dense = root + s.layers * attention + n_moe * moe_dense + n_dense * dense_mlp
    expert = n_moe * s.num_experts * per_expert
    return ParamCounts(
        total=dense + expert,
        dense=dense,
        expert=expert,
        active=dense + n_moe * s.top_k * per_expert,
        root=root,
        dense_layer=attention + max(moe_dense if n_moe else 0, dense_mlp if n_dense else 0),
        expert_layer=s.num_experts * per_expert if n_moe else 0,
        moe_layers=n_moe,
        num_experts=s.num_experts,
        top_k=s.top_k,
        hidden=s.hidden,
        vocab=s.vocab,
    )


# ----------------------------------------------------------------------------- activations
def _expert_activation_bytes(s: _Shape, received: float = EXPERT_LOAD_IMBALANCE, swiglu_kept: bool = True) -> float:
    """Bytes per token a MoE layer's routed experts save for their backward: the k routed copies of the input, gate_up's
    output, the SwiGLU output (unless made again: ``recompute_swiglu``), and the k outputs the weighted sum keeps (what
    ``checkpoint_experts`` recomputes). ``received``: the rows the busiest rank's experts hold, over the mean
    (``received_rows``)."""
    h, k = s.hidden, s.top_k
    rows_in, gate_up = ACT * k * h, ACT * k * 2 * s.expert_inter
    swiglu = ACT * k * s.expert_inter if swiglu_kept else 0
    back_home = ACT * k * h  # expert outputs returned by the all-to-all, saved by the weighted sum
    return received * (rows_in + gate_up + swiglu) + back_home


def received_rows(ep: int, capacity_factor: float) -> float:
    """Rows a rank's experts hold over the mean: ``EXPERT_LOAD_IMBALANCE`` on the exact exchange, and the static
    exchange's fixed capacity where it is larger (``ep_capacity_factor``: every layer's shapes are that many rows,
    padding included; never more than ep, every rank's rows, as ``pull_capacity`` caps it)."""
    if ep > 1 and capacity_factor > 0:
        return min(float(ep), max(EXPERT_LOAD_IMBALANCE, capacity_factor))
    return EXPERT_LOAD_IMBALANCE


def _layer_activation_bytes(s: _Shape, moe: bool, mode: str, received: float = EXPERT_LOAD_IMBALANCE,
                            swiglu_kept: bool = True) -> float:
    """Bytes one token's activations in one decoder layer hold until its backward ("none": what autograd
    saves; "selective": matmul, grouped-GEMM, communication and attention outputs; "full": the layer input;
    "experts": "none" less the routed experts', which are recomputed; ``swiglu_kept``: ``_expert_activation_bytes``)."""
    h, k = s.hidden, s.top_k
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    if mode == "full":
        return ACT * h
    qk_norm_elems = {"per_head": q + kv, "all_heads": q + kv, None: 0}[s.qk_norm]
    sdpa = ACT * (q + 2 * kv) + ACT * q + SDPA_LSE * s.heads  # q, k, v (after rotary), output, logsumexp
    if moe:
        router = ROUTER_PROB * s.num_experts + ROUTED_COPY_INDEX * k
        rows_in, gate_up = ACT * k * h, ACT * k * 2 * s.expert_inter
        back_home = ACT * k * h  # expert outputs returned by the all-to-all, saved by the weighted sum
        mlp_inter = s.shared_inter
        gate = ACT * (h + 1) if s.shared_gate else 0  # sigmoid(gate) * shared: the shared output and the gate
    else:
        router = rows_in = gate_up = back_home = gate = 0
        mlp_inter = s.dense_inter
    if mode in ("none", "experts"):
        norms = 2 * (NORM_SAVED * h + NORM_ROW + ACT * h)  # each norm's input and its output (the next matmul's input)
        attention = NORM_SAVED * qk_norm_elems + sdpa + ACT * q  # + o_proj's input (the output made contiguous)
        experts = _expert_activation_bytes(s, received, swiglu_kept) if moe and mode == "none" else 0.0
        mlp = ACT * 4 * mlp_inter + gate  # gate and up outputs, silu(gate), their product
        return norms + attention + router + experts + mlp
    # selective: element-wise work (norms, rotary, SwiGLU, residual adds, weighting) is recomputed
    inputs = ACT * h + ACT * h  # the layer input and o_proj's output (from which the residual is recomputed)
    experts = received * (rows_in + gate_up) + back_home
    mlp = ACT * 2 * mlp_inter + (ACT * h if mlp_inter else 0)  # gate and up outputs, down's output
    return inputs + ACT * (q + 2 * kv) + ACT * q + SDPA_LSE * s.heads + router + experts + mlp + gate


def _checkpointed(s: _Shape, mode: str, checkpointed: int) -> set[int]:
    return set(checkpointed_layers(s.layers, checkpointed)) if mode != "none" else set()


def _uncheckpointed_moe_layers(config, mode: str, checkpointed: int) -> int:
    s = _shape(config)
    chosen = _checkpointed(s, mode, checkpointed)
    return sum(1 for i in range(s.layers) if i in s.moe_layers and i not in chosen)


def activation_bytes(config, tokens: int, mode: str, checkpointed: int = -1, experts: bool = False,
                     received: float = EXPERT_LOAD_IMBALANCE, swiglu_kept: bool = True) -> float:
    """Peak activation bytes of a micro-batch of ``tokens`` tokens on one rank (the logits apart), with
    ``mode`` on ``checkpointed`` decoder layers (``checkpointed_layers``; -1: all) and none on the rest, the rest's
    routed experts recomputed with ``experts`` (``checkpoint_experts``); ``received``: ``received_rows``;
    ``swiglu_kept`` False: the layers that keep their experts' activations make SwiGLU's output again instead
    (``recompute_swiglu``; the layer being worked on in the backward is still counted whole)."""
    s = _shape(config)
    is_moe = [i in s.moe_layers for i in range(s.layers)]
    chosen = _checkpointed(s, mode, checkpointed)
    rest = "experts" if experts else "none"
    kept = sum(_layer_activation_bytes(s, moe, mode if i in chosen else rest, received, swiglu_kept) for i, moe in enumerate(is_moe))
    full_layer = max(_layer_activation_bytes(s, moe, "none", received) for moe in set(is_moe))
    recompute = 0.0  # the layer whose backward runs, recomputed to its "none" activations
    recomputed = {is_moe[i] for i in chosen}
    if mode == "full" and recomputed:
        recompute = max(_layer_activation_bytes(s, moe, "none", received) for moe in recomputed)
    elif mode == "selective" and recomputed:
        recompute = max(_layer_activation_bytes(s, moe, "none", received) - _layer_activation_bytes(s, moe, "selective", received)
                        for moe in recomputed)
    if experts and any(moe and i not in chosen for i, moe in enumerate(is_moe)):  # one layer's experts, recomputed
        recompute = max(recompute, _expert_activation_bytes(s, received))
    final_norm = NORM_SAVED * s.hidden + NORM_ROW + ACT * s.hidden  # and its output, lm_head's input
    return tokens * (kept + recompute + BACKWARD_WORKING_LAYERS * full_layer + final_norm)


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
    fsdp_wrap: str = "layer"  # "model": every layer's dense weights gathered at once (parallel/mesh.FSDP_WRAPS)
    ep_capacity_factor: float = 0.0  # > 0: the static exchange, every MoE layer's received rows at this x the mean
    quantize_base: str = "none"  # LoRA: "fp8" holds the frozen experts and decoder linear layers in FP8 (model/quantized_base.py)
    released: str | None = None  # how the checkpoint is quantized as released (loading.checkpoint_quantization): "mxfp4" experts stay so


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
    fsdp: bool = True  # False: one rank with bf16 weights (parallelize.needs_fsdp), gradients accumulated in place
    expert_grads_persist: bool = False  # expert gradients live across micro-steps, next to the activations
    adapters: int = 0  # LoRA's adapter parameters (global); 0 for a full fine-tune

    def describe(self, on_gpus: bool = True) -> str:
        """The model, the plan and (``on_gpus``) the peak per GPU by kind; on CPU ranks the first two only."""
        p = self.plan
        lines = [
            f"{self.name}: {_count(self.counts.total)} params ({_count(self.counts.active)} active; "
            f"{_count(self.counts.expert)} in {self.counts.num_experts} experts x {self.counts.moe_layers} layers, top-{self.counts.top_k})",
            f"plan: {p.world_size} {'GPUs' if on_gpus else 'CPU ranks'}, ep {self.ep} x dp {p.world_size // self.ep}"
            + (f" (dp_replicate {p.dp_replicate})" if p.dp_replicate > 1 else "")
            + f", shard_experts {str(self.shard_experts).lower()}, optim {p.optim}, micro batch {p.per_device_train_batch_size}"
            f" x {p.max_length} tokens, grad accumulation {p.gradient_accumulation_steps}, activation checkpointing "
            f"{checkpointing_text(self)}" + {"model": ", FSDP units: the whole model", "none": ", dense weights whole on every rank (no FSDP)"}.get(p.fsdp_wrap, "")
            + (f", LoRA r {p.lora_r} ({self.adapters / 1e6:.1f} M adapter params train; the weights are frozen in "
               f"{'fp8 (experts, linear layers)' if p.quantize_base == 'fp8' else 'bf16'})" if p.finetuning == "lora" else ""),
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
        ]:
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


def _count(n: float) -> str:
    """A parameter count as people say it: 30.53 B, 0.92 M."""
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"


# The ``fsdp_wrap`` setting's values: the FSDP units a run may build (parallel/mesh.FSDP_WRAPS) or "auto"
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
) -> MemoryEstimate:
    """Peak memory per GPU of a training plan; ``config_or_dir``: a config, a config.json dict or a model directory."""
    if fsdp_wrap not in FSDP_WRAPS:
        raise ValueError(f"fsdp_wrap={fsdp_wrap!r}: give the units the run builds, {', '.join(map(repr, FSDP_WRAPS))} (resolve_fsdp_wrap)")
    config = load_config(config_or_dir)
    released = released_format(config_or_dir) if isinstance(config_or_dir, (str, os.PathLike)) else None
    plan = Plan(
        world_size=world_size,
        ep_size=ep_size,
        optim=optim,
        shard_experts=shard_experts,
        dp_replicate=dp_replicate,
        nproc_per_node=nproc_per_node,
        max_length=max_length,
        per_device_train_batch_size=per_device_train_batch_size,
        gradient_accumulation_steps=gradient_accumulation_steps,
        activation_checkpointing=activation_checkpointing,
        activation_checkpointing_layers=activation_checkpointing_layers,
        finetuning=finetuning,
        lora_r=lora_r,
        lora_dropout=lora_dropout,
        lora_target_modules=lora_target_modules,
        chunked_loss=chunked_loss,
        checkpoint_experts=checkpoint_experts,
        fsdp_wrap=fsdp_wrap,
        ep_capacity_factor=ep_capacity_factor,
        recompute_swiglu=recompute_swiglu,
        quantize_base=quantize_base,
        released=released,
    )
    return _estimate(config, plan)


def check_checkpointed_layers(count, num_layers: int) -> int:
    """``activation_checkpointing_layers`` checked against the model's decoder layers; -1 -> ``num_layers``."""
    if not isinstance(count, int) or isinstance(count, bool) or count < -1:
        raise InputError(f"activation_checkpointing_layers={count!r} must be -1 (every decoder layer) or a count of layers, 0..{num_layers}")
    if count > num_layers:
        raise InputError(
            f"activation_checkpointing_layers={count} but the model has {num_layers} decoder layers; give 0..{num_layers}, or -1 for all"
        )
    return num_layers if count == -1 else count


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
            text += "; recompute_swiglu " + ("on" if swiglu_made_again(e.config, e.ep, _adapters(e.config, e.plan))
                                             else "(nothing to make again here)")
    return text


def _positive(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InputError(f"{name}={value!r} must be a positive integer")


def swiglu_made_again(config, ep: int, lora) -> bool:
    """Whether ``recompute_swiglu`` has anything to make again on a GPU (``experts.makes_swiglu_again``): experts
    of SiLU * up (not gpt-oss's clamped SwiGLU), several on each rank, no LoRA on them (``lora``: ``_adapters``), and an
    ep it has run at (``RECOMPUTE_SWIGLU_RAN_AT_EP``)."""
    from megablocks_utils.moe.experts import RECOMPUTE_SWIGLU_RAN_AT_EP

    spec = spec_for(config)
    if ep > RECOMPUTE_SWIGLU_RAN_AT_EP:
        return False
    silu = spec.expert_act is None and not spec.gate_up_interleaved and getattr(config, "hidden_act", "silu") == "silu"
    shape = _shape(config)
    return bool(shape.moe_layers) and silu and shape.num_experts // ep > 1 and (lora is None or not lora.expert)


def _adapters(config, plan: Plan):
    """LoRA's adapter counts for the plan (``model/lora.py``, from the model built on the meta device), or None."""
    if plan.finetuning == "full":
        return None
    if plan.finetuning != "lora":
        raise InputError(f"finetuning={plan.finetuning!r} is unknown; choose full or lora")
    _positive("lora_r", plan.lora_r)
    from megablocks_utils.model.lora import adapter_counts

    return adapter_counts(config, plan.lora_target_modules, plan.lora_r)


def _adapter_activation_bytes(config, lora, tokens: int, mode: str, checkpointed: int, dropout: float, experts: bool = False) -> float:
    """What the adapters add to the activations: per adapted projection and token (copy, for experts) the [., r]
    product that B's GEMM saves; with dropout the dropped input and its mask; under "selective" also B's output (a
    GEMM output, kept like the base projection's). Checkpointed ("full") layers keep nothing of it, the one being
    recomputed everything; with ``experts`` (``checkpoint_experts``) the other layers keep their dense adapters' only."""
    s = _shape(config)
    chosen = _checkpointed(s, mode, checkpointed)

    def layer(row, layer_mode: str) -> float:
        dense_r, dense_in, dense_out, expert_r, expert_in, expert_out = row
        if layer_mode == "full":
            return 0.0
        if layer_mode == "experts":
            expert_r = expert_in = expert_out = 0
        per_copy = ACT * (dense_r + EXPERT_LOAD_IMBALANCE * s.top_k * expert_r)
        if dropout > 0:
            per_copy += (ACT + 1) * (dense_in + EXPERT_LOAD_IMBALANCE * s.top_k * expert_in)
        if layer_mode == "selective":
            per_copy += ACT * (dense_out + EXPERT_LOAD_IMBALANCE * s.top_k * expert_out)
        return per_copy

    kept = sum(layer(row, mode if i in chosen else ("experts" if experts else "none")) for i, row in enumerate(lora.layers))
    recompute = max((layer(lora.layers[i], "none") for i in chosen), default=0.0) if mode != "none" else 0.0
    return tokens * (kept + recompute)


def _logits_bytes(config, plan: Plan, counts, tokens: int) -> float:
    """The loss's memory: one chunk of logits with the chunked loss (``install_loss_head``'s cases: not for a model
    that rescales its logits, nor for an lm_head with a LoRA adapter), else every token's full logits."""
    lm_head_adapter = plan.finetuning == "lora" and "lm_head" in [t.strip() for t in plan.lora_target_modules.split(",")]
    if plan.chunked_loss and not spec_for(config).logits_scaling_attr and not lm_head_adapter:
        return CHUNKED_LOGITS_BYTES * loss_chunk_rows(tokens, counts.vocab) * counts.vocab + COMPUTE_BYTES * tokens * counts.hidden
    return LOGITS_BYTES * tokens * counts.vocab


FP8_BYTES = 1 + 4 / 128**2  # a float8 weight and its share of its 128 x 128 block's fp32 scale (moe/quantized.py)
MXFP4_BYTES = 0.5 + 1 / 32  # an e2m1 weight and its share of its 32 inputs' exponent byte (gpt-oss's released experts)


def _frozen_bytes(counts: ParamCounts, quantize_base: str, dense_shards: int, expert_shards: int, released: str | None = None,
                  expert_biases: int = 0) -> float:
    """LoRA's frozen weights on one GPU: in the compute dtype, or with ``quantize_base`` fp8 the routed experts and the
    decoder layers' linear layers in FP8 (embeddings, lm_head, routers and norms stay in the compute dtype), experts
    released in MXFP4 (``released``) in MXFP4; their biases (``expert_biases``, gpt-oss's) stay in the compute dtype."""
    if quantize_base == "none":
        return COMPUTE_BYTES * (counts.dense / dense_shards + counts.expert / expert_shards)
    if quantize_base != "fp8":
        raise InputError(f"quantize_base={quantize_base!r} is unknown; choose none or fp8")
    kept = counts.root + counts.moe_layers * counts.num_experts * counts.hidden  # embeddings, lm_head, routers
    experts = MXFP4_BYTES if released == "mxfp4" else FP8_BYTES
    return (COMPUTE_BYTES * kept / dense_shards + FP8_BYTES * (counts.dense - kept) / dense_shards
            + (experts * (counts.expert - expert_biases) + COMPUTE_BYTES * expert_biases) / expert_shards)


def _estimate(config, plan: Plan) -> MemoryEstimate:
    for name in ("world_size", "dp_replicate", "nproc_per_node", "max_length", "per_device_train_batch_size", "gradient_accumulation_steps"):
        _positive(name, getattr(plan, name))
    if plan.optim not in OPTIM_BYTES:
        raise InputError(f"optim={plan.optim!r} is unknown; choose one of {', '.join(OPTIM_BYTES)}")
    spec = spec_for(config)
    counts = count_params(config)
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
    # fsdp_wrap "none": the dense weights whole on every rank (parallel/mesh.FSDP_WRAPS), nothing gathered or reduced
    # inside a micro-step; their gradients accumulate in place and are averaged once a step
    replicated_dense = plan.fsdp_wrap == "none" and w > 1
    if replicated_dense and ep != w:  # (and weights in the compute dtype: parallelize.check_replicated_dense)
        raise InputError(f"fsdp_wrap none (dense weights whole on every rank, no FSDP) needs ep = world size ({w}, here ep {ep}); "
                         "use --fsdp_wrap auto")
    dense_shards = 1 if replicated_dense else w // r  # HSDP: sharded over W / R, replicated over R
    expert_shards = ep * (dp // r) if shard else ep
    trained = counts if lora is None else lora
    local_params = trained.dense / dense_shards + trained.expert / expert_shards
    shape = _shape(config)
    expert_biases = counts.moe_layers * shape.num_experts * (2 * shape.expert_inter + shape.hidden) if shape.expert_bias else 0
    frozen = 0.0 if lora is None else _frozen_bytes(counts, plan.quantize_base, dense_shards, expert_shards, plan.released,
                                                    expert_biases)

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
            kept = _uncheckpointed_moe_layers(config, mode, checkpointed) + (1 if mode != "none" and checkpointed else 0)
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
    swiglu_kept = not (plan.recompute_swiglu and swiglu_made_again(config, ep, lora))
    activations = activation_bytes(config, tokens, mode, checkpointed, plan.checkpoint_experts, received, swiglu_kept)
    if ep > 1 and plan.ep_capacity_factor > 0:  # the static exchange's two shared buffers: rows sent, rows received
        activations += COMPUTE_BYTES * counts.hidden * counts.top_k * tokens * (1 + received)
    if lora is not None:
        activations += _adapter_activation_bytes(config, lora, tokens, mode, checkpointed, plan.lora_dropout, plan.checkpoint_experts)
    logits = _logits_bytes(config, plan, counts, tokens)
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
    allocated = params + state + gathered_weights + gathered_grads + during_backward
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
        fsdp=fsdp,
        expert_grads_persist=expert_grads_persist and fsdp,
        adapters=0 if lora is None else lora.dense + lora.expert,
    )

# ----------------------------------------------------------------------------- does it fit, and what would
MAX_NODES_SUGGESTED = 128  # how far fit_error looks for a GPU count that fits


def _gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB"


def _settings_text(e: MemoryEstimate) -> str:
    p = e.plan
    return (
        f"{p.world_size} GPUs, ep {e.ep}, optim {p.optim}, shard_experts {str(e.shard_experts).lower()}, "
        f"activation_checkpointing {checkpointing_text(e)}, micro batch {p.per_device_train_batch_size} x {p.max_length} tokens"
        + (f", gradient_accumulation_steps {p.gradient_accumulation_steps}" if p.gradient_accumulation_steps > 1 else "")
        + (f", fsdp_wrap {p.fsdp_wrap}" if p.fsdp_wrap != "layer" else "")
    )


def _try(e: MemoryEstimate, **changes) -> MemoryEstimate | None:
    try:
        return _estimate(e.config, replace(e.plan, **changes))
    except InputError:
        return None


def _fewest_checkpointed(e: MemoryEstimate, budget: float, mode: str, start: int = 1, **changes) -> int | None:
    """The fewest decoder layers, from ``start``, that ``mode`` must checkpoint for the plan (with ``changes``) to fit
    ``budget``."""
    for count in range(start, e.config.num_hidden_layers + 1):
        alt = _try(e, activation_checkpointing=mode, activation_checkpointing_layers=count, **changes)
        if alt is not None and alt.total <= budget:
            return count
    return None


def _recompute_flops(e: MemoryEstimate, **changes) -> float:
    """Forward FLOPs per token that a plan (``e``'s, with ``changes``) reruns in the backward: each whole checkpointed
    layer's (its weights' 2 x parameters touched, and attention's scores over half a row on average), or only the
    routed experts' in the layers ``checkpoint_experts`` leaves to them. Compares plans; not a time."""
    plan = replace(e.plan, **changes)
    s = _shape(e.config)
    mode = checkpointing_mode(plan.activation_checkpointing)
    count = 0 if mode == "none" else check_checkpointed_layers(plan.activation_checkpointing_layers, s.layers)
    chosen = _checkpointed(s, mode, count)
    experts = 2 * s.top_k * 3 * s.hidden * s.expert_inter
    attention = 2 * _attention_params(s) + 2 * plan.max_length * s.heads * s.head_dim

    def layer(moe: bool) -> float:
        mlp = experts + 2 * (s.num_experts * s.hidden + 3 * s.hidden * s.shared_inter) if moe else 2 * 3 * s.hidden * s.dense_inter
        return attention + mlp

    total = 0.0
    for i in range(s.layers):
        moe = i in s.moe_layers
        if i in chosen:
            total += layer(moe) if mode == "full" else 0.0  # selective reruns element-wise work only
        elif plan.checkpoint_experts and moe:
            total += experts
    return total


def checkpointing_hint(estimate: MemoryEstimate, gpu_memory_bytes: float, use: float = 0.9) -> str | None:
    """Where checkpointing is on and fewer checkpointed layers would still fit in ``use`` of the GPU (the
    estimate's margin), a line saying how many: each layer left out recomputes nothing and runs faster."""
    if estimate.checkpointing == "none":
        return None
    budget, layers = use * gpu_memory_bytes, estimate.config.num_hidden_layers
    count = _fewest_checkpointed(estimate, budget, estimate.checkpointing, start=0)
    if count is None or count >= estimate.checkpointed:
        count = None
    elif count == 0:
        alt = _try(estimate, activation_checkpointing_layers=0)
        return f"activation checkpointing: none would fit {_within(alt, use, gpu_memory_bytes)}; --activation_checkpointing none recomputes nothing and runs faster"
    # Making the experts' SwiGLU output again (one element-wise pass a layer) costs least of all: where it lets fewer
    # whole layers be checkpointed, that comes first.
    if not estimate.plan.recompute_swiglu:
        swiglu = _fewest_checkpointed(estimate, budget, estimate.checkpointing, start=0, recompute_swiglu=True)
        if swiglu is not None and swiglu < (estimate.checkpointed if count is None else count):
            alt = _try(estimate, activation_checkpointing_layers=swiglu, recompute_swiglu=True)
            flag = "--activation_checkpointing none" if swiglu == 0 else f"--activation_checkpointing_layers {swiglu}"
            return (f"activation checkpointing: {flag} --recompute_swiglu true would fit {_within(alt, use, gpu_memory_bytes)}; "
                    "it makes the experts' SwiGLU output again instead of recomputing whole layers: less work")
    # Recomputing only the routed experts (most of a MoE layer's activations, a small part of its work) in the layers
    # left out is cheaper than recomputing whole layers: fewer whole layers with it are faster still.
    with_experts = None
    if not estimate.plan.checkpoint_experts and estimate.counts.moe_layers:
        with_experts = _fewest_checkpointed(estimate, budget, estimate.checkpointing, start=0, checkpoint_experts=True)
    other = estimate.checkpointed if count is None else count  # whole layers recomputed without it
    if with_experts is not None and _recompute_flops(estimate, activation_checkpointing_layers=with_experts, checkpoint_experts=True) < \
            _recompute_flops(estimate, activation_checkpointing_layers=other):
        alt = _try(estimate, activation_checkpointing_layers=with_experts, checkpoint_experts=True)
        flag = ("--activation_checkpointing none" if with_experts == 0 else f"--activation_checkpointing_layers {with_experts}")
        return (f"activation checkpointing: {flag} --checkpoint_experts true would fit {_within(alt, use, gpu_memory_bytes)}; "
                f"it recomputes the routed experts of the other layers instead of whole layers: less work")
    if count is None:
        return None
    alt = _try(estimate, activation_checkpointing_layers=count)
    return (
        f"activation checkpointing: {count} of {layers} layers would be enough {_within(alt, use, gpu_memory_bytes)}; "
        f"--activation_checkpointing_layers {count} recomputes fewer layers and runs faster"
    )


def _within(alt: MemoryEstimate, use: float, gpu_memory_bytes: float) -> str:
    return f"(estimated {_gib(alt.total)}, within {use:.0%} of the GPU's {_gib(gpu_memory_bytes)})"


def _alternatives(e: MemoryEstimate, budget: float) -> list[str]:
    """One-setting changes that fit, each with its estimate; then the fewest GPUs that fit as planned."""
    p = e.plan
    found = []

    def offer(flag: str, **changes) -> bool:
        alt = _try(e, **changes)
        if alt is not None and alt.total <= budget:
            found.append(f"{flag} ({_gib(alt.total)})")
            return True
        return False

    for optim in OPTIM_BYTES:
        if optim != p.optim:
            offer(f"--optim {optim}", optim=optim)
    layers = e.config.num_hidden_layers
    if p.finetuning == "lora" and p.quantize_base == "none" and p.world_size == 1:  # the frozen base in FP8: half its bytes
        offer("--quantize_base fp8", quantize_base="fp8")
    if not p.recompute_swiglu:  # one element-wise pass a layer made again: cheaper still
        offer("--recompute_swiglu true", recompute_swiglu=True)
    if not p.checkpoint_experts and e.counts.moe_layers:  # the routed experts recomputed: the cheapest memory to give
        offer("--checkpoint_experts true", checkpoint_experts=True)
    for mode in CHECKPOINTING[max(1, CHECKPOINTING.index(e.checkpointing)) :]:
        # the fewest checkpointed layers that fit (the fastest), more than today's where the mode is today's
        start = e.checkpointed + 1 if mode == e.checkpointing else 1
        count = _fewest_checkpointed(e, budget, mode, start)
        if count is not None:
            flag = f"--activation_checkpointing {mode}" + (f" --activation_checkpointing_layers {count}" if count < layers else "")
            offer(flag, activation_checkpointing=mode, activation_checkpointing_layers=-1 if count == layers else count)
    for batch in range(p.per_device_train_batch_size - 1, 0, -1):  # the largest that fits
        if offer(f"--per_device_train_batch_size {batch}", per_device_train_batch_size=batch):
            break
    if p.gradient_accumulation_steps > 1:
        offer("--gradient_accumulation_steps 1", gradient_accumulation_steps=1)
    if not e.shard_experts:
        offer("--shard_experts true", shard_experts=True)
    if p.fsdp_wrap != "layer":  # each layer's dense weights gathered when used, not all at once (nor all on every rank)
        offer("--fsdp_wrap layer", fsdp_wrap="layer")
    if not found:  # no single change is enough: all of them at once
        smallest = min(OPTIM_BYTES, key=lambda o: sum(OPTIM_BYTES[o]))
        now = dict(optim=p.optim, activation_checkpointing=e.checkpointing, per_device_train_batch_size=p.per_device_train_batch_size,
                   gradient_accumulation_steps=p.gradient_accumulation_steps, shard_experts=e.shard_experts, fsdp_wrap=p.fsdp_wrap)
        least = dict(optim=smallest, activation_checkpointing="full", per_device_train_batch_size=1, gradient_accumulation_steps=1,
                     shard_experts=True, fsdp_wrap="layer")
        together = {k: v for k, v in least.items() if v != now[k]}
        if together:
            offer(" ".join(f"--{k} {str(v).lower()}" for k, v in together.items()), **together)
    nproc = p.nproc_per_node
    for world in range(nproc * (p.world_size // nproc + 1), nproc * MAX_NODES_SUGGESTED + 1, nproc):
        # ep as given if it still divides; with ep_size 0 (all ranks) or one that does not, keep today's ep.
        alt = _try(e, world_size=world) or _try(e, world_size=world, ep_size=e.ep)
        if alt is not None and alt.total <= budget:
            keep_ep = f" with --ep_size {alt.ep}" if alt.ep != world and p.ep_size == 0 else ""
            found.append(f"{world} GPUs ({world // nproc} nodes of {nproc}){keep_ep} ({_gib(alt.total)})")
            break
    return found


def fit_error(estimate: MemoryEstimate, gpu_memory_bytes: float) -> str | None:
    """None if the estimate fits in ``gpu_memory_bytes`` per GPU; else what does not fit and settings that would."""
    if estimate.total <= gpu_memory_bytes:
        return None
    alternatives = _alternatives(estimate, gpu_memory_bytes)
    fixes = "; ".join(alternatives) if alternatives else f"none found up to {MAX_NODES_SUGGESTED} nodes"
    return (
        f"{estimate.name} needs about {_gib(estimate.total)} per GPU ({_settings_text(estimate)}), more than the "
        f"{_gib(gpu_memory_bytes)} each GPU has. Settings that fit: {fixes}. "
        f"Breakdown: python -m megablocks_utils.tools.memory (docs/memory.md)"
    )


def resolve_fsdp_wrap(setting: str, estimate: Callable[[str], MemoryEstimate], gpu_memory_bytes: float, world_size: int,
                      ep: int, replicated: bool = False) -> str:
    """The script's ``fsdp_wrap`` ("auto", "layer", "model" or "none"; parallel/mesh.FSDP_WRAPS) as the units to build.

    "auto" is "model" where ep covers every rank (the experts stay out of FSDP, so FSDP's per-layer hooks only gather
    dense weights; measured there: 2 x H200 at ep 2, 11% faster steps, BENCHMARKS.md) and the plan with every layer's
    dense weights gathered at once fits within 90% of the GPU (``estimate``: the plan for a wrap; the margin because the
    estimate ran low on full-size Mixtral, docs/memory.md: a run near the limit keeps the smaller units); else "layer".
    With ``replicated`` (CUDA graphs of the dense segments planned, train/segment_graphs.py, which need the dense
    weights at fixed addresses) it is "none" first, where that plan fits the same way."""
    if setting != "auto":
        return setting
    if world_size == 1 or ep != world_size:
        return "layer"
    if replicated and (gpu_memory_bytes <= 0 or estimate("none").total <= 0.9 * gpu_memory_bytes):
        return "none"
    if gpu_memory_bytes > 0 and estimate("model").total > 0.9 * gpu_memory_bytes:
        return "layer"
    return "model"


def graphs_memory_blocker(estimate: MemoryEstimate, gpu_memory_bytes: float, use: float = 0.9) -> str | None:
    """Why whole micro-steps as CUDA graphs would not fit, or None: a graph's private pool holds a micro-step's
    activations and logits beside the blocks the eager warm-up steps left in the allocator, so the plan needs them twice.
    Measured on one H200 (2026-12-02, Qwen3-30B-A3B's shape, 6 layers, adamw_bf16): rows of 32,768 tokens trained with
    graphs (planned 75.5 + 36.6 GiB, within 90%); at 65,536 (112.0 + 71.3) the capture ran out of memory with 61.8 GiB
    in the graph's pool. ``use``: the share of the GPU the plan may fill (the estimate's margin)."""
    if gpu_memory_bytes <= 0:
        return None
    pool = estimate.activations + estimate.logits
    if estimate.total + pool <= use * gpu_memory_bytes:
        return None
    return (f"the graph's memory pool would hold a micro-step's activations and logits ({_gib(pool)}) beside the eager steps' "
            f"({_gib(estimate.total)} planned): more than {use:.0%} of the GPU's {_gib(gpu_memory_bytes)}; fewer tokens per "
            "micro-step (max_length x per_device_train_batch_size) or activation checkpointing leave room for them")


def check_fit(estimate: MemoryEstimate, gpu_memory_bytes: float, *, hint: bool = False) -> None:
    """Both scripts' fit check, before any weight is read: rank 0 prints the estimate; on a GPU
    (``gpu_memory_bytes`` > 0) every rank stops when it does not fit, rank 0 naming settings that would, and
    with ``hint`` rank 0 says how few checkpointed layers would be enough (``checkpointing_hint``)."""
    import torch.distributed as dist

    master = dist.get_rank() == 0
    if master:  # on CPU ranks no memory is planned: the model and the layout only
        print(estimate.describe(on_gpus=gpu_memory_bytes > 0), flush=True)
    if gpu_memory_bytes > 0:
        too_big = fit_error(estimate, gpu_memory_bytes)
        if too_big:
            fail(too_big)
        note = checkpointing_hint(estimate, gpu_memory_bytes) if hint else None
        if master and note:
            print(note, flush=True)
