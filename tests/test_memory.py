"""The memory fit check: parameter counts against published totals and against transformers' own models,
per-GPU bytes against hand-computed numbers for a tiny config, and the command line's verdicts."""

import ast
import json
import os
import re
import subprocess
import sys

import pytest
import torch
from conftest import ARCHITECTURES, ROOT, tiny_moe_config

from megablocks_utils.config.inputs import resolve_shard_experts
from megablocks_utils.errors import InputError
from megablocks_utils.model.architectures import spec_for
from megablocks_utils.model.loading import load_config
from megablocks_utils.tools import memory
from megablocks_utils.train import memory_activations, memory_fit, memory_plan
from megablocks_utils.train.memory_counts import GiB, count_params
from megablocks_utils.train.memory_fit import fit_error
from megablocks_utils.train.memory_plan import estimate_memory

CONFIGS = os.path.join(ROOT, "tests", "configs")
MIXTRAL_8X7B = os.path.join(CONFIGS, "mixtral-8x7b")

# Published sizes (model cards): total and active parameters, in billions, and the rounding they are given with.
PUBLISHED = {
    "mixtral-8x7b": (46.70, 12.9, 0.05),
    "mixtral-8x22b": (140.6, 39, 0.5),  # "39B active"
    "qwen3-30b-a3b": (30.5, 3.3, 0.05),
    # DeepSeek-V2-Lite: "15.7B total, 2.4B activated"; DeepSeek counts the active ones without the input embedding
    # (102400 x 2048 = 0.21 B), which our count (the parameters a token touches) includes: 2.66 B.
    "deepseek-v2-lite": (15.7, 2.4 + 102400 * 2048 / 1e9, 0.05),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_counts_match_published_totals(name):
    counts = count_params(load_config(os.path.join(CONFIGS, name)))
    total, active, rounding = PUBLISHED[name]
    assert abs(counts.total / 1e9 - total) / total < 0.005
    assert abs(counts.active / 1e9 - active) <= rounding + 0.01
    assert counts.total == counts.dense + counts.expert


def _built_counts(config) -> tuple[int, int]:
    """(total, expert) parameters of the transformers model itself, built on the meta device."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    spec = spec_for(config)
    named = dict(model.named_parameters())  # tied weights appear once
    expert = sum(p.numel() for n, p in named.items() if spec.is_expert_name(n))
    return sum(p.numel() for p in named.values()), expert


VARIANTS = [(arch, {}) for arch in ARCHITECTURES] + [
    ("qwen3_moe", dict(attention_bias=True, mlp_only_layers=[0], intermediate_size=40)),
    ("qwen2_moe", dict(decoder_sparse_step=2, mlp_only_layers=[], qkv_bias=False)),
    ("olmoe", dict(attention_bias=True, tie_word_embeddings=True)),
    ("granitemoe", dict(attention_bias=True, num_key_value_heads=4)),
    ("mixtral", dict(head_dim=8)),
    ("deepseek_v3", dict(q_lora_rank=None, attention_bias=True, first_k_dense_replace=0)),
    ("glm4_moe", dict(use_qk_norm=False, attention_bias=False, n_shared_experts=2)),
]


@pytest.mark.parametrize("arch,overrides", VARIANTS, ids=[f"{a}-{i}" for i, (a, _) in enumerate(VARIANTS)])
def test_counts_match_the_transformers_model(arch, overrides):
    config = tiny_moe_config(arch, **overrides)
    counts = count_params(config)
    assert (counts.total, counts.expert) == _built_counts(config)


# A tiny Mixtral counted by hand: H=8, I=16, 2 layers, 2 heads of 4 (q 8 wide), 1 kv head (4 wide), vocab 10,
# 4 experts top-2, untied.
#   attention 8*8 + 8*4 + 8*4 + 8*8 = 192, two norms 16, router 4*8 = 32: 240 dense per layer
#   experts 4 * 3*8*16 = 1536 per layer
#   dense = 2*240 + embed 80 + lm_head 80 + final norm 8 = 648; experts = 2*1536 = 3072
TINY = dict(
    model_type="mixtral", hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, vocab_size=10, num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False,
)


def _tiny(**settings):
    plan = dict(world_size=2, ep_size=2, optim="adamw_torch", shard_experts=True, max_length=5, per_device_train_batch_size=3)
    plan.update(settings)
    return estimate_memory(dict(TINY), **plan)


def test_tiny_counts_by_hand():
    counts = count_params(load_config(dict(TINY)))
    assert (counts.dense, counts.expert, counts.total) == (648, 3072, 3720)
    assert counts.active == 648 + 2 * 2 * 384  # two of the four 384-parameter experts in each layer


def test_persistent_bytes_by_hand():
    e = _tiny()  # 2 GPUs, ep 2, sharded: (648 + 3072) / 2 = 1860 parameters per GPU
    assert (e.params, e.grads, e.optimizer_state) == (4 * 1860, 4 * 1860, 8 * 1860)
    e = _tiny(world_size=4, shard_experts=False)  # dense / 4 + experts / ep 2 = 162 + 1536
    assert (e.params, e.grads, e.optimizer_state) == (4 * 1698, 4 * 1698, 8 * 1698)
    e = _tiny(world_size=4, dp_replicate=2)  # HSDP: sharded over 2, replicated over 2
    assert e.params == 4 * 1860


def test_gathered_weights_and_logits_by_hand():
    e = _tiny()
    # bf16 copies: root (embed 80 + lm_head 80 + norm 8) for the whole step, and two layers (computing +
    # prefetched) of dense weights (240) and this rank's 2 experts (2 * 384)
    assert e.gathered_weights == 2 * (168 + 2 * (240 + 768))
    # The chunked loss (the default): one chunk of rows (here all 15 tokens) x vocab 10 of bf16 logits and their bf16
    # gradient (2 + 2 bytes), and the hidden states' bf16 gradient, 15 tokens x hidden 8
    assert e.logits == 4 * 15 * 10 + 2 * 15 * 8
    # Full logits, 3 x 5 tokens x vocab 10: bf16 logits, fp32 log-probs, fp32 and bf16 gradients (2 + 4 + 4 + 2 bytes)
    assert _tiny(chunked_loss=False).logits == 12 * 15 * 10


def test_whole_model_fsdp_unit_gathers_every_layer():
    """fsdp_wrap "model": all dense weights unsharded at once (root + 4 layers of 240), not root + two layers."""
    four = dict(TINY, num_hidden_layers=4)
    layer, model = (estimate_memory(four, world_size=2, ep_size=2, optim="adamw_torch", shard_experts=True, max_length=5,
                                    per_device_train_batch_size=3, fsdp_wrap=wrap) for wrap in ("layer", "model"))
    assert model.gathered_weights - layer.gathered_weights == 2 * (4 - 2) * 240
    assert model.total > layer.total and "FSDP units: the whole model" in model.describe()
    with pytest.raises(ValueError, match="resolve_fsdp_wrap"):
        estimate_memory(four, world_size=2, max_length=5, per_device_train_batch_size=3, fsdp_wrap="auto")


def test_replicated_dense_weights_are_whole_on_every_rank():
    """fsdp_wrap "none" (ep = world size): each rank holds all dense weights (4 layers of 240 + root 168), their
    gradients and state, nothing gathered; only the fp32 bucket of the once-a-step average. Refused at dp > 1."""
    four = dict(TINY, num_hidden_layers=4)
    plan = dict(world_size=2, ep_size=2, optim="adamw_bf16", shard_experts=True, max_length=5, per_device_train_batch_size=3,
                gradient_accumulation_steps=2)
    layer, none = (estimate_memory(four, fsdp_wrap=wrap, **plan) for wrap in ("layer", "none"))
    dense = 168 + 4 * 240
    # params (bf16, 2 bytes): all dense on each rank against half of them sharded
    assert none.params - layer.params == 2 * dense / 2
    assert none.gathered_weights == 0 and none.accumulated_grads == 0 and not none.fsdp
    assert none.gathered_grads == 4 * dense  # the fp32 bucket (smaller than REPLICATED_BUCKET here)
    assert "dense weights whole on every rank" in none.describe()
    with pytest.raises(InputError, match="ep = world size"):
        estimate_memory(four, fsdp_wrap="none", **dict(plan, ep_size=1))


def test_replicated_dense_gradients_staged_in_fp32_at_the_backwards_end():
    """Averaged during the last backward (ReplicatedGradSync), every bucket's fp32 copy lives until the step's finish: at
    the backward's end the gradients and 4 bytes per dense weight are allocated, which a plan of small activations must
    count; where the activations are larger that moment is not the peak and the estimate is the activations'."""
    four = dict(TINY, num_hidden_layers=4)
    dense = 168 + 4 * 240
    plan = dict(world_size=2, ep_size=2, optim="adamw_bf16", shard_experts=True, per_device_train_batch_size=1,
                gradient_accumulation_steps=2, fsdp_wrap="none")
    short = estimate_memory(four, max_length=1, **plan)
    allocated = (short.total - memory_plan.OVERHEAD_BYTES) / (1 + memory_plan.FRAGMENTATION)
    assert short.activations + short.logits < 4 * dense  # small enough that the backward's end is the peak
    assert allocated == pytest.approx(short.params + short.optimizer_state + short.gathered_grads + short.grads + 4 * dense)
    long = estimate_memory(four, max_length=4096, **plan)
    allocated = (long.total - memory_plan.OVERHEAD_BYTES) / (1 + memory_plan.FRAGMENTATION)
    assert long.activations > 4 * dense
    assert allocated == pytest.approx(long.params + long.optimizer_state + long.gathered_grads + long.grads + long.activations
                                      + long.logits)


def test_replicated_dense_weights_need_the_compute_dtype_and_ep_world_size():
    """parallelize's check for fsdp_wrap "none": FSDP would have cast fp32 weights to bf16, or sharded experts over dp."""
    from types import SimpleNamespace

    from megablocks_utils.parallel.parallelize import check_replicated_dense

    model = torch.nn.Linear(2, 2)
    ep_world = SimpleNamespace(expert_fsdp=SimpleNamespace(size=lambda: 1), ep_size=2, world_size=2)
    check_replicated_dense(model, ep_world, torch.float32)  # fp32 weights, fp32 compute: nothing to cast
    with pytest.raises(ValueError, match="some are float32 and the compute dtype is bfloat16"):
        check_replicated_dense(model, ep_world, torch.bfloat16)
    dp2 = SimpleNamespace(expert_fsdp=SimpleNamespace(size=lambda: 2), ep_size=1, world_size=2)
    with pytest.raises(ValueError, match="needs ep = world size"):
        check_replicated_dense(model, dp2, torch.float32)


def test_fsdp_wrap_auto_is_the_whole_model_only_at_ep_world_size_and_where_it_fits():
    sizes = {"layer": 10 * GiB, "model": 12 * GiB}
    plan = lambda wrap: type("E", (), {"total": sizes[wrap]})()  # noqa: E731
    resolve = memory_fit.resolve_fsdp_wrap
    assert resolve("auto", plan, 16 * GiB, world_size=2, ep=2) == "model"
    assert resolve("auto", plan, 0, world_size=4, ep=4) == "model"  # on CPU: nothing to fit into
    assert resolve("auto", plan, 11 * GiB, world_size=2, ep=2) == "layer"  # the whole model would not fit
    assert resolve("auto", plan, 13 * GiB, world_size=2, ep=2) == "layer"  # it would, but not within 90% of the GPU
    assert resolve("auto", plan, 16 * GiB, world_size=4, ep=2) == "layer"  # dp 2: experts under FSDP, not measured
    assert resolve("auto", plan, 16 * GiB, world_size=1, ep=1) == "layer"  # one rank
    assert resolve("model", plan, 11 * GiB, world_size=4, ep=2) == "model"  # as asked (the fit check then says)


def test_fsdp_wrap_auto_is_none_where_segment_graphs_are_planned_and_it_fits():
    """cuda_graphs segments need the dense weights whole on every rank: auto gives "none" there, within the same 90%."""
    sizes = {"layer": 10 * GiB, "model": 12 * GiB, "none": 13 * GiB}
    plan = lambda wrap: type("E", (), {"total": sizes[wrap]})()  # noqa: E731
    resolve = memory_fit.resolve_fsdp_wrap
    assert resolve("auto", plan, 16 * GiB, world_size=2, ep=2, replicated=True) == "none"
    assert resolve("auto", plan, 0, world_size=2, ep=2, replicated=True) == "none"  # on CPU: nothing to fit into
    assert resolve("auto", plan, 14 * GiB, world_size=2, ep=2, replicated=True) == "model"  # none past 90%, model within
    assert resolve("auto", plan, 16 * GiB, world_size=2, ep=2) == "model"  # not planned: as before
    assert resolve("auto", plan, 16 * GiB, world_size=4, ep=2, replicated=True) == "layer"  # dp 2: segments never planned there
    assert resolve("layer", plan, 16 * GiB, world_size=2, ep=2, replicated=True) == "layer"  # as asked


def test_fsdp_wrap_settings_are_auto_and_the_units_parallelize_builds():
    from megablocks_utils.parallel.parallelize import FSDP_WRAPS

    assert memory_plan.FSDP_WRAP_SETTINGS == ("auto", *FSDP_WRAPS)


def test_chunked_loss_holds_one_chunk_of_logits():
    """A micro-batch longer than a chunk holds one chunk's logits (train/loss.py's loss_chunk_rows), not its own."""
    from megablocks_utils.train.loss import loss_chunk_rows

    config = load_config(os.path.join(CONFIGS, "qwen3-30b-a3b"))
    e = estimate_memory(config, world_size=8, max_length=4096, per_device_train_batch_size=1)
    rows = loss_chunk_rows(4096, config.vocab_size)
    assert rows == 2048
    assert e.logits == 4 * rows * config.vocab_size + 2 * 4096 * config.hidden_size
    full = estimate_memory(config, world_size=8, max_length=4096, per_device_train_batch_size=1, chunked_loss=False)
    assert full.logits == 12 * 4096 * config.vocab_size and full.total - e.total > 5 * GiB
    lora_head = estimate_memory(config, world_size=8, max_length=4096, per_device_train_batch_size=1, finetuning="lora",
                                lora_target_modules="q_proj,lm_head")
    assert lora_head.logits == full.logits  # an adapter on lm_head keeps the full logits (install_loss_head)


@pytest.mark.parametrize("ep", [8, 4, 2])
def test_sharded_state_falls_as_one_over_world_size(ep):
    def state(world):
        e = estimate_memory(MIXTRAL_8X7B, world_size=world, ep_size=ep, shard_experts=True, max_length=256, per_device_train_batch_size=1)
        return e.params + e.grads + e.optimizer_state

    assert state(16) == pytest.approx(state(8) / 2, rel=1e-12)
    assert state(32) == pytest.approx(state(8) / 4, rel=1e-12)
    assert state(8) == pytest.approx(16 * 46.70e9 / 8, rel=0.005)  # adamw_torch: 16 bytes per parameter


def test_unsharded_experts_stay_per_ep_rank():
    def state(world):
        e = estimate_memory(MIXTRAL_8X7B, world_size=world, ep_size=8, shard_experts=False, max_length=256, per_device_train_batch_size=1)
        return e.params + e.grads + e.optimizer_state

    counts = count_params(load_config(MIXTRAL_8X7B))
    assert state(16) == pytest.approx(16 * (counts.dense / 16 + counts.expert / 8))


def test_optimizers_bytes_per_parameter():
    def state(optim):
        e = estimate_memory(MIXTRAL_8X7B, world_size=8, ep_size=8, optim=optim, max_length=256, per_device_train_batch_size=1)
        return e.params + e.optimizer_state

    assert state("adamw_bf16") == pytest.approx(state("adamw_torch") / 2)
    assert state("adamw_torch_8bit") == pytest.approx(state("adamw_torch") * (4 + 1 + 1 + 8 / 256) / 12)


def test_checkpointing_keeps_less_and_activations_grow_with_tokens():
    config = load_config(MIXTRAL_8X7B)
    none, selective, full = (memory_activations.activation_bytes(config, 4096, m) for m in ("none", "selective", "full"))
    assert full < selective < none
    assert memory_activations.activation_bytes(config, 8192, "none") == pytest.approx(2 * none)
    # Without checkpointing a Mixtral layer keeps at least its experts' rows in, gate_up and SwiGLU outputs
    # (2 copies of each token: 2 * (4096 + 2*14336 + 14336) bf16 elements), for all 32 layers.
    assert none > 32 * 4096 * 2 * 2 * (4096 + 3 * 14336)
    # Full checkpointing keeps each layer's input (4096 bf16 per token) and one layer's activations.
    assert full < 32 * 4096 * 2 * 4096 + none / 32 * 2


def test_the_static_exchange_holds_its_capacity_of_rows_and_two_buffers():
    """With ``ep_capacity_factor`` F above the imbalance allowance every MoE layer's received rows (rows in, gate_up and
    SwiGLU outputs: bf16, k copies a token) are F x the mean, padding included, plus the two shared buffers (rows sent,
    F x rows received); at ep 1 and at 0 nothing changes; a factor under the allowance changes only the buffers."""
    config = load_config(os.path.join(CONFIGS, "qwen3-30b-a3b"))
    plan = dict(world_size=4, ep_size=4, optim="adamw_bf16", max_length=4096, per_device_train_batch_size=1)
    exact, static = (estimate_memory(config, **plan, ep_capacity_factor=f) for f in (0.0, 3.0))
    k, h, inter, layers, tokens = 8, 2048, 768, 48, 4096
    grown = (3.0 - memory_activations.EXPERT_LOAD_IMBALANCE) * 2 * k * (h + 2 * inter + inter) * tokens * layers
    buffers = 2 * h * k * tokens * (1 + 3.0)
    assert static.activations - exact.activations == pytest.approx(grown + buffers, rel=0.02)
    assert estimate_memory(config, **{**plan, "world_size": 1, "ep_size": 1}, ep_capacity_factor=3.0).activations == \
        estimate_memory(config, **{**plan, "world_size": 1, "ep_size": 1}).activations
    capped = estimate_memory(config, **plan, ep_capacity_factor=9.0)  # a receiver never holds more than ep x the mean
    assert capped.activations - exact.activations == pytest.approx(
        (4.0 - memory_activations.EXPERT_LOAD_IMBALANCE) / (3.0 - memory_activations.EXPERT_LOAD_IMBALANCE) * grown + buffers * 5 / 4, rel=0.02)
    low = estimate_memory(config, **plan, ep_capacity_factor=1.0)
    assert low.activations - exact.activations == pytest.approx(2 * h * k * tokens * (1 + memory_activations.EXPERT_LOAD_IMBALANCE))


def test_checkpointing_a_count_of_layers_keeps_the_rest():
    """Each layer left out of checkpointing keeps its full activations: the estimate moves by the same
    step per layer, from full on all 32 to none; a count of 0 is none, one above the model is refused."""
    config = load_config(MIXTRAL_8X7B)
    act = {k: memory_activations.activation_bytes(config, 4096, "full", k) for k in (-1, 32, 24, 16, 8, 0)}
    none = memory_activations.activation_bytes(config, 4096, "none")
    assert act[-1] == act[32] < act[24] < act[16] < act[8] < none == act[0]
    assert act[8] - act[16] == pytest.approx(act[16] - act[24]) == pytest.approx(act[24] - act[32])
    # A layer's step: its "none" activations (at least its experts' rows in, gate_up and SwiGLU outputs, as in
    # the test above) less the layer input that full checkpointing keeps.
    assert (act[24] - act[32]) / 8 > 4096 * 2 * 2 * (4096 + 3 * 14336) - 4096 * 2 * 4096
    with pytest.raises(InputError, match="has 32 decoder layers; give 0..32"):
        _mixtral_80(activation_checkpointing="full", activation_checkpointing_layers=33)
    with pytest.raises(InputError, match="must be -1"):
        _mixtral_80(activation_checkpointing="full", activation_checkpointing_layers=-2)


def _h200x4(**settings):
    plan = dict(world_size=4, ep_size=4, nproc_per_node=4, optim="adamw_bf16", shard_experts=True, max_length=4096,
                per_device_train_batch_size=1, gradient_accumulation_steps=4)
    plan.update(settings)
    return estimate_memory(MIXTRAL_8X7B, **plan)


def test_fit_error_offers_the_fewest_checkpointed_layers_that_fit():
    budget = 139.8 * GiB
    e = _h200x4()  # no checkpointing: does not fit
    message = fit_error(e, budget)
    count = int(re.search(r"--activation_checkpointing full --activation_checkpointing_layers (\d+)", message).group(1))
    assert _h200x4(activation_checkpointing="full", activation_checkpointing_layers=count).total <= budget
    assert _h200x4(activation_checkpointing="full", activation_checkpointing_layers=count - 1).total > budget
    assert "checkpointing full on" in memory_fit._settings_text(_h200x4(activation_checkpointing="full", activation_checkpointing_layers=count))


def test_checkpointing_hint_names_how_few_layers_are_enough():
    budget = 139.8 * GiB
    every = _h200x4(activation_checkpointing="full")
    hint = memory_fit.checkpointing_hint(every, budget)
    count = int(re.search(r"--activation_checkpointing_layers (\d+)", hint).group(1))
    assert 0 < count < 32
    assert _h200x4(activation_checkpointing="full", activation_checkpointing_layers=count).total <= 0.9 * budget
    assert _h200x4(activation_checkpointing="full", activation_checkpointing_layers=count - 1).total > 0.9 * budget
    assert memory_fit.checkpointing_hint(_h200x4(activation_checkpointing="full", activation_checkpointing_layers=count), budget) is None
    assert memory_fit.checkpointing_hint(_h200x4(), budget) is None  # no checkpointing: nothing to leave out
    assert memory_fit.checkpointing_hint(every, 80 * GiB) is None  # needs every layer there (and more)
    roomy = memory_fit.checkpointing_hint(every, 200 * GiB)
    assert roomy.startswith("activation checkpointing: none would fit") and _h200x4().total <= 0.9 * 200 * GiB


def test_resolve_shard_experts():
    assert resolve_shard_experts("auto", 16, 8) is True  # across nodes
    assert resolve_shard_experts("false", 16, 8) is False
    assert resolve_shard_experts(True, 8, 8) is True
    with pytest.raises(InputError, match="shard_experts"):
        resolve_shard_experts("maybe", 8, 8)


def test_bad_plans_name_the_fix():
    with pytest.raises(InputError, match="choose ep_size in"):
        _tiny(world_size=4, ep_size=3)
    with pytest.raises(InputError, match="optim='sgd' is unknown"):
        _tiny(optim="sgd")
    with pytest.raises(InputError, match="dp_replicate=3"):
        _tiny(world_size=4, dp_replicate=3)
    with pytest.raises(InputError, match="activation_checkpointing"):
        _tiny(activation_checkpointing="some")


def _mixtral_80(**settings):
    plan = dict(world_size=8, ep_size=8, optim="adamw_torch", shard_experts=False, max_length=4096, per_device_train_batch_size=1)
    plan.update(settings)
    return estimate_memory(MIXTRAL_8X7B, **plan)


def test_fit_error_suggests_settings_that_do_fit():
    budget = 80 * GiB
    e = _mixtral_80()
    message = fit_error(e, budget)
    assert message is not None and "80.0 GiB" in message
    # Re-estimate every suggested flag set independently of the message's own numbers.
    suggestions = re.findall(r"((?:--\w+ \S+ ?)+) \(([\d.]+) GiB\)", message)
    assert suggestions
    for flags, _ in suggestions:
        changes = dict(zip(*[iter(flags.replace("--", "").split())] * 2))
        for key in ("per_device_train_batch_size", "gradient_accumulation_steps", "activation_checkpointing_layers"):
            if key in changes:
                changes[key] = int(changes[key])
        assert _mixtral_80(**changes).total <= budget, flags
    gpus = re.search(r"(\d+) GPUs \(\d+ nodes of 8\)", message)
    if gpus:
        assert _mixtral_80(world_size=int(gpus.group(1))).total <= budget
    assert fit_error(_mixtral_80(optim="adamw_bf16", activation_checkpointing="full"), budget) is None


def test_fit_error_offers_per_layer_units_where_the_whole_model_unit_does_not_fit():
    model_unit = _mixtral_80(optim="adamw_bf16", activation_checkpointing="full", fsdp_wrap="model")
    layer_units = _mixtral_80(optim="adamw_bf16", activation_checkpointing="full", fsdp_wrap="layer")
    assert layer_units.total < model_unit.total
    budget = (layer_units.total + model_unit.total) / 2
    message = fit_error(model_unit, budget)
    assert "fsdp_wrap model" in message  # the plan it refuses
    offered = re.search(r"--fsdp_wrap layer \(([\d.]+) GiB\)", message)
    assert offered and float(offered.group(1)) == pytest.approx(layer_units.total / GiB, abs=0.05), message
    assert "--fsdp_wrap" not in (fit_error(_mixtral_80(fsdp_wrap="layer"), 80 * GiB) or "")


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "megablocks_utils.tools.memory", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def test_cli_full_mixtral_adamw_torch_unsharded_does_not_fit_on_8x80():
    r = _cli("--model_name_or_path", MIXTRAL_8X7B, "--nproc", "8", "--gpu_memory_gib", "80", "--optim", "adamw_torch",
             "--shard_experts", "false", "--max_length", "4096", "--per_device_train_batch_size", "1")
    assert r.returncode == 1, r.stderr
    assert r.stdout.rstrip("\n").splitlines()[-1] == "fits: no"
    assert "--optim adamw_bf16" in r.stdout


def test_cli_bf16_full_checkpointing_fits_on_8x80(capsys):
    code = memory.main(["--model_name_or_path", MIXTRAL_8X7B, "--nproc", "8", "--gpu_memory_gib", "80", "--optim", "adamw_bf16",
                        "--activation_checkpointing", "full", "--max_length", "4096", "--per_device_train_batch_size", "1"])
    out = capsys.readouterr().out
    assert code == 0
    assert out.rstrip("\n").splitlines()[-1] == "fits: yes"


def test_cli_counts_the_static_exchanges_capacity(capsys):
    """``--ep_capacity_factor`` reaches the estimate: Qwen3-30B-A3B at ep 4, 3 x the mean rows a layer, more activations."""
    base = ["--model_name_or_path", os.path.join(CONFIGS, "qwen3-30b-a3b"), "--nproc", "4", "--ep_size", "4", "--gpu_memory_gib",
            "140", "--optim", "adamw_bf16", "--max_length", "4096", "--per_device_train_batch_size", "1"]
    activations = []
    for extra in ([], ["--ep_capacity_factor", "3"]):
        assert memory.main(base + extra) == 0
        line = next(x for x in capsys.readouterr().out.splitlines() if x.strip().startswith("activations"))
        activations.append(float(line.split()[-1]))
    assert activations[1] > activations[0] + 20, activations  # 48 layers x 1.75 x the rows' ~0.3 GiB, and the buffers


@pytest.mark.parametrize("args,expect", [
    (["--ep_size", "3"], "ep_size"),
    (["--optim", "sgd"], "optim"),
    (["--activation_checkpointing", "sometimes"], "activation_checkpointing"),
    (["--nproc", "zero"], "nproc"),
    (["--ep_capacity_factor", "-0.5"], "ep_capacity_factor"),
])
def test_cli_bad_argument_exits_2_with_one_line(args, expect, capsys):
    base = {"--model_name_or_path": MIXTRAL_8X7B, "--nproc": "8", "--gpu_memory_gib": "80"}
    for flag, value in zip(args[::2], args[1::2]):
        base[flag] = value
    with pytest.raises(SystemExit) as exit_:
        memory.main([x for pair in base.items() for x in pair])
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert len(err.strip().splitlines()) == 1 and expect in err


def test_cli_missing_model_dir_exits_2(tmp_path):
    r = _cli("--model_name_or_path", str(tmp_path / "absent"), "--nproc", "8", "--gpu_memory_gib", "80")
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1 and "config.json" in r.stderr


def test_cli_defaults_are_train_fsdp2s():
    with open(os.path.join(ROOT, "train_fsdp2.py")) as f:
        tree = ast.parse(f.read())
    script = {  # the settings block's literals, negative numbers (a unary minus) included
        node.targets[0].id: ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
        and isinstance(node.value, (ast.Constant, ast.UnaryOp)) and isinstance(getattr(node.value, "operand", node.value), ast.Constant)
    }
    compared = 0
    for name, default in memory_plan.DEFAULTS.items():
        if name in script:
            value = memory_activations.checkpointing_mode(script[name]) if name == "activation_checkpointing" else script[name]
            assert default == value, name
            compared += 1
    assert compared >= 4 and "ep_capacity_factor" in script and "cuda_graphs" in script


def _estimate_lines(out: str) -> list[str]:
    """The printed plan and estimate, without the line that says what auto chose."""
    return [x for x in out.splitlines() if not x.startswith("ep_capacity_factor auto")]


def test_cli_resolves_the_exchange_and_units_as_train_fsdp2(tmp_path, capsys):
    """The command line plans what train_fsdp2.py would run: its auto capacity factor at ep 4 = world size on one node
    (3, with the dense weights whole on every rank), the same estimate as that plan given outright; auto's factor dropped
    where its buffers do not fit within 90% (full Qwen3-30B-A3B: the exact exchange's estimate); auto's reasons for the
    exact exchange said (another optimizer, ranks over two nodes); an explicit factor taken as given."""
    with open(os.path.join(CONFIGS, "qwen3-30b-a3b", "config.json")) as f:
        config = json.load(f)
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 12}))
    base = ["--nproc", "4", "--nproc_per_node", "4", "--gpu_memory_gib", "140", "--optim", "adamw_bf16", "--max_length", "4096",
            "--per_device_train_batch_size", "1", "--gradient_accumulation_steps", "4"]

    def run(model, *extra):
        assert memory.main(["--model_name_or_path", model, *base, *extra]) == 0
        return capsys.readouterr().out

    auto12 = run(str(tmp_path))
    assert auto12.startswith("ep_capacity_factor auto: 3 (ep 4 = world size on one node"), auto12
    assert _estimate_lines(auto12) == _estimate_lines(run(str(tmp_path), "--ep_capacity_factor", "3", "--fsdp_wrap", "none"))
    assert _estimate_lines(auto12) != _estimate_lines(run(str(tmp_path), "--ep_capacity_factor", "0"))
    full = os.path.join(CONFIGS, "qwen3-30b-a3b")
    auto48 = run(full)
    assert auto48.startswith("ep_capacity_factor auto: 0, the exact exchange (with its buffers the dense weights do not fit"), auto48
    exact48 = run(full, "--ep_capacity_factor", "0")
    assert not exact48.startswith("ep_capacity_factor") and _estimate_lines(auto48) == _estimate_lines(exact48)
    assert "optim adamw_torch: the dense weights whole" in run(str(tmp_path), "--optim", "adamw_torch")
    assert "spans nodes of 2 GPUs" in run(str(tmp_path), "--nproc_per_node", "2")
    assert "static exchange" not in run(str(tmp_path), "--cuda_graphs", "false")


