"""Activation checkpointing of each decoder layer: none, full recompute, or selective (SAC).

Full recompute reruns every op of a layer in the backward, the GEMMs and the all-to-alls included:
on 4x H200 at 8 Mixtral layers it dropped MFU from 48% to 32%. "selective" uses torch's selective
checkpoint API (``create_selective_checkpoint_contexts``) on the same per-layer checkpoint: the
outputs of the GEMMs (mm, addmm, bmm, baddbmm, grouped mm), of the attention kernels and of the
all-to-alls are kept from the forward, everything else (norms, rotary embedding, SiLU * up, softmax,
routing bookkeeping, casts) is recomputed. The recompute then does no communication at all, and
costs only element-wise work.

What else the recompute of an expert-parallel layer must get right:
- Routing. The recomputed layer routes exactly as the first pass: routing is a pure function of the
  layer input. The host sync (``.tolist()`` of the routed counts after the small all-to-all) reads
  the kept all-to-all output, so it yields the same splits without a collective.
- Collectives across ranks. "selective" issues none in the recompute, so ranks cannot mismatch
  whatever they recompute. "full" reissues a layer's three all-to-alls; every rank recomputes the
  same layers in the same (graph) order, as before.
- Router recording. The loss reads the routing of the forward (``aux_loss.router_stats``, which
  also turns recording off). The recompute runs with recording paused as well, so even a caller
  that never turned it off gets the forward's routing, not a second copy.

torch.compile'd parts inside a checkpointed layer (on CUDA: ``compile_dense`` compiles attention and
norms; the MoE layer compiles its SiLU * up and its combine), from torch 2.13's source, checked on CPU:
- Dynamo does not skip them: under a dispatch mode it falls back to eager only for modes that do not
  say ``ignore_compile_internals()``; both SAC modes say it (``_dynamo/convert_frame.py``,
  ``utils/_python_dispatch.any_torch_dispatch_mode_on_stack``). Compiling (the first call) runs with
  the modes switched off, so tracing does not disturb SAC's per-op counters.
- At run time SAC does not see generated (Triton) kernels: they are rerun in the recompute, which is
  what we want for element-wise work. It sees the ops the generated code calls through the
  dispatcher: fallback kernels such as the SDPA kernels (``.default``, kept) and extern GEMMs as
  ``aten.mm.out`` / ``addmm.out`` / ``bmm.out`` writing into a buffer the generated code allocated.
  Keeping an ``out=`` op is wrong: the recompute would get the old tensor back while the code reads
  its new, unwritten buffer (torch raises "Tensor cached during selective activation checkpoint has
  been mutated"; with ``allow_cache_entry_mutation`` it would be silently wrong). So the policy keeps
  exact ``.default`` overloads only, never a whole op packet.
- The price: with compile_dense on, the q/k/v/o projections inside the compiled attention are
  recomputed (about a tenth of a Mixtral layer's GEMM FLOPs); the attention output is kept. Not chosen:
  ``torch._inductor.config.wrap_inductor_compiled_regions`` (a global flag) makes each compiled
  region one op that SAC can keep or recompute as a whole; keeping it keeps all of the region's saved
  activations (no memory saved on attention), recomputing it reruns its GEMMs anyway.
- Compiling a whole checkpointed layer would need ``context_fn`` to return two dispatch modes (torch
  asserts it when it traces a checkpoint); ours returns a plain context for the recompute.
  compile_dense compiles parts inside the layer, never the layer, so the checkpoint stays eager.

Call order (``parallelize``): expert parallelism, then this, then compile, then FSDP2. transformers'
hook checkpoints each layer's ``forward``, not ``__call__``, so FSDP2's hooks stay outside the
recompute and the compiled modules' ``__call__`` stay inside it.
"""

import contextlib
import functools

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import (
    CheckpointPolicy,
    create_selective_checkpoint_contexts,
)

from megablocks_utils.config.inputs import parse_bool
from megablocks_utils.model.architectures import decoder_layers

ACTIVATION_CHECKPOINTING = ("none", "full", "selective")
# The recompute skips the RNG replay (no dropout) on at most this many GPUs: where it has run (one H200, 2026-12-02).
SKIPPED_RNG_REPLAY_RAN_ON_GPUS = 1

