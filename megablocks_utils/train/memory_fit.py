"""Does a training plan fit, and what would: the fit check's verdict on a ``MemoryEstimate`` (``memory_plan``), the
settings it offers where it does not fit, the hint where fewer checkpointed layers would, the FSDP units ``auto``
takes, and whether whole micro-steps as CUDA graphs fit beside it. ``check_fit`` is what both scripts call."""

from collections.abc import Callable
from dataclasses import replace

from megablocks_utils.config.inputs import fail
from megablocks_utils.errors import InputError
from megablocks_utils.train.memory_activations import CHECKPOINTING, check_checkpointed_layers, checkpointing_mode, chosen_layers
from megablocks_utils.train.memory_counts import OPTIM_BYTES, GiB, attention_params
from megablocks_utils.train.memory_plan import MemoryEstimate, checkpointing_text, estimate_plan

MAX_NODES_SUGGESTED = 128  # how far fit_error looks for a GPU count that fits


def _gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB"


def _settings_text(e: MemoryEstimate) -> str:
    p = e.plan
    return (
        f"{p.world_size} GPUs, ep {e.ep}, optim {p.optim}, shard_experts {str(e.shard_experts).lower()}, "
        f"activation_checkpointing {checkpointing_text(e)}, micro batch {p.per_device_train_batch_size} x {p.max_length} tokens"
        + (f", gradient_accumulation_steps {p.gradient_accumulation_steps}" if p.gradient_accumulation_steps > 1 else "")
        + (f", fsdp_wrap {p.fsdp_wrap}" if p.fsdp_wrap != "layer" else "")
    )


def _try(e: MemoryEstimate, **changes) -> MemoryEstimate | None:
    try:
        return estimate_plan(e.config, replace(e.plan, **changes))
    except InputError:
        return None


def _fewest_checkpointed(e: MemoryEstimate, budget: float, mode: str, start: int = 1, **changes) -> int | None:
    """The fewest decoder layers, from ``start``, that ``mode`` must checkpoint for the plan (with ``changes``) to fit
    ``budget``."""
    for count in range(start, e.config.num_hidden_layers + 1):
        alt = _try(e, activation_checkpointing=mode, activation_checkpointing_layers=count, **changes)
        if alt is not None and alt.total <= budget:
            return count
    return None


def _recompute_flops(e: MemoryEstimate, **changes) -> float:
    """Forward FLOPs per token that a plan (``e``'s, with ``changes``) reruns in the backward: each whole checkpointed
    layer's (its weights' 2 x parameters touched, and attention's scores over half a row on average), or only the
    routed experts' in the layers ``checkpoint_experts`` leaves to them. Compares plans; not a time."""
    plan = replace(e.plan, **changes)
    s = e.shape
    mode = checkpointing_mode(plan.activation_checkpointing)
    count = 0 if mode == "none" else check_checkpointed_layers(plan.activation_checkpointing_layers, s.layers)
    chosen = chosen_layers(s, mode, count)
    experts = 2 * s.top_k * 3 * s.hidden * s.expert_inter
    attention = 2 * attention_params(s) + 2 * plan.max_length * s.heads * s.head_dim

    def layer(moe: bool) -> float:
        mlp = experts + 2 * (s.num_experts * s.hidden + 3 * s.hidden * s.shared_inter) if moe else 2 * 3 * s.hidden * s.dense_inter
        return attention + mlp

    total = 0.0
    for i in range(s.layers):
        moe = i in s.moe_layers
        if i in chosen:
            total += layer(moe) if mode == "full" else 0.0  # selective reruns element-wise work only
        elif plan.checkpoint_experts and moe:
            total += experts
    return total


