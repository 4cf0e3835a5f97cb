"""Every `optim` trains our EP + FSDP2 model in the precision it promises (2 gloo ranks, two meshes)."""

import pytest
import torch
from conftest import ARCHITECTURES, run_ranks, tiny_mixtral_config, tiny_moe_config

from megablocks_utils import (
    build_mesh,
    causal_lm_loss_sum,
    clip_grad_norm_,
    count_label_tokens,
    expert_parameters,
)
from megablocks_utils.parallel.parallelize import parallelize
from megablocks_utils.train.optim import (
    OPTIMIZERS,
    build_optimizer,
    decay_parameter_names,
    param_dtype,
    parameter_groups,
    state_bytes,
)

# Optimizer state bytes per parameter each option promises (AdamW's two moments): fp32, bf16, and 8-bit
# codes (plus per-block scales and a 256-entry codebook per tensor: up to ~0.6 more on these small tensors).
STATE_BYTES = {"adamw_torch": (7.9, 8.1), "adamw_bf16": (3.9, 4.1), "adamw_torch_8bit": (2.0, 3.0)}


def train_steps(rank, world, optim, ep_size, steps=4):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = tiny_mixtral_config()
    model = AutoModelForCausalLM.from_config(config).to(param_dtype(optim))
    mesh = build_mesh(ep_size, "cpu")
    parallelize(model, mesh, param_dtype=param_dtype(optim), device="cpu")
    experts = set(expert_parameters(model))
    groups = [{"params": [p for p in model.parameters() if p not in experts]}, {"params": list(experts)}]
    optimizer = build_optimizer(optim, groups, lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, device_type="cpu")
    before = {n: p.detach().to_local().clone() for n, p in model.named_parameters()}
    ids = torch.randint(1, config.vocab_size, (4, 16), generator=torch.Generator().manual_seed(1))[rank * 2:(rank + 1) * 2]
    losses = []
    for _ in range(steps):
        # this rank's mean; FSDP averages over the 2 ranks (equal token counts): the global mean's gradient
        loss = causal_lm_loss_sum(model(ids).logits.float(), ids) / count_label_tokens(ids)
        loss.backward()
        clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss))
    return model, optimizer, before, losses


def check_every_optim(rank, world):
    for ep_size in (2, 1):  # ep = 2; dp = 2 with experts FSDP-sharded over dp
        for optim in OPTIMIZERS:
            where = f"{optim}, ep={ep_size}"
            model, optimizer, before, losses = train_steps(rank, world, optim, ep_size)
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


def _state_bytes_of(state: dict) -> int:
    holder = torch.optim.Optimizer.__new__(torch.optim.Optimizer)  # state_bytes reads only .state
    holder.state = {0: state}
    return state_bytes(holder)


def test_every_optim_trains_in_its_precision_on_two_meshes():
    run_ranks(check_every_optim, 2)


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


def test_adamw_bf16_is_torchaos_update_in_fewer_calls():
    """Without its rounding noise, AdamWBF16 gives torchao's _AdamW(bf16_stochastic_round=False) bits exactly, over
    three steps, with and without weight decay, as the learning rate changes: 12 sizes (more than torch.compile's
    8 recompiles of a function), one of them in more tensors than one compiled call takes."""
    import torchao.optim

    from megablocks_utils.train import adamw_bf16

    torch.manual_seed(0)
    shapes = [(7, 5), (64,), (3, 4, 6), (2,), (33,), (5, 5), (9,), (4, 4, 4), (13,), (6, 7), (11, 3), (17,)] * 2
    shapes += [(8, 8)] * (adamw_bf16.CHUNK + 2)
    start = [torch.randn(s).to(torch.bfloat16) for s in shapes]
    grads = [[torch.randn(s).to(torch.bfloat16) for s in shapes] for _ in range(3)]

    def run(make, lrs=(1e-2, 5e-3, 2e-3)):
        params = [torch.nn.Parameter(t.clone()) for t in start]
        optimizer = make([{"params": params[:12]}, {"params": params[12:], "weight_decay": 0.0}])
        for step, lr in enumerate(lrs):
            for group in optimizer.param_groups:
                group["lr"].fill_(lr) if isinstance(group["lr"], torch.Tensor) else group.update(lr=lr)
            for p, g in zip(params, grads[step]):
                p.grad = g.clone()
            optimizer.step()
        return [p.detach() for p in params], optimizer

    kwargs = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    ours, optimizer = run(lambda g: adamw_bf16.AdamWBF16(g, stochastic_round=False, **kwargs))
    theirs, reference = run(lambda g: torchao.optim._AdamW(g, bf16_stochastic_round=False, **kwargs))
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert torch.equal(a, b), (i, shapes[i], (a.float() - b.float()).abs().max())
    for p_ours, p_ref in zip(optimizer.param_groups[0]["params"], reference.param_groups[0]["params"]):
        for name in ("exp_avg", "exp_avg_sq", "step"):  # the same state, so checkpoints carry over
            assert torch.equal(optimizer.state[p_ours][name], reference.state[p_ref][name]), name


def test_stochastic_rounding_is_unbiased_and_lands_on_a_neighbour():
    from megablocks_utils.train.adamw_bf16 import _round_stochastic

    x = torch.full((200_000,), 1.0 + 2**-10, dtype=torch.float32)  # 1/8 of a bf16 ulp (2**-7) above 1.0
    x[100_000:] *= -1
    rounded = _round_stochastic(x).float()
    up, down = 1.0 + 2**-7, 1.0
    assert set(rounded[:100_000].unique().tolist()) == {down, up}
    assert set(rounded[100_000:].unique().tolist()) == {-down, -up}
    share_up = (rounded[:100_000] == up).float().mean().item()
    assert abs(share_up - 1 / 8) < 0.01, share_up  # rounds up with the probability of the dropped fraction
    assert abs(rounded.abs().mean().item() - (1.0 + 2**-10)) < 2e-4
    exact = torch.tensor([0.0, 1.0, -2.5, float("inf")])  # representable in bf16: left as they are
    assert torch.equal(_round_stochastic(exact).float(), exact)


def test_adamw_bf16_compiles_one_graph_for_many_sizes():
    """The compiled update is specialised on the chunk's length (a power of two), not on the tensors' sizes or how
    many share one: 20 sizes held by 1 to 20 tensors each get at most five graphs (torch.compile stops recompiling
    a function after 8 and, with fullgraph, raises: seen on a 12-layer Qwen3 shape)."""
    from torch._dynamo.utils import counters  # torch.compile's own tally; there is no public one

    from megablocks_utils.train.adamw_bf16 import AdamWBF16

    torch._dynamo.reset()
    counters.clear()
    shapes = [[(n + 2,), (2, n + 2), (n + 2, 1, 3)][n % 3] for n in range(20)]  # a flat view would carry its base's rank
    params = [torch.nn.Parameter(torch.randn(shapes[n]).to(torch.bfloat16)) for n in range(20) for _ in range(n + 1)]
    optimizer = AdamWBF16(params, lr=1e-3)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn_like(p)
        optimizer.step()
    assert 1 <= counters["stats"]["unique_graphs"] <= 5, dict(counters["stats"])
