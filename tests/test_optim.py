"""Every ``optim`` option trains the EP + FSDP2 model in the precision it promises, and resumes from DCP."""

import math
import os
import sys

import pytest
import torch
import torch.distributed as dist
from conftest import run_ranks, tiny_mixtral_config
from torch.distributed.tensor import DTensor

from megablocks_utils import causal_lm_loss_sum, clip_grad_norm_, expert_parameters, shard_moe, sync_expert_grads
from megablocks_utils.optim import (
    BLOCK_SIZE_8BIT,
    MIN_NUMEL_8BIT,
    OPTIMIZERS,
    build_optimizer,
    bytes_per_param,
    param_dtype,
    state_bytes_per_param,
)

# vocab 256: the embedding and lm_head shards (128 x 64) are large enough for 8-bit state, so both
# parameter groups (dense, experts) hold some.
CONFIG = dict(vocab_size=256)
STEPS = 4
MOMENTS = ("exp_avg", "exp_avg_sq")


def parallelize(model, ep_size, dtype):
    """train_fsdp2.py's layout: EP on the experts, FSDP2 on every decoder layer and the root for the rest.

    Returns the mesh and the optimizer's two parameter groups (one per mesh). The one place to change
    when the layout changes (e.g. experts FSDP-sharded over dp too).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = shard_moe(model, ep_size, device="cpu")
    experts = expert_parameters(model)
    ignored = set(experts)
    mp_policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh.world, mp_policy=mp_policy, ignored_params=ignored)
    fully_shard(model, mesh=mesh.world, mp_policy=mp_policy, ignored_params=ignored)
    dense = [p for p in model.parameters() if p not in ignored]
    return mesh, [{"params": dense}, {"params": experts}]


def local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def is_8bit(t) -> bool:
    codes = getattr(local(t), "codes", None)
    return codes is not None and codes.dtype == torch.uint8


def moment_bytes(t) -> int:
    """Bytes a moment holds per the format (8-bit: codes and scales; the 1 KiB code table is left out)."""
    t = local(t)
    return t.codes.nbytes + t.scale.nbytes if is_8bit(t) else t.nbytes


def snapshot(optimizer):
    """Copies of every parameter shard and moment (8-bit ones as codes and scales)."""
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state[p]
            moments = [(local(state[k]).codes.clone(), local(state[k]).scale.clone()) if is_8bit(state[k])
                       else (local(state[k]).clone(),) for k in MOMENTS]
            out.append((local(p).detach().clone(), moments, float(state["step"])))
    return out


def assert_snapshots_equal(a, b, what):
    assert len(a) == len(b)
    for i, ((pa, ma, sa), (pb, mb, sb)) in enumerate(zip(a, b)):
        assert torch.equal(pa, pb), f"{what}: parameter {i} differs"
        assert sa == sb, f"{what}: step of parameter {i}: {sa} vs {sb}"
        for k, (xa, xb) in enumerate(zip(ma, mb)):
            assert all(torch.equal(u, v) for u, v in zip(xa, xb)), f"{what}: {MOMENTS[k]} of parameter {i} differs"


def check_state_precision(optim, optimizer, groups):
    """The state is in the promised format; returns measured moment bytes per parameter."""
    total_bytes = total_numel = 0
    quantized = [0, 0]  # 8-bit tensors in the dense and expert group
    for g, group in enumerate(groups):
        for p in group["params"]:
            state, n = optimizer.state[p], local(p).numel()
            for k in MOMENTS:
                m = state[k]
                if optim == "adamw_torch_8bit":
                    big = n >= MIN_NUMEL_8BIT and n % BLOCK_SIZE_8BIT == 0
                    assert is_8bit(m) == big, (k, tuple(p.shape), n, type(local(m)).__name__)
                    if big:
                        quantized[g] += 1
                        assert moment_bytes(m) / n == state_bytes_per_param(optim) / 2
                    else:
                        assert local(m).dtype == torch.float32
                else:
                    assert not is_8bit(m) and local(m).dtype == param_dtype(optim), (k, local(m).dtype)
                    assert moment_bytes(m) / n == state_bytes_per_param(optim) / 2
                total_bytes += moment_bytes(m)
            total_numel += n
    if optim == "adamw_torch_8bit":
        assert all(quantized), f"8-bit moments in (dense, expert) groups: {quantized}; both should have some"
    return total_bytes / total_numel


def train_and_resume(rank, world, optim, ep_size, root):
    from transformers import AutoModelForCausalLM, get_scheduler

    dtype = param_dtype(optim)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_mixtral_config(**CONFIG), dtype=dtype)
    mesh, groups = parallelize(model, ep_size, dtype)
    optimizer = build_optimizer(optim, groups, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01, device_type="cpu")
    scheduler = get_scheduler("linear", optimizer, num_warmup_steps=0, num_training_steps=100)
    ids = torch.randint(1, CONFIG["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(rank))
    tokens = (ids.shape[1] - 1) * ids.shape[0] * world

    def step():
        loss = world * causal_lm_loss_sum(model(input_ids=ids).logits, ids) / tokens
        loss.backward()
        sync_expert_grads(model, mesh)
        clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        global_loss = loss.detach() / world
        dist.all_reduce(global_loss)
        return float(global_loss)

    initial = [local(p).detach().clone() for g in groups for p in g["params"]]
    losses = [step() for _ in range(STEPS)]
    where = f"{optim}, dp={mesh.dp_size} x ep={mesh.ep_size}"
    assert losses[-1] < losses[0] - 0.05, f"{where}: the loss did not fall: {losses}"
    for i, (p, before) in enumerate(zip((p for g in groups for p in g["params"]), initial)):
        assert p.dtype == dtype, f"{where}: parameter {i} is {p.dtype}"
        assert not torch.equal(local(p), before), f"{where}: parameter {i} {tuple(p.shape)} did not change"
    measured = check_state_precision(optim, optimizer, groups)

    # DCP round trip: save, take a step, load; the state is back and the next step repeats exactly
    # (the RNG comes back too: adamw_bf16's stochastic rounding draws from it).
    from megablocks_utils.checkpoint import load_checkpoint, save_checkpoint

    saved_at = snapshot(optimizer)
    path = save_checkpoint(root, STEPS, model, optimizer, scheduler, {}, 1)
    step()
    after_one = snapshot(optimizer)
    load_checkpoint(path, model, optimizer, scheduler)
    assert_snapshots_equal(snapshot(optimizer), saved_at, f"{where}: after load")
    assert isinstance(optimizer.param_groups[0]["lr"], torch.Tensor) == (optim != "adamw_torch")
    assert math.isclose(float(scheduler.get_last_lr()[0]), 1e-2 * (1 - STEPS / 100), rel_tol=1e-6)
    step()
    assert_snapshots_equal(snapshot(optimizer), after_one, f"{where}: the step after resuming")
    if rank == 0:
        print(f"{where}: losses {[round(x, 4) for x in losses]}, moments {measured:.4f} B/param", flush=True)
    dist.barrier()


def train_every_option(rank, world, root):
    for optim in OPTIMIZERS:
        for ep_size in (2, 1):  # dp=1 x ep=2, dp=2 x ep=1
            train_and_resume(rank, world, optim, ep_size, os.path.join(root, f"{optim}_ep{ep_size}"))


def test_every_optim_trains_ep_fsdp2_in_its_precision_and_resumes(tmp_path):
    """One spawn of 2 ranks runs every option on both meshes (spawns and torchao's compiles are the cost)."""
    pytest.importorskip("torchao")
    run_ranks(train_every_option, 2, str(tmp_path))


def adamw_reference(params, grads_per_step, lr, betas, eps, weight_decay):
    """AdamW written out (decoupled weight decay, bias-corrected moments), one tensor at a time."""
    params = [p.detach().clone() for p in params]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    for t, grads in enumerate(grads_per_step, start=1):
        for p, g, m_, v_ in zip(params, grads, m, v):
            p.mul_(1 - lr * weight_decay)
            m_.mul_(betas[0]).add_(g, alpha=1 - betas[0])
            v_.mul_(betas[1]).addcmul_(g, g, value=1 - betas[1])
            denom = (v_ / (1 - betas[1] ** t)).sqrt() + eps
            p.sub_(lr * (m_ / (1 - betas[0] ** t)) / denom)
    return params


def test_adamw_torch_matches_adamw_written_out():
    """Single process, two groups: the result equals AdamW written out, from the same gradients."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_mixtral_config())
    params = list(model.parameters())
    start = [p.detach().clone() for p in params]
    kwargs = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    optimizer = build_optimizer("adamw_torch", [{"params": params[:5]}, {"params": params[5:]}], device_type="cpu", **kwargs)
    ids = torch.randint(1, 96, (2, 12), generator=torch.Generator().manual_seed(0))
    grads_per_step = []
    for _ in range(3):
        causal_lm_loss_sum(model(input_ids=ids).logits, ids).backward()
        grads_per_step.append([p.grad.clone() for p in params])
        optimizer.step()
        optimizer.zero_grad()
    expected = adamw_reference(start, grads_per_step, **kwargs)
    for p, e, s in zip(params, expected, start):
        assert not torch.equal(p, s)
        torch.testing.assert_close(p.detach(), e, rtol=1e-6, atol=1e-7)


def test_unknown_optim_names_the_choices():
    with pytest.raises(ValueError, match=r"optim='adamw_8bit' is unknown; choose one of adamw_torch, adamw_bf16, adamw_torch_8bit"):
        build_optimizer("adamw_8bit", [{"params": [torch.nn.Parameter(torch.ones(2))]}], lr=1e-3, betas=(0.9, 0.95))


@pytest.mark.parametrize("optim", OPTIMIZERS)
def test_parameters_of_another_dtype_are_refused(optim):
    other = torch.float32 if param_dtype(optim) == torch.bfloat16 else torch.bfloat16
    p = torch.nn.Parameter(torch.ones(4, dtype=other))
    with pytest.raises(ValueError, match=rf"optim='{optim}' needs {param_dtype(optim)} parameters .*dtype=param_dtype"):
        build_optimizer(optim, [{"params": [p]}], lr=1e-3, betas=(0.9, 0.95))


def test_missing_torchao_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.optim", None)  # import torchao.optim raises ImportError
    p = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    with pytest.raises(ImportError, match=r"pip install torchao==0\.18\.0"):
        build_optimizer("adamw_bf16", [{"params": [p]}], lr=1e-3, betas=(0.9, 0.95))


def test_bytes_per_param():
    assert [bytes_per_param(o) for o in OPTIMIZERS] == [16.0, 8.0, 10.03125]