# (namespace, op): outputs that "selective" keeps. Exact .default overloads (see the module docstring
# on out= variants); an op this torch build lacks is skipped.
_SAVED_OPS = (
    ("aten", "mm"), ("aten", "addmm"), ("aten", "bmm"), ("aten", "baddbmm"),
    ("aten", "_grouped_mm"), ("aten", "grouped_mm"),
    ("aten", "_scaled_dot_product_flash_attention"), ("aten", "_scaled_dot_product_efficient_attention"),
    ("aten", "_scaled_dot_product_cudnn_attention"), ("aten", "_scaled_dot_product_flash_attention_for_cpu"),
    ("aten", "_flash_attention_forward"), ("aten", "_efficient_attention_forward"),
    # The MoE layer's all-to-alls (moe/dispatch.py) call the plain functional op and wait on it: these entries
    # keep every all-to-all of the layer (the autograd variant reaches a dispatch mode as the plain op too).
    ("_c10d_functional", "all_to_all_single"), ("_c10d_functional_autograd", "all_to_all_single"),
    ("_c10d_functional", "wait_tensor"),
)


def _resolve(namespace: str, name: str):
    try:
        return getattr(getattr(torch.ops, namespace), name).default
    except (AttributeError, RuntimeError):
        return None


@functools.cache
def saved_ops() -> frozenset:
    """The op overloads whose outputs "selective" keeps (resolved on first use: the collective ops
    register when torch.distributed._functional_collectives is imported)."""
    import torch.distributed._functional_collectives  # noqa: F401  (registers the _c10d_functional ops)

    return frozenset(op for op in (_resolve(ns, name) for ns, name in _SAVED_OPS) if op is not None)


def _policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if func in saved_ops() else CheckpointPolicy.PREFER_RECOMPUTE


@contextlib.contextmanager
def _recompute(blocks: list[nn.Module], mode):
    """The recompute of a layer: under SAC's replay mode (selective) and with router recording paused."""
    recording = [b.record_router for b in blocks]
    for b in blocks:
        b.record_router = False
    try:
        with mode:
            yield
    finally:
        for b, r in zip(blocks, recording):
            b.record_router = r


def _contexts(blocks: list[nn.Module], selective: bool):
    """``context_fn`` of torch.utils.checkpoint: (forward context, recompute context), fresh per call."""
    if not selective:
        return contextlib.nullcontext(), _recompute(blocks, contextlib.nullcontext())
    caching, replaying = create_selective_checkpoint_contexts(_policy)
    return caching, _recompute(blocks, replaying)


def parse_activation_checkpointing(value: str | bool) -> str:
    """A setting's value as a mode; true/false (older command lines: ``--activation_checkpointing true``)
    mean "full"/"none"."""
    flag = parse_bool(value)
    if flag is not None:
        return "full" if flag else "none"
    text = str(value).strip().lower()
    if text == "":
        return "none"
    if text not in ACTIVATION_CHECKPOINTING:
        raise ValueError(
            f"activation_checkpointing={value!r} is unknown; choose none, full (recompute each decoder layer) "
            "or selective (keep GEMM, attention and all-to-all outputs, recompute the rest)"
        )
    return text


def checkpointed_layers(num_layers: int, count: int) -> list[int]:
    """The decoder layers ``activation_checkpointing_layers = count`` checkpoints: ``count`` of the
    ``num_layers``, spread evenly (every other one for half); -1 (or ``count >= num_layers``): all.
    The fit check (``train/memory_plan.py``) plans the same layers."""
    if count < 0 or count >= num_layers:
        return list(range(num_layers))
    return [i for i in range(num_layers) if i * count // num_layers != (i + 1) * count // num_layers]


def apply_activation_checkpointing(model: nn.Module, mode: str, layers: int = -1, experts: bool = False,
                                   swiglu: bool = False) -> None:
    """Checkpoint the decoder layers of a transformers model: "none", "full" or "selective", on ``layers``
    of them spread evenly (``checkpointed_layers``; -1: all). The layers left out keep their
    activations and recompute nothing: where memory allows, that buys back speed a layer at a time.

    Non-reentrant ``torch.utils.checkpoint`` through transformers' own per-layer hook
    (``activation_checkpointing_enable``, which passes its kwargs, ``context_fn`` included, to
    ``checkpoint``). Its ``every_n_layers`` can only checkpoint 1/n of the layers; a count can be any
    share, so each layer's ``gradient_checkpointing`` flag (the switch transformers' hook reads) is set
    here. Call it after ``shard_moe`` and before compile and FSDP2. "none" turns an earlier setting off,
    so a model can be switched between modes.

    ``experts`` (the scripts' ``checkpoint_experts``): in every decoder layer this leaves out (all of them under
    "none"), the routed experts alone are recomputed in the backward (``ExpertParallelExperts.recompute``): their
    activations are most of a layer's, and their forward a small part of its work.

    ``swiglu`` (the scripts' ``recompute_swiglu``): every layer's experts make SwiGLU's output again in the backward
    rather than keep it (``ExpertParallelExperts.recompute_swiglu``; where it applies: ``experts.makes_swiglu_again``),
    up to the ep it has run at on GPUs (``experts.RECOMPUTE_SWIGLU_RAN_AT_EP``).
    """
    mode = parse_activation_checkpointing(mode)
    decoder = decoder_layers(model)
    if layers < -1 or layers > len(decoder):
        raise ValueError(f"activation_checkpointing_layers={layers}: give 0..{len(decoder)} decoder layers, or -1 for all")
    from megablocks_utils.moe.experts import RECOMPUTE_SWIGLU_RAN_AT_EP
    from megablocks_utils.moe.layer import (  # here: the scripts parse the setting before transformers loads
        ExpertParallelExperts,
        ExpertParallelMoE,
    )

    chosen = set() if mode == "none" or layers == 0 else set(checkpointed_layers(len(decoder), layers))
    # Without dropout no RNG state to replay: none read (a CUDA graph capture cannot). On more GPUs than that has run on,
    # the replay stays, as before (CUDA graphs under a recompute are refused there too: train/cuda_graph.graph_blocker).
    ranks = dist.get_world_size() if dist.is_initialized() else 1
    random = trains_with_dropout(model) or ranks > SKIPPED_RNG_REPLAY_RAN_ON_GPUS
    for index, layer in enumerate(decoder):
        for module in layer.modules():
            if isinstance(module, ExpertParallelExperts):
                module.recompute = experts and index not in chosen
                module.recompute_rng = random
                module.recompute_swiglu = swiglu and module.ep_size <= RECOMPUTE_SWIGLU_RAN_AT_EP
    if not chosen:
        if model.is_activation_checkpointing:
            model.activation_checkpointing_disable()
        return
    blocks = [m for m in model.modules() if isinstance(m, ExpertParallelMoE)]
    context_fn = functools.partial(_contexts, blocks, mode == "selective")
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False, "context_fn": context_fn,
                                                                          "preserve_rng_state": random})
    for index, layer in enumerate(decoder):
        layer.gradient_checkpointing = index in chosen


