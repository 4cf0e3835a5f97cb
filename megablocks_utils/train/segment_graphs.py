"""At ep > 1, the dense segment of each decoder layer replayed from CUDA graphs, the MoE block between two segments
launched from Python as before (``cuda_graphs segments``).

Why: at ep > 1 the forward is paced by the host. Each MoE layer reads its routed counts (the one sync that sizes the
all-to-all), so the host cannot run ahead, and the GPU waits while the host launches the layer's next kernels: ~5 ms
of launches per layer at Qwen3-30B-A3B's shape on 4 x H200 against ~2.3 ms of GPU work (bench/reports/
ep_levers_h200_2026-11-27e.md). Whole micro-steps cannot be graphs there (the exact exchange's splits are host numbers;
the static exchange that would allow it overflowed or padded too much). The part of each layer before its MoE block (input norm,
attention, residual, post-attention norm) has fixed shapes and no sync: one graph each way, through
``torch.cuda.make_graphed_callables`` (forward and backward graphs as one autograd node). So has the native MoE
block's part before its exchange (router, route, dispatch, shared expert: ``ExpertParallelMoE.before_exchange``), which
can join the graph where the block sends all tokens at once (``routes_in_graph``; off: ``ROUTE_IN_GRAPH``); the
exchange, the experts and the combine then stay eager (``after_exchange``). Measured by a probe (bench/reports/probes_retired_2026-12-02.md),
a micro-step of the 12-layer stack at ep 4: 118 ms against 163 ms eager (4 x H200, dense segments); 140 ms dense
segments, 126 ms with the routing, 166 ms eager (4 x H100).

How: each decoder layer's ``forward`` (on the instance, as make_graphed_callables itself replaces a module's forward)
becomes ``segment -> mlp -> residual``, which the layers of ``segment_plan.SEGMENT_LAYERS`` (Mixtral, Qwen2/3-MoE, DeepSeek-V2/V3,
gpt-oss, OLMoE, GLM-4-MoE) compute exactly. The segment runs eagerly (the same operators in the same order as
transformers' layer) until the script says the warm-up steps are done (``live``); then the first micro-step of each
new input signature (shapes, dtypes, the attention's other arguments) captures all layers' segments, and later
micro-steps of that signature replay them. Packed rows' document boundaries come padded to a multiple of
``cuda_graph.DOCUMENT_MULTIPLE`` (the script's collate), so real records have one signature or a few, not one each.

What the graphs need, and where it is ensured:
- weights at fixed addresses: ``fsdp_wrap`` "none" (no FSDP: dense weights whole on every rank, their gradients
  averaged during the last backward, ``parallel/replicated_grads.py``); the optimizer updates them in place;
- gradients that exist before the first graphed backward and stay in place: a graphed backward returns its weight
  gradients in static buffers, which autograd would take over as ``.grad`` were none there (and the next replay would
  overwrite a step's sum); ``prepare_grads`` allocates them and ``zero_grads`` zeroes them in place;
- a segment's outputs are static buffers too, rewritten at its next replay: every micro-step's backward finishes before
  the next forward (gradient accumulation), and evaluation (no gradients) runs the eager segment;
- capturable attention (``cuda_graph.CAPTURABLE_ATTENTION``: no mask built on the host), no activation checkpointing
  (a recomputed segment would replay over the outputs its backward still needs), no LoRA (not yet run under graphs).
"""

import time

import torch
from torch import nn

from megablocks_utils.model.architectures import decoder_layers
from megablocks_utils.moe.layer import ExpertParallelExperts, ExpertParallelMoE
from megablocks_utils.train.cuda_graph import zero_grads

# Whether a layer's graph reaches to its MoE block's exchange where it can (``routes_in_graph``). Off: on 4 x H200 (ep 4,
# Qwen3-30B-A3B's shape, 12 layers, synthetic rows; 2026-11-28) training took 0.611 s a step with it against 0.614 without
# (median of 8; with it, the last three steps 0.69-0.89 s) and 2.5 GiB more at its peak (each layer's routed rows and
# router outputs held as static buffers, which the fit check does not count), though the retired segment-graphs probe's
# micro-step was 126 ms against 140 ms on 4 x H100. Verified on GPUs either way (tests/gpu/test_graphs_ep.py at ep 2).
ROUTE_IN_GRAPH = False
# Signatures with graphs of their own (each holds every layer's segment activations); a micro-step of one more runs eagerly.
MAX_SIGNATURES = 4