def test_import_stays_light():
    code = "import sys, megablocks_utils.tools.memory; print('transformers' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "False", r.stderr


def test_one_rank_with_bf16_weights_has_nothing_gathered():
    """parallelize applies no FSDP there: no gathered copies, and the in-place gradients meet the second
    micro-step's activations (the sum, not the larger); fp32 weights on one rank keep FSDP's terms."""
    e = _tiny(world_size=1, ep_size=1, optim="adamw_bf16", gradient_accumulation_steps=2)
    assert not e.fsdp and e.gathered_weights == e.gathered_grads == e.accumulated_grads == 0
    assert e.total - e.overhead == pytest.approx(e.params + e.optimizer_state + e.grads + e.activations + e.logits, abs=1)
    once = _tiny(world_size=1, ep_size=1, optim="adamw_bf16", gradient_accumulation_steps=1)
    assert once.total - once.overhead == pytest.approx(once.params + once.optimizer_state + max(once.grads, once.activations + once.logits), abs=1)
    fp32 = _tiny(world_size=1, ep_size=1, optim="adamw_torch", gradient_accumulation_steps=2)
    assert fp32.fsdp and fp32.gathered_weights > 0 and fp32.accumulated_grads > 0
    assert _tiny(world_size=2, optim="adamw_bf16").gathered_weights > 0