def checkpointing_hint(estimate: MemoryEstimate, gpu_memory_bytes: float, use: float = 0.9) -> str | None:
    """Where checkpointing is on and fewer checkpointed layers would still fit in ``use`` of the GPU (the
    estimate's margin), a line saying how many: each layer left out recomputes nothing and runs faster."""
    if estimate.checkpointing == "none":
        return None
    budget, layers = use * gpu_memory_bytes, estimate.config.num_hidden_layers
    count = _fewest_checkpointed(estimate, budget, estimate.checkpointing, start=0)
    if count is None or count >= estimate.checkpointed:
        count = None
    elif count == 0:
        alt = _try(estimate, activation_checkpointing_layers=0)
        return f"activation checkpointing: none would fit {_within(alt, use, gpu_memory_bytes)}; --activation_checkpointing none recomputes nothing and runs faster"
    # Making the experts' SwiGLU output again (one element-wise pass a layer) costs least of all: where it lets fewer
    # whole layers be checkpointed, that comes first.
    if not estimate.plan.recompute_swiglu:
        swiglu = _fewest_checkpointed(estimate, budget, estimate.checkpointing, start=0, recompute_swiglu=True)
        if swiglu is not None and swiglu < (estimate.checkpointed if count is None else count):
            alt = _try(estimate, activation_checkpointing_layers=swiglu, recompute_swiglu=True)
            flag = "--activation_checkpointing none" if swiglu == 0 else f"--activation_checkpointing_layers {swiglu}"
            return (f"activation checkpointing: {flag} --recompute_swiglu true would fit {_within(alt, use, gpu_memory_bytes)}; "
                    "it makes the experts' SwiGLU output again instead of recomputing whole layers: less work")
    # Recomputing only the routed experts (most of a MoE layer's activations, a small part of its work) in the layers
    # left out is cheaper than recomputing whole layers: fewer whole layers with it are faster still.
    with_experts = None
    if not estimate.plan.checkpoint_experts and estimate.counts.moe_layers:
        with_experts = _fewest_checkpointed(estimate, budget, estimate.checkpointing, start=0, checkpoint_experts=True)
    other = estimate.checkpointed if count is None else count  # whole layers recomputed without it
    if with_experts is not None and _recompute_flops(estimate, activation_checkpointing_layers=with_experts, checkpoint_experts=True) < \
            _recompute_flops(estimate, activation_checkpointing_layers=other):
        alt = _try(estimate, activation_checkpointing_layers=with_experts, checkpoint_experts=True)
        flag = ("--activation_checkpointing none" if with_experts == 0 else f"--activation_checkpointing_layers {with_experts}")
        return (f"activation checkpointing: {flag} --checkpoint_experts true would fit {_within(alt, use, gpu_memory_bytes)}; "
                f"it recomputes the routed experts of the other layers instead of whole layers: less work")
    if count is None:
        return None
    alt = _try(estimate, activation_checkpointing_layers=count)
    return (
        f"activation checkpointing: {count} of {layers} layers would be enough {_within(alt, use, gpu_memory_bytes)}; "
        f"--activation_checkpointing_layers {count} recomputes fewer layers and runs faster"
    )


def _within(alt: MemoryEstimate, use: float, gpu_memory_bytes: float) -> str:
    return f"(estimated {_gib(alt.total)}, within {use:.0%} of the GPU's {_gib(gpu_memory_bytes)})"


