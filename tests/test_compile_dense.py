"""compile_dense_parts picks each decoder layer's attention and norms (what train_fsdp2.py compiles on
GPUs) and nothing of the MoE block. The GPU check of the compiled model is tests/gpu/test_train_parity.py
(compiled vs eager training runs)."""

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
