"""Each rank loads exactly its own experts from sharded safetensors, in hub and fused layouts."""

import json
import os
import re
from unittest import mock

import pytest
import torch
from conftest import ARCHITECTURES, run_rank_cases, run_ranks, tiny_mixtral_config, tiny_moe_config

from megablocks_utils import load_model, spec_for
from megablocks_utils.errors import InputError
from megablocks_utils.model.export import hub_state_dict, write_shards
from megablocks_utils.model.loading import Checkpoint, check_model_dir
from megablocks_utils.mesh import check_ep_size

EXPERT_NAME = re.compile(r"layers\.(\d+)\..*experts\.(\d+)\.\w+\.weight$")


def write_checkpoint(path: str, layout: str) -> None:
    from transformers import MixtralForCausalLM

    torch.manual_seed(3)
    model = MixtralForCausalLM(tiny_mixtral_config())
    # transformers' own state dict is the fused layout (its save_pretrained converts back to hub names)
    tensors = model.state_dict() if layout == "fused" else hub_state_dict(model)
    names = sorted(tensors)
    os.makedirs(path)
    write_shards(path, [{n: tensors[n] for n in names[i::3]} for i in range(3)])
    model.config.save_pretrained(path)


def check_local_experts(rank, world, ep_size, path, layout):
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    reads = []
    get, get_rows = Checkpoint.get, Checkpoint.get_rows

    def spy_get(self, name):
        reads.append((name, None))
        return get(self, name)

    def spy_get_rows(self, name, start, stop):
        reads.append((name, (start, stop)))
        return get_rows(self, name, start, stop)

    with mock.patch.object(Checkpoint, "get", spy_get), mock.patch.object(Checkpoint, "get_rows", spy_get_rows):
        model, mesh = load_model(path, ep_size, device="cpu")
    spec = spec_for(model.config)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    local = getattr(model.config, spec.num_experts_attr) // ep_size
    # The layout mesh.py documents (ep innermost), not mesh.ep_rank: at dp > 1 the global rank and the
    # ep rank differ, and a loader that used the global rank must fail here.
    ep_rank = rank % ep_size
    assert (mesh.ep_size, mesh.dp_size, mesh.ep_rank) == (ep_size, world // ep_size, ep_rank)
    mine = range(ep_rank * local, (ep_rank + 1) * local)

    expert_reads = [(n, rows) for n, rows in reads if spec.is_expert_name(n)]
    assert expert_reads, "no expert tensor was read"
    everyone = [None] * world
    dist.all_gather_object(everyone, sorted(expert_reads, key=str))
    for other, their_reads in enumerate(everyone):  # dp replicas read the same set; other ep ranks other experts
        if other % ep_size == ep_rank:
            assert their_reads == everyone[rank], f"ranks {rank} and {other} (both ep rank {ep_rank}) read different experts"
        else:
            assert not set(their_reads) & set(everyone[rank]), f"ranks {rank} and {other} read the same expert tensors"
    stacked = layout == "fused" or spec.hub_stacked is not None  # one tensor per layer: read as row slices
    for name, rows in expert_reads:
        if stacked:
            assert rows == (mine.start, mine.stop), f"rank {rank} read rows {rows} of {name}"
        else:
            assert rows is None and int(EXPERT_NAME.search(name).group(2)) in mine, f"rank {rank} read {name}"
    stacked_per_layer = 4 if spec.expert_bias else 2  # gate_up, down (and their biases: gpt-oss)
    per_expert = stacked_per_layer / local if stacked else 3  # gate, up, down each; or stacked slices per layer
    assert len(expert_reads) == 2 * local * per_expert  # 2 MoE layers; every local tensor read exactly once

    moe_layers = 0
    for i, layer in enumerate(model.model.layers):
        ref = getattr(reference.model.layers[i], spec.block_attr)
        if not hasattr(ref, spec.experts_attr):  # a dense layer (Qwen2-MoE's mlp_only_layers)
            continue
        moe_layers += 1
        got = getattr(layer, spec.block_attr)
        assert got.experts.gate_up_proj.to_local().shape[0] == local
        for name in ("gate_up_proj", "down_proj") + (("gate_up_proj_bias", "down_proj_bias") if spec.expert_bias else ()):
            expected = getattr(ref.experts, name)[mine.start : mine.stop]
            torch.testing.assert_close(getattr(got.experts, name).to_local(), expected, rtol=0, atol=0)
        torch.testing.assert_close(got.top_k_router.weight, getattr(ref, spec.router_attr).weight, rtol=0, atol=0)
        if spec.score_bias is not None:
            torch.testing.assert_close(got.top_k_router.score_bias, getattr(getattr(ref, spec.router_attr), spec.score_bias), rtol=0, atol=0)
        if spec.router_bias:
            torch.testing.assert_close(got.top_k_router.bias, getattr(ref, spec.router_attr).bias, rtol=0, atol=0)
    assert moe_layers == 2
    ids = torch.randint(1, 96, (2, 10), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=1e-5, atol=1e-6)


def check_every_architecture_loads(rank, world, paths):
    for arch, path in paths.items():
        try:
            check_local_experts(rank, world, world, path, "hub")
            # In bf16 (adamw_bf16, LoRA's frozen weights) every parameter is bf16: transformers 5.24 keeps DeepSeek-V2's
            # router weights in fp32, which adamw_bf16 refused.
            model, _ = load_model(path, world, device="cpu", dtype=torch.bfloat16)
            other = {n: p.dtype for n, p in model.named_parameters() if p.dtype != torch.bfloat16}
            assert not other, f"parameters not in bf16: {other}"
        except AssertionError as e:
            raise AssertionError(f"{arch}: {e}") from e


def test_weights_transformers_keeps_in_fp32_take_the_asked_dtype():
    """``one_dtype``: a weight left in fp32 (as transformers keeps a router with ``_keep_in_fp32_modules_strict``) takes
    the model's dtype and is named; buffers (rotary frequencies) keep theirs."""
    from transformers import AutoModelForCausalLM

    from megablocks_utils.model.build import one_dtype

    model = AutoModelForCausalLM.from_config(tiny_moe_config("deepseek_v2"), dtype=torch.bfloat16)
    router = model.model.layers[1].mlp.gate
    router.weight.data = router.weight.data.float()
    buffers = {n: b.dtype for n, b in model.named_buffers()}
    cast = one_dtype(model, torch.bfloat16)  # from transformers 5.24 also layer 2's router, kept in fp32 by transformers
    assert "model.layers.1.mlp.gate.weight" in cast and all(name.endswith("mlp.gate.weight") for name in cast), cast
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert router.weight.requires_grad and {n: b.dtype for n, b in model.named_buffers()} == buffers


def write_every_architecture(folder: str) -> dict:
    """Each architecture's tiny model saved by transformers' own save_pretrained (the hub layout) under ``folder``: per
    architecture its path, the names it saved, our exporter's names for it and its files."""
    from transformers import AutoModelForCausalLM

    from megablocks_utils.model.export import hub_state_dict

    written = {}
    for arch in ARCHITECTURES:
        torch.manual_seed(3)
        model = AutoModelForCausalLM.from_config(tiny_moe_config(arch))
        for name, buf in model.named_buffers():  # a trained selection bias (DeepSeek-V3), not the zeros of init
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0, 0.05)
        with torch.no_grad():  # zero-initialised weights (gpt-oss's expert biases) random, so a misplaced one shows
            for p in model.parameters():
                if not p.any():
                    p.normal_(std=0.02)
        path = os.path.join(folder, arch)
        model.save_pretrained(path, max_shard_size="100KB")
        saved = json.load(open(os.path.join(path, "model.safetensors.index.json")))["weight_map"]
        written[arch] = {"path": path, "saved": sorted(saved), "ours": sorted(hub_state_dict(model)), "files": len(set(saved.values())),
                         "experts": getattr(model.config, spec_for(model.config).num_experts_attr)}
    return written


