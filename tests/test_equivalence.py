"""The expert-parallel model equals the single-process transformers model: logits, loss, aux loss, every grad."""

import copy

import pytest
import torch
import torch.distributed as dist
from conftest import ARCHITECTURES, run_rank_cases, run_ranks, tiny_moe_config
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from megablocks_utils import (
    IGNORE_INDEX,
    build_mesh,
    causal_lm_loss_sum,
    clip_grad_norm_,
    count_label_tokens,
    expert_parameters,
    moe_blocks,
    router_stats,
    shard_moe,
    spec_for,
)
from megablocks_utils.parallel.parallelize import needs_fsdp, parallelize

TOL = 1e-5


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))


def make_batch(vocab: int, batch: int = 4, seq: int = 12):
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(1, vocab, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[1, 9:] = 0  # right padding on some rows
    mask[3, 5:] = 0
    labels = input_ids.masked_fill(mask == 0, IGNORE_INDEX)
    labels[:, :3] = IGNORE_INDEX  # a "prompt" that is not trained
    input_ids = input_ids.masked_fill(mask == 0, 0)
    return input_ids, mask, labels


def rank_loss(model, mesh, config, input_ids, mask, labels, rank: int, world: int):
    """This rank's share of the global batch through ``model``: (its rows, the output, the router statistics, the loss
    whose backward gives this rank's part of the global mean's gradient: cross-entropy over the global label count
    plus the aux loss, times world)."""
    rows = slice(rank * len(input_ids) // world, (rank + 1) * len(input_ids) // world)
    out = model(input_ids[rows], attention_mask=mask[rows])
    stats = router_stats(model, mask[rows], mesh.world.get_group())
    ce = causal_lm_loss_sum(out.logits, labels[rows]) / count_label_tokens(labels)
    return rows, out, stats, world * (ce + spec_for(config).aux_loss_coef(config) * stats.local)


def check_matches_single_process(rank, world, ep_size, routing, top_k, arch="mixtral", shard_experts=True, dp_replicate=1,
                                 fsdp_wrap="layer"):
    """The parallelized model (EP + FSDP2 on the dense weights and the experts, as the script runs it)
    against transformers' model on the whole batch in one process."""
    from transformers import AutoModelForCausalLM

    config = tiny_moe_config(arch, num_experts_per_tok=top_k)
    spec = spec_for(config)
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(config).float()
    if spec.score_bias is not None:  # a non-zero selection bias (DeepSeek-V3): it moves the choice, not the weights
        g = torch.Generator().manual_seed(2)
        for name, buf in reference.named_buffers():
            if name.endswith(spec.score_bias):
                buf.copy_(0.05 * torch.randn(buf.shape, generator=g))
    if routing == "collapsed":  # equal router scores: every token picks the same top-k experts
        for layer in reference.model.layers:
            block = getattr(layer, spec.block_attr)
            if hasattr(block, spec.router_attr):
                torch.nn.init.zeros_(getattr(block, spec.router_attr).weight)
    model = copy.deepcopy(reference)
    input_ids, mask, labels = make_batch(config.vocab_size)

    ref_out = reference(input_ids, attention_mask=mask, labels=labels, output_router_logits=True)
    ref_out.loss.backward()

    mesh = build_mesh(ep_size, "cpu", shard_experts=shard_experts, dp_replicate=dp_replicate)
    parallelize(model, mesh, param_dtype=torch.float32, fsdp_wrap=fsdp_wrap, device="cpu")
    layer_units = [isinstance(layer, FSDPModule) for layer in model.model.layers]
    assert layer_units == [fsdp_wrap == "layer" and world > 1] * len(layer_units), (fsdp_wrap, layer_units)
    expert_shards = {p.device_mesh.ndim for p in expert_parameters(model)}
    if world // ep_size > 1:
        assert expert_shards == {3}, "FSDP did not take the experts over"
    else:  # dp = 1, fp32 weights and compute: nothing to shard or cast (parallelize.experts_need_fsdp)
        assert expert_shards == {1}, "FSDP took experts it has nothing to do for"
        assert any(isinstance(m, FSDPModule) for m in model.modules()) is (world > 1), "FSDP on one rank (needs_fsdp)"
    rows, out, stats, loss = rank_loss(model, mesh, config, input_ids, mask, labels, rank, world)
    loss.backward()

    global_loss = loss.detach() / world
    dist.all_reduce(global_loss)
    assert rel_err(global_loss, ref_out.loss) <= TOL, (global_loss, ref_out.loss)
    if spec.aux_coef_attr is not None:  # aux-loss-free models (DeepSeek-V3) have none to compare
        assert rel_err(stats.value, ref_out.aux_loss) <= TOL, (stats.value, ref_out.aux_loss)
    assert rel_err(out.logits, ref_out.logits[rows]) <= TOL
    ref_params = dict(reference.named_parameters())
    names = [n for n, _ in model.named_parameters()]
    assert sorted(names) == sorted(ref_params), "parameter names differ from transformers'"
    for name, p in model.named_parameters():
        grad = full(p.grad)
        assert grad.shape == ref_params[name].grad.shape, name
        assert rel_err(grad, ref_params[name].grad) <= TOL, (name, rel_err(grad, ref_params[name].grad))
    ref_norm = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()])
    norm = clip_grad_norm_(model.parameters(), max_norm=0.5 * float(ref_norm))
    assert rel_err(norm, ref_norm) <= TOL, (norm, ref_norm)
    clipped = torch.nn.utils.get_total_norm([full(p.grad) for p in model.parameters()])
    assert rel_err(clipped, 0.5 * ref_norm) <= 1e-4, (clipped, ref_norm)
    if routing == "collapsed":  # the layer really saw experts with no tokens anywhere
        assert (stats.tokens_per_expert == 0).any()


