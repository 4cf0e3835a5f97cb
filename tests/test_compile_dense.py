"""compile_dense_parts picks each decoder layer's attention, norms and dense MLPs (a shared expert, a dense layer's MLP:
what train_fsdp2.py compiles on GPUs) and nothing of the router or the routed experts. The GPU check of the compiled
model is tests/gpu/test_train_parity.py (compiled vs eager training runs)."""

import torch
import torch.nn as nn
from transformers import MixtralConfig, MixtralForCausalLM

from megablocks_utils import compile_dense_parts


def test_compiles_attention_and_norms_of_every_layer(monkeypatch):
    config = MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    model = MixtralForCausalLM(config)
    compiled = []
    monkeypatch.setattr(nn.Module, "compile", lambda self, *a, **k: compiled.append(self))
    assert compile_dense_parts(model) == 3 * 3 + 1  # per layer: attention + 2 RMSNorms; plus the final norm
    expected = [m for layer in model.model.layers for m in (layer.input_layernorm, layer.post_attention_layernorm, layer.self_attn)]
    assert {id(m) for m in compiled} == {id(m) for m in expected + [model.model.norm]}


def test_compiles_the_shared_expert_and_the_dense_layers_mlp_not_the_routed_experts(monkeypatch):
    """DeepSeek-V2 after the MoE swap: layer 0's dense MLP and each MoE block's shared expert are compiled with the
    attention and norms; the router and the routed experts are not."""
    import torch.distributed as dist
    from conftest import free_port, tiny_moe_config
    from transformers import AutoModelForCausalLM

    from megablocks_utils import shard_moe
    from megablocks_utils.moe.layer import ExpertParallelMoE

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_moe_config("deepseek_v2"))  # 3 layers, layer 0 dense
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        shard_moe(model, 1, device="cpu")
    finally:
        dist.destroy_process_group()
    compiled = []
    monkeypatch.setattr(nn.Module, "compile", lambda self, *a, **k: compiled.append(self))
    layers = model.model.layers
    assert not isinstance(layers[0].mlp, ExpertParallelMoE) and all(isinstance(layer.mlp, ExpertParallelMoE) for layer in layers[1:])
    mlps = [layers[0].mlp] + [layer.mlp.shared_experts for layer in layers[1:]]
    expected = [m for layer in layers for m in (layer.input_layernorm, layer.post_attention_layernorm, layer.self_attn)]
    assert compile_dense_parts(model) == 3 * 3 + 3 + 1
    assert {id(m) for m in compiled} == {id(m) for m in expected + mlps + [model.model.norm]}