def routes_in_graph(layer: nn.Module) -> bool:
    """Whether the layer's MoE block has its part before the exchange in the segment's graph: ``ROUTE_IN_GRAPH`` and the
    native block (``ExpertParallelMoE`` with the native experts) sending all tokens at once (``sends_whole``)."""
    mlp = getattr(layer, "mlp", None)
    return (ROUTE_IN_GRAPH and isinstance(mlp, ExpertParallelMoE) and type(mlp.experts) is ExpertParallelExperts
            and mlp.experts.sends_whole)


class _Segment(nn.Module):
    """One layer's part before its MoE block: ``h -> (h + attention(norm(h)), post_norm(h + ...))``, and with
    ``routed`` the block's part before its exchange on that (``ExpertParallelMoE.before_exchange``: router, route,
    dispatch, shared expert). The modules used are its children (their parameters are the graph's weights; the
    experts are not among them: their weights are used after the exchange, eagerly); it is not part of the model's
    tree, so the model's parameter names do not change. ``args``: how the attention's arguments are rebuilt from the
    tensors given after ``h`` and the ``fixed`` rest (``_Arguments``)."""

    def __init__(self, layer: nn.Module, args: "_Arguments", routed: bool):
        super().__init__()
        self.input_layernorm = layer.input_layernorm
        self.self_attn = layer.self_attn
        self.post_attention_layernorm = layer.post_attention_layernorm
        self.args = args
        self.block = (layer.mlp,) if routed else None  # in a tuple: not a child
        if routed:
            self.router = layer.mlp.top_k_router
            for attr in (layer.mlp.shared_expert_attr, layer.mlp.shared_gate_attr):
                if attr is not None:
                    self.add_module(attr, getattr(layer.mlp, attr))

    def forward(self, h: torch.Tensor, *tensors: torch.Tensor):
        h, normed = _dense_segment(self, h, self.args.rebuild(tensors))
        if self.block is None:
            return h, normed
        return (h, *self.block[0].before_exchange(normed.reshape(-1, normed.shape[-1])))


def _dense_segment(layer: nn.Module, h: torch.Tensor, kwargs: dict):
    """transformers' decoder layer up to its MLP, operator for operator: (the residual stream, the MLP's input)."""
    attended = layer.self_attn(hidden_states=layer.input_layernorm(h), **kwargs)[0]
    h = h + attended
    return h, layer.post_attention_layernorm(h)


class _Arguments:
    """A layer call's keyword arguments (position embeddings, the attention's inputs) as a graph sees them: the tensors
    (a tuple of tensors, such as (cos, sin), counts as its tensors) in a fixed order, and the rest, which must be the
    same at every replay. ``key``: what a graph is captured for; None where an argument cannot be part of one (an
    object that is neither a tensor, a tuple of them, a number, a string nor None, such as a cache)."""

    def __init__(self, kwargs: dict):
        self.slots: list[tuple[str, int | None]] = []  # (name, index in its tuple or None)
        self.fixed, self.key = {}, None
        for name in sorted(kwargs):
            value = kwargs[name]
            if isinstance(value, torch.Tensor):
                self.slots.append((name, None))
            elif isinstance(value, tuple) and value and all(isinstance(v, torch.Tensor) for v in value):
                self.slots += [(name, i) for i in range(len(value))]
            elif value is None or isinstance(value, (bool, int, float, str)):
                self.fixed[name] = value
            else:
                return
        tensors = self.tensors(kwargs)
        self.key = (tuple(self.slots), tuple((tuple(t.shape), t.dtype, t.requires_grad) for t in tensors),
                    tuple(self.fixed.items()))

    def tensors(self, kwargs: dict) -> list[torch.Tensor]:
        return [kwargs[name] if i is None else kwargs[name][i] for name, i in self.slots]

    def rebuild(self, tensors) -> dict:
        kwargs, tuples = dict(self.fixed), {}
        for (name, i), t in zip(self.slots, tensors):
            if i is None:
                kwargs[name] = t
            else:
                tuples.setdefault(name, []).append(t)
        kwargs.update({name: tuple(parts) for name, parts in tuples.items()})
        return kwargs


