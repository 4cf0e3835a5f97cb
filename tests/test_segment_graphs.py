"""The dense segments of train/segment_graphs.py and the overlapped average of parallel/replicated_grads.py, on CPU: the
restructured decoder layer against transformers' own, the settings' rules, and the average over 2 gloo ranks (the graphs
themselves: tests/gpu/test_graphs_ep.py)."""

import copy

import pytest
import torch
import torch.distributed as dist
from conftest import ARCHITECTURES, run_ranks, tiny_moe_config
from torch import nn

from megablocks_utils.errors import InputError
from megablocks_utils.train import segment_graphs, segment_plan
from megablocks_utils.train.segment_graphs import SegmentGraphs
from megablocks_utils.train.segment_plan import SEGMENT_LAYERS, resolve_segment_graphs, segment_blocker

EP2 = dict(device_type="cuda", world_size=2, ep_size=2, moe_backend="native", attention="varlen", activation_checkpointing="none",
           checkpoint_experts=False, lora=False, dtype=torch.bfloat16, weights=torch.bfloat16, fsdp_wrap="none")


def _model(arch: str):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_moe_config(arch), attn_implementation="eager").float()


def _loss_and_grads(model, ids):
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_the_segmented_layer_is_transformers_layer(arch):
    """Every layer the segments accept computes segment -> mlp -> residual exactly (loss and every gradient bitwise equal,
    fp32, with its eager segment: the graphs replay these very operators); the others are refused by name."""
    model = _model(arch)
    if type(model.model.layers[0]).__name__ not in SEGMENT_LAYERS:
        assert "not a decoder layer the segments" in segment_blocker(**EP2, model=model)
        return
    assert segment_blocker(**EP2, model=model) is None
    segmented = copy.deepcopy(model)
    segments = SegmentGraphs(segmented)
    ids = torch.randint(1, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    loss, grads = _loss_and_grads(model, ids)
    seg_loss, seg_grads = _loss_and_grads(segmented, ids)
    assert torch.equal(loss, seg_loss), (loss, seg_loss)
    assert grads.keys() == seg_grads.keys()
    for name in grads:
        assert torch.equal(grads[name], seg_grads[name]), name
    # the model's parameter names are untouched (a checkpoint of it loads as before), the segments hold the layers' weights
    assert [n for n, _ in segmented.named_parameters()] == [n for n, _ in model.named_parameters()]
    # transformers' MoE blocks (not swapped for the native layer here): the dense segment alone in each graph
    assert not any(segments.routed)
    assert {id(p) for p in segments.params} == {id(p) for layer in segmented.model.layers for part in
                                               ("input_layernorm", "self_attn", "post_attention_layernorm")
                                               for p in getattr(layer, part).parameters()}


def test_gradients_stay_allocated_once_graphs_exist():
    """A graphed backward returns its weight gradients in static buffers, so they must exist before and stay in place:
    prepare_grads allocates zeros; zero_grads zeroes them in place (the rest freed) once graphs exist, frees all before."""
    model = _model("mixtral")
    segments = SegmentGraphs(model)
    ids = torch.randint(1, 96, (1, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    segments.zero_grads()  # no graphs yet: as the eager steps
    assert all(p.grad is None for p in model.parameters())
    segments.prepare_grads()
    assert all(p.grad is not None and not p.grad.any() for p in segments.params)
    model(input_ids=ids, labels=ids).loss.backward()
    kept = {id(p): p.grad for p in segments.params}
    segments.graphs[("a signature",)] = []  # as after a capture
    segments.zero_grads()
    assert all(p.grad is kept[id(p)] and not p.grad.any() for p in segments.params)  # the same tensors, zeroed
    assert all(p.grad is None for p in model.parameters() if id(p) not in kept)


def test_segments_are_refused_where_they_cannot_run():
    assert segment_blocker(**EP2) is None
    assert segment_blocker(**{**EP2, "fsdp_wrap": "auto", "attention": None}) is None  # auto is resolved to none for them
    blocked = {
        "device_type": ("cpu", "need a GPU"),
        "world_size": (1, "one GPU"),
        "ep_size": (1, "ep = world size"),
        "fsdp_wrap": ("model", "--fsdp_wrap none"),
        "dtype": (torch.float32, "bf16 only"),
        "weights": (torch.float32, "--optim adamw_bf16"),
        "moe_backend": ("megablocks", "native"),
        "attention": ("flex_attention", "flex_attention"),
        "activation_checkpointing": ("full", "checkpointing"),
        "checkpoint_experts": (True, "checkpointing"),
        "lora": (True, "LoRA"),
    }
    for name, (value, words) in blocked.items():
        assert words in segment_blocker(**{**EP2, "world_size": 2, name: value} if name != "world_size"
                                        else {**EP2, "world_size": 1, "ep_size": 1}), name


def test_the_setting_segments_is_on_or_refused_and_auto_follows_the_switch(monkeypatch):
    on, note = resolve_segment_graphs("segments", None)
    assert on and "MoE block launched from Python" in note
    with pytest.raises(InputError, match="cuda_graphs segments: CUDA graphs need a GPU.*--cuda_graphs auto or false"):
        resolve_segment_graphs("segments", "CUDA graphs need a GPU")
    assert resolve_segment_graphs("false", None) == (False, "")
    assert resolve_segment_graphs("true", None) == (False, "")  # whole micro-steps: cuda_graph.py
    monkeypatch.setattr(segment_plan, "SEGMENTS_IN_AUTO", True)
    assert resolve_segment_graphs("auto", None)[0] is True
    assert resolve_segment_graphs("auto", "one GPU: ...") == (False, "")
    assert resolve_segment_graphs("auto", None, single_node=False) == (False, "")  # measured on one node only
    assert resolve_segment_graphs("segments", None, single_node=False)[0] is True  # as asked
    monkeypatch.setattr(segment_plan, "SEGMENTS_IN_AUTO", False)
    assert resolve_segment_graphs("auto", None) == (False, "")


def _check_overlapped_average(rank, world):
    from megablocks_utils.parallel.replicated_grads import ReplicatedGradSync

    torch.manual_seed(0)  # the same weights on both ranks
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    sync = ReplicatedGradSync(model.parameters(), dist.group.WORLD, bucket_elements=60)  # several buckets
    assert len(sync.buckets) >= 3
    inputs = [torch.randn(5, 6, generator=torch.Generator().manual_seed(10 * rank + i)) for i in range(2)]
    for i, x in enumerate(inputs):
        sync.arm(i == len(inputs) - 1)
        model(x).square().sum().backward()
        if i == 0:
            assert sync.launched == []  # a first micro-step's gradients are not reduced
    assert len(sync.launched) == len(sync.buckets)  # every bucket launched by the hooks, during the backward
    local = [p.grad.clone() for p in model.parameters()]
    sync.finish()
    for p, mine in zip(model.parameters(), local):
        gathered = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(gathered, mine)
        expected = torch.stack(gathered).sum(0) / world
        assert torch.allclose(p.grad, expected, rtol=1e-6, atol=1e-7), (rank, (p.grad - expected).abs().max())
    assert sync.launched == [] and not sync.armed  # ready for the next step


def test_replicated_gradients_are_averaged_by_the_last_backward():
    run_ranks(_check_overlapped_average, 2)


def test_live_segments_capture_once_per_signature_and_replay_the_layer(monkeypatch):
    """The graphed path's logic on CPU, with make_graphed_callables replaced by a stand-in that returns the segment modules
    themselves (the callables it would capture): the first live micro-step captures every layer's segment once, with
    samples shaped as the call's arguments; the segments, called with the arguments rebuilt from their tensors, give
    transformers' loss and gradients bit for bit; a micro-step of the same shape captures nothing, a new shape captures
    again, past MAX_SIGNATURES shapes micro-steps run eagerly with one note; no gradients, or eval mode, never capture."""
    captured = []

    def stand_in(callables, samples):
        captured.append([tuple(t.shape) for t in samples[0]])
        assert len(callables) == len(samples)
        assert all(s[0].requires_grad for s in samples)  # h; the rest (cos, sin, position ids) as given
        return callables

    monkeypatch.setattr(torch.cuda, "make_graphed_callables", stand_in)
    monkeypatch.setattr(segment_graphs, "MAX_SIGNATURES", 2)
    model = _model("qwen3_moe")
    reference = copy.deepcopy(model)
    notes = []
    segments = SegmentGraphs(model, announce=notes.append)
    segments.live = True
    ids = torch.randint(1, 96, (2, 12), generator=torch.Generator().manual_seed(1))

    def step(m, rows):  # as the scripts' batches call the model: no cache (data.batches.collate)
        out = m(input_ids=rows, labels=rows, use_cache=False)
        out.loss.backward()
        return out.loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}

    loss, grads = step(reference, ids)
    seg_loss, seg_grads = step(model, ids)
    assert len(captured) == 1 and captured[0][0] == (2, 12, 64), captured  # h: rows, tokens, hidden
    # the line tests/gpu/test_graphs_ep.py reads (transformers' MoE blocks here: no routing in the graphs)
    assert notes[0].startswith("cuda_graphs segments: 2 layers' dense segments captured in "), notes
    assert torch.equal(loss, seg_loss)
    for name in grads:
        assert torch.equal(grads[name], seg_grads[name]), name
    step(model, ids)
    assert len(captured) == 1  # the same signature: replayed
    for length in (10, 8, 6):
        step(model, ids[:, :length])
    assert len(captured) == 2 and len(notes) == 3, (captured, notes)  # 12 and 10 captured, then the cap
    assert "more than 2 input shapes" in notes[-1]
    monkeypatch.setattr(segment_graphs, "MAX_SIGNATURES", 9)
    with torch.no_grad():
        model(input_ids=ids[:, :4], use_cache=False)
    model.eval()
    step(model, ids[:, :5])
    assert len(captured) == 2
    # A cache (transformers' default outside the scripts) cannot be part of a signature: eager, no capture
    model.train()
    model(input_ids=ids[:, :7], labels=ids[:, :7]).loss.backward()
    assert len(captured) == 2


def _sharded_pair(arch: str, rank: int = 0, world: int = 1):
    """The tiny model of ``arch`` twice, both with the native MoE layer at ep = ``world`` (call inside a process group)."""
    from megablocks_utils import shard_moe

    model = _model(arch)
    segmented = copy.deepcopy(model)
    for m in (model, segmented):
        shard_moe(m, world, device="cpu")
    return model, segmented


def _loss_aux_and_grads(model, ids):
    """The scripts' loss with the load-balancing term (the MoE blocks' recorded routing), and every gradient."""
    from megablocks_utils.moe.aux_loss import router_stats

    out = model(input_ids=ids, labels=ids, use_cache=False)
    loss = out.loss + 0.01 * router_stats(model, None, None).local
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _check_routed_segments(rank, world, archs):
    """On ``world`` gloo ranks at ep = world: each layer's graphed segment ends after its MoE block's dispatch (router,
    route, dispatch and shared expert in the graph, the exchange and combine eager), and the loss with the
    load-balancing term and every gradient equal the eager model's bit for bit (fp32)."""
    for arch in archs:
        captured = []

        def stand_in(callables, samples):
            captured.append(callables)
            return callables

        torch.cuda.make_graphed_callables = stand_in  # a spawned rank's own modules, or the test's (it restores them)
        segment_graphs.ROUTE_IN_GRAPH = True
        model, segmented = _sharded_pair(arch, rank, world)
        notes = []
        segments = SegmentGraphs(segmented, announce=notes.append)
        segments.live = True
        ids = torch.randint(1, 96, (2, 12), generator=torch.Generator().manual_seed(7 + rank))
        loss, grads = _loss_aux_and_grads(model, ids)
        seg_loss, seg_grads = _loss_aux_and_grads(segmented, ids)
        routed = [s for s in captured[0] if s.block is not None]
        assert f"({len(routed)} with their MoE block's routing and dispatch) captured" in notes[0], notes
        moe_layers = [layer for layer in segmented.model.layers if hasattr(layer.mlp, "before_exchange")]
        assert len(routed) == len(moe_layers) > 0, (arch, len(routed), len(moe_layers))
        assert torch.equal(loss, seg_loss), (arch, loss, seg_loss)
        assert grads.keys() == seg_grads.keys(), arch
        for name in grads:
            assert torch.equal(grads[name], seg_grads[name]), (arch, name)
        # The graphs' weights: the dense parts, the routers and shared experts; never the routed experts' weights
        graph_weights = {id(p) for p in segments.params}
        routers = [layer.mlp.top_k_router.weight for layer in moe_layers]
        experts = [p for layer in moe_layers for p in layer.mlp.experts.parameters()]
        assert all(id(p) in graph_weights for p in routers) and not any(id(p) in graph_weights for p in experts), arch


# The tiny architectures whose layers the segments take (the others: Granite's, refused by the first test above).
SEGMENT_ARCHITECTURES = [a for a in ARCHITECTURES if not a.startswith("granitemoe")]


@pytest.mark.parametrize("arch", SEGMENT_ARCHITECTURES)
def test_routed_segments_match_the_eager_layer(arch, monkeypatch):
    import torch.distributed as dist
    from conftest import free_port

    monkeypatch.setattr(torch.cuda, "make_graphed_callables", torch.cuda.make_graphed_callables)  # restored after
    monkeypatch.setattr(segment_graphs, "ROUTE_IN_GRAPH", segment_graphs.ROUTE_IN_GRAPH)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        _check_routed_segments(0, 1, [arch])
    finally:
        dist.destroy_process_group()


def test_routed_segments_match_the_eager_layer_at_ep2():
    run_ranks(_check_routed_segments, 2, ["qwen3_moe", "deepseek_v2"])


def test_routing_stays_out_of_the_graphs_unless_switched_on():
    """``ROUTE_IN_GRAPH`` off (the default): the native MoE blocks stay out of the segments' graphs."""
    import torch.distributed as dist
    from conftest import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        _, segmented = _sharded_pair("qwen3_moe")
    finally:
        dist.destroy_process_group()
    assert not segment_graphs.ROUTE_IN_GRAPH
    assert not any(SegmentGraphs(segmented).routed)
