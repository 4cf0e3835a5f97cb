"""The fit check's parameter side: the model's shape read once from its config (``model_shape``), its parameter
counts, and the bytes each weight, gradient and optimizer state takes (``OPTIM_BYTES``, which ``train/optim.py`` reads
back; a frozen quantized base's, ``frozen_bytes``). ``memory_plan`` adds them up with the activations
(``memory_activations``)."""

from dataclasses import dataclass

import torch

from megablocks_utils.errors import InputError
from megablocks_utils.model.architectures import spec_for
from megablocks_utils.moe.quantized import dequantizes_first

GiB = 2**30

# ----------------------------------------------------------------------------- bytes (calibrate here)
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
class ModelShape:
    """What the fit check reads from a config, read once (``model_shape``) and passed down."""

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
    spec: object = None  # the model table's row (architectures.MoESpec)
    hidden_act: str = "silu"


def model_shape(config_or_shape) -> ModelShape:
    """The shape of a config's model (a ``ModelShape`` is returned as it is)."""
    if isinstance(config_or_shape, ModelShape):
        return config_or_shape
    config = config_or_shape
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
    return ModelShape(
        spec=spec,
        hidden_act=getattr(config, "hidden_act", "silu"),
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


def attention_params(s: ModelShape) -> int:
    if s.mla is not None:
        return _mla_params(s)
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    weights = s.hidden * q + 2 * s.hidden * kv + q * s.hidden
    biases = (q + 2 * kv if s.qkv_bias else 0) + (s.hidden if s.o_bias else 0)
    qk_norm = {"per_head": 2 * s.head_dim, "all_heads": q + kv, None: 0}[s.qk_norm]
    sinks = s.heads if s.sinks else 0
    return weights + biases + qk_norm + sinks + 2 * s.hidden  # + input and post-attention RMSNorm


def _mla_params(s: ModelShape) -> int:
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
    """Parameter counts from the config's fields and the model table (no weights, no model built); ``config``: a
    config or its ``ModelShape``."""
    s = model_shape(config)
    attention = attention_params(s)
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


def count_text(n: float) -> str:
    """A parameter count as people say it: 30.53 B, 0.92 M."""
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"


# ----------------------------------------------------------------------------- a frozen base's bytes (LoRA)
FP8_BYTES = 1 + 4 / 128**2  # a float8 weight and its share of its 128 x 128 block's fp32 scale (moe/quantized.py)
MXFP4_BYTES = 0.5 + 1 / 32  # an e2m1 weight and its share of its 32 inputs' exponent byte (gpt-oss's released experts)


def frozen_bytes(counts: ParamCounts, quantize_base: str, dense_shards: int, expert_shards: int, released: str | None = None,
                  expert_biases: int = 0, routed_rows: float = 0.0) -> float:
    """LoRA's frozen weights on one GPU: in the compute dtype, or with ``quantize_base`` fp8 the routed experts and the
    decoder layers' linear layers in FP8 (embeddings, lm_head, routers and norms stay in the compute dtype), experts
    released in MXFP4 (``released``) in MXFP4; their biases (``expert_biases``, gpt-oss's) stay in the compute dtype.
    FP8 experts over ``routed_rows`` rows a micro-step: where their GEMMs write the bf16 weight first
    (``quantized.dequantizes_first``), the largest one (gate and up: two thirds of a layer's) while its GEMM runs."""
    if quantize_base == "none":
        return COMPUTE_BYTES * (counts.dense / dense_shards + counts.expert / expert_shards)
    if quantize_base != "fp8":
        raise InputError(f"quantize_base={quantize_base!r} is unknown; choose none or fp8")
    kept = counts.root + counts.moe_layers * counts.num_experts * counts.hidden  # embeddings, lm_head, routers
    experts = MXFP4_BYTES if released == "mxfp4" else FP8_BYTES
    copy = 0.0
    if released != "mxfp4" and dequantizes_first("auto", routed_rows, counts.num_experts / expert_shards):
        copy = COMPUTE_BYTES * 2 / 3 * (counts.expert_layer - expert_biases / max(counts.moe_layers, 1)) / expert_shards
    return (COMPUTE_BYTES * kept / dense_shards + FP8_BYTES * (counts.dense - kept) / dense_shards
            + (experts * (counts.expert - expert_biases) + COMPUTE_BYTES * expert_biases) / expert_shards + copy)