def test_experts_left_out_of_fsdp_at_dp1():
    """dp = 1: FSDP gathers no experts (parallelize.experts_need_fsdp). fp32 weights are cast by the layer, and
    each layer's cast is kept for its backward unless the layer is checkpointed (then one recompute's at a time);
    the bf16 gradient's divided copy is in the weights' dtype. dp > 1: one layer's local experts are gathered
    (computing + prefetched), their gradient reduced through a bf16 + fp32 pair."""
    local = 2 * 384  # this rank's 2 of the tiny model's 4 experts, one layer
    layers = TINY["num_hidden_layers"]
    bf16, fp32 = _tiny(optim="adamw_bf16"), _tiny(optim="adamw_torch")
    assert fp32.gathered_weights - bf16.gathered_weights == 2 * local * layers
    assert _tiny(optim="adamw_torch", activation_checkpointing="full").gathered_weights - bf16.gathered_weights == 2 * local
    assert fp32.gathered_grads - bf16.gathered_grads == (4 - 2) * local
    dp2 = _tiny(world_size=4, optim="adamw_torch")
    assert dp2.gathered_grads == fp32.gathered_grads  # bf16 + fp32 either way
    assert dp2.gathered_weights - bf16.gathered_weights == 2 * 2 * local  # two layers' experts gathered in bf16


