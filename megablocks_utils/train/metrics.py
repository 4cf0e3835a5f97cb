"""Throughput, MFU and memory numbers for the per-step JSONL and the end-of-run summary.

FLOPs per trained token (docs/metrics.md):
    6 * N_active + 12 * L * d_model * S
N_active counts the weights a token passes through in matmuls: attention and norms, the router,
top_k of the E experts of each layer, and the LM head (not the embedding lookup). The second
term is attention's QK^T and AV products for a sequence of S tokens (forward + backward).
"""

import json
import math
import resource

import torch


def _quantized_weights(model) -> tuple[int, int]:
    """(dense, expert) weights held quantized (LoRA's ``quantize_base``: buffers, not parameters), global counts: the
    linear layers' are whole on every rank, each rank holds its own experts'."""
    from megablocks_utils.moe.expert_weights import ExpertWeights
    from megablocks_utils.moe.quantized import QuantizedLinear

    dense = expert = 0
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            dense += module.in_features * module.out_features
        elif isinstance(module, ExpertWeights) and module.quantized:
            expert += sum(math.prod(w.shape) * module.num_experts // w.shape[0] for w in (module.gate_up_proj, module.down_proj))
    return dense, expert


def active_params(model, config, expert_params) -> int:
    """Parameters a token multiplies through (global count, not this rank's shard), quantized frozen weights included."""
    experts = {id(p) for p in expert_params}
    quantized_dense, quantized_expert = _quantized_weights(model)
    dense = sum(p.numel() for p in model.parameters() if id(p) not in experts) + quantized_dense
    embed = model.get_input_embeddings().weight.numel()
    expert_total = sum(p.numel() for p in expert_params) + quantized_expert  # DTensor numel is the global numel
    num_experts = config.num_local_experts if hasattr(config, "num_local_experts") else config.num_experts
    return dense - embed + expert_total * config.num_experts_per_tok // num_experts


def flops_per_token(n_active: int, config, seq_len: int) -> int:
    return 6 * n_active + 12 * config.num_hidden_layers * config.hidden_size * seq_len


def peak_memory_gb(device: torch.device) -> dict:
    if device.type == "cuda":
        return {
            "peak_memory_allocated_gb": torch.cuda.max_memory_allocated(device) / 2**30,
            "peak_memory_reserved_gb": torch.cuda.max_memory_reserved(device) / 2**30,
            # How often the caching allocator had to free its cache and retry (a slow, synchronising step): a
            # count that grows during training explains single slow steps.
            "alloc_retries": torch.cuda.memory_stats(device).get("num_alloc_retries", 0),
        }
    return {"peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}  # KiB on Linux


def finite_or_none(record: dict) -> dict:
    """JSON has no NaN or Infinity: a non-finite number (the loss of a skipped step) becomes None (null)."""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}


def write_summary(path: str, summary: dict) -> None:
    with open(path, "w") as f:
        json.dump(finite_or_none(summary), f, indent=1)


class JsonlWriter:
    """One JSON record per line. JSON has no NaN or Infinity: a non-finite number (the loss of a skipped step) is null."""

    def __init__(self, path: str):
        self.file = open(path, "a")

    def write(self, record: dict) -> None:
        self.file.write(json.dumps(finite_or_none(record)) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()
