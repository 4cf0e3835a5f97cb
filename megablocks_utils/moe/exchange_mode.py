"""The static expert exchange and the check that keeps it exact: ``use_static_exchange`` and ``run_exactly`` (the
default at ep 2 on one GPU node, train/auto_exchange.py; opt-in elsewhere).

Why: the exact exchange (``dispatch.exchange``) reads every layer's counts on the host, one sync per layer that paces
the GPUs at ep 2 and 4. With ``ep_capacity_factor`` F > 0 every MoE layer exchanges at fixed shapes instead, with no
host sync (the mode's transport: ``pull_exchange``, each rank receiving at most F x its mean rows, read from its peers'
GPU memory one row per token and rank, or ``static_exchange``, blocks of F x a peer's share through the all-to-all) and adds its ``overflow`` flag (a
device bool) to the model's ``ExchangeMode``. ``run_exactly`` wraps a micro-step's forward:

  arm (exact off, flags cleared) -> the forward, every layer static -> OR of the flags, all-reduced (MAX) over the
  world, read once (the one host read left per micro-step) -> if any layer of any rank overflowed: the first forward
  dropped, exact on, the RNG state put back, the forward again on the exact exchange.

Every rank takes the same path (FSDP's collectives and the exchange need all of them), so the flag goes over the
world, not the ep group. ``exact`` stays on until the next arm: activation checkpointing's recompute in the backward
then takes the path its forward took (a static recompute has the same capacity, hence the same blocks). The result
is the exact path's: a kept static forward dropped no row, and a rerun is the exact forward itself.

Under CUDA graphs (train/cuda_graph.py, ep = world size) a micro-step cannot stop between its forward and backward to
read a flag: ``StepLoss(defer_overflow=True)`` keeps each micro-step's flag on the device with the step's numbers
(``forward_deferred``; ``StepLoss.overflow``), the script reads it once the step's micro-steps are done
(``step_overflowed``) and, when any rank overflowed, zeroes the gradients and runs the whole step again eagerly inside
``exact_exchange`` (no optimizer step was taken yet).

Off (no mode, the default, and at ep 1 where there is no exchange) ``run_exactly`` is the forward alone: no
collective, no host read. Not for megablocks (it moves the tokens itself) nor for experts with a bias (gpt-oss: the
bias's one-hot covers all rows, padding included), nor with ``overlap_chunks`` > 1 (those layers keep the exact
exchange). With LoRA dropout a kept static forward draws its masks over the padded rows, so they differ from the
exact path's (still dropout; a rerun restores the RNG and draws the exact path's).
"""

import os
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import nn

from megablocks_utils.moe.blocks import moe_blocks
from megablocks_utils.moe.layer import ExpertParallelExperts

T = TypeVar("T")


# How the static exchange moves rows (``use_static_exchange``'s ``transport``): "pull" reads them from the peers' GPU
# memory (``pull_exchange``: the exact bytes, a receiver's capacity in all), "all_to_all" sends fixed blocks through the
# process group (``static_exchange``: padding on the wire, a capacity per pair of ranks), "gathered" is "pull" over
# all-gathered copies (any backend: the CPU tests'). "auto": ``choose_transport``.
TRANSPORTS = ("auto", "pull", "all_to_all", "gathered")


def choose_transport(setting: str, device_type: str, ep: int, local_world_size: int) -> str:
    """The transport "auto" means: "pull" where the experts are on GPUs and every ep group lies within one node (ep groups
    are consecutive ranks: ``local_world_size`` divisible by ep), since symmetric memory maps one node's GPUs; else
    "all_to_all". "pull" asked for across nodes is refused."""
    one_node = local_world_size % ep == 0
    if setting == "pull" and not one_node:
        raise ValueError(f"transport pull: an ep group of {ep} spans nodes of {local_world_size} GPUs, and the peers' memory "
                         "is mapped within one node; use transport auto or all_to_all")
    if setting != "auto":
        return setting
    return "pull" if device_type == "cuda" and one_node else "all_to_all"


class ExchangeMode:
    """One model's static exchange: the capacity factor, the transport (``TRANSPORTS``), whether the layers must take
    the exact exchange (``exact``) and the overflow flags its layers added since the last arm (``flags``). Reruns are
    counted by the caller (``run_exactly`` says whether it reran: StepLoss puts them in the step's record)."""

    def __init__(self, capacity_factor: float, transport: str = "all_to_all"):
        self.capacity_factor = capacity_factor
        self.transport = transport
        self.exact = False
        self.flags: list[torch.Tensor] = []
        self._gathered: dict[str, object] = {}

    def peers(self, group: dist.ProcessGroup):
        """What ``pull_exchange`` reads from: None (symmetric memory, made there) or, for "gathered", this group's
        ``GatheredPeers``."""
        if self.transport != "gathered":
            return None
        if group.group_name not in self._gathered:
            from megablocks_utils.moe.pull_exchange import GatheredPeers

            self._gathered[group.group_name] = GatheredPeers(group)
        return self._gathered[group.group_name]


# The modes of live models: while there is none, ``run_exactly`` looks for nothing (the default run's host time).
_LIVE_MODES: "weakref.WeakSet[ExchangeMode]" = weakref.WeakSet()


