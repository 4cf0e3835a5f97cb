"""``ep_capacity_factor`` -1 (auto): where the static expert exchange with whole micro-steps as CUDA graphs is the
default, and the factor it takes there (``resolve_capacity_factor``).

Why: at ep = world size on one node, the static exchange read from the peers' GPU memory (moe/pull_exchange.py) lets
each micro-step be one CUDA graph, and that ran 13% faster than the same with the nineteenth session's row pull and 30%
faster than the default segments' graphs at ep 2 on 2 x H200; at ep 4 on 4 x H200 its steps were 23% (synthetic rows) and
16% (chat records) shorter than the segments' (BENCHMARKS.md, "Several GPUs"). A fast path is the
default only where it ran: ``AUTO_FACTORS`` holds the ep sizes measured in training, each with a factor that never
reran there. Everything the graphs need must hold too (``cuda_graph.graph_blocker``), and the dense weights must fit
whole on every rank (``resolve_wrap_and_factor`` drops the factor where that plan does not fit, and the script drops it
where the graphs turn out blocked after loading: the static exchange without graphs was not measured faster).
"""

from collections.abc import Callable

import torch

from megablocks_utils.train.cuda_graph import graph_blocker
from megablocks_utils.train.memory_counts import PARAM_DTYPE
from megablocks_utils.train.memory_fit import resolve_fsdp_wrap
from megablocks_utils.train.memory_plan import MemoryEstimate
from megablocks_utils.train.segment_plan import resolve_segment_graphs, segment_blocker

AUTO = -1.0
# ep -> factor. At ep 2 a rank can never receive more than 2 x the mean rows (both ranks' rows), so 2 never overflows.
# At ep 4, 3: the random checkpoint's busiest rank took 2.45 x the mean in its worst layer and no micro-step reran (4 x
# H200, 23rd session: 0.415 s a step against 0.536 for the segments, 80% of one GPU); a micro-step that overflows reruns
# on the exact exchange, so the factor moves speed and memory, never the result.
AUTO_FACTORS = {2: 2.0, 4: 3.0}


def auto_blocker(*, device_type: str, world_size: int, ep_size: int, local_world_size: int, moe_backend: str,
                 expert_bias: bool, lora: bool, activation_checkpointing: str, checkpoint_experts: bool, dtype,
                 optim: str, cuda_graphs: str, fsdp_wrap: str, whole_graphs: bool = True) -> str | None:
    """Why auto keeps the exact exchange in this run, or None where it takes ``AUTO_FACTORS[ep_size]``
    (``whole_graphs``: whether the script runs micro-steps as CUDA graphs at all; train_fsdp1.py does not)."""
    if not whole_graphs:
        return "this script runs no CUDA graphs, which the static exchange is the default for"
    graphs = graph_blocker(device_type=device_type, world_size=world_size, moe_backend=moe_backend, attention=None,
                           activation_checkpointing=activation_checkpointing, checkpoint_experts=checkpoint_experts,
                           lora=lora, dtype=dtype, fsdp=False, ep_size=ep_size, static_exchange=True)
    if graphs is not None:
        return graphs
    if world_size == 1:
        return "one GPU: no expert exchange"
    if ep_size not in AUTO_FACTORS:
        return f"ep {ep_size}: measured at ep {', '.join(map(str, AUTO_FACTORS))} only; give a factor to try it"
    if local_world_size % ep_size:
        return f"an ep group of {ep_size} spans nodes of {local_world_size} GPUs (the peers' memory is mapped within one node)"
    if expert_bias:
        return "experts with a bias (gpt-oss)"
    if optim != "adamw_bf16":
        return f"optim {optim}: the dense weights whole on every rank (fsdp_wrap none) need --optim adamw_bf16"
    if str(cuda_graphs).lower() not in ("auto", "true"):
        return f"cuda_graphs {cuda_graphs}"
    if fsdp_wrap not in ("auto", "none"):
        return f"fsdp_wrap {fsdp_wrap}: the graphs need the dense weights whole on every rank (none)"
    return None


