"""Every `optim` trains our EP + FSDP2 model in the precision it promises (2 gloo ranks, two meshes)."""

import pytest
import torch
from conftest import ARCHITECTURES, run_rank_cases, tiny_mixtral_config, tiny_moe_config

from megablocks_utils import (
    build_mesh,
    causal_lm_loss_sum,
    clip_grad_norm_,
    clipped_step,
    count_label_tokens,
    expert_parameters,
    grad_norm_and_clip_coef,
)
from megablocks_utils.parallel.parallelize import parallelize
from megablocks_utils.train.optim import (
    OPTIMIZERS,
    build_optimizer,
    decay_parameter_names,
    param_dtype,
    parameter_groups,
    prepare_step,
    state_bytes,
)

# Optimizer state bytes per parameter each option promises (AdamW's two moments): fp32, bf16, and 8-bit
# codes (plus per-block scales and a 256-entry codebook per tensor: up to ~0.6 more on these small tensors).
STATE_BYTES = {"adamw_torch": (7.9, 8.1), "adamw_bf16": (3.9, 4.1), "adamw_torch_8bit": (2.0, 3.0)}


def train_steps(rank, world, optim, ep_size, steps=4, max_norm=1.0, fold=False):
    """``fold``: the clip as train_fsdp2.py applies it (the step prepared ahead, then ``clipped_step``), else
    ``clip_grad_norm_`` then the step."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = tiny_mixtral_config()
    model = AutoModelForCausalLM.from_config(config).to(param_dtype(optim))
    mesh = build_mesh(ep_size, "cpu")
    parallelize(model, mesh, param_dtype=param_dtype(optim), device="cpu")
    experts = set(expert_parameters(model))
    # in the model's order (a set's order changes from run to run, and with it which tensor draws which rounding seed)
    groups = [{"params": [p for p in model.parameters() if p not in experts]}, {"params": [p for p in model.parameters() if p in experts]}]
    optimizer = build_optimizer(optim, groups, lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, device_type="cpu")
    before = {n: p.detach().to_local().clone() for n, p in model.named_parameters()}
    ids = torch.randint(1, config.vocab_size, (4, 16), generator=torch.Generator().manual_seed(1))[rank * 2:(rank + 1) * 2]
    losses, norms = [], []
    for _ in range(steps):
        # this rank's mean; FSDP averages over the 2 ranks (equal token counts): the global mean's gradient
        loss = causal_lm_loss_sum(model(ids).logits.float(), ids) / count_label_tokens(ids)
        loss.backward()
        if fold:
            norm, coef = grad_norm_and_clip_coef(model.parameters(), max_norm)
            clipped_step(optimizer, coef, prepare_step(optimizer, coef))
        else:
            norm = clip_grad_norm_(model.parameters(), max_norm)
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss))
        norms.append(float(norm))
    return model, optimizer, before, losses, norms


def check_every_optim(rank, world):
    for ep_size in (2, 1):  # ep = 2; dp = 2 with experts FSDP-sharded over dp
        for optim in OPTIMIZERS:
            where = f"{optim}, ep={ep_size}"
            model, optimizer, before, losses, _ = train_steps(rank, world, optim, ep_size)
            assert losses[-1] < losses[0] - 0.05, (where, losses)
            numel = 0
            for name, p in model.named_parameters():
                assert p.dtype == param_dtype(optim), (where, name, p.dtype)
                local = p.detach().to_local()
                numel += local.numel()
                if local.numel():
                    assert not torch.equal(local, before[name]), f"{where}: {name} did not change"
            # A silent fallback to fp32 state (or fp32 weights for adamw_bf16) fails here. torchao keeps
            # tensors under 4096 elements in fp32 state, so the 8-bit promise is checked on the larger ones.
            large = [p for p in model.parameters() if p.to_local().numel() >= 4096]
            assert large, where
            total = sum(p.to_local().numel() for p in large)
            measured = sum(_state_bytes_of(optimizer.state[p]) for p in large) / total
            low, high = STATE_BYTES[optim]
            assert low <= measured <= high, (where, measured)


def check_clip_folded_into_adamw_bf16(rank, world):
    for ep_size in (2, 1):  # ep = 2; dp = 2 with experts FSDP-sharded over dp: gradients on two meshes
        first, first_optim, _, first_losses, first_norms = train_steps(rank, world, "adamw_bf16", ep_size, max_norm=0.05)
        fold, fold_optim, _, fold_losses, fold_norms = train_steps(rank, world, "adamw_bf16", ep_size, max_norm=0.05, fold=True)
        assert min(fold_norms) > 0.05, fold_norms  # the clip scaled every step's gradients
        assert (first_losses, first_norms) == (fold_losses, fold_norms), ep_size
        for (name, p), q in zip(first.named_parameters(), fold.parameters()):
            assert torch.equal(p.to_local(), q.to_local()), (ep_size, name)
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(first_optim.state[p][key].to_local(), fold_optim.state[q][key].to_local()), (ep_size, name, key)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict:
    """This file's 2-rank checks on one start of the ranks (spawns are the cost): each one's outcome."""
    cases = {"clip_folded": (check_clip_folded_into_adamw_bf16,), "every_optim": (check_every_optim,)}
    return run_rank_cases(2, cases, str(tmp_path_factory.mktemp("optim_ranks")))


def test_adamw_bf16_with_the_clip_folded_in_trains_the_same_bits(two_ranks):
    """adamw_bf16 multiplying the clip's coefficient into each gradient as its update reads it (``clipped_step`` of a
    step prepared ahead, train_fsdp2.py's path) gives the weights, moments and losses of clipping the gradients in place first, bit for bit:
    the update rounds the product to bf16 as the in-place multiply stores it (adamw_bf16.py). Equal noise: the same
    seeds, drawn in the same order."""
    assert two_ranks["clip_folded"] is None, two_ranks["clip_folded"]


def _state_bytes_of(state: dict) -> int:
    holder = torch.optim.Optimizer.__new__(torch.optim.Optimizer)  # state_bytes reads only .state
    holder.state = {0: state}
    return state_bytes(holder)


def test_every_optim_trains_in_its_precision_on_two_meshes(two_ranks):
    assert two_ranks["every_optim"] is None, two_ranks["every_optim"]


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_weight_decay_skips_what_trainer_skips(arch):
    """train_fsdp2's decayed parameters are Trainer's (train_fsdp1), on transformers' model and on ours after the
    MoE swap (same names); norms and biases are left out, the rest kept; the groups keep the meshes apart."""
    import copy

    import torch.distributed as dist
    from conftest import free_port
    from transformers import AutoModelForCausalLM, Trainer

    from megablocks_utils import shard_moe

    model = AutoModelForCausalLM.from_config(tiny_moe_config(arch))
    trainers = set(Trainer.get_decay_parameter_names(None, model))  # it reads nothing of the Trainer itself
    ours = decay_parameter_names(model)
    assert ours == trainers
    names = {n for n, _ in model.named_parameters()}
    assert any("norm" in n for n in names - ours) and not any("norm" in n or "bias" in n for n in ours)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        swapped = copy.deepcopy(model)
        shard_moe(swapped, 1, device="cpu")
        assert decay_parameter_names(swapped) == trainers
        experts = set(expert_parameters(swapped))
        groups = parameter_groups(swapped, experts, weight_decay=0.1)
        assert sum(len(g["params"]) for g in groups) == len(names)
        for g in groups:  # one mesh per group; the not-decayed groups say so
            assert len({p in experts for p in g["params"]}) == 1
            decayed = {id(p) for n, p in swapped.named_parameters() if n in trainers}
            assert all((id(p) in decayed) == ("weight_decay" not in g) for p in g["params"])
        assert len(parameter_groups(swapped, experts, weight_decay=0.0)) == 2
    finally:
        dist.destroy_process_group()


def test_the_8bit_step_compiles_with_one_kernel_config_per_kernel(monkeypatch):
    """adamw_torch_8bit's step runs under Inductor's deterministic mode with pointwise configs not timed (every rank
    compiles the same kernels, so replicated weights stay equal: bench/reports/probes_retired_2026-12-02.md), and only inside it."""
    import torch._inductor.config as inductor_config
    from torchao.optim import AdamW8bit

    from megablocks_utils.train.optim import build_optimizer

    seen = []
    monkeypatch.setattr(AdamW8bit, "step", lambda self, closure=None: seen.append(
        (inductor_config.deterministic, inductor_config.triton.autotune_pointwise)))
    weight = torch.nn.Parameter(torch.zeros(4096))
    optimizer = build_optimizer("adamw_torch_8bit", [{"params": [weight]}], lr=1e-3, betas=(0.9, 0.95))
    assert isinstance(optimizer, AdamW8bit) and type(optimizer).__name__ == "AdamW8bit"
    again = build_optimizer("adamw_torch_8bit", [{"params": [weight]}], lr=1e-3, betas=(0.9, 0.95))
    assert type(again) is type(optimizer)  # one subclass, whatever the number of optimizers built
    optimizer.step()
    assert seen == [(True, False)]
    assert (inductor_config.deterministic, inductor_config.triton.autotune_pointwise) == (False, True)  # restored
