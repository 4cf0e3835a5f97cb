"""train_fsdp2.py on one rank is plain transformers training: the stock model, torch's AdamW, the same
batches, a hand-written loop. Its per-step losses hold FSDP2, gradient accumulation, activation
checkpointing, the clipping and the schedule to it."""

import json
import math
import os

import torch
import torch.nn.functional as F
from conftest import read_jsonl

# What train_fsdp2.py uses (its settings and optimizer call), for the run in conftest's one_rank_run.
LEARNING_RATE, BETAS, EPS, WEIGHT_DECAY, MAX_GRAD_NORM = 2e-3, (0.9, 0.95), 1e-8, 0.0, 1.0
MAX_LENGTH, SEED = 256, 42


def cosine_with_warmup(step: int, warmup: int, total: int) -> float:
    """The factor on the peak learning rate for the update of 0-based ``step`` (written out, not transformers')."""
    if step < warmup:
        return step / warmup
    return 0.5 * (1.0 + math.cos(math.pi * (step - warmup) / (total - warmup)))


def plain_transformers_losses(model_dir: str, data_path: str, steps: int, micro_batch: int, grad_accum: int, warmup: int) -> list[dict]:
    """One process, no package code but the data's definition (GlobalBatches, collate)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megablocks_utils.data import GlobalBatches, build_dataset, collate

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    dataset, _ = build_dataset(data_path, tokenizer, MAX_LENGTH)
    batches = GlobalBatches(dataset, micro_batch, grad_accum, world_size=1, rank=0, seed=SEED)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    coef = model.config.router_aux_loss_coef
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: cosine_with_warmup(s, warmup, steps))
    records = []
    for step in range(steps):
        micro_batches, label_tokens = batches.micro_batches(step)
        ce_total, aux_total = 0.0, 0.0
        for indices in micro_batches:
            batch = collate([dataset[j] for j in indices], tokenizer.pad_token_id, "cpu")
            out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_router_logits=True)
            logits, labels = out.logits[:, :-1], batch["labels"][:, 1:]
            ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100, reduction="sum")
            # The step's loss: CE summed over all its label tokens / their count, plus the micro-steps' mean aux loss.
            (ce / label_tokens + coef * out.aux_loss / len(micro_batches)).backward()
            ce_total += float(ce.detach())
            aux_total += float(out.aux_loss.detach()) / len(micro_batches)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        records.append({"step": step + 1, "loss": ce_total / label_tokens + coef * aux_total, "grad_norm": float(grad_norm),
                        "lr": scheduler.get_last_lr()[0]})
    return records


def test_one_rank_equals_a_plain_transformers_loop(one_rank_run, tiny_model_dir, small_data):
    """Per-step losses in fp32 within 1e-5: a schedule off by one step, a lost micro-step or a clip that
    differs moves them by far more (the learning rate changes every step, and the norm is above 1)."""
    with open(os.path.join(one_rank_run, "settings.json")) as f:
        used = json.load(f)
    assert (used["learning_rate"], used["weight_decay"], used["max_grad_norm"], used["max_length"], used["seed"]) == (
        LEARNING_RATE, WEIGHT_DECAY, MAX_GRAD_NORM, MAX_LENGTH, SEED)
    assert used["activation_checkpointing"] == "full" and used["lr_scheduler_type"] == "cosine" and used["dtype"] in ("auto", "fp32")
    script = read_jsonl(os.path.join(one_rank_run, "metrics.jsonl"))
    expected = plain_transformers_losses(tiny_model_dir, small_data, used["max_steps"], used["per_device_train_batch_size"],
                                         used["gradient_accumulation_steps"], used["warmup_steps"])
    assert len(script) == len(expected) == used["max_steps"] >= 4, (len(script), len(expected))
    assert used["gradient_accumulation_steps"] >= 2
    assert any(r["grad_norm"] > MAX_GRAD_NORM for r in expected)  # the clip is exercised
    for got, want in zip(script, expected):
        assert got["step"] == want["step"]
        assert abs(got["loss"] - want["loss"]) <= 1e-5 * abs(want["loss"]), (got["step"], got["loss"], want["loss"])
        assert abs(got["grad_norm"] - want["grad_norm"]) <= 1e-4 * want["grad_norm"], (got["step"], got["grad_norm"], want["grad_norm"])
        assert math.isclose(got["lr"], want["lr"], rel_tol=1e-9, abs_tol=1e-12), (got["step"], got["lr"], want["lr"])
