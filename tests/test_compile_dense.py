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


def _trace_moe_bodies(rank, world_size, model_types):
    """One gloo rank: for each model type, the MoE block after its router traces as one graph with no break (the
    grouped-GEMM path, which CUDA runs), all blocks of the model share that one compile, and the compiled body
    (dynamo's eager backend: the trace itself, no code generation) gives the eager body's output bit for bit."""
    from torch._dynamo.utils import counters
    from transformers import AutoModelForCausalLM

    from conftest import tiny_moe_config
    from megablocks_utils import moe_blocks, shard_moe
    from megablocks_utils.moe import experts as moe_experts

    moe_experts.grouped_mm_supported = lambda x: True  # the CUDA path; torch's CPU grouped_mm runs its forward
    for model_type in model_types:
        torch.manual_seed(0)
        config = tiny_moe_config(model_type, hidden_size=64)
        model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
        shard_moe(model, 1, device="cpu")
        blocks = moe_blocks(model)
        assert len(blocks) >= 2 and all(b.can_compile_body() is None for b in blocks), model_type
        x = torch.randn(64, config.hidden_size, dtype=torch.bfloat16)
        first = blocks[0]
        _, top_w, top_i = first.top_k_router(x)
        explained = torch._dynamo.explain(first.body)(x, top_i, top_w, first.experts.local_weights(x.dtype))
        assert (explained.graph_count, explained.graph_break_count) == (1, 0), (model_type, explained.break_reasons)
        torch._dynamo.reset()
        counters.clear()
        for block in blocks:
            _, top_w, top_i = block.top_k_router(x)
            weights = block.experts.local_weights(x.dtype)
            compiled = torch.compile(block.body, backend="eager")(x, top_i, top_w, weights)
            assert torch.equal(compiled, block.body(x, top_i, top_w, weights)), model_type
        assert counters["stats"]["unique_graphs"] == 1, (model_type, dict(counters["stats"]))
        first.experts.recompute = True
        assert "checkpoint_experts" in first.can_compile_body()


def test_moe_body_is_one_graph_shared_by_every_block():
    from conftest import run_ranks

    run_ranks(_trace_moe_bodies, 1, ("mixtral", "qwen3_moe", "deepseek_v2", "gpt_oss"))
