"""Activation checkpointing: "full", "selective" and the experts' recompute (``checkpoint_experts``) give the
loss and every gradient of no checkpointing on an expert-parallel model; "selective" recomputes no GEMM and no
all-to-all; the experts' recompute reruns the expert GEMMs and the layer's all-to-alls and nothing else; a count of
checkpointed layers recomputes those layers and no others."""

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from conftest import run_ranks, tiny_mixtral_config
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import CheckpointPolicy, checkpoint

from megablocks_utils import (
    causal_lm_loss_sum,
    count_label_tokens,
    moe_blocks,
    router_stats,
    shard_moe,
)
from megablocks_utils.model.architectures import decoder_layers
from megablocks_utils.parallel.activation_checkpointing import (
    ACTIVATION_CHECKPOINTING,
    OpCounter,
    _contexts,
    _policy,
    apply_activation_checkpointing,
    checkpointed_layers,
    parse_activation_checkpointing,
)

aten = torch.ops.aten
MATMULS = (aten.mm, aten.addmm, aten.bmm, aten.baddbmm)
TOL = 1e-6


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))


def train_step(reference, mode, rank, layers=-1, experts=False, chunks=1):
    """One forward and backward of a fresh ep=2 copy (tokens in ``chunks`` overlap chunks); the backward runs under an
    op counter."""
    model = copy.deepcopy(reference)
    mesh = shard_moe(model, 2, device="cpu", overlap_chunks=chunks)
    apply_activation_checkpointing(model, mode, layers, experts)
    flags = [layer.gradient_checkpointing for layer in decoder_layers(model)]
    chosen = checkpointed_layers(len(flags), layers) if mode != "none" else []
    assert flags == [i in chosen for i in range(len(flags))], (mode, layers, flags)
    recompute = [block.experts.recompute for block in moe_blocks(model)]
    assert recompute == [experts and i not in chosen for i in range(len(flags))], (mode, layers, experts, recompute)
    model.train()
    g = torch.Generator().manual_seed(rank)
    input_ids = torch.randint(1, model.config.vocab_size, (2, 10), generator=g)
    mask = torch.ones_like(input_ids)
    mask[1, 7:] = 0
    labels = input_ids.masked_fill(mask == 0, -100)
    out = model(input_ids, attention_mask=mask)
    stats = router_stats(model, mask, mesh.world.get_group())
    loss = causal_lm_loss_sum(out.logits, labels) / count_label_tokens(labels) + 0.02 * stats.local
    for block in moe_blocks(model):
        block.record_router = True  # as if the caller never turned recording off: a recompute must not record
    with OpCounter() as backward_ops:
        loss.backward()
    recorded = sum(block.router_probs is not None for block in moe_blocks(model))
    grads = {n: (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).clone() for n, p in model.named_parameters()}
    return loss.detach(), grads, backward_ops, recorded