def check_every_architecture(rank, world, ep_size, only=""):
    for arch in [a for a in ARCHITECTURES if only in a]:
        try:
            check_matches_single_process(rank, world, ep_size, "learned", 2, arch)
        except AssertionError as e:
            raise AssertionError(f"{arch}: {e}") from e


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict:
    """The 2-rank checks of this file on one start of the ranks (spawns are the cost): each one's outcome."""
    cases = {"every_architecture_ep2": (check_every_architecture, 2), "every_architecture_ep1": (check_every_architecture, 1),
             "collapsed_top1": (check_matches_single_process, 2, "collapsed", 1),
             "collapsed_top2": (check_matches_single_process, 2, "collapsed", 2),
             "whole_model_unit": (check_whole_model_unit,), "overlap_chunks": (check_overlap_chunks_change_nothing,),
             "bf16_recompute": (check_bf16_recompute,), "dp1_expert_gradients": (check_dp1_expert_gradients_are_exact,)}
    return run_rank_cases(2, cases, str(tmp_path_factory.mktemp("two_ranks")))


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory) -> dict:
    """The 4-rank checks (the slow tests) on one start of 4 ranks."""
    cases = {"every_architecture_ep2": (check_every_architecture, 2), "other_layouts": (check_other_layouts,)}
    return run_rank_cases(4, cases, str(tmp_path_factory.mktemp("four_ranks")))


def passed(outcomes: dict, case: str) -> None:
    assert outcomes[case] is None, outcomes[case]


@pytest.mark.parametrize("dp,ep", [(1, 2), (2, 1), pytest.param(2, 2, marks=pytest.mark.slow)])
def test_every_architecture_matches_single_process(request, dp, ep):
    """Every row of the model table (Mixtral included) on meshes (1,2), (2,1), (2,2); all architectures in one case."""
    passed(request.getfixturevalue("four_ranks" if dp * ep == 4 else "two_ranks"), f"every_architecture_ep{ep}")


@pytest.mark.parametrize("top_k", [1, 2])
def test_collapsed_routing_is_exact(two_ranks, top_k):
    """All tokens to the same expert(s): other experts get nothing, rank 0 sends nothing away."""
    passed(two_ranks, f"collapsed_top{top_k}")


