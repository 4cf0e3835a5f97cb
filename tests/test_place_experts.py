"""Experts placed on the ep ranks by load (megablocks_utils/tools/place_experts.py): the renumbered model computes
the same logits in transformers, its contiguous blocks carry balanced loads, and --undo gives back every tensor."""

import json
import os

import pytest
import torch
from conftest import ARCHITECTURES, tiny_moe_config

from megablocks_utils.errors import InputError
from megablocks_utils.model.architectures import spec_for
from megablocks_utils.model.loading import weight_map
from megablocks_utils.model.placement import ORDER_FILE, balanced_placement, expert_loads, place, undo
from megablocks_utils.tools.place_experts import main


def test_balanced_placement_deals_the_heaviest_first():
    assert balanced_placement([4, 3, 1, 0], 2) == [[0, 3], [1, 2]]  # 4 + 0 and 3 + 1, where blocks give 7 and 1
    assert balanced_placement([5, 5, 5, 5, 1, 1, 1, 1], 4) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    with pytest.raises(InputError, match="do not split over ep 3"):
        balanced_placement([1, 2, 3, 4], 3)


def tensors(model_dir: str) -> dict:
    from safetensors import safe_open

    out = {}
    for name, file in weight_map(model_dir).items():
        with safe_open(os.path.join(model_dir, file), framework="pt") as f:
            out[name] = f.get_tensor(name)
    return out


# DeepSeek-V3 and GLM-4.5 in one group: their score-correction buffer moves with the router's rows
CASES = [(arch, {}) for arch in ARCHITECTURES] + [(arch, dict(n_group=1, topk_group=1)) for arch in ("deepseek_v3", "glm4_moe")]


@pytest.mark.parametrize("arch,overrides", CASES, ids=[a + ("-one-group" if o else "") for a, o in CASES])
def test_a_placed_model_is_the_same_model_and_undo_restores_it(arch, overrides, tmp_path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = tiny_moe_config(arch, **overrides)
    source = str(tmp_path / "source")
    model = AutoModelForCausalLM.from_config(config)
    spec = spec_for(config)
    if spec.score_bias:  # non-zero, so that moving it matters
        for name, buf in model.named_buffers():
            if name.endswith(spec.score_bias):
                buf.copy_(0.05 * torch.randn(buf.shape, generator=torch.Generator().manual_seed(5)))
    model.save_pretrained(source)
    spec = spec_for(config)
    experts = getattr(config, spec.num_experts_attr)
    moe_layers = sum(hasattr(getattr(layer, spec.block_attr), spec.experts_attr) for layer in model.model.layers)
    loads = [[float((3 * e + layer) % experts) ** 2 for e in range(experts)] for layer in range(moe_layers)]
    placed = str(tmp_path / "placed")
    try:
        orders = place(source, placed, loads, ep=2)
    except InputError as e:  # a router over groups of consecutive experts
        assert "groups of consecutive experts" in str(e), e
        assert spec.router in ("sigmoid_group_topk", "softmax_group_topk"), arch
        return
    assert any(order != sorted(order) for order in orders.values()), orders  # something moved
    for (layer, order), load in zip(sorted(orders.items()), loads):
        blocks = [sum(load[e] for e in order[r * experts // 2:(r + 1) * experts // 2]) for r in range(2)]
        assert max(blocks) == max(sum(load[e] for e in rank) for rank in balanced_placement(load, 2)), (layer, blocks)
    with open(os.path.join(placed, ORDER_FILE)) as f:
        assert {int(k): v for k, v in json.load(f)["orders"].items()} == orders

    probe = torch.randint(1, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)(probe).logits
        after = AutoModelForCausalLM.from_pretrained(placed, dtype=torch.float32)(probe).logits
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-6)  # the k outputs may add up in another order
    assert tensors(placed).keys() == tensors(source).keys()

    back = str(tmp_path / "back")
    undo(placed, back, os.path.join(placed, ORDER_FILE))
    original, restored = tensors(source), tensors(back)
    assert restored.keys() == original.keys()
    assert all(torch.equal(restored[n], original[n]) for n in original), arch


def test_loads_come_from_a_runs_metrics_and_the_command_line_says_what_is_wrong(tmp_path, tiny_model_dir, capsys):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(json.dumps({"step": 1, "tokens_per_expert": [[1, 2], [3, 4]]}) + "\n"
                       + json.dumps({"step": 2, "eval_loss": 1.0}) + "\n"
                       + json.dumps({"step": 3, "tokens_per_expert": [[1, 0], [0, 4]]}) + "\n")
    assert expert_loads(str(metrics)) == [[2.0, 2.0], [3.0, 8.0]]
    # the tiny Mixtral has 2 layers of 8 experts: loads of 2 experts come from another model
    assert main([tiny_model_dir, str(tmp_path / "out"), "--loads", str(metrics), "--ep", "2"]) == 2
    assert "the loads have 2 MoE layers of [2] experts" in capsys.readouterr().out
    assert not os.path.exists(tmp_path / "out")