def _alternatives(e: MemoryEstimate, budget: float) -> list[str]:
    """One-setting changes that fit, each with its estimate; then the fewest GPUs that fit as planned."""
    p = e.plan
    found = []

    def offer(flag: str, **changes) -> bool:
        alt = _try(e, **changes)
        if alt is not None and alt.total <= budget:
            found.append(f"{flag} ({_gib(alt.total)})")
            return True
        return False

    for optim in OPTIM_BYTES:
        if optim != p.optim:
            offer(f"--optim {optim}", optim=optim)
    layers = e.config.num_hidden_layers
    if p.finetuning == "lora" and p.quantize_base == "none" and p.world_size == 1:  # the frozen base in FP8: half its bytes
        offer("--quantize_base fp8", quantize_base="fp8")
    if not p.recompute_swiglu:  # one element-wise pass a layer made again: cheaper still
        offer("--recompute_swiglu true", recompute_swiglu=True)
    if not p.checkpoint_experts and e.counts.moe_layers:  # the routed experts recomputed: the cheapest memory to give
        offer("--checkpoint_experts true", checkpoint_experts=True)
    for mode in CHECKPOINTING[max(1, CHECKPOINTING.index(e.checkpointing)) :]:
        # the fewest checkpointed layers that fit (the fastest), more than today's where the mode is today's
        start = e.checkpointed + 1 if mode == e.checkpointing else 1
        count = _fewest_checkpointed(e, budget, mode, start)
        if count is not None:
            flag = f"--activation_checkpointing {mode}" + (f" --activation_checkpointing_layers {count}" if count < layers else "")
            offer(flag, activation_checkpointing=mode, activation_checkpointing_layers=-1 if count == layers else count)
    for batch in range(p.per_device_train_batch_size - 1, 0, -1):  # the largest that fits
        if offer(f"--per_device_train_batch_size {batch}", per_device_train_batch_size=batch):
            break
    if p.gradient_accumulation_steps > 1:
        offer("--gradient_accumulation_steps 1", gradient_accumulation_steps=1)
    if not e.shard_experts:
        offer("--shard_experts true", shard_experts=True)
    if p.fsdp_wrap != "layer":  # each layer's dense weights gathered when used, not all at once (nor all on every rank)
        offer("--fsdp_wrap layer", fsdp_wrap="layer")
    if not found:  # no single change is enough: all of them at once
        smallest = min(OPTIM_BYTES, key=lambda o: sum(OPTIM_BYTES[o]))
        now = dict(optim=p.optim, activation_checkpointing=e.checkpointing, per_device_train_batch_size=p.per_device_train_batch_size,
                   gradient_accumulation_steps=p.gradient_accumulation_steps, shard_experts=e.shard_experts, fsdp_wrap=p.fsdp_wrap)
        least = dict(optim=smallest, activation_checkpointing="full", per_device_train_batch_size=1, gradient_accumulation_steps=1,
                     shard_experts=True, fsdp_wrap="layer")
        together = {k: v for k, v in least.items() if v != now[k]}
        if together:
            offer(" ".join(f"--{k} {str(v).lower()}" for k, v in together.items()), **together)
    nproc = p.nproc_per_node
    for world in range(nproc * (p.world_size // nproc + 1), nproc * MAX_NODES_SUGGESTED + 1, nproc):
        # ep as given if it still divides; with ep_size 0 (all ranks) or one that does not, keep today's ep.
        alt = _try(e, world_size=world) or _try(e, world_size=world, ep_size=e.ep)
        if alt is not None and alt.total <= budget:
            keep_ep = f" with --ep_size {alt.ep}" if alt.ep != world and p.ep_size == 0 else ""
            found.append(f"{world} GPUs ({world // nproc} nodes of {nproc}){keep_ep} ({_gib(alt.total)})")
            break
    return found


def fit_error(estimate: MemoryEstimate, gpu_memory_bytes: float) -> str | None:
    """None if the estimate fits in ``gpu_memory_bytes`` per GPU; else what does not fit and settings that would."""
    if estimate.total <= gpu_memory_bytes:
        return None
    alternatives = _alternatives(estimate, gpu_memory_bytes)
    fixes = "; ".join(alternatives) if alternatives else f"none found up to {MAX_NODES_SUGGESTED} nodes"
    return (
        f"{estimate.name} needs about {_gib(estimate.total)} per GPU ({_settings_text(estimate)}), more than the "
        f"{_gib(gpu_memory_bytes)} each GPU has. Settings that fit: {fixes}. "
        f"Breakdown: python -m megablocks_utils.tools.memory (docs/memory.md)"
    )


def resolve_fsdp_wrap(setting: str, estimate: Callable[[str], MemoryEstimate], gpu_memory_bytes: float, world_size: int,
                      ep: int, replicated: bool = False) -> str:
    """The script's ``fsdp_wrap`` ("auto", "layer", "model" or "none"; mesh.FSDP_WRAPS) as the units to build.

    "auto" is "model" where ep covers every rank (the experts stay out of FSDP, so FSDP's per-layer hooks only gather
    dense weights; measured there: 2 x H200 at ep 2, 11% faster steps, BENCHMARKS.md) and the plan with every layer's
    dense weights gathered at once fits within 90% of the GPU (``estimate``: the plan for a wrap; the margin because the
    estimate ran low on full-size Mixtral, docs/memory.md: a run near the limit keeps the smaller units); else "layer".
    With ``replicated`` (CUDA graphs of the dense segments planned, train/segment_graphs.py, which need the dense
    weights at fixed addresses) it is "none" first, where that plan fits the same way."""
    if setting != "auto":
        return setting
    if world_size == 1 or ep != world_size:
        return "layer"
    if replicated and (gpu_memory_bytes <= 0 or estimate("none").total <= 0.9 * gpu_memory_bytes):
        return "none"
    if gpu_memory_bytes > 0 and estimate("model").total > 0.9 * gpu_memory_bytes:
        return "layer"
    return "model"


def graphs_memory_blocker(estimate: MemoryEstimate, gpu_memory_bytes: float, use: float = 0.9) -> str | None:
    """Why whole micro-steps as CUDA graphs would not fit, or None. ``estimate``: planned with ``cuda_graphs`` (its
    ``graph_pool``: a graph's private pool holds a micro-step's activations and logits beside the blocks the eager warm-up
    steps left in the allocator). Measured on one H200 (2026-12-02, Qwen3-30B-A3B's shape, 6 layers, adamw_bf16): rows of
    32,768 tokens trained with graphs (planned 75.5 + 36.6 GiB, within 90%); at 65,536 (112.0 + 71.3) the capture ran
    out of memory with 61.8 GiB in the graph's pool. ``use``: the share of the GPU the plan may fill (its margin)."""
    if gpu_memory_bytes <= 0 or estimate.total <= use * gpu_memory_bytes:
        return None
    return (f"the graph's memory pool would hold a micro-step's activations and logits ({_gib(estimate.graph_pool)}) beside "
            f"the eager steps' blocks: {_gib(estimate.total)} planned, more than {use:.0%} of the GPU's "
            f"{_gib(gpu_memory_bytes)}; fewer tokens per micro-step (max_length x per_device_train_batch_size) or "
            "activation checkpointing leave room for them")


def plan_graphs(plan_for, cuda_graphs, blocker: str | None, gpu_memory_bytes: float) -> tuple[MemoryEstimate, str | None]:
    """(the run's plan, why CUDA graphs stay off for memory or None). ``plan_for(**changes)``: the run's estimate;
    ``blocker``: ``graph_blocker`` from the settings alone. Where graphs would run, the plan counts their pool; where
    that does not fit, auto plans without them and says why, and ``cuda_graphs true`` raises InputError."""
    from megablocks_utils.train.cuda_graph import resolve_cuda_graphs  # here: the fit check loads no MoE code

    plan = plan_for()
    if blocker is not None or not resolve_cuda_graphs(cuda_graphs, None)[0]:
        return plan, None
    with_graphs = plan_for(cuda_graphs=True)
    memory = graphs_memory_blocker(with_graphs, gpu_memory_bytes)
    if memory is None:
        return with_graphs, None
    resolve_cuda_graphs(cuda_graphs, memory)  # true: InputError saying why
    return plan, memory


def check_fit(estimate: MemoryEstimate, gpu_memory_bytes: float, *, hint: bool = False) -> None:
    """Both scripts' fit check, before any weight is read: rank 0 prints the estimate; on a GPU
    (``gpu_memory_bytes`` > 0) every rank stops when it does not fit, rank 0 naming settings that would, and
    with ``hint`` rank 0 says how few checkpointed layers would be enough (``checkpointing_hint``)."""
    import torch.distributed as dist

    master = dist.get_rank() == 0
    if master:  # on CPU ranks no memory is planned: the model and the layout only
        print(estimate.describe(on_gpus=gpu_memory_bytes > 0), flush=True)
    if gpu_memory_bytes > 0:
        too_big = fit_error(estimate, gpu_memory_bytes)
        if too_big:
            fail(too_big)
        note = checkpointing_hint(estimate, gpu_memory_bytes) if hint else None
        if master and note:
            print(note, flush=True)