# The 2-rank loads of this file on one start of the ranks (spawns are the cost), keyed as the tests' ids.
TWO_RANK_LAYOUTS = {"hub-dp1-ep2": ("hub", 2), "fused-dp1-ep2": ("fused", 2), "fused-dp2-ep1": ("fused", 1)}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    """The test checkpoints: tiny Mixtral in each layout, and every architecture in the hub layout."""
    folder = tmp_path_factory.mktemp("checkpoints")
    paths = {layout: str(folder / layout) for layout in ("hub", "fused")}
    for layout, path in paths.items():
        write_checkpoint(path, layout)
    return {**paths, "architectures": write_every_architecture(str(folder / "architectures"))}


@pytest.fixture(scope="module")
def two_rank_loads(checkpoints, tmp_path_factory) -> dict:
    cases = {"every_architecture": (check_every_architecture_loads, {a: w["path"] for a, w in checkpoints["architectures"].items()})}
    cases |= {name: (check_local_experts, ep, checkpoints[layout], layout) for name, (layout, ep) in TWO_RANK_LAYOUTS.items()}
    return run_rank_cases(2, cases, str(tmp_path_factory.mktemp("two_rank_loads")))


def test_every_architecture_loads_from_hub_layout(checkpoints, two_rank_loads):
    """transformers' own save_pretrained writes the hub layout; our exporter's names must be the same."""
    for arch, written in checkpoints["architectures"].items():
        assert written["files"] >= 2, f"{arch}: the test checkpoint must span several files"
        assert written["saved"] == written["ours"], f"{arch}: hub names differ from transformers'"
        assert check_model_dir(written["path"])[0] == written["experts"], arch
    assert two_rank_loads["every_architecture"] is None, two_rank_loads["every_architecture"]


