"""train_fsdp2.py on one rank is plain transformers training: the stock model, torch's AdamW, the same
batches, a hand-written loop. Its per-step losses hold FSDP2, gradient accumulation, activation
checkpointing, the clipping and the schedule to it."""

import json
import math
import os

import torch
import torch.nn.functional as F
from conftest import read_jsonl

# What train_fsdp2.py uses by default (its settings block), checked against the run's settings.json.
DEFAULTS = {"learning_rate": 2e-3, "adam_beta1": 0.9, "adam_beta2": 0.95, "adam_epsilon": 1e-8, "weight_decay": 0.0,
            "max_grad_norm": 1.0, "max_length": 256, "seed": 42, "lr_scheduler_type": "cosine", "packing": True,
            "router_aux_loss_coef": -1.0, "activation_checkpointing": "full", "attn_implementation": "auto"}
ATTENTION_ON_CPU = "sdpa"  # what attn_implementation "auto" picks on CPU (megablocks_utils.model.attention, tests/test_attention.py)


def cosine_with_warmup(step: int, warmup: int, total: int) -> float:
    """The factor on the peak learning rate for the update of 0-based ``step`` (written out, not transformers')."""
    if step < warmup:
        return step / warmup
    return 0.5 * (1.0 + math.cos(math.pi * (step - warmup) / (total - warmup)))


def plain_transformers_losses(model_dir: str, data_path: str, s: dict) -> list[dict]:
    """One process, the stock model and torch's AdamW; no package code but the data's definition (the
    dataset, its packed rows, GlobalBatches, collate)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    from megablocks_utils.data.batches import GlobalBatches, collate
    from megablocks_utils.data.packing import pack_dataset
    from megablocks_utils.data.records import build_dataset

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    dataset = pack_dataset(build_dataset(data_path, tokenizer, s["max_length"])[0], s["max_length"], s["seed"])
    steps, grad_accum = s["max_steps"], s["gradient_accumulation_steps"]
    batches = GlobalBatches(dataset, s["per_device_train_batch_size"], grad_accum, world_size=1, rank=0, seed=s["seed"])
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=ATTENTION_ON_CPU)
    model.train()
    config = model.config
    optimizer = torch.optim.AdamW(model.parameters(), lr=s["learning_rate"], betas=(s["adam_beta1"], s["adam_beta2"]),
                                  eps=s["adam_epsilon"], weight_decay=s["weight_decay"])
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: cosine_with_warmup(step, int(s["warmup_steps"]), steps))
    records = []
    for step in range(steps):
        micro_batches, label_tokens = batches.micro_batches(step)
        ce_total, aux_total = 0.0, 0.0
        for indices in micro_batches:
            batch = collate([dataset[j] for j in indices], tokenizer.pad_token_id, "cpu")
            # Packed rows: per-document position_ids and no mask, so transformers keeps the documents apart.
            out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"],
                        output_router_logits=True, use_cache=False)
            logits, labels = out.logits[:, :-1], batch["labels"][:, 1:]
            ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100, reduction="sum")
            # transformers' own load-balancing loss, over the real tokens (not a row's padding at its end)
            aux = load_balancing_loss_func(out.router_logits, config.num_local_experts, config.num_experts_per_tok, batch["real"])
            # The step's loss: CE summed over all its label tokens / their count, plus the micro-steps' mean aux loss.
            (ce / label_tokens + config.router_aux_loss_coef * aux / grad_accum).backward()
            ce_total += float(ce.detach())
            aux_total += float(aux.detach()) / grad_accum
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), s["max_grad_norm"])
        lr = optimizer.param_groups[0]["lr"]  # the rate this step's update uses
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        records.append({"step": step + 1, "loss": ce_total / label_tokens + config.router_aux_loss_coef * aux_total,
                        "grad_norm": float(grad_norm), "lr": lr})
    return records


def test_one_rank_equals_a_plain_transformers_loop(one_rank_run, tiny_model_dir, small_data):
    """Per-step losses in fp32 within 1e-5: a schedule off by one step, a lost micro-step or a clip that
    differs moves them by far more (the learning rate changes every step, and the norm is above 1)."""
    with open(os.path.join(one_rank_run, "settings.json")) as f:
        used = json.load(f)
    assert {k: used[k] for k in DEFAULTS} == DEFAULTS
    assert used["dtype"] in ("auto", "fp32") and used["warmup_ratio"] == 0 and used["gradient_accumulation_steps"] >= 2
    script = read_jsonl(os.path.join(one_rank_run, "metrics.jsonl"))
    expected = plain_transformers_losses(tiny_model_dir, small_data, used)
    assert len(script) == len(expected) == used["max_steps"] >= 4, (len(script), len(expected))
    assert any(r["grad_norm"] > used["max_grad_norm"] for r in expected)  # the clip is exercised
    for got, want in zip(script, expected):
        assert got["step"] == want["step"]
        assert abs(got["loss"] - want["loss"]) <= 1e-5 * abs(want["loss"]), (got["step"], got["loss"], want["loss"])
        assert abs(got["grad_norm"] - want["grad_norm"]) <= 1e-4 * want["grad_norm"], (got["step"], got["grad_norm"], want["grad_norm"])
        assert math.isclose(got["lr"], want["lr"], rel_tol=1e-9, abs_tol=1e-12), (got["step"], got["lr"], want["lr"])
