"""The native dropless expert-parallel MoE layer: ``ExpertParallelMoE`` (router, experts, shared expert)
and ``ExpertParallelExperts`` (this rank's expert weights, ``expert_weights.py``, and their forward), composing the parts.

One token's trip through a layer, each step in its own module:
  route (the model's top-k rule: ``router.py``) -> sort token copies by expert -> all-to-all to the ep
  rank that owns the expert (``dispatch.py``) -> the local experts' GEMMs (``experts.py``) on weights
  cast to the compute dtype (``cast.py``) -> all-to-all back -> weight by the router scores and sum the
  k copies of each token (``dispatch.py``).

Expert weights are DTensors sharded (Shard(0)) over the ep mesh; under FSDP2 (``parallelize.py``) they
are gathered over dp before the forward, which uses their local block. Their gradient is therefore
this ep group's contribution only: FSDP's reduce-scatter (or ``sync_expert_grads`` for FSDP1) sums it
over dp and scales it the way FSDP scales dense gradients (``grads.py``).
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.utils.checkpoint import checkpoint

from megablocks_utils.moe.dispatch import Route, combine, dispatch, exchange, route
from megablocks_utils.moe.expert_weights import ExpertWeights
from megablocks_utils.moe.experts import LocalExperts
from megablocks_utils.moe.pull_exchange import pull_capacity, pull_exchange
from megablocks_utils.moe.router import TopKRouter
from megablocks_utils.moe.static_exchange import static_capacity, static_exchange


class ExpertParallelExperts(ExpertWeights):
    """This rank's experts of one layer: their weights (``ExpertWeights``: stored fused like transformers 5 does,
    sharded over "ep") and the forward that sends each token's k copies to them and back.

    ``act_fn`` is a transformers activation name, or "gpt_oss_swiglu" (clamped, with ``alpha`` and ``limit``);
    ``transposed``, ``interleaved`` and ``bias``: the weights' layout (``ExpertWeights``). Settings, given at construction:
    ``force_loop``: the local experts as the per-expert loop even where grouped GEMMs run (tests compare the two).
    ``compile_elementwise``: on CUDA, torch.compile the GLU (SiLU * up, gpt-oss's clamped SwiGLU) and the cast's
    gradient division (``fused.py``), and run the weighted combine of the k outputs (both ways) and the dispatch's
    backward as our Triton kernels (``gather_kernels.py``).
    ``overlap_chunks``: with ep > 1, tokens in this many chunks, one's all-to-all beside another's experts (forward).
    ``exchange_mode`` (``exchange_mode.use_static_exchange``, the scripts' ``ep_capacity_factor``; None: off): at ep > 1
    with one chunk, the exchange at fixed shapes (``pull_exchange`` or ``static_exchange``, by the mode's transport)
    unless the mode asks for the exact one; the layer adds its overflow flag to the mode, which reruns exactly.
    ``recompute`` (``apply_activation_checkpointing``, the scripts' ``checkpoint_experts``): the forward keeps only its
    inputs and reruns in the backward (non-reentrant checkpoint): at Qwen3-30B-A3B's shape some 100 KB a token of a
    layer's ~163 (routed copies, gate_up and SwiGLU outputs, expert outputs) for a quarter of its forward work.
    """

    def __init__(
        self,
        num_experts: int,
        mesh,
        act_fn: str,
        *,
        transposed: bool = False,
        interleaved: bool = False,
        bias: bool = False,
        alpha: float | None = None,
        limit: float | None = None,
        force_loop: bool = False,
        compile_elementwise: bool = True,
        overlap_chunks: int = 1,
    ):
        super().__init__(bias=bias, compile_elementwise=compile_elementwise)
        if overlap_chunks < 1:
            raise ValueError(f"overlap_chunks={overlap_chunks}: give 1 (no overlap) or more chunks")
        self.num_experts = num_experts
        self.mesh = mesh  # the run's mesh.MoEMesh: the layer reads its ep size, rank and group
        # Read here: the forward then calls no DeviceMesh method for it (torch 2.11's dynamo fails tracing them, which
        # compiling a whole decoder layer would do; the group comes from ``_ep_group``, outside compile).
        self.ep_size = mesh.ep_size
        self.num_local_experts = num_experts // mesh.ep_size
        self.local = LocalExperts(act_fn, transposed=transposed, interleaved=interleaved, alpha=alpha, limit=limit, force_loop=force_loop)
        self.overlap_chunks = overlap_chunks
        self.recompute, self.recompute_rng = False, True  # checkpoint_experts; replay the RNG (off without dropout)
        self.recompute_swiglu = False  # SwiGLU's output made again in the backward, not kept (recompute_swiglu: experts.silu_mul_down)
        self.exchange_mode = None  # the model's ExchangeMode where ep_capacity_factor > 0 (exchange_mode.py)

    def fuse_elementwise(self, t: torch.Tensor) -> bool:
        return self.compile_elementwise and t.is_cuda

    @torch.compiler.disable  # torch 2.11's dynamo fails on DeviceMesh internals
    def _ep_group(self) -> "torch.distributed.ProcessGroup":
        # Looked up when used, not kept on the module, so the model holds no ProcessGroup past
        # destroy_process_group (suspected, not shown, to abort a shutdown after SIGTERM).
        return self.mesh.ep_group

    def owns_weight_grads(self, x: torch.Tensor, counts: torch.Tensor) -> bool:
        """Whether the GEMMs' backward adds gate_up's and down's gradients into ``.grad`` itself (``weight_grad.py``):
        ``weight_grads_in_gemm`` on, grouped GEMMs, weights that need a gradient and that FSDP does not manage
        (FSDP reduces the gradient autograd gives its unsharded weights)."""
        return (self.weight_grads_in_gemm and torch.is_grad_enabled() and not isinstance(self, FSDPModule)
                and self.gate_up_proj.requires_grad and self.down_proj.requires_grad and self.local.uses_grouped_gemms(x, counts))

    def compute(self, x: torch.Tensor, counts: torch.Tensor, counts_host: list[int] | None = None,
                padded: bool = False) -> torch.Tensor:
        """Run the local experts on rows of ``x`` already grouped by local expert (``LocalExperts``; ``counts_host``,
        ``counts`` as a list, spares the per-expert loop a host sync; ``padded``: rows past the counts' sum follow)."""
        adapters = self._local_weights(x.dtype, self.lora.tensors()) if self.lora is not None else ()
        if self.owns_weight_grads(x, counts):
            weights, grads_into = self._weights_grads_into(x)
        else:
            weights, grads_into = self._local_weights(x.dtype), None
        return self.local(x, counts, weights, counts_host, fuse=self.fuse_elementwise(x), lora=self.lora, adapters=adapters,
                          grads_into=grads_into, padded=padded, recompute_swiglu=self.recompute_swiglu)

    def compute_valid_rows(self, x: torch.Tensor, counts: torch.Tensor, counts_host: None = None) -> torch.Tensor:
        """``compute`` for ``static_exchange``: the first ``counts.sum()`` rows of ``x`` exact, the padding after them
        anything. The grouped GEMM stops at its last offset by itself; the per-expert loop splits all rows by the counts,
        so it reads them on the host (free on CPU, one sync on a GPU), runs on the valid rows and pads with zeros."""
        if not self.local.loops(x):
            return self.compute(x, counts, padded=True)
        counts_host = counts.tolist()
        valid = sum(counts_host)
        return F.pad(self.compute(x[:valid], counts, counts_host), (0, 0, 0, x.shape[0] - valid))

    def forward(self, x: torch.Tensor, top_i: torch.Tensor, top_w: torch.Tensor) -> torch.Tensor:
        """x [T, H], top_i/top_w [T, k] -> [T, H] (the same contract as transformers' experts); with ``recompute``,
        under torch.utils.checkpoint."""
        if self.recompute and torch.is_grad_enabled():
            return checkpoint(self.route_and_compute, x, top_i, top_w, use_reentrant=False, preserve_rng_state=self.recompute_rng)
        return self.route_and_compute(x, top_i, top_w)

    def route_and_compute(self, x: torch.Tensor, top_i: torch.Tensor, top_w: torch.Tensor) -> torch.Tensor:
        """The forward's work: each token's k copies to their experts and back, weighted and summed (``send``, then
        ``receive``).

        With ``overlap_chunks`` = C > 1 (and ep > 1) the tokens go through in C consecutive chunks whose
        collectives are issued so that one chunk's all-to-all can run while another's experts compute (every
        dispatch first, then each chunk's experts and its return trip): the same result, one host sync.
        """
        num_tokens = top_i.shape[0]
        pieces = 1 if self.ep_size == 1 else max(1, min(self.overlap_chunks, num_tokens))
        if pieces == 1 and _static_transport(self) not in (None, "all_to_all"):  # the rows read from x: no dispatch
            return _pull(self, x, top_i, top_w, route(top_i, self.num_experts))
        if pieces == 1:  # x whole: a slice's backward would allocate and fill a zero gradient of all of x
            return self.receive(*self.send(x, top_i), top_w, x.dtype)
        edges = [num_tokens * i // pieces for i in range(pieces + 1)]
        parts = [(x[a:b], top_i[a:b], top_w[a:b]) for a, b in zip(edges[:-1], edges[1:])]
        sent = [self.send(part_x, part_i) for part_x, part_i, _ in parts]
        routes = [r for r, _ in sent]
        outs = exchange([rows for _, rows in sent], [r.counts for r in routes], self.ep_size, self.num_local_experts,
                        self._ep_group(), self.compute)
        fuse = self.fuse_elementwise(x)
        return torch.cat([combine(out, r, part_w, x.dtype, fuse) for out, r, (_, _, part_w) in zip(outs, routes, parts)])

    @property
    def sends_whole(self) -> bool:
        """Whether the forward is ``send`` then ``receive`` on all tokens at once (one chunk, no recomputation): what
        lets ``cuda_graphs segments`` put ``send`` in the graph before the exchange (train/segment_graphs.py)."""
        return (self.ep_size == 1 or self.overlap_chunks == 1) and not self.recompute

    def send(self, x: torch.Tensor, top_i: torch.Tensor) -> tuple[Route, torch.Tensor]:
        """The part before the exchange, with no host sync: the route (``route``) and each token's k copies in expert
        order (``dispatch``)."""
        r = route(top_i, self.num_experts)
        return r, dispatch(x, r, top_i.shape[1], self.fuse_elementwise(x))

    def receive(self, r: Route, routed: torch.Tensor, top_w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The rest, from ``send``'s outputs (all tokens, one chunk): the copies to the ep ranks owning their experts and
        back (ep > 1: the exact exchange, or fixed shapes under ``exchange_mode``), weighted by ``top_w`` and summed
        into one row per token, in ``dtype``."""
        num_tokens, k = top_w.shape
        ep = self.ep_size
        transport = _static_transport(self)
        if ep == 1:  # no host sync: the grouped GEMM reads the counts on the GPU
            out = self.compute(routed, r.counts)
        elif transport == "all_to_all":  # fixed blocks, no host sync
            capacity = static_capacity(num_tokens, k, ep, self.exchange_mode.capacity_factor)
            out, overflow = static_exchange(routed, r.counts, ep, self.num_local_experts, self._ep_group(),
                                            self.compute_valid_rows, capacity)
            self.exchange_mode.flags.append(overflow)  # the mode checks overflow
        elif transport is not None:  # the pull reads tokens: each one's row (its first copy) and experts from the route
            copies = r.copy_row.view(num_tokens, k)
            return _pull(self, routed[copies[:, 0]], _expert_of_row(r)[copies], top_w, r)
        else:
            out = exchange([routed], [r.counts], ep, self.num_local_experts, self._ep_group(), self.compute)[0]
        return combine(out, r, top_w, dtype, self.fuse_elementwise(routed))


def _static_transport(experts: ExpertParallelExperts) -> str | None:
    """The transport of the static exchange the layer takes now (its ``exchange_mode``'s), or None: the exact one."""
    mode = experts.exchange_mode
    return mode.transport if experts.ep_size > 1 and mode is not None and not mode.exact else None


def _expert_of_row(r: Route) -> torch.Tensor:
    """The expert of each copy in expert order (``output_size``: no host sync)."""
    experts = torch.arange(r.counts.shape[0], device=r.counts.device)
    return torch.repeat_interleave(experts, r.counts, output_size=r.copy_row.shape[0])


def _pull(experts: ExpertParallelExperts, x: torch.Tensor, top_i: torch.Tensor, top_w: torch.Tensor, r: Route) -> torch.Tensor:
    """The exchange read from the peers' buffers (``pull_exchange``: exact bytes, one row per token and rank, fixed
    shapes, no host sync), its overflow flag added to the mode."""
    mode, group = experts.exchange_mode, experts._ep_group()
    capacity = pull_capacity(top_i.shape[0], top_i.shape[1], experts.ep_size, mode.capacity_factor)
    out, overflow = pull_exchange(x, top_i, top_w, r.copy_row, r.counts, experts.ep_size, experts.num_local_experts, group,
                                  experts.compute_valid_rows, capacity, mode.peers(group))
    mode.flags.append(overflow)
    return out


class ExpertParallelMoE(nn.Module):
    """A dropless expert-parallel replacement for a transformers MoE block (``layer.mlp`` and the like).

    The router lives under the model's own attribute name (``router_attr``: "gate", "router") and a
    shared expert, if the model has one, stays transformers' own module under its own name, so
    parameter names match the single-process model. ``router`` is the router whatever its name.

    While ``record_router`` is on, the forward keeps this layer's router probabilities and choices
    for the load-balancing loss (see ``aux_loss.py``); ``shard_moe`` turns it on at each model
    forward and the loss turns it off, so recomputation under activation checkpointing records
    nothing and routes exactly as the first pass did (routing is a pure function of the input).
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        renormalize: bool,
        mesh,
        act_fn: str,
        *,
        router_attr: str = "gate",
        router_mode: str = "softmax_topk",
        router_options: dict | None = None,
        router_bias: bool = False,
        returns_scores: bool = False,
        experts: ExpertParallelExperts | None = None,
    ):
        super().__init__()
        self.router_attr = router_attr
        router = TopKRouter(hidden_size, num_experts, top_k, renormalize, router_mode, bias=router_bias, **(router_options or {}))
        setattr(self, router_attr, router)
        # The experts' forward is the backend: this module's own (moe_backend="native") or megablocks'
        # (megablocks_backend.MegablocksExperts, a subclass holding the same weights).
        self.experts = experts if experts is not None else ExpertParallelExperts(num_experts, mesh, act_fn)
        # gpt-oss's decoder layer unpacks (hidden states, router scores) from its MoE block.
        self.returns_scores = returns_scores
        self.shared_expert_attr = None
        self.shared_gate_attr = None
        self.record_router = False
        self.router_probs = None
        self.router_choices = None

    @property
    def top_k_router(self) -> TopKRouter:
        return getattr(self, self.router_attr)

    def add_shared_expert(self, attr: str, expert: nn.Module, gate_attr: str | None = None, gate: nn.Module | None = None) -> None:
        """Add ``expert(x)`` (times ``sigmoid(gate(x))`` if a gate is given) to every token's output."""
        self.shared_expert_attr = attr
        setattr(self, attr, expert)
        if gate is not None:
            self.shared_gate_attr = gate_attr
            setattr(self, gate_attr, gate)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        probs, top_w, top_i = self.top_k_router(x)
        if self.record_router:
            self.router_probs, self.router_choices = probs, top_i
        out = self.experts(x, top_i, top_w)
        if self.shared_expert_attr is not None:
            out = out + self._shared(x)
        return self._output(out, shape, top_w)

    def _shared(self, x: torch.Tensor) -> torch.Tensor:
        shared = getattr(self, self.shared_expert_attr)(x)
        if self.shared_gate_attr is not None:
            shared = torch.sigmoid(getattr(self, self.shared_gate_attr)(x)) * shared
        return shared

    def _output(self, out: torch.Tensor, shape: torch.Size, top_w: torch.Tensor):
        if self.returns_scores:
            return out.reshape(shape), top_w
        return out.reshape(shape)

    # ``forward`` in two halves, for ``cuda_graphs segments`` (train/segment_graphs.py), which replays the first from a
    # CUDA graph: ``before_exchange`` has fixed shapes and no host sync, ``after_exchange`` holds the exchange's sync.
    # The same operators as ``forward`` on the same inputs, where ``experts.sends_whole`` (else use ``forward``).

    def before_exchange(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [T, H] -> (router probabilities, top-k weights, top-k experts, the route's four tensors, the routed rows,
        and the shared expert's output where the block has one): tensors only, a graph's outputs."""
        probs, top_w, top_i = self.top_k_router(x)
        r, routed = self.experts.send(x, top_i)
        shared = (self._shared(x),) if self.shared_expert_attr is not None else ()
        return (probs, top_w, top_i, *r, routed, *shared)

    def after_exchange(self, shape: torch.Size, parts: tuple[torch.Tensor, ...]):
        """The block's output (as ``forward`` returns it, of ``shape``) from ``before_exchange``'s outputs."""
        probs, top_w, top_i, order, token_of_copy, copy_row, counts, routed, *shared = parts
        if self.record_router:
            self.router_probs, self.router_choices = probs, top_i
        out = self.experts.receive(Route(order, token_of_copy, copy_row, counts), routed, top_w, routed.dtype)
        if shared:
            out = out + shared[0]
        return self._output(out, shape, top_w)