def resolve_capacity_factor(setting: float, **conditions) -> tuple[float, str]:
    """(the factor, the line the script prints, "" for none): a factor >= 0 as given; auto (-1) ``AUTO_FACTORS``'s
    where ``auto_blocker(**conditions)`` finds nothing in the way, else 0 (the exact exchange), saying why on GPUs."""
    if setting != AUTO:
        return setting, ""
    why = auto_blocker(**conditions)
    if why is not None:  # said on GPUs with an exchange to make; on CPU or one GPU there is nothing to choose
        quiet = conditions["device_type"] != "cuda" or conditions["world_size"] == 1
        return 0.0, "" if quiet else f"ep_capacity_factor auto: 0, the exact exchange ({why})"
    factor = AUTO_FACTORS[conditions["ep_size"]]
    return factor, (f"ep_capacity_factor auto: {factor:g} (ep {conditions['ep_size']} = world size on one node: the static "
                    "exchange read from the peers' memory, each micro-step one CUDA graph)")


def resolve_wrap_and_factor(fsdp_wrap: str, plan_for: Callable[..., MemoryEstimate], gpu_memory_bytes: float,
                            world_size: int, ep: int, *, factor: float, factor_auto: bool,
                            segments_planned: bool) -> tuple[str, float, str]:
    """(fsdp_wrap's units, the capacity factor, the line the script prints or ""), from the fit check's estimates
    (``plan_for(fsdp_wrap=..., ep_capacity_factor=...)``).

    Auto's factor goes with the dense weights whole on every rank (its micro-steps are CUDA graphs). Where its plan does
    not fit (the static exchange's buffers hold ``factor`` x the mean rows: full Qwen3-30B-A3B at ep 4 and factor 3
    estimated 131 GiB, over 90% of an H200), the factor is dropped and the units chosen again as if it had never been
    taken, so the run keeps what it had without it (there: the segments' graphs, no FSDP), not FSDP's per-layer units."""
    auto_on = factor_auto and factor > 0
    wrap = resolve_fsdp_wrap(fsdp_wrap, lambda w: plan_for(fsdp_wrap=w, ep_capacity_factor=factor), gpu_memory_bytes,
                             world_size, ep, replicated=segments_planned or auto_on)
    if not auto_on or wrap == "none":
        return wrap, factor, ""
    wrap = resolve_fsdp_wrap(fsdp_wrap, lambda w: plan_for(fsdp_wrap=w, ep_capacity_factor=0.0), gpu_memory_bytes,
                             world_size, ep, replicated=segments_planned)
    return wrap, 0.0, (f"ep_capacity_factor auto: 0, the exact exchange (with its buffers the dense weights do not fit "
                       f"whole on every rank within 90% of the GPU; fsdp_wrap auto: {wrap})")


def plan_as_the_script(ep_capacity_factor: float, fsdp_wrap: str, plan_for: Callable[..., MemoryEstimate],
                       gpu_memory_bytes: float, *, world_size: int, ep: int, local_world_size: int, optim: str, lora: bool,
                       activation_checkpointing: str, checkpoint_experts: bool, expert_bias: bool,
                       cuda_graphs: str = "auto", moe_backend: str = "native") -> tuple[str, float, str]:
    """(fsdp_wrap's units, the capacity factor, the line the script prints or "") as train_fsdp2.py resolves them on GPUs
    in bf16, through the same rules in its order (``resolve_capacity_factor``, the segments' plan,
    ``resolve_wrap_and_factor``): the fit check's command line estimates the run the script would make. The attention
    kernel is taken as capturable (the script checks the one auto picks once the model is loaded)."""
    factor, factor_note = resolve_capacity_factor(
        ep_capacity_factor, device_type="cuda", world_size=world_size, ep_size=ep, local_world_size=local_world_size,
        moe_backend=moe_backend, expert_bias=expert_bias, lora=lora, activation_checkpointing=activation_checkpointing,
        checkpoint_experts=checkpoint_experts, dtype=torch.bfloat16, optim=optim, cuda_graphs=cuda_graphs, fsdp_wrap=fsdp_wrap)
    segments_planned = resolve_segment_graphs(cuda_graphs, segment_blocker(
        device_type="cuda", world_size=world_size, ep_size=ep, moe_backend=moe_backend, attention=None,
        activation_checkpointing=activation_checkpointing, checkpoint_experts=checkpoint_experts, lora=lora,
        dtype=torch.bfloat16, weights=PARAM_DTYPE[optim], fsdp_wrap=fsdp_wrap),
        single_node=local_world_size >= world_size)[0]
    wrap, factor, wrap_note = resolve_wrap_and_factor(fsdp_wrap, plan_for, gpu_memory_bytes, world_size, ep, factor=factor,
                                                      factor_auto=ep_capacity_factor == AUTO, segments_planned=segments_planned)
    return wrap, factor, wrap_note or factor_note
