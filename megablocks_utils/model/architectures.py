"""The model table: where each supported architecture keeps its MoE block, router and expert weights.

One row per architecture. Everything else (the MoE layer, the loader, the exporter) reads this table
instead of knowing model names, so adding a model means adding a row here (docs/models.md).

Two layouts of the same weights exist. transformers 5 holds a layer's experts fused
(``model.layers.{l}.<block_attr>.experts.gate_up_proj`` [E, 2I, H], gate rows first, and ``down_proj``
[E, H, I]); the hub layout is what checkpoints on the Hub hold and what ``save_pretrained`` writes
back: one tensor per expert and projection for most models, one stacked tensor per layer for Granite.
gpt-oss is the exception to the fused layout above: transformers stores its experts transposed
(``gate_up_proj`` [E, H, 2I] with gate and up in alternating columns, ``down_proj`` [E, I, H]) with
biases, and its hub layout is that same fused layout. Our expert module keeps whatever layout the row
names (``experts_transposed``, ``gate_up_interleaved``), so names and shapes match transformers'.

The load-balancing loss of every row is transformers' ``load_balancing_loss_func`` (the same function,
copied into each model file): softmax of the full router logits, top-k counts, padding masked, times E.
DeepSeek-V3 and GLM-4.5 (``aux_coef_attr=None``) train without one: their router carries a per-expert
score-correction bias instead (aux-loss-free balancing, ``balance.py``).
"""

