"""Activation checkpointing on GPUs: full and selective give no checkpointing's loss and gradients, with compiled
attention and norms inside the checkpointed layers, FSDP2 in bf16 and fp32, and (2 GPUs) the all-to-alls in the region;
so does ``recompute_swiglu`` in bf16 (the experts' SwiGLU output made again in the backward), also at ep 2.

A Mixtral shape (hidden 1024, 8 experts of 3584, top-2, 2 layers) sharded with ep = world size and set up as
train_fsdp2.py does it (checkpointing, compile_dense, FSDP2), the same seeded weights and batch for every mode; one
forward + backward each (no optimizer step), then one more with an op counter around the backward. "none" runs twice:
the second measures the run-to-run noise of the GPU kernels (atomics in some backward kernels), against which full and
selective are judged.
"""

import gc

import pytest
import torch

from .launch import gpus, run_on_gpus

pytestmark = gpus(1)
BOUND = {"fp32": 1e-5, "bf16": 2e-2}  # fp32: the CPU suite's equality bound; bf16: 5 units of 2^-8 (recomputed GEMMs may pick other kernels)
MODES = ("none", "none_again", "full", "selective", "swiglu_again")
VOCAB, BATCH, SEQ = 32000, 2, 1024


def build(mode: str, dtype: torch.dtype, device):
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import MixtralConfig, MixtralForCausalLM

    from megablocks_utils import compile_dense_parts, expert_parameters, shard_moe
    from megablocks_utils.parallel.activation_checkpointing import (
        apply_activation_checkpointing,
    )

    config = MixtralConfig(vocab_size=VOCAB, hidden_size=1024, intermediate_size=3584, num_hidden_layers=2,
                           num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
                           max_position_embeddings=4096, router_aux_loss_coef=0.02, tie_word_embeddings=False)
    torch.manual_seed(0)
    with device:
        model = MixtralForCausalLM(config)
    mesh = shard_moe(model, dist.get_world_size(), device=device)
    apply_activation_checkpointing(model, mode if mode in ("full", "selective") else "none")
    if mode == "swiglu_again":
        from megablocks_utils.moe.layer import ExpertParallelExperts

        for module in model.modules():  # set directly, past the ep guard (RECOMPUTE_SWIGLU_RAN_AT_EP): this check at ep 2
            if isinstance(module, ExpertParallelExperts):  # is what lets that guard rise
                module.recompute_swiglu = True
    compile_dense_parts(model)
    experts = set(expert_parameters(model))
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh.world, mp_policy=mp, ignored_params=experts)
    fully_shard(model, mesh=mesh.world, mp_policy=mp, ignored_params=experts)
    return model, mesh


def step(model, mesh, ids):
    from megablocks_utils import causal_lm_loss_sum, router_stats

    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids)
    stats = router_stats(model, None, mesh.world.get_group())
    loss = causal_lm_loss_sum(out.logits, ids) / (ids.numel() - ids.shape[0]) + 0.02 * stats.local
    loss.backward()
    return loss.detach()


def measure(rank, world):
    import torch.distributed as dist

    from megablocks_utils import causal_lm_loss_sum
    from megablocks_utils.moe import experts as experts_module
    from megablocks_utils.parallel.activation_checkpointing import OpCounter

    silu_mul_down, calls = experts_module.silu_mul_down, []
    experts_module.silu_mul_down = lambda *a: calls.append(1) or silu_mul_down(*a)  # noqa: E731  (counts the path's use)

    torch._dynamo.config.recompile_limit = 64  # every run builds a new model; the compiled code is reused
    device = torch.device("cuda", rank)
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1 + rank)).to(device)
    aten = torch.ops.aten
    found = {}
    for dtype_name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        reference = None
        for mode in MODES:
            if mode == "swiglu_again" and dtype != torch.bfloat16:  # fp32 experts take the per-expert loop: nothing to make again
                continue
            calls.clear()
            model, mesh = build(mode, dtype, device)
            step(model, mesh, ids)  # warm-up: compiles
            loss = step(model, mesh, ids)
            grads = {n: (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).detach().float()
                     for n, p in model.named_parameters() if p.grad is not None}
            dist.all_reduce(loss)
            record = {"loss": float(loss) / world}
            if reference is None:
                reference = {"loss": record["loss"], "grads": grads}
            else:
                worst = torch.zeros((), device=device)
                for name, ref in reference["grads"].items():
                    worst = torch.maximum(worst, (grads[name] - ref).abs().max() / ref.abs().max().clamp(min=1e-12))
                dist.all_reduce(worst, op=dist.ReduceOp.MAX)
                record.update(max_rel_grad=float(worst), rel_loss=abs(record["loss"] - reference["loss"]) / abs(reference["loss"]))
            counter = OpCounter()
            model.zero_grad(set_to_none=True)
            logits = model(input_ids=ids).logits
            with counter:
                causal_lm_loss_sum(logits, ids).backward()
            record["bwd_gemms"] = counter.total(aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten._grouped_mm)
            record["bwd_all_to_all"] = counter.total(torch.ops._c10d_functional.all_to_all_single)
            record["silu_mul_down_calls"] = len(calls)
            found[f"{dtype_name} {mode}"] = record
            del model, mesh, grads, logits
            gc.collect()
            torch.cuda.empty_cache()
    return found


# 4 GPUs (ep 4): where a machine of 4 runs this file whole (lanes.sh's lane b sees 2 of them, so there it skips)
@pytest.fixture(scope="module", params=[1, pytest.param(2, marks=gpus(2)), pytest.param(4, marks=gpus(4))],
                ids=["1gpu", "2gpus", "4gpus"])
def found(request):
    return run_on_gpus(measure, request.param)[0]


@pytest.mark.parametrize("mode", ["full", "selective"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_checkpointing_gives_the_loss_and_gradients_of_none(found, dtype, mode):
    """Within max(bound, 10 x the noise of two identical runs without checkpointing)."""
    noise, run = found[f"{dtype} none_again"], found[f"{dtype} {mode}"]
    assert run["max_rel_grad"] <= max(BOUND[dtype], 10 * noise["max_rel_grad"]), (run, noise)
    assert run["rel_loss"] <= max(BOUND[dtype], 10 * noise["rel_loss"]), (run, noise)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_selective_recomputes_no_all_to_all(found, dtype):
    assert found[f"{dtype} selective"]["bwd_all_to_all"] == found[f"{dtype} none"]["bwd_all_to_all"], found


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_full_recomputes_gemms(found, dtype):
    """The counter sees what a backward runs: full checkpointing replays the forward's GEMMs too."""
    assert found[f"{dtype} full"]["bwd_gemms"] > found[f"{dtype} none"]["bwd_gemms"], found


def test_recompute_swiglu_gives_the_loss_and_gradients_of_none(found):
    """bf16, the experts' SwiGLU output made again in the backward: no checkpointing's loss and gradients within
    max(bound, 10 x the noise of two identical runs), the same GEMMs and all-to-alls in the backward, and the layers took
    the path (2 layers x 3 forwards)."""
    noise, run, none = found["bf16 none_again"], found["bf16 swiglu_again"], found["bf16 none"]
    assert run["max_rel_grad"] <= max(BOUND["bf16"], 10 * noise["max_rel_grad"]), (run, noise)
    assert run["rel_loss"] <= max(BOUND["bf16"], 10 * noise["rel_loss"]), (run, noise)
    assert (run["bwd_gemms"], run["bwd_all_to_all"]) == (none["bwd_gemms"], none["bwd_all_to_all"]), (run, none)
    assert run["silu_mul_down_calls"] == 6 and none["silu_mul_down_calls"] == 0, (run, none)
