"""What decides and feeds the CUDA graphs of train/cuda_graph.py, on CPU (the graphs themselves: tests/gpu/test_cuda_graphs.py)."""

import pytest
import torch

from megablocks_utils.errors import InputError
from megablocks_utils.data.packing import varlen_inputs
from megablocks_utils.train.cuda_graph import _Captured, _static_batch, graph_blocker, resolve_cuda_graphs, signature

ONE_GPU = dict(device_type="cuda", world_size=1, moe_backend="native", attention="varlen", activation_checkpointing="none",
               checkpoint_experts=False, lora=False)


def test_graphs_are_allowed_on_one_gpu_with_a_capturable_step_only():
    assert graph_blocker(**ONE_GPU) is None
    assert graph_blocker(**{**ONE_GPU, "attention": "sdpa_causal"}) is None
    blocked = {
        "device_type": ("cpu", "need a GPU"),
        "world_size": (2, "2 ranks"),
        "moe_backend": ("megablocks", "megablocks"),
        "attention": ("flex_attention", "flex_attention"),
        "dtype": (torch.float32, "per-expert loop"),
        "fsdp": (True, "--optim adamw_bf16"),
    }
    for name, (value, words) in blocked.items():
        assert words in graph_blocker(**{**ONE_GPU, name: value}), name
    # Recompute and LoRA: allowed on one GPU (tests/gpu/test_graphs_lora.py), recompute without dropout only
    for recompute in ({"activation_checkpointing": "full"}, {"activation_checkpointing": "selective"}, {"checkpoint_experts": True}):
        assert graph_blocker(**{**ONE_GPU, **recompute, "lora": True}) is None, recompute
        assert "dropout under activation checkpointing" in graph_blocker(**{**ONE_GPU, **recompute, "dropout": True})
    assert graph_blocker(**{**ONE_GPU, "lora": True, "dropout": True}) is None  # no recompute: the graph draws it


def test_graphs_on_several_gpus_need_ep_world_size_the_static_exchange_and_no_fsdp():
    ep2 = {**ONE_GPU, "world_size": 2, "ep_size": 2, "static_exchange": True, "fsdp": False}
    assert graph_blocker(**ep2) is None
    assert "ep = world size" in graph_blocker(**{**ep2, "ep_size": 1})
    assert "--ep_capacity_factor" in graph_blocker(**{**ep2, "static_exchange": False})
    assert "--fsdp_wrap none" in graph_blocker(**{**ep2, "fsdp": True})
    # Recompute and LoRA under graphs have run on one GPU only: refused above it, saying so
    assert "has run on 1 GPU so far, not yet on 2" in graph_blocker(**{**ep2, "activation_checkpointing": "full"})
    assert "LoRA under graphs has run on 1 GPU" in graph_blocker(**{**ep2, "lora": True})
    assert "moe_backend" in graph_blocker(**{**ep2, "moe_backend": "megablocks"})  # the one-GPU rules still hold


def test_dropout_is_found_in_modules_and_in_the_config(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from megablocks_utils.parallel.activation_checkpointing import trains_with_dropout

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert not trains_with_dropout(model)
    model.config.attention_dropout = 0.1
    assert trains_with_dropout(model)
    model.config.attention_dropout = 0.0
    model.config.router_jitter_noise = 0.01
    assert trains_with_dropout(model)
    model.config.router_jitter_noise = 0.0
    model.model.layers[0].extra = torch.nn.Dropout(0.0)  # p = 0 draws nothing
    assert not trains_with_dropout(model)
    model.model.layers[0].extra = torch.nn.Dropout(0.05)
    assert trains_with_dropout(model)


def test_the_setting_says_what_it_does_and_refuses_an_impossible_true():
    assert resolve_cuda_graphs("auto", None)[0] is True
    on, note = resolve_cuda_graphs("auto", "2 ranks: ...")
    assert not on and "off (2 ranks" in note
    assert resolve_cuda_graphs("false", None)[0] is False
    assert resolve_cuda_graphs(True, None)[0] is True
    with pytest.raises(InputError, match="cuda_graphs true: 2 ranks.*--cuda_graphs auto or false"):
        resolve_cuda_graphs("true", "2 ranks")
    with pytest.raises(InputError, match="choose auto, true, segments or false"):
        resolve_cuda_graphs("sometimes", None)


def test_varlen_boundaries_are_padded_with_empty_documents():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2], [0, 1, 2, 3, 4, 5, 0, 1]])
    assert varlen_inputs(positions)["cu_seq_lens_q"].tolist() == [0, 3, 5, 8, 14, 16]
    padded = varlen_inputs(positions, 4)["cu_seq_lens_q"]
    assert padded.tolist() == [0, 3, 5, 8, 14, 16, 16, 16, 16]
    assert padded.dtype == torch.int32
    assert len(varlen_inputs(positions, 5)["cu_seq_lens_q"]) == 6  # 5 documents: already a multiple