def test_expert_gradients_live_across_micro_steps():
    """With gradient accumulation, expert gradients are reduced (or accumulated in place) at every micro-step, so
    from the second one on they sit next to its activations: counted beside them, not overlapped with them.
    Dense gradients and experts replicated over dp (reduced once, at the end) still overlap."""
    def during_backward(e):
        return e.total - e.overhead - e.params - e.optimizer_state - e.gathered_weights - e.gathered_grads

    counts = count_params(load_config(dict(TINY)))
    for plan in (dict(), dict(world_size=4), dict(world_size=4, shard_experts=True, dp_replicate=2)):
        e = _tiny(gradient_accumulation_steps=2, **plan)
        expert_grads = 4 * counts.expert / (2 * (e.plan.world_size // 2 // e.plan.dp_replicate))  # fp32, over ep x dp shards
        assert e.expert_grads_persist
        assert during_backward(e) == pytest.approx(expert_grads + max(e.grads - expert_grads, e.activations + e.logits + e.accumulated_grads), abs=1)
    once = _tiny(gradient_accumulation_steps=1)
    assert not once.expert_grads_persist
    assert during_backward(once) == pytest.approx(max(once.grads, once.activations + once.logits), abs=1)
    replicated = _tiny(world_size=4, shard_experts=False, gradient_accumulation_steps=2)
    assert not replicated.expert_grads_persist
    assert during_backward(replicated) == pytest.approx(max(replicated.grads, replicated.activations + replicated.logits + replicated.accumulated_grads), abs=1)


QWEN3 = os.path.join(CONFIGS, "qwen3-30b-a3b")


def _qwen3_lora_one_gpu(**settings):
    plan = dict(world_size=1, nproc_per_node=1, optim="adamw_torch", max_length=4096, per_device_train_batch_size=1,
                gradient_accumulation_steps=4, finetuning="lora")
    plan.update(settings)
    return estimate_memory(QWEN3, **plan)


def test_checkpoint_experts_keeps_less_than_none_and_more_than_full():
    """Recomputing the routed experts drops their rows, gate_up and SwiGLU outputs and the outputs the weighted sum
    keeps (some 100 of a Qwen3 layer's 163 KB per token, measured) and nothing of attention's."""
    config = load_config(QWEN3)
    none, full = memory_activations.activation_bytes(config, 4096, "none"), memory_activations.activation_bytes(config, 4096, "full")
    experts = memory_activations.activation_bytes(config, 4096, "none", -1, experts=True)
    assert full < experts < none
    per_layer_token = (none - experts) / 48 / 4096
    assert 80e3 < per_layer_token < 140e3, per_layer_token
    # beside full checkpointing on some layers, only the others' experts are recomputed
    mixed = memory_activations.activation_bytes(config, 4096, "full", 24, True)
    assert full < mixed < experts


@pytest.mark.parametrize("settings,allocated,reserved", [
    (dict(activation_checkpointing="full"), 68.57, 69.64),
    (dict(checkpoint_experts=True), 78.61, 79.54),
    (dict(checkpoint_experts=True, optim="adamw_bf16"), 73.90, 74.62),
], ids=["full", "experts-fp32-adapters", "experts-bf16-adapters"])
def test_lora_estimates_cover_the_measured_peaks(settings, allocated, reserved):
    """Qwen3-30B-A3B's 48 layers, LoRA, one H200, seq 4096, 1 x 4 (bench/lora_peft.py at the script's defaults;
    bench/results/small_experts_and_lora_h200_2026-11-24_to_25/records.md#lora_48l_checkpoint_experts_h200_2026-11-24jsonl): the estimate is not below what PyTorch allocated
    and within 10% of the reserved peak, the GPU check's bar (tests/gpu/test_memory_estimate.py)."""
    estimate = _qwen3_lora_one_gpu(**settings).total / GiB
    assert allocated <= estimate <= 1.1 * reserved, (estimate, allocated, reserved)


@pytest.mark.parametrize("name,settings,allocated,reserved", [
    ("mixtral-8x7b", dict(checkpoint_experts=True), 58.34, 59.62),  # its experts' bf16 weight written before each GEMM
    ("glm-4.5-air", dict(activation_checkpointing="full"), 115.71, 117.38),
    ("gpt-oss-120b", dict(checkpoint_experts=True), 81.16, 83.21),  # its config.json: MXFP4 experts, kept so
])
def test_quantized_base_estimates_cover_the_measured_peaks(name, settings, allocated, reserved):
    """LoRA over a quantized base at full depth, one H200, seq 4096, 1 x 4, bf16 adapters (bench/lora_peft.py
    --quantize_base fp8; bench/results/quantized_base_full_depth_h200_2026-12-02/records.md#bigjsonl, Mixtral-8x7B's
    bench/results/lora_fp8_base_speed_quality_h200_2026-12-02/records.md#mixtral32jsonl): the estimate from config.json
    alone is not below what PyTorch allocated and within 10% of the reserved peak."""
    estimate = estimate_memory(os.path.join(CONFIGS, name), world_size=1, nproc_per_node=1, optim="adamw_bf16", max_length=4096,
                               per_device_train_batch_size=1, gradient_accumulation_steps=4, finetuning="lora",
                               quantize_base="fp8", **settings).total / GiB
    assert allocated <= estimate <= 1.1 * reserved, (estimate, allocated, reserved)


def test_fit_check_offers_checkpoint_experts_where_it_fits_for_less_work():
    e = _qwen3_lora_one_gpu()  # no checkpointing: ~108 GiB
    message = fit_error(e, 95 * GiB)
    assert "--checkpoint_experts true (" in message, message
    assert _qwen3_lora_one_gpu(checkpoint_experts=True).total <= 95 * GiB
    full = _qwen3_lora_one_gpu(activation_checkpointing="full")
    hint = memory_fit.checkpointing_hint(full, 100 * GiB)
    assert hint.startswith("activation checkpointing: --activation_checkpointing none --checkpoint_experts true would fit"), hint
    assert memory_fit._recompute_flops(full, activation_checkpointing="none", checkpoint_experts=True) < memory_fit._recompute_flops(full)
    assert "the routed experts recomputed" in memory_fit._settings_text(_qwen3_lora_one_gpu(checkpoint_experts=True))
    already = memory_fit.checkpointing_hint(_qwen3_lora_one_gpu(activation_checkpointing="full", checkpoint_experts=True), 100 * GiB)
    assert already is None or "--checkpoint_experts" not in already  # not offered twice


def test_recompute_swiglu_drops_swiglus_output_where_the_gpu_makes_it_again(monkeypatch):
    """recompute_swiglu: each layer that keeps its experts' activations keeps no SwiGLU output (2 x k x I bytes a
    token, for the busiest rank's rows), where the GPU path makes it again: SiLU experts, several a rank, no LoRA on
    them, an ep it has run at (moe/experts.py RECOMPUTE_SWIGLU_RAN_AT_EP); elsewhere the estimate is unchanged."""
    from megablocks_utils.moe import experts

    plan = dict(world_size=1, optim="adamw_bf16", max_length=4096, per_device_train_batch_size=1, gradient_accumulation_steps=4)
    kept, again = (estimate_memory(MIXTRAL_8X7B, recompute_swiglu=r, **plan) for r in (False, True))
    assert kept.activations - again.activations == 4096 * 32 * memory_activations.EXPERT_LOAD_IMBALANCE * 2 * 2 * 14336
    # beside full checkpointing on half the layers: only the other half keeps (and drops) it
    half = [estimate_memory(MIXTRAL_8X7B, recompute_swiglu=r, activation_checkpointing="full", activation_checkpointing_layers=16,
                            **plan).activations for r in (False, True)]
    assert half[0] - half[1] == (kept.activations - again.activations) / 2
    at_ep4 = dict(plan, world_size=4)
    assert estimate_memory(MIXTRAL_8X7B, recompute_swiglu=True, **at_ep4).total == estimate_memory(MIXTRAL_8X7B, **at_ep4).total
    assert "recompute_swiglu off at ep 4 (run on GPUs at ep <= 1 so far)" in estimate_memory(MIXTRAL_8X7B, recompute_swiglu=True,
                                                                                          **at_ep4).describe()
    assert "recompute_swiglu on" in again.describe()
    monkeypatch.setattr(experts, "RECOMPUTE_SWIGLU_RAN_AT_EP", 4)  # the guard, not the plan, kept it at ep 4
    assert estimate_memory(MIXTRAL_8X7B, recompute_swiglu=True, **at_ep4).total < estimate_memory(MIXTRAL_8X7B, **at_ep4).total
    lora = dict(plan, finetuning="lora")  # the default targets adapt the experts: their down adapter reads SwiGLU's output
    assert estimate_memory(MIXTRAL_8X7B, recompute_swiglu=True, **lora).total == estimate_memory(MIXTRAL_8X7B, **lora).total
    gpt_oss = tiny_moe_config("gpt_oss")  # clamped SwiGLU: none of our kernels make it again
    assert (estimate_memory(gpt_oss, recompute_swiglu=True, **plan).total == estimate_memory(gpt_oss, **plan).total)


def test_fit_check_offers_recompute_swiglu_first_where_it_fits():
    plan = dict(world_size=1, optim="adamw_bf16", max_length=4096, per_device_train_batch_size=1, gradient_accumulation_steps=4)
    kept, again = (estimate_memory(QWEN3, recompute_swiglu=r, **plan) for r in (False, True))
    budget = (kept.total + again.total) / 2
    message = fit_error(kept, budget)
    assert "Settings that fit: --recompute_swiglu true (" in message, message
    assert fit_error(again, budget) is None


def test_checkpointing_hint_offers_recompute_swiglu_where_it_spares_whole_layers():
    plan = dict(world_size=1, optim="adamw_bf16", max_length=4096, per_device_train_batch_size=1, gradient_accumulation_steps=4)
    full = estimate_memory(MIXTRAL_8X7B, activation_checkpointing="full", **plan)
    kept, again = (estimate_memory(MIXTRAL_8X7B, recompute_swiglu=r, **plan) for r in (False, True))  # no checkpointing
    gpu = 1.0001 * again.total / 0.9  # no checkpointing fits within 90% only with SwiGLU's output made again
    assert kept.total > 0.9 * gpu
    hint = memory_fit.checkpointing_hint(full, gpu)
    assert hint.startswith("activation checkpointing: --activation_checkpointing none --recompute_swiglu true would fit"), hint
    assert memory_fit.checkpointing_hint(estimate_memory(MIXTRAL_8X7B, activation_checkpointing="full", recompute_swiglu=True,
                                                          **plan), gpu).startswith("activation checkpointing: none would fit")


@pytest.mark.parametrize("tokens,fits", [(32768, True), (65536, False)])
def test_cuda_graphs_are_planned_with_their_pool(tokens, fits):
    """One H200, 2026-12-02, Qwen3-30B-A3B's shape with 6 layers at the defaults but adamw_bf16: rows of 32,768 tokens
    trained with whole micro-steps as graphs; at 65,536 the capture ran out of memory (61.8 GiB in the graph's pool beside
    the eager steps' blocks). The plan keeps graphs for the first and says why not for the second."""
    from megablocks_utils.errors import InputError
    from megablocks_utils.model.loading import load_config
    from megablocks_utils.train.memory_fit import plan_graphs

    config = load_config(os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "qwen3-30b-a3b"))
    config.num_hidden_layers = 6

    def plan_for(**changes):
        return estimate_memory(config, **{**dict(world_size=1, ep_size=1, optim="adamw_bf16", max_length=tokens,
                                                 per_device_train_batch_size=1, gradient_accumulation_steps=2,
                                                 fsdp_wrap="layer", ep_capacity_factor=0), **changes})

    h200 = 139.8 * 2**30
    eager, with_graphs = plan_for(), plan_for(cuda_graphs=True)
    assert eager.graph_pool == 0 and with_graphs.graph_pool == eager.activations + eager.logits  # counted twice under graphs
    assert with_graphs.total > eager.total + with_graphs.graph_pool
    assert "CUDA graphs' pool" in with_graphs.describe() and "CUDA graphs' pool" not in eager.describe()
    plan, blocker = plan_graphs(plan_for, "auto", None, h200)
    assert (blocker is None) == fits, blocker
    assert plan.graph_pool == (with_graphs.graph_pool if fits else 0)  # auto plans what it will run
    assert fits or "the graph's memory pool would hold a micro-step's activations and logits" in blocker
    if not fits:
        with pytest.raises(InputError, match="cuda_graphs true: the graph's memory pool"):
            plan_graphs(plan_for, "true", None, h200)
    assert plan_graphs(plan_for, "false", None, h200) == (eager, None)
    assert plan_graphs(plan_for, "auto", "attention 'flex_attention' ...", h200) == (eager, None)  # graphs off anyway
    # adamw_torch on one GPU: FSDP casts the weights, graphs stay off, no pool to plan
    assert plan_for(optim="adamw_torch", cuda_graphs=True).graph_pool == 0
