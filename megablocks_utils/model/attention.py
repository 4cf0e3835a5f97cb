"""The attention kernel for a run: ``auto`` picks the fastest one that is exact for the model, device and rows.

Every row the scripts train on is exactly ``max_length`` tokens (``data.collate``): packed rows hold several
documents and a padding document, unpacked rows one document and padding. So there is almost always something
to mask, and the kernels differ in how they do it:

- ``sdpa``: transformers builds a dense [rows, 1, L, L] mask from the position ids; torch's sdpa then cannot
  use its flash kernel and computes every block. Exact, slow on GPU with packed rows.
- ``flex_attention``: transformers builds a BlockMask from the same position ids once per forward (shared by all
  layers); the kernel skips the blocks no token of a document needs. Attention sinks (gpt-oss) are supported on
  GPU. No backward on CPU.
- ``varlen``: torch's variable-length flash attention (``torch.nn.attention.varlen``, CUDA) over the documents'
  cumulative lengths, which the collator computes on the host once per micro-batch. No mask at all. Registered with
  transformers' public ``AttentionInterface``.
- ``eager``: transformers' reference (matmul + softmax); the CPU choice for models with attention sinks.
- ``sdpa_causal`` (``auto``'s pick for rows that are each one whole document, on GPU): transformers' sdpa with no
  mask at all, the kernel's causal triangle only. With sdpa itself transformers checks the position ids for packed
  documents before every forward, a host sync that emptied the GPU's queue each micro-batch (bench/profile_steps.py
  --sync_debug); a kernel name transformers has no mask function for skips that check, as ``varlen`` does.

``auto`` (the default), on GPU: ``varlen`` where the model allows it (BENCHMARKS.md, "Real data at full speed",
measured it against ``flex_attention`` and ``sdpa`` on the same rows), else ``flex_attention`` (attention sinks,
attention dropout, fp32 compute), or ``sdpa`` when no row has anything to mask; on CPU, ``sdpa``, or ``eager`` where the model
needs sinks.
"""

import inspect

import torch

from megablocks_utils.errors import AttentionChoiceError

KERNELS = ("auto", "sdpa", "eager", "flex_attention", "varlen")


def choose_attention(requested: str, config, device_type: str, masked: bool = True, dtype: torch.dtype | None = None) -> tuple[str, str]:
    """(kernel, why) for ``requested`` (one of ``KERNELS``) and a model config; an explicit kernel is checked,
    ``auto`` resolved. The model table (``models.spec_for``) knows which models have attention sinks.

    ``masked``: whether any row has something to mask (several documents, or padding); the scripts know once
    the data is read (``data.TrainingData.needs_mask``). Full rows of one document each need only the causal mask.
    ``dtype``: the compute dtype, where known: the varlen (flash) kernel runs only in bf16 and fp16, so fp32 on a GPU
    gets flex_attention (or sdpa for unmasked rows) from ``auto``, and an explicit ``varlen`` is refused.
    """
    from megablocks_utils.model.architectures import spec_for

    spec = spec_for(config)
    sinks = spec.attention_sinks
    if requested == "auto":
        if device_type != "cuda":
            if sinks:
                return "eager", f"auto: eager (CPU; {spec.model_type}'s attention sinks have no sdpa kernel, flex no CPU backward)"
            return "sdpa", "auto: sdpa (CPU)"
        if not masked and not sinks:
            register_sdpa_causal()
            return "sdpa_causal", ("auto: sdpa_causal (GPU; every row is one whole document: nothing to mask but the causal "
                                   "triangle, so no mask is built)")
        blocker = _varlen_blocker(spec, config, dtype)
        if blocker is None:
            register_varlen()
            return "varlen", "auto: varlen (GPU; each document attends only to itself, no mask to build)"
        return "flex_attention", f"auto: flex_attention (GPU; {blocker}, so not varlen; documents kept apart by a block mask)"
    if requested == "sdpa" and not spec.supports_sdpa:
        raise AttentionChoiceError(f"{spec.model_type} has no sdpa attention in transformers (its attention sinks need eager "
                                   "or flex); set attn_implementation to 'auto', 'eager' or 'flex_attention'")
    if requested == "flex_attention" and sinks and device_type != "cuda":
        raise AttentionChoiceError(f"{spec.model_type}'s attention sinks need flex_attention on a GPU; on CPU set "
                                   "attn_implementation to 'auto' or 'eager'")
    if requested == "varlen":
        if device_type != "cuda":
            raise AttentionChoiceError("attn_implementation 'varlen' (torch's flash varlen kernel) needs a GPU; on CPU use "
                                       "'auto' or 'sdpa'")
        blocker = _varlen_blocker(spec, config, dtype)
        if blocker is not None:
            raise AttentionChoiceError(f"{blocker}; set attn_implementation to 'auto' or 'flex_attention'")
        register_varlen()
    return requested, f"{requested} (as set)"