def check_one_rank(rank, world):
    """One rank: no FSDP where it would shard over one rank and cast nothing (the run matches transformers),
    FSDP where it casts (fp32 weights, bf16 compute: its mixed precision is the cast)."""
    from transformers import AutoModelForCausalLM

    check_matches_single_process(rank, world, 1, "learned", 2)
    mesh = build_mesh(1, "cpu")
    for weights, compute, wanted in [(torch.bfloat16, torch.bfloat16, False), (torch.float32, torch.bfloat16, True)]:
        model = AutoModelForCausalLM.from_config(tiny_moe_config("mixtral")).to(weights)
        assert needs_fsdp(model, mesh, compute) is wanted
        parallelize(model, mesh, param_dtype=compute, device="cpu")
        assert any(isinstance(m, FSDPModule) for m in model.modules()) is wanted, (weights, compute)


def test_single_rank_ep1_matches():
    run_ranks(check_one_rank, 1)


def check_whole_model_unit(rank, world):
    for ep_size in (2, 1):
        for arch in ("mixtral", "qwen2_moe"):
            try:
                check_matches_single_process(rank, world, ep_size, "learned", 2, arch, fsdp_wrap="model")
            except AssertionError as e:
                raise AssertionError(f"{arch} ep={ep_size}: {e}") from e


def test_whole_model_fsdp_unit_matches_single_process(two_ranks):
    """fsdp_wrap="model" (the dense weights as one FSDP unit, gathered once per forward and kept for the backward): the
    same loss, logits and gradients as one process, at ep 2 (dp 1) and at ep 1 (dp 2, experts under FSDP too)."""
    passed(two_ranks, "whole_model_unit")


def check_other_layouts(rank, world):
    """Experts replicated over dp (shard_experts off) and HSDP (2 replicas x 2 shards) on 4 ranks."""
    for ep_size, shard_experts, dp_replicate in [(2, False, 1), (1, True, 2), (2, True, 2)]:
        try:
            check_matches_single_process(rank, world, ep_size, "learned", 2, "qwen2_moe", shard_experts, dp_replicate)
        except AssertionError as e:
            raise AssertionError(f"ep={ep_size} shard_experts={shard_experts} dp_replicate={dp_replicate}: {e}") from e


@pytest.mark.slow
def test_replicated_experts_and_hsdp_match_single_process(four_ranks):
    """The other expert layout and HSDP on 4 ranks; Qwen2-MoE (shared expert and a dense layer) covers most."""
    passed(four_ranks, "other_layouts")