def trains_with_dropout(model: nn.Module) -> bool:
    """Whether the training forward draws random numbers: a dropout module with p > 0 (LoRA's, PEFT-style), or a
    config's dropout or router jitter above 0 (transformers applies attention dropout as a function). Only then must a
    recompute replay the forward's RNG state (``preserve_rng_state``); a CUDA graph capture cannot read that state."""
    if any(isinstance(m, nn.Dropout) and m.p > 0 for m in model.modules()):
        return True
    config = getattr(model, "config", None)
    configs = [c for c in (config, getattr(config, "text_config", None)) if c is not None]
    return any(isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
               for c in configs for key, value in vars(c).items() if key.endswith(("dropout", "jitter_noise")))


class OpCounter(TorchDispatchMode):
    """Counts the ops run under it by op packet (``counts[torch.ops.aten.mm]``), every overload
    (``.default``, ``.out``) included. Around ``loss.backward()`` it shows what a backward recomputes:
    an op whose output SAC kept is replayed from the cache and not counted."""

    def __init__(self):
        super().__init__()
        self.counts = {}

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True  # count what compiled code dispatches at run time; do not push it back to eager

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        packet = getattr(func, "overloadpacket", func)
        self.counts[packet] = self.counts.get(packet, 0) + 1
        return func(*args, **(kwargs or {}))

    def total(self, *packets) -> int:
        return sum(self.counts.get(p, 0) for p in packets)


def recompute_swiglu_text(model: nn.Module, device_type: str) -> str:
    """What ``recompute_swiglu`` does in this run, for the script to print: the MoE layers whose SwiGLU output the
    backward makes again, or why none (``experts.makes_swiglu_again``)."""
    from megablocks_utils.moe.experts import RECOMPUTE_SWIGLU_RAN_AT_EP, makes_swiglu_again
    from megablocks_utils.moe.layer import ExpertParallelExperts

    experts = [m for m in model.modules() if isinstance(m, ExpertParallelExperts)]
    if device_type != "cuda":
        return "recompute_swiglu: nothing to make again on CPU (the per-expert loop keeps its activations)"
    if experts and experts[0].ep_size > RECOMPUTE_SWIGLU_RAN_AT_EP:
        return (f"recompute_swiglu: off: on GPUs it has run only at ep <= {RECOMPUTE_SWIGLU_RAN_AT_EP} so far, this run has "
                f"ep {experts[0].ep_size} (moe/experts.py RECOMPUTE_SWIGLU_RAN_AT_EP); SwiGLU's output is kept")
    applies = [e for e in experts if makes_swiglu_again(e.local, e.compile_elementwise, e.num_local_experts, e.lora is not None)]
    if not applies:
        return ("recompute_swiglu: nothing to make again (it needs SiLU experts, compile_elementwise, several experts a "
                "rank and no LoRA on the experts)")
    return f"recompute_swiglu: {len(applies)} of {len(experts)} MoE layers make SwiGLU's output again in the backward"