def _varlen_blocker(spec, config, dtype: torch.dtype | None = None) -> str | None:
    """What keeps this model (in compute ``dtype``, where known) from torch's varlen kernel, or None."""
    if dtype is not None and dtype not in (torch.bfloat16, torch.float16):
        return f"the varlen (flash) kernel runs in bf16 or fp16, not {str(dtype).removeprefix('torch.')}"
    if spec.attention_sinks:
        return f"{spec.model_type}'s attention sinks are not in the varlen kernel"
    if getattr(config, "attention_dropout", 0.0):
        return "attention dropout is not in the varlen kernel"
    if getattr(config, "sliding_window", None) and not _varlen_has_window():
        return "this torch's varlen kernel has no sliding window"
    return None


def _varlen_has_window() -> bool:
    from torch.nn.attention.varlen import varlen_attn

    return "window_size" in inspect.signature(varlen_attn).parameters


# Set by register_varlen, outside torch.compile: the kernel and the keyword arguments this torch's version takes.
_VARLEN_OPTIONS: set = set()


def _varlen_kernel(q, k, v, cu_seqlens, max_len, scale, window):
    """torch's varlen flash attention, causal, with an optional left window (torch 2.10 takes is_causal, 2.11 a
    window); key/value heads are repeated for grouped-query attention where the kernel cannot share them."""
    from torch.nn.attention.varlen import varlen_attn

    extra = {}
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in _VARLEN_OPTIONS:
            extra["enable_gqa"] = True
        else:
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    if "window_size" in _VARLEN_OPTIONS:
        extra["window_size"] = (window, 0)
    else:
        extra["is_causal"] = True
    return varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, scale=scale, **extra)


def varlen_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
                     cu_seq_lens_q=None, max_length_q=None, **kwargs):
    """transformers' attention-function signature over torch's varlen kernel.

    query [B, Hq, L, D], key [B, Hkv, L, D], value [B, Hkv, L, Dv] with Dv <= D -> ([B, L, Hq, Dv], None). The B
    rows are laid end to end and ``cu_seq_lens_q`` (int32, the documents' cumulative lengths over all rows, from
    ``data.collate``) keeps every document to itself; ``max_length_q`` is the row length, an upper bound on a document's.
    """
    if cu_seq_lens_q is None:
        raise ValueError("attn_implementation 'varlen' needs the rows' document boundaries: call the model with "
                         "data.collate's model_inputs (cu_seq_lens_q, max_length_q)")
    if dropout and module.training:
        raise ValueError("attn_implementation 'varlen' has no attention dropout; set the model's attention_dropout to 0 "
                         "or use 'flex_attention'")
    if kwargs.get("s_aux") is not None:
        raise ValueError("attn_implementation 'varlen' has no attention sinks; use 'flex_attention'")
    import torch.nn.functional as F

    b, heads, length, dim = query.shape
    kv_heads, v_dim = key.shape[1], value.shape[-1]
    if v_dim > dim:
        raise ValueError(f"attn_implementation 'varlen' takes value heads no wider than query heads ({v_dim} > {dim}); "
                         "use 'flex_attention'")
    if v_dim < dim:  # DeepSeek's MLA (q/k 192, v 128): the kernel takes one width; zero value columns give zero outputs
        value = F.pad(value, (0, dim - v_dim))
    q = query.transpose(1, 2).reshape(b * length, heads, dim)
    k = key.transpose(1, 2).reshape(b * length, kv_heads, -1)
    v = value.transpose(1, 2).reshape(b * length, kv_heads, -1)
    window = sliding_window - 1 if sliding_window else -1  # transformers' window counts the token itself
    out = _varlen_kernel(q, k, v, cu_seq_lens_q, max_length_q, scaling, window)
    return out.view(b, length, heads, dim)[..., :v_dim], None


def sdpa_causal_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' sdpa attention with only the causal triangle (``is_causal``): for rows that are each one whole
    document, where there is nothing else to mask (``choose_attention``). transformers drops a 2D mask for a kernel
    without a mask function, so the guard is the collator's: it refuses such a kernel rows that need a mask
    (``data.collate``); a prepared 4D mask, which transformers would pass on, is refused here."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if attention_mask is not None:
        raise ValueError("attn_implementation 'sdpa_causal' is for rows that are each one whole document, without an "
                         "attention mask; rows with padding or several documents need 'sdpa', 'flex_attention' or 'varlen'")
    return sdpa_attention_forward(module, query, key, value, None, **kwargs)


def register_sdpa_causal() -> None:
    """Make ``attn_implementation="sdpa_causal"`` known to transformers (its public AttentionInterface, no mask function:
    so transformers builds no mask and makes no check of the positions); idempotent."""
    from transformers import AttentionInterface

    AttentionInterface.register("sdpa_causal", sdpa_causal_attention)


def register_varlen() -> None:
    """Make ``attn_implementation="varlen"`` known to transformers (its public AttentionInterface); idempotent."""
    from torch.nn.attention.varlen import varlen_attn
    from transformers import AttentionInterface

    _VARLEN_OPTIONS.update(inspect.signature(varlen_attn).parameters)
    AttentionInterface.register("varlen", varlen_attention)