import re
from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True, kw_only=True)
class MoESpec:
    model_type: str  # config.model_type
    block_attr: str  # attribute of a decoder layer that holds the MoE block (transformers 5 name)
    router_attr: str  # attribute of the MoE block that holds the router (weight [E, H])
    experts_attr: str = "experts"  # attribute of the MoE block that holds the fused experts
    # "softmax_topk": softmax (fp32) over all experts, then top-k (Mixtral, Qwen, OLMoE);
    # "topk_softmax": top-k of the logits, then softmax over those k (Granite; the same as
    # "softmax_topk" with renormalisation, computed in the other order);
    # "sigmoid_group_topk": sigmoid scores (fp32), the best topk_group of n_group expert groups (a group
    # scores the sum of its 2 best), top-k inside them, the weights times routed_scaling_factor (DeepSeek-V3);
    # "softmax_group_topk": softmax (fp32 inputs), with group limiting the best topk_group of n_group groups (a
    # group scores its best expert), top-k, the weights times routed_scaling_factor (DeepSeek-V2).
    router: str = "softmax_topk"
    renormalize: bool | str = False  # renormalise the top-k weights (bool, or a config field); not topk_softmax
    # sigmoid_group_topk: config fields of the group count, the groups kept per token, and the weight scale.
    num_groups_attr: str | None = None
    topk_groups_attr: str | None = None
    scaling_attr: str | None = None
    # softmax_group_topk: config field that turns group limiting on with the value "group_limited_greedy"
    # (DeepSeek-V2's topk_method; "greedy" is plain top-k over all experts).
    group_method_attr: str | None = None
    # The router's own per-expert buffer added to the scores when choosing experts, never to the weights
    # (DeepSeek-V3's e_score_correction_bias); aux-loss-free balancing updates it (balance.py).
    score_bias: str | None = None
    num_experts_attr: str = "num_local_experts"  # config field: number of experts
    top_k_attr: str = "num_experts_per_tok"  # config field: experts per token
    intermediate_attr: str = "intermediate_size"  # config field: expert hidden width
    aux_coef_attr: str | None = "router_aux_loss_coef"  # config field: load-balancing loss coefficient; None: no aux loss
    # Config field: the first N decoder layers have a dense MLP, no MoE block (DeepSeek-V3's first_k_dense_replace).
    dense_layers_attr: str | None = None
    # An always-on dense MLP inside the MoE block, added to the experts' output, optionally scaled by
    # sigmoid(gate(x)) with gate = Linear(H, 1) (Qwen2-MoE). Kept as transformers' own modules.
    shared_expert_attr: str | None = None
    shared_gate_attr: str | None = None
    # Config field holding the width of an always-on dense MLP in every MoE layer: Qwen2-MoE's shared
    # expert (inside the block, above), GraniteMoeShared's shared_mlp (on the decoder layer; 0 = none).
    shared_intermediate_attr: str | None = None
    shared_count_attr: str | None = None  # config field multiplying that width (DeepSeek's n_shared_experts)
    # "mla": DeepSeek's multi-head latent attention (low-rank q and kv projections); dense, FSDP shards it
    # like any attention, only the parameter count (train/memory_plan.py) needs to know.
    attention: str = "standard"
    o_proj_bias: bool = True  # config.attention_bias biases o_proj too (GLM-4.5: only q, k and v)
    # RMSNorm on queries and keys: "per_head" (Qwen3: one weight of head_dim, shared by the heads) or
    # "all_heads" (OLMoE: over the whole q and k projections).
    qk_norm: str | None = None
    # Hub layout, names relative to model.layers.{l}.<hub_block_name>.
    hub_block_name: str
    hub_router: str = "gate.weight"  # the router weight
    hub_gate: str | None = None  # per expert: experts.{e}.<hub_gate>.weight [I, H]
    hub_up: str | None = None  # per expert: experts.{e}.<hub_up>.weight   [I, H]
    hub_down: str | None = None  # per expert: experts.{e}.<hub_down>.weight [H, I]
    hub_stacked: tuple[str, str] | None = None  # or all experts in one tensor: (gate_up [E, 2I, H], down [E, H, I])
    # Expert compute, as in transformers' fused experts (the flags of its use_experts_implementation):
    # None: act(gate) * up with config.hidden_act; "gpt_oss_swiglu": gpt-oss's clamped SwiGLU,
    # (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = clamp(gate, max=limit), with alpha and
    # limit from config.swiglu_alpha / config.swiglu_limit.
    expert_act: str | None = None
    experts_transposed: bool = False  # fused weights stored [E, in, out]: gate_up [E, H, 2I], down [E, I, H]
    gate_up_interleaved: bool = False  # gate and up alternate columns (gate = [..., ::2]), not halves
    expert_bias: bool = False  # per-expert gate_up_proj_bias [E, 2I] and down_proj_bias [E, H]
    router_bias: bool = False  # the router is Linear(H, E) with a bias
    # The block returns (hidden states, router scores) and the decoder layer unpacks them (gpt-oss).
    block_returns_scores: bool = False
    # Attention details the model table knows for the parameter count and the attention choice:
    # one learned sink logit per head (gpt-oss), and whether transformers has an sdpa kernel for it.
    attention_sinks: bool = False
    supports_sdpa: bool = True
    # Config field the model divides lm_head's output by before returning it as logits (Granite's logits_scaling).
    # The loss computed inside lm_head (train/loss.py's LossHead) would be divided too: such a model keeps the
    # full-logits loss.
    logits_scaling_attr: str | None = None

    def aux_loss_coef(self, config) -> float:
        """The config's load-balancing loss coefficient; 0 for a model trained without one."""
        return float(getattr(config, self.aux_coef_attr, 0.0) or 0.0) if self.aux_coef_attr else 0.0

    def router_options(self, config) -> dict:
        """Keyword arguments of ``router.TopKRouter`` beyond the common ones, from the config."""
        if self.router not in ("sigmoid_group_topk", "softmax_group_topk"):
            return dict(score_bias=self.score_bias)
        if self.group_method_attr is not None and getattr(config, self.group_method_attr) != "group_limited_greedy":
            return dict(scaling=float(getattr(config, self.scaling_attr)), score_bias=self.score_bias)
        return dict(
            num_groups=getattr(config, self.num_groups_attr) or 1,
            topk_groups=getattr(config, self.topk_groups_attr) or 1,
            scaling=float(getattr(config, self.scaling_attr)),
            score_bias=self.score_bias,
        )

    def fused_names(self, layer: int) -> tuple[str, str]:
        """transformers 5 names of one layer's (gate_up_proj, down_proj)."""
        prefix = f"model.layers.{layer}.{self.block_attr}.{self.experts_attr}"
        return f"{prefix}.gate_up_proj", f"{prefix}.down_proj"

    def fused_bias_names(self, layer: int) -> tuple[str, str]:
        """transformers 5 names of one layer's (gate_up_proj_bias, down_proj_bias), where the row has them."""
        gate_up, down = self.fused_names(layer)
        return f"{gate_up}_bias", f"{down}_bias"

    def hub_expert_names(self, layer: int, expert: int) -> tuple[str, str, str]:
        """Hub names of one expert's (gate, up, down) projections (per-expert hub layout)."""
        prefix = f"model.layers.{layer}.{self.hub_block_name}.experts.{expert}"
        return tuple(f"{prefix}.{p}.weight" for p in (self.hub_gate, self.hub_up, self.hub_down))

    def hub_stacked_names(self, layer: int) -> tuple[str, str]:
        """Hub names of one layer's stacked (gate_up, down) tensors (stacked hub layout)."""
        return tuple(f"model.layers.{layer}.{self.hub_block_name}.{n}" for n in self.hub_stacked)

    def model_to_hub(self, name: str) -> str:
        """A non-expert transformers 5 name -> its hub name (only the router moves)."""
        pattern = rf"^(model\.layers\.\d+)\.{re.escape(self.block_attr)}\.{re.escape(self.router_attr)}\.weight$"
        return re.sub(pattern, rf"\1.{self.hub_block_name}.{self.hub_router}", name)

    def hub_to_model(self, name: str) -> str:
        """A non-expert hub name -> its transformers 5 name."""
        pattern = rf"^(model\.layers\.\d+)\.{re.escape(self.hub_block_name)}\.{re.escape(self.hub_router)}$"
        return re.sub(pattern, rf"\1.{self.block_attr}.{self.router_attr}.weight", name)

    def is_expert_name(self, name: str) -> bool:
        """Whether a tensor name (either layout) is expert weights."""
        if f".{self.block_attr}.{self.experts_attr}." in name:
            return True
        if self.hub_stacked is not None:
            return any(name.endswith(f".{self.hub_block_name}.{n}") for n in self.hub_stacked)
        return f".{self.hub_block_name}.experts." in name


