"""The MoE block after its router as one compiled region (``ExpertParallelMoE.compile_body``, what train_fsdp2.py runs
at ep = 1 on a GPU) against the same block eager, on one GPU in bf16, for four architectures (Mixtral: SwiGLU;
Qwen3-MoE: many experts; DeepSeek-V2: shared experts; gpt-oss: clamped SwiGLU, biases): the output and the gradients
of the input, the router weights and every expert tensor, twice (the second call reuses the compile: no recompile
across the model's blocks or calls), with no host sync in the compiled forward and backward. The compiled graph rounds
fewer intermediates to bf16 than eager (the gathers' custom operators and the grouped GEMMs are the same kernels), so
the two agree to bf16 roundings: 2e-2 of each tensor's largest value, as tests/gpu/test_moe_layer.py's compiled SiLU."""

import pytest
import torch

from .launch import gpus, host_sync_error, run_on_gpus

pytestmark = gpus(1)
MODEL_TYPES = ("mixtral", "qwen3_moe", "deepseek_v2", "gpt_oss")


def rel(a, b) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-12))


def measure(rank, world):
    import os
    import sys

    from torch._dynamo.utils import counters
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from conftest import tiny_moe_config

    from megablocks_utils import moe_blocks, shard_moe

    found = {}
    for model_type in MODEL_TYPES:
        torch.manual_seed(0)
        layers = {"num_hidden_layers": 4}
        if model_type == "gpt_oss":
            layers["layer_types"] = ["sliding_attention", "full_attention"] * 2
        config = tiny_moe_config(model_type, hidden_size=256, **layers)
        model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
        shard_moe(model, 1, device="cuda")
        blocks = moe_blocks(model)
        x = torch.randn(2048, config.hidden_size, device="cuda", dtype=torch.bfloat16)
        torch._dynamo.reset()
        counters.clear()

        def run(block, compiled: bool):
            leaf = x.detach().requires_grad_()
            _, top_w, top_i = block.top_k_router(leaf)
            weights = block.experts.local_weights(leaf.dtype)
            out = (block.compiled_body if compiled else block.body)(leaf, top_i, top_w, weights)
            grads = torch.autograd.grad(out.float().square().sum(), [leaf, *block.parameters()], allow_unused=True)
            return out.detach(), grads

        compiled = []
        for block in blocks:
            block.compile_body()
            compiled.append([run(block, True) for _ in range(2)][-1])  # the second call reuses the compile
        graphs = counters["stats"]["unique_graphs"]  # before the eager runs, whose fused GLU is a compile of its own
        worst = 0.0
        for block, (out_c, grads_c) in zip(blocks, compiled):
            out_e, grads_e = run(block, False)
            assert len(grads_c) == len(grads_e) == 1 + len(list(block.parameters()))
            worst = max([worst, rel(out_c, out_e)] + [rel(a, b) for a, b in zip(grads_c, grads_e) if b is not None])
        found[model_type] = {"worst_rel": worst, "unique_graphs": graphs, "blocks": len(blocks),
                             "host_sync": host_sync_error(lambda: run(blocks[-1], True))}
    return found


@pytest.fixture(scope="module")
def found():
    return run_on_gpus(measure, 1)[0]


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_compiled_body_equals_eager(found, model_type):
    result = found[model_type]
    assert result["worst_rel"] <= 2e-2, result


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_one_compile_for_every_block_and_no_host_sync(found, model_type):
    result = found[model_type]
    assert result["blocks"] >= 3 and result["unique_graphs"] == 1, result
    assert result["host_sync"] == "", result
