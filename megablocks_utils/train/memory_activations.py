"""The fit check's activation side: what a micro-batch's forward keeps for its backward, per decoder layer and
token, under each activation checkpointing mode, with the routed experts' rows, LoRA's adapters and the loss's logits.
Every byte constant is named with its reasoning (first estimates from what autograd saves, calibrated against measured
peaks: docs/memory.md)."""

from megablocks_utils.config.inputs import parse_bool
from megablocks_utils.errors import InputError
from megablocks_utils.parallel.activation_checkpointing import checkpointed_layers
from megablocks_utils.train.loss import loss_chunk_rows
from megablocks_utils.train.memory_counts import COMPUTE_BYTES, ModelShape, model_shape

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

CHECKPOINTING = ("none", "selective", "full")  # weakest to strongest

def checkpointing_mode(setting) -> str:
    """``activation_checkpointing`` as the scripts give it (a bool, or none/selective/full) -> a mode name."""
    flag = parse_bool(setting)
    if flag is not None:
        return "full" if flag else "none"
    text = str(setting).lower()
    if text not in CHECKPOINTING:
        raise InputError(f"activation_checkpointing={setting!r} is unknown; choose none, selective or full (true = full, false = none)")
    return text

def _expert_activation_bytes(s: ModelShape, received: float = EXPERT_LOAD_IMBALANCE, swiglu_kept: bool = True) -> float:
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


def _layer_activation_bytes(s: ModelShape, moe: bool, mode: str, received: float = EXPERT_LOAD_IMBALANCE,
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


def chosen_layers(s: ModelShape, mode: str, checkpointed: int) -> set[int]:
    """The decoder layers ``mode`` applies to (``checkpointed_layers``); none for "none"."""
    return set(checkpointed_layers(s.layers, checkpointed)) if mode != "none" else set()


def uncheckpointed_moe_layers(s: ModelShape, mode: str, checkpointed: int) -> int:
    chosen = chosen_layers(s, mode, checkpointed)
    return sum(1 for i in range(s.layers) if i in s.moe_layers and i not in chosen)


def activation_bytes(config, tokens: int, mode: str, checkpointed: int = -1, experts: bool = False,
                     received: float = EXPERT_LOAD_IMBALANCE, swiglu_kept: bool = True) -> float:
    """Peak activation bytes of a micro-batch of ``tokens`` tokens on one rank (the logits apart), with
    ``mode`` on ``checkpointed`` decoder layers (``checkpointed_layers``; -1: all) and none on the rest, the rest's
    routed experts recomputed with ``experts`` (``checkpoint_experts``); ``received``: ``received_rows``;
    ``swiglu_kept`` False: the layers that keep their experts' activations make SwiGLU's output again instead
    (``recompute_swiglu``; the layer being worked on in the backward is still counted whole). ``config``: a config or
    its ``ModelShape``."""
    s = model_shape(config)
    is_moe = [i in s.moe_layers for i in range(s.layers)]
    chosen = chosen_layers(s, mode, checkpointed)
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

def swiglu_made_again(s: ModelShape, ep: int, lora) -> bool:
    """Whether ``recompute_swiglu`` has anything to make again on a GPU (``experts.makes_swiglu_again``): experts
    of SiLU * up (not gpt-oss's clamped SwiGLU), several on each rank, no LoRA on them (``lora``: the adapter counts), and
    an ep it has run at (``RECOMPUTE_SWIGLU_RAN_AT_EP``)."""
    from megablocks_utils.moe.experts import RECOMPUTE_SWIGLU_RAN_AT_EP

    if ep > RECOMPUTE_SWIGLU_RAN_AT_EP:
        return False
    silu = s.spec.expert_act is None and not s.spec.gate_up_interleaved and s.hidden_act == "silu"
    return bool(s.moe_layers) and silu and s.num_experts // ep > 1 and (lora is None or not lora.expert)


def adapter_activation_bytes(s: ModelShape, lora, tokens: int, mode: str, checkpointed: int, dropout: float, experts: bool = False) -> float:
    """What the adapters add to the activations: per adapted projection and token (copy, for experts) the [., r]
    product that B's GEMM saves; with dropout the dropped input and its mask; under "selective" also B's output (a
    GEMM output, kept like the base projection's). Checkpointed ("full") layers keep nothing of it, the one being
    recomputed everything; with ``experts`` (``checkpoint_experts``) the other layers keep their dense adapters' only."""
    chosen = chosen_layers(s, mode, checkpointed)

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


def logits_bytes(s: ModelShape, tokens: int, chunked_loss: bool, lm_head_adapter: bool) -> float:
    """The loss's memory: one chunk of logits with the chunked loss (``install_loss_head``'s cases: not for a model
    that rescales its logits, nor for an lm_head with a LoRA adapter), else every token's full logits."""
    if chunked_loss and not s.spec.logits_scaling_attr and not lm_head_adapter:
        return CHUNKED_LOGITS_BYTES * loss_chunk_rows(tokens, s.vocab) * s.vocab + COMPUTE_BYTES * tokens * s.hidden
    return LOGITS_BYTES * tokens * s.vocab


def check_checkpointed_layers(count, num_layers: int) -> int:
    """``activation_checkpointing_layers`` checked against the model's decoder layers; -1 -> ``num_layers``."""
    if not isinstance(count, int) or isinstance(count, bool) or count < -1:
        raise InputError(f"activation_checkpointing_layers={count!r} must be -1 (every decoder layer) or a count of layers, 0..{num_layers}")
    if count > num_layers:
        raise InputError(
            f"activation_checkpointing_layers={count} but the model has {num_layers} decoder layers; give 0..{num_layers}, or -1 for all"
        )
    return num_layers if count == -1 else count