@pytest.mark.parametrize("layout,world,ep", [
    ("hub", 2, 2),
    ("fused", 2, 2),
    ("fused", 2, 1),
    pytest.param("hub", 4, 2, marks=pytest.mark.slow),
], ids=["hub-dp1-ep2", "fused-dp1-ep2", "fused-dp2-ep1", "hub-dp2-ep2"])
def test_each_rank_reads_only_its_experts(request, checkpoints, layout, world, ep):
    """Rank r reads its ep rank's experts (rank % ep), and only those; its dp replicas read the same."""
    path = checkpoints[layout]
    files = set(json.load(open(os.path.join(path, "model.safetensors.index.json")))["weight_map"].values())
    assert len(files) >= 2, "the test checkpoint must span several files"
    if layout == "hub":
        index = json.load(open(os.path.join(path, "model.safetensors.index.json")))["weight_map"]
        w1 = index["model.layers.0.block_sparse_moe.experts.1.w1.weight"]
        w3 = index["model.layers.0.block_sparse_moe.experts.1.w3.weight"]
        assert w1 != w3, "one expert's w1 and w3 should sit in different files"
    assert check_model_dir(path) == (4, "num_local_experts")
    if world == 2:
        outcome = request.getfixturevalue("two_rank_loads")[request.node.callspec.id]
        assert outcome is None, outcome
    else:
        run_ranks(check_local_experts, world, ep, path, layout)


def test_ep1_loads_all_experts(checkpoints):
    run_ranks(check_local_experts, 1, 1, checkpoints["hub"], "hub")


def test_ep_size_errors_name_the_valid_choices():
    with pytest.raises(ValueError, match=r"num_local_experts=8 is not divisible by ep_size=3; choose ep_size in \[1, 2\]"):
        check_ep_size(3, 6, 8)
    with pytest.raises(ValueError, match=r"world_size=2 is not divisible by ep_size=4; choose ep_size in \[1, 2\]"):
        check_ep_size(4, 2, 8)


def test_missing_index_or_shard_is_a_clear_error(tmp_path):
    with pytest.raises(InputError, match="no model.safetensors.index.json or model.safetensors"):
        Checkpoint(str(tmp_path))
    path = str(tmp_path / "hub")
    write_checkpoint(path, "hub")
    os.remove(os.path.join(path, "model-00002-of-00003.safetensors"))
    with pytest.raises(InputError, match=r"names shard file\(s\) that are not in .*: \['model-00002-of-00003.safetensors'\]"):
        Checkpoint(path)


def test_index_disagreeing_with_shards_or_lacking_experts_is_a_clear_error(tmp_path):
    path = str(tmp_path / "hub")
    write_checkpoint(path, "hub")
    index_path = os.path.join(path, "model.safetensors.index.json")
    index = json.load(open(index_path))
    expert = "model.layers.1.block_sparse_moe.experts.3.w2.weight"
    wrong = {**index["weight_map"], "model.norm.extra": "model-00001-of-00003.safetensors"}
    json.dump({**index, "weight_map": wrong}, open(index_path, "w"))
    with pytest.raises(InputError, match=r"places 1 tensor\(s\) in model-00001-of-00003.safetensors that it does not hold"):
        check_model_dir(path)
    lacking = {n: f for n, f in index["weight_map"].items() if n != expert}
    json.dump({**index, "weight_map": lacking}, open(index_path, "w"))
    with pytest.raises(InputError, match=rf"lacks 1 expert tensor\(s\), e.g. \['{re.escape(expert)}'\]"):
        check_model_dir(path)


def check_no_moe_blocks(rank, world):
    from transformers import MixtralForCausalLM

    from megablocks_utils import shard_moe

    model = MixtralForCausalLM(tiny_mixtral_config())
    for layer in model.model.layers:
        layer.mlp = torch.nn.Identity()
    with pytest.raises(ValueError, match="has no MoE blocks"):
        shard_moe(model, 1, device="cpu")


def test_model_without_moe_blocks_is_a_clear_error():
    run_ranks(check_no_moe_blocks, 1)


def test_unsupported_architecture_lists_supported():
    from transformers import LlamaConfig

    from megablocks_utils import spec_for

    with pytest.raises(ValueError, match=r"model_type='llama' is not a supported MoE architecture; supported: \['deepseek_v2', 'deepseek_v3', 'glm4_moe', 'gpt_oss', 'granitemoe', .*'mixtral', 'olmoe', 'qwen2_moe', 'qwen3_moe'\]"):
        spec_for(LlamaConfig())