_QWEN_STYLE = dict(  # Qwen2-MoE, Qwen3-MoE and OLMoE share names and hub layout
    block_attr="mlp",
    router_attr="gate",
    num_experts_attr="num_experts",
    renormalize="norm_topk_prob",
    hub_block_name="mlp",
    hub_gate="gate_proj",
    hub_up="up_proj",
    hub_down="down_proj",
)
_GRANITE = dict(
    block_attr="block_sparse_moe",
    router_attr="router",
    router="topk_softmax",
    hub_block_name="block_sparse_moe",
    hub_router="router.layer.weight",
    hub_stacked=("input_linear.weight", "output_linear.weight"),
    logits_scaling_attr="logits_scaling",
)

_DEEPSEEK_STYLE = dict(  # DeepSeek-V3 and GLM-4.5 share the MoE block, its names and hub layout
    **{k: v for k, v in _QWEN_STYLE.items() if k != "num_experts_attr"},
    router="sigmoid_group_topk",
    num_groups_attr="n_group",
    topk_groups_attr="topk_group",
    scaling_attr="routed_scaling_factor",
    score_bias="e_score_correction_bias",
    intermediate_attr="moe_intermediate_size",
    aux_coef_attr=None,
    dense_layers_attr="first_k_dense_replace",
    shared_expert_attr="shared_experts",
    shared_intermediate_attr="moe_intermediate_size",
    shared_count_attr="n_shared_experts",
)

