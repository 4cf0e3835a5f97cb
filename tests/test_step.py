"""One optimizer step's loss (megablocks_utils/train/step.py, which both scripts use): over 2 ranks and 2 micro-steps
its gradients, loss and aux loss are those of one process computing the step from all its rows (the mean over every
label token of the step, plus coef x the mean of each micro-step's aux loss over its global token set), with the loss
from the full logits and computed inside lm_head in chunks (the scripts' default, train/loss.py)."""

import copy

import pytest
import torch
from conftest import run_rank_cases, tiny_mixtral_config
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from megablocks_utils import (
    IGNORE_INDEX,
    average_replicated_grads,
    build_mesh,
    clip_grad_norm_,
    count_label_tokens,
    spec_for,
)
from megablocks_utils.data.batches import collate
from megablocks_utils.parallel.parallelize import parallelize, set_gradient_sync
from megablocks_utils.train.evaluate import eval_loss
from megablocks_utils.train.loss import LossHead, install_loss_head
from megablocks_utils.train.nonfinite import NonFiniteSteps
from megablocks_utils.train.step import StepLoss

TOL = 1e-5
LENGTH = 16
ROOT_WEIGHT = "model.embed_tokens.weight"  # one of the root FSDP unit's own weights  # every row padded to it, as the scripts pad to max_length


def rel_err(a, b) -> float:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))


def samples(vocab: int, n: int = 8) -> list[dict]:
    """Samples of different lengths and prompt lengths, so ranks and micro-steps hold different label-token counts."""
    g = torch.Generator().manual_seed(1)
    found = []
    for i in range(n):
        ids = torch.randint(1, vocab, (6 + (i * 3) % 7,), generator=g).tolist()
        prompt = 2 + i % 3
        found.append({"input_ids": ids, "labels": [IGNORE_INDEX] * prompt + ids[prompt:]})
    return found


def check_step_loss_is_one_process_step(rank, world, ep_size, chunked, fsdp_wrap):
    config = tiny_mixtral_config()
    coef = spec_for(config).aux_loss_coef(config)
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(config)
    model = copy.deepcopy(reference)
    micro_steps = [samples(config.vocab_size)[:4], samples(config.vocab_size)[4:]]  # each: 2 rows per rank
    label_tokens = sum(count_label_tokens(collate(rows, 0, "cpu", LENGTH)["labels"]) for rows in micro_steps)

    ref_loss, ref_aux = 0.0, 0.0
    for rows in micro_steps:  # one process: each micro-step's rows of every rank at once
        batch = collate(rows, 0, "cpu", LENGTH)
        out = reference(**batch["model_inputs"], output_router_logits=True)
        ce = torch.nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(),
                                               ignore_index=IGNORE_INDEX, reduction="sum")
        ref_loss = ref_loss + ce / label_tokens + coef * out.aux_loss / len(micro_steps)
        ref_aux = ref_aux + out.aux_loss.detach() / len(micro_steps)
    ref_loss.backward()

    mesh = build_mesh(ep_size, "cpu")
    if chunked:  # as the scripts: before FSDP; 5-row chunks, so a rank's 2 x 16 rows end in a short chunk
        assert install_loss_head(model) == ""
        model.lm_head.chunk_rows = 5
    parallelize(model, mesh, param_dtype=torch.float32, device="cpu", fsdp_wrap=fsdp_wrap)
    assert isinstance(model.lm_head, LossHead) == chunked
    step_loss = StepLoss(1, label_tokens, len(micro_steps), aux_coef=coef, group=mesh.world.get_group(), device="cpu")
    for i, rows in enumerate(micro_steps):
        set_gradient_sync(model, mesh, i == len(micro_steps) - 1)
        loss, _ = step_loss.micro_batch(model, collate(rows[2 * rank : 2 * rank + 2], 0, "cpu", LENGTH))
        # The root unit (embeddings, head; every dense weight with fsdp_wrap "model"): with "model" gathered through the
        # forward; with "layer" sharded after it (parallelize passes reshard_after_forward to the root too); with
        # "none" never sharded (whole on every rank).
        assert isinstance(model.get_parameter(ROOT_WEIGHT), DTensor) == (fsdp_wrap == "layer"), (i, fsdp_wrap)
        loss.backward()
        # It stays gathered from one backward to the next micro-step's forward, and is sharded after the step's last.
        last = i == len(micro_steps) - 1
        assert isinstance(model.get_parameter(ROOT_WEIGHT), DTensor) == (last and fsdp_wrap != "none"), (i, fsdp_wrap)
    if fsdp_wrap == "none":  # as train_fsdp2.py: the whole dense weights' gradients averaged once a step
        assert not any(isinstance(m, FSDPModule) for m in model.modules())
        average_replicated_grads(model.parameters(), mesh.world.get_group())
    grad_norm = clip_grad_norm_(model.parameters(), float("inf"))
    assert step_loss.check(NonFiniteSteps("stop", 5), grad_norm) is False
    sums = step_loss.sums
    assert rel_err(sums.ce_sum / step_loss.label_tokens + coef * sums.aux, ref_loss.detach()) <= TOL
    assert rel_err(sums.aux, ref_aux) <= TOL
    assert sums.tokens == sum(len(s["input_ids"]) for rows in micro_steps for s in rows)
    assert sums.nonfinite == 0
    ref_params = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        assert rel_err(grad, ref_params[name].grad) <= TOL, (name, rel_err(grad, ref_params[name].grad))
    # An eval pass (no backward) leaves no unit gathered: a later in-place edit (LoRA's merge) must reach the weights.
    eval_loss(model, samples(config.vocab_size)[:4], 2, 0, "cpu", mesh.world.get_group(), LENGTH)
    assert isinstance(model.get_parameter(ROOT_WEIGHT), DTensor) == (fsdp_wrap != "none"), fsdp_wrap


MESHES = {"dp2": (1, "layer"), "ep2": (2, "layer"), "ep2-model-unit": (2, "model"), "ep2-replicated-dense": (2, "none")}
LOSSES = {"full_logits": False, "chunked_loss": True}


@pytest.fixture(scope="module")
def step_cases(tmp_path_factory) -> dict:
    """Every mesh and loss below on one start of 2 ranks (``run_rank_cases``): each case's outcome."""
    cases = {f"{mesh}-{loss}": (check_step_loss_is_one_process_step, MESHES[mesh][0], chunked, MESHES[mesh][1])
             for mesh in MESHES for loss, chunked in LOSSES.items()}
    return run_rank_cases(2, cases, str(tmp_path_factory.mktemp("step_cases")))


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("mesh", MESHES)
def test_step_loss_over_ranks_and_micro_steps_is_one_process_step(step_cases, mesh, loss):
    error = step_cases[f"{mesh}-{loss}"]
    assert error is None, error