class SegmentGraphs:
    """Each decoder layer's dense segment through CUDA graphs once ``live`` (see the module's docstring).

    The script sets ``live`` after its warm-up steps, calls ``zero_grads`` after each optimizer step (instead of
    setting gradients to None). The graphs live as long as the model (its GPU runs exported with them alive).
    ``announce`` (rank 0's print) hears each capture."""

    def __init__(self, model: nn.Module, announce=None):
        self.model, self.announce = model, announce
        self.layers = list(decoder_layers(model))
        self.live = False
        self.graphs: dict[tuple, list] = {}  # signature -> each layer's graphed segment
        self.too_many = False
        # Which layers' graphs reach to their MoE block's exchange, decided once (the blocks' settings are made before).
        self.routed = [routes_in_graph(layer) for layer in self.layers]
        # The graphs' weights: every segment's parameters, once each (dict keys: one per parameter, in order).
        self.params = list({id(p): p for layer, routed in zip(self.layers, self.routed)
                            for p in _Segment(layer, None, routed).parameters() if p.requires_grad}.values())
        for i, layer in enumerate(self.layers):
            # An instance attribute: the layer's class and every other model are untouched.
            layer.forward = self._layer_forward(layer, i)

    def _layer_forward(self, layer: nn.Module, index: int):
        def forward(hidden_states: torch.Tensor, **kwargs) -> torch.Tensor:
            outputs = self._replay(index, hidden_states, kwargs)
            if outputs is None:  # eager: transformers' order of operators
                h, normed = _dense_segment(layer, hidden_states, kwargs)
                out = layer.mlp(normed)
            elif len(outputs) == 2:  # the dense segment replayed
                h, normed = outputs
                out = layer.mlp(normed)
            else:  # the segment and the MoE block up to its exchange replayed
                h = outputs[0]
                out = layer.mlp.after_exchange(h.shape, outputs[1:])
            if isinstance(out, tuple):  # gpt-oss's MoE block returns (hidden states, router scores)
                out = out[0]
            return h + out

        return forward

    def _replay(self, index: int, h: torch.Tensor, kwargs: dict) -> tuple | None:
        """The layer's graphed segment run on this call's tensors (its outputs), or None where it runs eagerly."""
        if self.live and self.layers[index].training and torch.is_grad_enabled():
            args = _Arguments(kwargs)
            if args.key is not None:
                key = (tuple(h.shape), h.dtype, h.requires_grad, args.key)
                graphed = self.graphs.get(key)
                if graphed is None and index == 0:
                    graphed = self._capture(key, h, args, kwargs)
                if graphed is not None:
                    return graphed[index](h, *args.tensors(kwargs))
        return None

    def _capture(self, key: tuple, h: torch.Tensor, args: _Arguments, kwargs: dict) -> list | None:
        """Every layer's segment captured for this signature (at the first layer of its first live micro-step), with
        this call's tensors as samples; None past ``MAX_SIGNATURES``."""
        if len(self.graphs) >= MAX_SIGNATURES:
            if not self.too_many and self.announce:
                self.announce(f"cuda_graphs segments: more than {MAX_SIGNATURES} input shapes; micro-steps of a new one run eagerly")
            self.too_many = True
            return None
        start = time.perf_counter()
        self.prepare_grads()
        segments = tuple(_Segment(layer, args, routed) for layer, routed in zip(self.layers, self.routed))
        samples = tuple((h.detach().clone().requires_grad_(h.requires_grad), *(t.detach().clone() for t in args.tensors(kwargs)))
                        for _ in segments)
        self.graphs[key] = list(torch.cuda.make_graphed_callables(segments, samples))
        if self.announce:
            routed = sum(segment.block is not None for segment in segments)
            routing = f" ({routed} with their MoE block's routing and dispatch)" if routed else ""
            self.announce(f"cuda_graphs segments: {len(segments)} layers' dense segments{routing} captured in "
                          f"{time.perf_counter() - start:.1f} s (input {tuple(h.shape)})")
        return self.graphs[key]

    def prepare_grads(self) -> None:
        """Every segment weight's gradient allocated (zero) where it is None, before a graphed backward adds into it."""
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)

    def zero_grads(self) -> None:
        """After the optimizer step: the segments' gradients zeroed in place once graphs exist (they add into them),
        every other gradient freed as the eager steps do."""
        kept = {id(p) for p in self.params} if self.graphs else set()
        for p in self.model.parameters():
            if id(p) not in kept:
                p.grad = None
        if kept:
            zero_grads(self.params)