MOE_SPECS = {
    "mixtral": MoESpec(
        model_type="mixtral",
        block_attr="mlp",
        router_attr="gate",
        renormalize=True,
        hub_block_name="block_sparse_moe",
        hub_gate="w1",
        hub_up="w3",
        hub_down="w2",
    ),
    "qwen2_moe": MoESpec(
        model_type="qwen2_moe",
        **_QWEN_STYLE,
        intermediate_attr="moe_intermediate_size",
        shared_expert_attr="shared_expert",
        shared_gate_attr="shared_expert_gate",
        shared_intermediate_attr="shared_expert_intermediate_size",
    ),
    "qwen3_moe": MoESpec(model_type="qwen3_moe", **_QWEN_STYLE, intermediate_attr="moe_intermediate_size", qk_norm="per_head"),
    "olmoe": MoESpec(model_type="olmoe", **_QWEN_STYLE, qk_norm="all_heads"),
    # GraniteMoeShared's shared MLP sits on the decoder layer (shared_mlp), outside the MoE block: dense.
    "granitemoe": MoESpec(model_type="granitemoe", **_GRANITE),
    "granitemoeshared": MoESpec(model_type="granitemoeshared", **_GRANITE, shared_intermediate_attr="shared_intermediate_size"),
    # MLA attention; the MTP layers of hub checkpoints (past num_hidden_layers) are not part of the model.
    "deepseek_v3": MoESpec(model_type="deepseek_v3", **_DEEPSEEK_STYLE, attention="mla"),
    # DeepSeek-V2 (and V2-Lite): V3's block, names and MLA, routed by softmax (greedy or group-limited top-k, no
    # renormalisation: transformers ignores norm_topk_prob here), no score bias, no load-balancing loss.
    "deepseek_v2": MoESpec(
        model_type="deepseek_v2",
        **{**_DEEPSEEK_STYLE, "router": "softmax_group_topk", "score_bias": None, "renormalize": False},
        num_experts_attr="num_experts",
        group_method_attr="topk_method",
        attention="mla",
    ),
    # GLM-4.5: DeepSeek-V3's MoE block with standard attention (qk norm per head if use_qk_norm).
    "glm4_moe": MoESpec(model_type="glm4_moe", **_DEEPSEEK_STYLE, o_proj_bias=False),
    # gpt-oss: save_pretrained writes the fused names (no conversion), so the hub layout is "stacked"
    # under the same names. Sliding-window layers and attention sinks are transformers' attention (dense).
    "gpt_oss": MoESpec(
        model_type="gpt_oss",
        block_attr="mlp",
        router_attr="router",
        router="topk_softmax",
        hub_block_name="mlp",
        hub_router="router.weight",
        hub_stacked=("experts.gate_up_proj", "experts.down_proj"),
        expert_act="gpt_oss_swiglu",
        experts_transposed=True,
        gate_up_interleaved=True,
        expert_bias=True,
        router_bias=True,
        block_returns_scores=True,
        attention_sinks=True,
        supports_sdpa=False,
    ),
}


def spec_for(config) -> MoESpec:
    """The table row for a config, or an error listing what is supported."""
    model_type = getattr(config, "model_type", None)
    if model_type not in MOE_SPECS:
        raise ValueError(
            f"model_type={model_type!r} is not a supported MoE architecture; supported: "
            f"{sorted(MOE_SPECS)}. Add a row to megablocks_utils/model/architectures.py:MOE_SPECS to support it."
        )
    return MOE_SPECS[model_type]


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a causal LM (``model.model.layers`` in every supported family)."""
    base = getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"{type(model).__name__} has no `model.layers` ModuleList; cannot find decoder layers")
    return layers


def decoder_layer_class_name(model: nn.Module) -> str:
    """The decoder-layer class name, which FSDP1's transformer-based wrap policy needs."""
    return type(decoder_layers(model)[0]).__name__