def test_one_rank_pads_varlen_documents_to_a_few_slots_several_ranks_to_a_count_they_share():
    from megablocks_utils.train.cuda_graph import document_multiple

    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 0, 0, 1, 0]])  # 5 documents
    slots = {world: len(varlen_inputs(positions, document_multiple(world))["cu_seq_lens_q"]) - 1 for world in (1, 2, 8)}
    # one rank: 8 slots (the flash kernel's grid grows with them); ranks: 64, whatever each one's count up to 64
    assert slots == {1: 8, 2: 64, 8: 64}


def test_a_graph_keeps_one_copy_of_a_shared_tensor_and_its_signature_ignores_the_batch_numbers():
    ids = torch.arange(8).view(1, 8)
    batch = {"input_ids": ids, "labels": ids + 1, "attention_sq": 64.0,
             "model_inputs": {"input_ids": ids, "position_ids": torch.arange(8).view(1, 8), "use_cache": False}}
    static, by_name = _static_batch(batch)
    assert static["input_ids"] is static["model_inputs"]["input_ids"] and static["input_ids"] is not ids
    assert torch.equal(static["labels"], batch["labels"])
    assert set(by_name) == {"batch.input_ids", "batch.labels", "model.input_ids", "model.position_ids"}
    other = {**batch, "attention_sq": 32.0}
    assert signature(other) == signature(batch)
    longer = {**batch, "labels": torch.zeros(1, 9, dtype=torch.long)}
    assert signature(longer) != signature(batch)
    assert signature({**batch, "model_inputs": {**batch["model_inputs"], "max_length_q": 8}}) != signature(batch)


def test_gradients_are_zeroed_in_place_dtensor_and_plain_alike():
    import torch.distributed as dist
    from conftest import free_port
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from megablocks_utils.train.cuda_graph import zero_grads

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        _zero_mixed_gradients(init_device_mesh("cpu", (1,)), DTensor, Shard, zero_grads)
    finally:  # gone after the test: a forked script run must not inherit it
        dist.destroy_process_group()


def _zero_mixed_gradients(mesh, DTensor, Shard, zero_grads) -> None:
    plain = torch.nn.Parameter(torch.randn(3, 4))
    sharded = torch.nn.Parameter(DTensor.from_local(torch.randn(2, 4), mesh, [Shard(0)]))
    half = torch.nn.Parameter(torch.randn(5).bfloat16())
    never = torch.nn.Parameter(torch.randn(2))
    for p in (plain, sharded, half):
        p.grad = torch.ones_like(p)
    kept = [plain.grad, sharded.grad.to_local(), half.grad]
    zero_grads([plain, sharded, half, never])
    assert never.grad is None
    for before, p in zip(kept, (plain, sharded, half)):
        local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        assert local.data_ptr() == before.data_ptr() and not local.any()


def test_router_stats_of_one_rank_make_no_collective(monkeypatch):
    """On one rank the routing statistics are already global: no all_reduce (a collective would be one more launch, and
    inside a CUDA graph one more thing to capture); the numbers are the one rank's."""
    from types import SimpleNamespace

    import torch.distributed as dist
    from conftest import free_port

    from megablocks_utils.moe.aux_loss import router_stats
    from megablocks_utils.moe.layer import ExpertParallelMoE

    block = ExpertParallelMoE(8, 4, 2, True, SimpleNamespace(ep_size=1), "silu")
    model = torch.nn.Sequential(block)
    block.router_probs = torch.full((3, 4), 0.25)
    block.router_choices = torch.tensor([[0, 1], [0, 2], [0, 3]])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        def refuse(*args, **kwargs):
            raise AssertionError("router_stats called all_reduce on a one-rank group")

        monkeypatch.setattr(dist, "all_reduce", refuse)
        stats = router_stats(model, None, dist.group.WORLD)
    finally:
        dist.destroy_process_group()
    assert stats.tokens_per_expert.tolist() == [[3.0, 1.0, 1.0, 1.0]]
    # E * sum_e f_e P_e with f = counts / rows (3) and P_e = 0.25: 4 * (6 / 3) * 0.25 = 2
    assert float(stats.value) == pytest.approx(2.0)


def test_a_replay_copies_the_new_batch_into_the_graphs_inputs_once_each():
    class Graph:  # stands in for torch.cuda.CUDAGraph: what the graph reads when replayed
        def replay(self):
            self.seen = (static["input_ids"].clone(), static["labels"].clone())

    ids = torch.arange(8).view(1, 8)
    batch = {"input_ids": ids, "labels": ids + 1, "attention_sq": 64.0, "model_inputs": {"input_ids": ids, "use_cache": False}}
    static, by_name = _static_batch(batch)
    graph = Graph()
    captured = _Captured(graph, by_name, {"ce_sum": torch.zeros(())})
    assert len(captured.inputs) == 2  # input_ids (under two names) and labels
    new_ids = torch.arange(8, 16).view(1, 8)
    numbers = captured.replay({**batch, "input_ids": new_ids, "labels": new_ids * 2, "model_inputs": {"input_ids": new_ids, "use_cache": False}})
    assert torch.equal(graph.seen[0], new_ids) and torch.equal(graph.seen[1], new_ids * 2)
    assert numbers is captured.numbers