def check_overlap_chunks_change_nothing(rank, world):
    """The overlap lever (tokens in chunks whose all-to-alls interleave with the experts' work) gives the same
    logits and gradients as one chunk: 2 and 3 chunks (uneven), top-1 and top-2, ep = world size."""
    from transformers import AutoModelForCausalLM

    for top_k in (1, 2):
        config = tiny_moe_config("qwen2_moe", num_experts_per_tok=top_k)
        input_ids, mask, labels = make_batch(config.vocab_size, seq=13)
        results = {}
        for chunks in (1, 2, 3):
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(config).float()
            mesh = build_mesh(world, "cpu")
            shard_moe(model, mesh, device="cpu", overlap_chunks=chunks)
            assert all(block.experts.overlap_chunks == chunks for block in moe_blocks(model))
            parallelize(model, mesh, param_dtype=torch.float32, device="cpu")
            rows = slice(rank * len(input_ids) // world, (rank + 1) * len(input_ids) // world)
            out = model(input_ids[rows], attention_mask=mask[rows])
            (world * causal_lm_loss_sum(out.logits, labels[rows]) / count_label_tokens(labels)).backward()
            results[chunks] = out.logits.detach(), {n: full(p.grad) for n, p in model.named_parameters()}
        logits, grads = results[1]
        for chunks in (2, 3):
            assert rel_err(results[chunks][0], logits) <= 1e-6, (top_k, chunks)
            for name, grad in grads.items():
                assert rel_err(results[chunks][1][name], grad) <= 1e-5, (top_k, chunks, name)


def test_overlap_chunks_change_nothing(two_ranks):
    passed(two_ranks, "overlap_chunks")


def check_bf16_recompute(rank, world):
    """bf16 compute with full and selective checkpointing through parallelize: gradients within bf16
    rounding of the run without checkpointing. (The GPU failure this guards, FSDP casting the experts'
    fp32 router weights to bf16 in the forward but not in the recompute, did not show on CPU: there it
    only reaches the compiled combine, which runs on CUDA.)"""
    from transformers import AutoModelForCausalLM

    config = tiny_moe_config("mixtral")
    input_ids, mask, labels = make_batch(config.vocab_size)
    rows = slice(rank * len(input_ids) // world, (rank + 1) * len(input_ids) // world)
    grads = {}
    for mode in ("none", "full", "selective"):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).float()
        parallelize(model, build_mesh(2, "cpu"), param_dtype=torch.bfloat16, activation_checkpointing=mode, device="cpu")
        out = model(input_ids[rows], attention_mask=mask[rows])
        (world * causal_lm_loss_sum(out.logits.float(), labels[rows]) / count_label_tokens(labels)).backward()
        grads[mode] = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    for mode in ("full", "selective"):
        for name, grad in grads[mode].items():
            assert torch.isfinite(grad).all(), (mode, name)
            assert rel_err(grad, grads["none"][name]) <= 2e-2, (mode, name, rel_err(grad, grads["none"][name]))


def test_bf16_activation_checkpointing_recomputes_what_the_forward_saw(two_ranks):
    passed(two_ranks, "bf16_recompute")


def check_dp1_expert_gradients_are_exact(rank, world):
    """At ep = world size (dp = 1) nothing is summed over the experts, so what FSDP would do for them is a copy
    and a division by world size. FSDP leaves them out (``experts_need_fsdp``): the MoE layer casts fp32 master
    weights to bf16 itself, and the backward of that cast divides the gradients. Over two micro-steps that gives,
    bit for bit, the gradients of FSDP managing them and reducing in fp32, with fp32 and with bf16 weights. With
    dp > 1 they stay under FSDP."""
    from transformers import AutoModelForCausalLM

    import megablocks_utils.parallel.parallelize as parallelize_module
    from megablocks_utils.parallel.parallelize import (
        experts_need_fsdp,
        set_gradient_sync,
    )

    config = tiny_moe_config("mixtral")
    input_ids, mask, labels = make_batch(config.vocab_size, batch=8)
    assert not experts_need_fsdp(build_mesh(2, "cpu")) and experts_need_fsdp(build_mesh(1, "cpu"))  # dp = 2: a real sum
    chosen = parallelize_module.experts_need_fsdp
    for weights in (torch.float32, torch.bfloat16):
        grads = {}
        for variant, need_fsdp in (("chosen", chosen), ("fp32 FSDP", lambda mesh: True)):
            parallelize_module.experts_need_fsdp = need_fsdp
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(config).to(weights)
            mesh = build_mesh(2, "cpu")
            parallelize(model, mesh, param_dtype=torch.bfloat16, device="cpu")
            dims = {p.device_mesh.ndim for p in expert_parameters(model)}
            assert dims == ({1} if variant == "chosen" else {3}), (weights, variant, dims)
            for micro in range(2):
                set_gradient_sync(model, mesh, last_micro_step=micro == 1)
                rows = slice((2 * micro + rank) * 2, (2 * micro + rank + 1) * 2)
                out = model(input_ids[rows], attention_mask=mask[rows])
                (world * causal_lm_loss_sum(out.logits.float(), labels[rows]) / count_label_tokens(labels)).backward()
            grads[variant] = {n: p.grad.to_local().clone() for n, p in model.named_parameters() if ".experts." in n}
        parallelize_module.experts_need_fsdp = chosen
        assert grads["fp32 FSDP"] and grads["chosen"].keys() == grads["fp32 FSDP"].keys()
        for name, grad in grads["chosen"].items():
            assert grad.dtype == weights and torch.equal(grad, grads["fp32 FSDP"][name]), (weights, name)


def test_dp1_expert_gradients_equal_fp32_fsdp_reduce(two_ranks):
    passed(two_ranks, "dp1_expert_gradients")
