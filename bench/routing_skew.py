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
The calibration ranks the logits (plus the router's bias, gpt-oss's): exact for top-k of softmax or of logits; a
router that limits groups (DeepSeek-V3, V2 with group_limited_greedy; not V2-Lite) lands near ``target``, not on it.

``balance_routing(model, num_experts, top_k)`` is the other end: every expert gets exactly ``T * top_k / E`` of a
micro-batch's ``T`` token copies (busiest / mean = 1). Its pre-hook adds to token t's router input
``u_t = pinv(W) b_t`` (``W`` [E, H] with E < H has full row rank, so ``W u_t = b_t``): ``b_t`` is ``+C/2`` on the k
experts the token is dealt and ``-C/2`` on the others, ``C`` 20x the logits' standard deviation on the layer's first
batch (doubled until the dealt experts are that batch's top-k), so they win the top-k of softmax, sigmoid and raw
logits alike. Token t is dealt positions ``(t * k + j) mod E`` (j < k) of a per-layer seeded order of the experts;
with group-limited routing (DeepSeek) the rule runs inside one group per token and the order moves whole groups.

``control_routing(model, "own" | "balanced" | "skew:R")`` applies either from the model's config, the same way to
transformers' model and to ours; ``RouterCounts`` reads each layer's top-k counts from the routers' own outputs.
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
        if getattr(module, "bias", None) is not None:  # gpt-oss's router has a learned bias
            logits = logits + _local(module.bias).detach().float()
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


def dealt_experts(tokens: int, num_experts: int, top_k: int, order: torch.Tensor, num_groups: int = 1) -> torch.Tensor:
    """[tokens, top_k] experts: token t gets positions ``(t * top_k + j) % num_experts`` (j < top_k) of ``order``, k
    distinct experts, every expert ``tokens * top_k / num_experts`` times where that divides. With expert groups
    (``num_groups`` > 1, k no more than a group) the same rule runs inside one group per token, the groups in turn, so
    each token's experts lie in one group."""
    size = num_experts // num_groups
    t, j = torch.arange(tokens).unsqueeze(1), torch.arange(top_k)
    if num_groups == 1 or top_k > size:
        return order[(t * top_k + j) % num_experts]
    return order[t % num_groups * size + (t // num_groups * top_k + j) % size]


def group_keeping_order(num_experts: int, num_groups: int, generator: torch.Generator) -> torch.Tensor:
    """A random order of the experts that moves whole groups (and shuffles inside each): consecutive positions of
    one group stay in one group."""
    size = num_experts // num_groups
    groups = torch.randperm(num_groups, generator=generator)
    inside = torch.stack([torch.randperm(size, generator=generator) for _ in range(num_groups)])
    return (groups.unsqueeze(1) * size + inside).flatten()


class RoutingBalance:
    """The hooks of ``balance_routing`` and their state. ``scales[i]``: layer i's C (set on its first forward)."""

    def __init__(self, routers: list[nn.Module], top_k: int, seed: int, num_groups: int = 1, topk_groups: int = 1,
                 scale: float = 20.0):
        num_experts, hidden = routers[0].weight.shape
        if num_experts > hidden:
            raise ValueError(f"{num_experts} experts over a hidden size of {hidden}: the router's logits cannot be moved "
                             "independently (balanced routing needs fewer experts than hidden units)")
        if not 1 <= top_k <= num_experts or num_experts % num_groups:
            raise ValueError(f"top_k={top_k} must be in 1..{num_experts} and num_groups={num_groups} divide {num_experts}")
        size = num_experts // num_groups
        if top_k > size:  # more experts than a group holds: dealt across the groups, as many as a block of k touches
            spans = max(len({(t * top_k + j) % num_experts // size for j in range(top_k)}) for t in range(num_experts))
            if spans > topk_groups:
                raise ValueError(f"each token's {top_k} experts would span {spans} of the {num_groups} expert groups, more "
                                 f"than the {topk_groups} group-limited routing keeps: balanced routing cannot be exact here")
        self.num_experts, self.top_k, self.num_groups, self.scale = num_experts, top_k, num_groups, scale
        generator = torch.Generator().manual_seed(seed)
        self.orders = [group_keeping_order(num_experts, num_groups, generator) for _ in routers]
        self.scales: list[float | None] = [None] * len(routers)
        self.offsets: list[torch.Tensor | None] = [None] * len(routers)
        self.handles = [r.register_forward_pre_hook(self._hook(i)) for i, r in enumerate(routers)]

    def _offsets(self, i: int, module: nn.Module, rows: torch.Tensor) -> torch.Tensor:
        """[tokens, hidden] u with W u_t = b_t; C doubles until the dealt experts are this batch's top-k (fp32)."""
        weight = _local(module.weight).detach().float()
        logits = rows.float() @ weight.T
        if self.scales[i] is None:
            self.scales[i] = self.scale * float(logits.std())
        dealt = dealt_experts(rows.shape[0], self.num_experts, self.top_k, self.orders[i], self.num_groups).to(rows.device)
        inverse = torch.linalg.pinv(weight).T  # [E, H]: W pinv(W) = I
        for _ in range(8):
            c = self.scales[i]
            u = torch.full_like(logits, -c / 2).scatter_(1, dealt, c / 2) @ inverse
            chosen = torch.topk(logits + u @ weight.T, self.top_k, dim=-1).indices
            if torch.equal(chosen.sort(dim=-1).values, dealt.sort(dim=-1).values):
                return u
            self.scales[i] = 2 * c
        raise RuntimeError(f"layer {i}: the dealt experts are not the top-k even with offsets of {c:g}")

    def _hook(self, i: int):
        def pre_hook(module, args):
            x = args[0]
            rows = x.reshape(-1, x.shape[-1])
            u = self.offsets[i]
            if u is None or u.shape != rows.shape or u.device != x.device:
                with torch.no_grad():
                    u = self.offsets[i] = self._offsets(i, module, rows.detach()).to(x.dtype)
            return ((rows + u.to(x.dtype)).view(x.shape), *args[1:])  # the router's input only: the experts get x

        return pre_hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def balance_routing(model: nn.Module, num_experts: int, top_k: int, seed: int = 0, num_groups: int = 1,
                    topk_groups: int = 1) -> RoutingBalance:
    """Register the hooks that deal every micro-batch's token copies evenly over the experts of every router of
    ``model``; each layer's offsets are made on its first forward (and again if the token count changes). Exact when
    ``tokens * top_k`` is a multiple of ``num_experts`` (and, with groups, ``tokens`` of ``num_groups``): 4096 tokens
    at every shape of bench/real_data.py. ``num_groups``/``topk_groups``: group-limited routing's (DeepSeek's
    ``n_group``/``topk_group`` where the model limits groups; 1 otherwise)."""
    return RoutingBalance(find_routers(model, num_experts), top_k, seed, num_groups, topk_groups)


class RouterCounts:
    """Each layer's top-k counts since the last ``take``, read by forward hooks from the routers' own outputs (the
    chosen experts are the last value a router returns: transformers' routers and our ``TopKRouter`` alike). Summed
    on the device, so no forward waits for the host."""

    def __init__(self, model: nn.Module, num_experts: int):
        routers = find_routers(model, num_experts)
        self.num_experts, self.counts = num_experts, [None] * len(routers)
        self.handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(routers)]

    def _hook(self, i: int):
        def hook(module, args, out):
            chosen = out[-1].detach().flatten()
            ones = torch.ones(chosen.numel(), device=chosen.device)
            counts = torch.zeros(self.num_experts, device=chosen.device).index_add_(0, chosen, ones)
            self.counts[i] = counts if self.counts[i] is None else self.counts[i] + counts

        return hook

    def take(self) -> list[float]:
        """Each layer's busiest expert over the mean since the last call (a host sync), and start again."""
        ratios = [load_ratio(c) for c in self.counts if c is not None]
        self.counts = [None] * len(self.counts)
        return ratios

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


ROUTINGS = "own, balanced or skew:R (R: the busiest expert's load over the mean, e.g. skew:2.38)"


def parse_routing(text: str) -> str:
    """The benchmarks' --routing value, checked: "own", "balanced" or "skew:R" with R >= 1."""
    if text in ("own", "balanced"):
        return text
    if text.startswith("skew:"):
        try:
            if float(text[5:]) >= 1:
                return text
        except ValueError:
            pass
    raise ValueError(f"routing {text!r} is unknown; give {ROUTINGS}")


def control_routing(model: nn.Module, routing: str, seed: int = 0) -> RoutingBalance | RoutingSkew | None:
    """``routing`` (``parse_routing``'s) on every router of ``model``, transformers' or ours (the model table gives
    the expert count, top-k and groups): "own" leaves it, "balanced" is ``balance_routing``, "skew:R" is
    ``skew_routing`` (calibrated by the next forward, on every rank)."""
    from megablocks_utils.model.architectures import spec_for

    routing = parse_routing(routing)
    spec = spec_for(model.config)
    num_experts, top_k = getattr(model.config, spec.num_experts_attr), getattr(model.config, spec.top_k_attr)
    if routing == "own":
        return None
    if routing == "balanced":
        options = spec.router_options(model.config)
        return balance_routing(model, num_experts, top_k, seed, options.get("num_groups", 1), options.get("topk_groups", 1))
    return skew_routing(model, float(routing[5:]), num_experts, top_k, seed)