def check_modes(rank, world):
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    config = tiny_mixtral_config(num_hidden_layers=3)
    reference = AutoModelForCausalLM.from_config(config).float()
    runs = {mode: train_step(reference, mode, rank) for mode in ACTIVATION_CHECKPOINTING}
    runs["full on 1"] = train_step(reference, "full", rank, layers=1)  # the middle layer only
    runs["selective on 2"] = train_step(reference, "selective", rank, layers=2)
    runs["experts"] = train_step(reference, "none", rank, experts=True)
    runs["full on 1, experts"] = train_step(reference, "full", rank, layers=1, experts=True)
    runs["none, 2 chunks"] = train_step(reference, "none", rank, chunks=2)
    runs["selective, 2 chunks"] = train_step(reference, "selective", rank, chunks=2)
    loss, grads, none_ops, _ = runs["none"]
    for mode in ("full", "selective", "full on 1", "selective on 2", "experts", "full on 1, experts", "none, 2 chunks",
                 "selective, 2 chunks"):
        mode_loss, mode_grads, _, recorded = runs[mode]
        assert rel_err(mode_loss, loss) <= TOL, (mode, mode_loss, loss)
        assert mode_grads.keys() == grads.keys()
        for name, grad in grads.items():
            assert rel_err(mode_grads[name], grad) <= TOL, (mode, name, rel_err(mode_grads[name], grad))
        assert recorded == 0, f"{mode}: the recompute recorded router outputs in {recorded} layers"

    layers = config.num_hidden_layers
    # A decoder layer's forward GEMMs: q, k, v, o, the router, and per local expert gate_up and down.
    layer_gemms = 4 + 1 + 2 * (config.num_local_experts // 2)
    a2a = torch.ops._c10d_functional.all_to_all_single
    full_ops, selective_ops = runs["full"][2], runs["selective"][2]
    assert full_ops.total(*MATMULS) == none_ops.total(*MATMULS) + layers * layer_gemms, (full_ops.counts, none_ops.counts)
    assert selective_ops.total(*MATMULS) == none_ops.total(*MATMULS), "selective recomputed GEMMs"
    # Three all-to-alls per layer forward (counts, tokens out, tokens back): full repeats them, selective does not.
    assert full_ops.total(a2a) == none_ops.total(a2a) + 3 * layers
    assert selective_ops.total(a2a) == none_ops.total(a2a), "selective communicated in the recompute"
    assert selective_ops.total(aten.silu) == full_ops.total(aten.silu) > none_ops.total(aten.silu), "element-wise ops are recomputed"
    # A count: only those layers recompute (1 of 3 here: one layer's GEMMs and all-to-alls; 2 of 3: two layers' SiLUs).
    assert runs["full on 1"][2].total(*MATMULS) == none_ops.total(*MATMULS) + layer_gemms
    assert runs["full on 1"][2].total(a2a) == none_ops.total(a2a) + 3
    silu_per_layer = (full_ops.total(aten.silu) - none_ops.total(aten.silu)) // layers
    assert silu_per_layer > 0
    assert runs["selective on 2"][2].total(aten.silu) == none_ops.total(aten.silu) + 2 * silu_per_layer
    assert runs["selective on 2"][2].total(*MATMULS) == none_ops.total(*MATMULS)
    # The experts' recompute: each layer's expert GEMMs and its three all-to-alls again, not q/k/v/o or the router.
    expert_gemms = 2 * (config.num_local_experts // 2)
    experts_ops = runs["experts"][2]
    assert experts_ops.total(*MATMULS) == none_ops.total(*MATMULS) + layers * expert_gemms, (experts_ops.counts, none_ops.counts)
    assert experts_ops.total(a2a) == none_ops.total(a2a) + 3 * layers
    mixed = runs["full on 1, experts"][2]  # layer 1 whole, layers 0 and 2 their experts
    assert mixed.total(*MATMULS) == none_ops.total(*MATMULS) + layer_gemms + 2 * expert_gemms
    assert mixed.total(a2a) == none_ops.total(a2a) + 3 * layers
    # overlap_chunks: selective replays each chunk's all-to-alls and GEMMs from the forward too.
    chunked_none, chunked_selective = runs["none, 2 chunks"][2], runs["selective, 2 chunks"][2]
    assert chunked_none.total(a2a) == none_ops.total(a2a) + 2 * layers  # each layer's second chunk: its rows both ways
    assert chunked_selective.total(a2a) == chunked_none.total(a2a), "selective communicated in the recompute (2 chunks)"
    assert chunked_selective.total(*MATMULS) == chunked_none.total(*MATMULS), "selective recomputed GEMMs (2 chunks)"


def test_full_and_selective_match_no_checkpointing_on_ep2():
    """2 gloo ranks, ep=2, fp32: loss and every gradient equal, on all layers and on a count of them, and with the
    experts' recompute alone or beside full layers, and with the tokens in 2 overlap chunks; selective replays GEMMs and all-to-alls from the forward, full
    recomputes each checkpointed layer's GEMMs and all-to-alls once, the experts' recompute only the expert GEMMs and
    the all-to-alls; no router recording."""
    run_ranks(check_modes, 2)


def test_selective_keeps_exact_overloads_so_compiled_gemms_stay_correct():
    """Compiled code calls its GEMMs as aten.mm.out into its own buffers: the policy must recompute
    those (a kept out= result would not land in the recompute's buffer) and keep mm.default."""
    assert _policy(None, aten.mm.default) == CheckpointPolicy.MUST_SAVE
    assert _policy(None, aten.mm.out) == CheckpointPolicy.PREFER_RECOMPUTE
    assert _policy(None, aten.silu.default) == CheckpointPolicy.PREFER_RECOMPUTE
    torch.manual_seed(0)
    w1, w2 = torch.randn(16, 16, requires_grad=True), torch.randn(16, 16, requires_grad=True)

    def part(x):
        return F.linear(torch.relu(F.linear(x, w1)), w2)

    compiled = torch.compile(part)

    def layer(x, f):
        return torch.sin(f(torch.cos(x)) @ w2)

    x = torch.randn(8, 16, requires_grad=True)
    expected = torch.autograd.grad(layer(x, part).square().sum(), (x, w1, w2))
    context_fn = functools.partial(_contexts, [], True)
    out = checkpoint(layer, x, compiled, use_reentrant=False, context_fn=context_fn)
    grads = torch.autograd.grad(out.square().sum(), (x, w1, w2))
    assert len(grads) == len(expected) == 3
    for g, e in zip(grads, expected):
        assert rel_err(g, e) <= 1e-5


@pytest.mark.parametrize("value,mode", [("true", "full"), ("False", "none"), (True, "full"), ("selective", "selective"), ("none", "none")])
def test_parse_accepts_modes_and_old_booleans(value, mode):
    assert parse_activation_checkpointing(value) == mode


def test_parse_names_the_choices():
    with pytest.raises(ValueError, match="choose none, full .* or selective"):
        parse_activation_checkpointing("partial")


@pytest.mark.parametrize("layers,count", [(32, 16), (32, 1), (32, 31), (5, 2), (3, 0), (7, 7), (7, -1)])
def test_checkpointed_layers_are_the_count_spread_evenly(layers, count):
    chosen = checkpointed_layers(layers, count)
    want = layers if count == -1 else count
    assert len(chosen) == len(set(chosen)) == want and all(0 <= i < layers for i in chosen)
    if 0 < want < layers:  # gaps between chosen layers (and before the first) differ by at most one
        gaps = [b - a for a, b in zip([-1, *chosen], chosen)]
        assert max(gaps) - min(gaps) <= 1, chosen
    if count == layers // 2 and layers % 2 == 0:
        assert chosen == list(range(1, layers, 2))


def test_a_count_beyond_the_model_is_refused():
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(tiny_mixtral_config(num_hidden_layers=2))
    with pytest.raises(ValueError, match="give 0..2 decoder layers"):
        apply_activation_checkpointing(model, "full", 3)


def test_recompute_swiglu_reaches_the_layers_only_up_to_the_ep_it_has_run_at(monkeypatch):
    """``apply_activation_checkpointing(..., swiglu=True)`` sets every MoE layer's ``recompute_swiglu`` where the ep is at
    most ``RECOMPUTE_SWIGLU_RAN_AT_EP`` (the GPUs it has run on), and leaves it off above, which the run's line says."""
    import torch.distributed as dist
    from conftest import free_port
    from transformers import AutoModelForCausalLM

    from megablocks_utils.moe import experts as moe_experts
    from megablocks_utils.moe.layer import ExpertParallelExperts
    from megablocks_utils.parallel.activation_checkpointing import apply_activation_checkpointing, recompute_swiglu_text

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_mixtral_config())
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        shard_moe(model, 1, device="cpu")
    finally:
        dist.destroy_process_group()
    layers = [m for m in model.modules() if isinstance(m, ExpertParallelExperts)]
    apply_activation_checkpointing(model, "none", swiglu=True)
    assert len(layers) == 2 and all(m.recompute_swiglu for m in layers)
    assert recompute_swiglu_text(model, "cuda") == "recompute_swiglu: 2 of 2 MoE layers make SwiGLU's output again in the backward"
    monkeypatch.setattr(moe_experts, "RECOMPUTE_SWIGLU_RAN_AT_EP", 0)  # as if this ep had not run: the guard keeps it off
    apply_activation_checkpointing(model, "none", swiglu=True)
    assert not any(m.recompute_swiglu for m in layers)
    assert recompute_swiglu_text(model, "cuda").startswith("recompute_swiglu: off: on GPUs it has run only at ep <= 0 so far")
    assert recompute_swiglu_text(model, "cpu").startswith("recompute_swiglu: nothing to make again on CPU")
