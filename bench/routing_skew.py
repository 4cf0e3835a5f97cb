"""Skewed routing for the benchmarks: a fixed per-expert offset on every router's logits, the same way for every
implementation (ours, transformers' FSDP2, transformers' own FSDP2 + EP).

Random weights route almost uniformly; trained models do not (this project's real-text record: the busiest expert
gets 2.38x the mean). ``skew_routing(model, target)`` registers a forward pre-hook on each router (the module that
maps hidden states to expert logits with a ``weight`` of shape [experts, hidden]: transformers' ``gate``/``router``,
our ``TopKRouter`` under the same name) that adds a constant vector ``u`` to the router's input, so its logits move by
``W u = b``: a per-expert offset, as a learned router bias would give. Only the router sees ``u``; the experts get the
hidden states unchanged. Hooks are public module API; nothing of transformers is patched.

``b = alpha * g``, ``g`` a fixed draw (seeded) of standard normals per layer, and ``alpha`` is found by bisection on
the first forward after ``skew_routing`` (the calibration batch, under ``torch.no_grad``): the top-k counts of
``W x + alpha g`` over every rank's tokens (all-reduced) give the busiest expert's load over the mean, and alpha is
set so that it is ``target``. Each layer is calibrated in turn, after the layers before it are already skewed.
``ratios`` holds, per layer, the ratio reached; a layer whose own routing is already more uneven than ``target``
(small random models' deeper layers can be) keeps it (alpha = 0). ``uniform_ratios``: each layer's own, unskewed.
"""

import torch
import torch.distributed as dist
from torch import nn

ROUTER_NAMES = ("gate", "router")


def find_routers(model: nn.Module, num_experts: int) -> list[nn.Module]:
    """Every MoE layer's router, in layer order: a submodule named gate/router whose weight is [num_experts, hidden]."""
    routers = []
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if name.rsplit(".", 1)[-1] in ROUTER_NAMES and weight is not None and weight.dim() == 2 and weight.shape[0] == num_experts:
            routers.append(module)
    if not routers:
        raise ValueError(f"no router (a gate/router module with a [{num_experts}, hidden] weight) in the model")
    return routers


def _local(t: torch.Tensor) -> torch.Tensor:
    """A full tensor: inside a forward FSDP2 has gathered the weight already; a DTensor outside it is gathered here."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def load_ratio(counts: torch.Tensor) -> float:
    return float(counts.max() / counts.float().mean())


class RoutingSkew:
    """The hooks and their state; ``skew_routing`` makes one. ``ratios[i]``: the load ratio layer i was set to."""

    def __init__(self, routers: list[nn.Module], target: float, top_k: int, seed: int, group=None, offsets=None):
        most = routers[0].weight.shape[0] / top_k  # every token sends one copy to the busiest expert
        if not 1.0 <= target <= most:
            raise ValueError(f"target={target}: the busiest expert's load over the mean is at least 1 and at most "
                             f"experts / top_k = {most:g}")
        self.target, self.top_k, self.group = target, top_k, group
        generator = torch.Generator().manual_seed(seed)
        self.directions = [torch.randn(r.weight.shape[0], generator=generator) for r in routers]
        self.offsets: list[torch.Tensor | None] = list(offsets) if offsets is not None else [None] * len(routers)
        if len(self.offsets) != len(routers):
            raise ValueError(f"{len(self.offsets)} offsets for {len(routers)} routers")
        self.ratios: list[float | None] = [None] * len(routers)
        self.uniform_ratios: list[float | None] = [None] * len(routers)
        self.handles = [r.register_forward_pre_hook(self._hook(i)) for i, r in enumerate(routers)]

    def _counts(self, logits: torch.Tensor) -> torch.Tensor:
        top = torch.topk(logits, self.top_k, dim=-1).indices
        counts = torch.bincount(top.flatten(), minlength=logits.shape[-1]).float()
        if self.group is not None or dist.is_initialized():
            dist.all_reduce(counts, group=self.group)
        return counts

    def _calibrate(self, i: int, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        weight = _local(module.weight).detach().float()
        rows = x.detach().reshape(-1, x.shape[-1]).float()
        logits = rows @ weight.T
        g = self.directions[i].to(logits.device)
        self.uniform_ratios[i] = load_ratio(self._counts(logits))
        low, high = 0.0, float(logits.std()) * 8
        for _ in range(30):  # the ratio grows with alpha (the busiest expert is the one g favours most, once alpha counts)
            alpha = (low + high) / 2
            if load_ratio(self._counts(logits + alpha * g)) < self.target:
                low = alpha
            else:
                high = alpha
        alpha = (low + high) / 2
        self.ratios[i] = load_ratio(self._counts(logits + alpha * g))
        # u with W u = alpha g: the least-norm solution (W has full row rank: experts << hidden).
        u = torch.linalg.lstsq(weight, (alpha * g).unsqueeze(1)).solution.squeeze(1)
        return u

    def _hook(self, i: int):
        def pre_hook(module, args):
            x = args[0]
            if self.offsets[i] is None:
                with torch.no_grad():
                    self.offsets[i] = self._calibrate(i, module, x)
            return (x + self.offsets[i].to(dtype=x.dtype, device=x.device), *args[1:])

        return pre_hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def skew_routing(model: nn.Module, target: float, num_experts: int, top_k: int, seed: int = 0, group=None,
                 offsets: list[torch.Tensor] | None = None) -> RoutingSkew:
    """Register the offset hooks on every router of ``model``; the next forward (run it under ``torch.no_grad`` on a
    representative batch, on every rank) calibrates them. Collective: every rank must run that forward.
    ``offsets``: another model's calibrated ``RoutingSkew.offsets`` (the same router weights) to apply as they are.

    Two calibrations of models that differ only by rounding can land on slightly different offsets: the load ratio
    is a step function of alpha, and the bisection stops at whichever step crosses the target."""
    return RoutingSkew(find_routers(model, num_experts), target, top_k, seed, group, offsets)