def use_static_exchange(model: nn.Module, capacity_factor: float, transport: str = "auto") -> str:
    """Give every MoE layer of the built model (after ``shard_moe``) one shared ``ExchangeMode`` of ``capacity_factor``
    (0: nothing changes) and ``transport`` (``TRANSPORTS``). Returns a line for the launch print ("" when off)."""
    if transport not in TRANSPORTS:
        raise ValueError(f"transport={transport!r}: choose one of {', '.join(TRANSPORTS)}")
    if capacity_factor < 0:
        raise ValueError(f"ep_capacity_factor={capacity_factor}: give 0 (the exact exchange) or a positive factor")
    if capacity_factor == 0:
        return ""
    experts = [block.experts for block in moe_blocks(model)]
    if any(type(e).route_and_compute is not ExpertParallelExperts.route_and_compute for e in experts):
        raise ValueError("ep_capacity_factor > 0 needs moe_backend native (megablocks moves the tokens itself); "
                         "use --moe_backend native or --ep_capacity_factor 0")
    if any(e.has_bias for e in experts):
        raise ValueError("ep_capacity_factor > 0 does not support experts with a bias (gpt-oss); use --ep_capacity_factor 0")
    if not experts or experts[0].ep_size == 1:
        return f"ep_capacity_factor {capacity_factor:g}: no effect at ep 1 (no expert exchange)"
    ep = experts[0].ep_size
    transport = choose_transport(transport, experts[0].gate_up_proj.device.type, ep,
                                 int(os.environ.get("LOCAL_WORLD_SIZE", ep)))
    mode = ExchangeMode(capacity_factor, transport)
    _LIVE_MODES.add(mode)
    for e in experts:
        e.exchange_mode = mode
    if transport == "all_to_all":
        way = f"static blocks of {capacity_factor:g} x a peer's mean share of rows through all-to-all"
    else:
        way = (f"each rank receives at most {capacity_factor:g} x its mean rows, read from the peers' "
               f"{'GPU memory (symmetric memory)' if transport == 'pull' else 'all-gathered buffers'}")
    return f"expert exchange: {way}, no host sync; a micro-step that overflows reruns exactly (exchange_reruns in metrics.jsonl)"


def drop_static_exchange(model: nn.Module) -> None:
    """Every MoE layer back on the exact exchange (``use_static_exchange`` undone)."""
    for block in moe_blocks(model):
        block.experts.exchange_mode = None


def exchange_mode(model: nn.Module) -> ExchangeMode | None:
    """The model's ``ExchangeMode``, or None (no static exchange)."""
    if not _LIVE_MODES:
        return None
    blocks = moe_blocks(model)
    return blocks[0].experts.exchange_mode if blocks else None


def _rng_states(device: torch.device) -> tuple:
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def _set_rng_states(states: tuple, device: torch.device) -> None:
    torch.set_rng_state(states[0])
    if states[1] is not None:
        torch.cuda.set_rng_state(states[1], device)


def run_exactly(model: nn.Module, forward: Callable[[], T], group: dist.ProcessGroup | None, device) -> tuple[T, bool]:
    """``forward()`` (the model's forward and what reads its routing), exactly as on the exact exchange; and whether it
    was rerun. Collective over ``group`` (all ranks) when a layer ran static; else the forward alone."""
    mode = exchange_mode(model)
    if mode is None:
        return forward(), False
    mode.exact, mode.flags = False, []
    rng = _rng_states(torch.device(device))
    result = forward()
    if not mode.flags:  # no layer ran static (e.g. overlap_chunks > 1)
        return result, False
    overflowed = torch.stack(mode.flags).any().to(torch.int32).reshape(1)
    mode.flags = []
    if group is None or dist.get_world_size(group) > 1:
        dist.all_reduce(overflowed, op=dist.ReduceOp.MAX, group=group)
    if not overflowed.item():
        return result, False
    del result  # its activations can go before the rerun makes its own
    mode.exact = True  # until the next arm: a checkpointed recompute in the backward takes the exact path too
    _set_rng_states(rng, torch.device(device))
    return forward(), True


def forward_deferred(model: nn.Module, forward: Callable[[], T]) -> tuple[T, torch.Tensor | None]:
    """``forward()`` with its layers on the static exchange (unless ``exact_exchange`` is on) and, instead of a check,
    whether any layer overflowed: a device bool, nothing read on the host (None where no layer ran static). The caller
    must not keep the result of a forward that overflowed (``StepLoss`` with ``defer_overflow``: the script reruns the
    step inside ``exact_exchange``)."""
    mode = exchange_mode(model)
    if mode is None:
        return forward(), None
    mode.flags = []
    result = forward()
    overflow = torch.stack(mode.flags).any() if mode.flags else None
    mode.flags = []
    return result, overflow


def step_overflowed(overflow: torch.Tensor | None, group: dist.ProcessGroup | None) -> bool:
    """Whether any rank's static exchange overflowed in this step (``overflow``: this rank's flag, or None where
    nothing ran static): one all-reduce and one host read. Collective over ``group`` (all ranks)."""
    flag = torch.zeros(1, dtype=torch.int32) if overflow is None else overflow.to(torch.int32).reshape(1)
    if group is None or dist.get_world_size(group) > 1:
        if overflow is None and dist.get_backend(group) == "nccl":
            flag = flag.cuda()
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())


@contextmanager
def exact_exchange(model: nn.Module) -> Iterator[None]:
    """Every layer on the exact exchange inside the block (a step rerun after ``step_overflowed``); the static one after."""
    mode = exchange_mode(model)
    if mode is None:
        yield
        return
    mode.exact = True
    try:
        yield
    finally:
        mode.exact = False
