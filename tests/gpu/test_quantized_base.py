"""LoRA over an FP8 base on one GPU (``--quantize_base fp8``): the same model as over a bf16 base holding the FP8 weights'
values (the experts' grouped GEMMs, the per-expert loop, compiled attention), nothing of the dequantized weights kept for
the backward, and no host sync in the experts at ep 1 (megablocks_utils/moe/quantized.py)."""

import copy

import pytest
import torch

from .launch import gpus, host_sync_error, run_on_gpus

pytestmark = gpus(1)
SHAPE = dict(hidden_size=512, intermediate_size=1024, num_local_experts=8, num_experts_per_tok=2, num_hidden_layers=2,
             num_attention_heads=8, num_key_value_heads=4, vocab_size=1024)


def rel(a, b) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-12))


def _models(loop: bool):
    """(ours over the FP8 base, ours over a bf16 base holding the dequantized FP8 values), the same adapters (B non-zero)."""
    from transformers import AutoModelForCausalLM, MixtralConfig

    import megablocks_utils.moe.layer as moe_layer
    from megablocks_utils import build_mesh, shard_moe
    from megablocks_utils.model.lora import LoraSettings, add_lora, load_peft_tensors, parse_targets, peft_tensors
    from megablocks_utils.moe.quantized import QuantizedLinear, QuantizedWeight
    from megablocks_utils.parallel.parallelize import parallelize

    if loop:
        moe_layer.grouped_mm_supported = lambda x: False
    torch.manual_seed(0)
    config = MixtralConfig(**SHAPE, attn_implementation="sdpa")
    base = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).cuda()
    mesh = build_mesh(1, "cuda")
    lora = LoraSettings(r=16, alpha=32, dropout=0.0, targets=parse_targets("auto"))
    quantized, plain = copy.deepcopy(base), base
    shard_moe(quantized, mesh, device="cuda", quantize_base="fp8")
    shard_moe(plain, mesh, device="cuda")
    with torch.no_grad():  # the bf16 base: the FP8 weights' values
        named = dict(quantized.named_modules())
        for name, module in plain.named_modules():
            twin = named[name]
            if isinstance(twin, QuantizedLinear):
                module.weight.copy_(twin.weight.dequantized(torch.bfloat16))
            for proj in ("gate_up_proj", "down_proj"):
                if isinstance(getattr(twin, proj, None), QuantizedWeight):
                    getattr(module, proj).to_local().copy_(getattr(twin, proj).dequantized(torch.bfloat16))
    for model in (quantized, plain):
        add_lora(model, mesh, lora, torch.float32)
        parallelize(model, mesh, param_dtype=torch.bfloat16, compile_dense=True, device="cuda")
    g = torch.Generator().manual_seed(1)
    adapters = {k: 0.05 * torch.randn(v.shape, generator=g) for k, v in peft_tensors(plain).items()}
    for model in (quantized, plain):
        load_peft_tensors(model, adapters)
    return quantized, plain


def equal_to_bf16_base(rank, world, loop, gemm="kernel"):
    from megablocks_utils import causal_lm_loss_sum
    from megablocks_utils.model.lora import peft_tensors
    from megablocks_utils.model.quantized_base import set_expert_gemm

    quantized, plain = _models(loop)
    assert set_expert_gemm(quantized, gemm) > 0
    ids = torch.randint(0, SHAPE["vocab_size"], (2, 256), device="cuda")
    out = {}
    for name, model in (("fp8", quantized), ("bf16", plain)):
        logits = model(ids).logits
        causal_lm_loss_sum(logits, ids).backward()
        out[name] = (logits.detach(), peft_tensors(model, grads=True))
    (lq, gq), (lp, gp) = out["fp8"], out["bf16"]
    return {"logits": rel(lq, lp), "grads": max(rel(gq[k], gp[k]) for k in gp), "keys": len(gp)}


@pytest.mark.parametrize("gemm", ["kernel", "dequantize"])
def test_fp8_base_equals_bf16_base_of_its_values_grouped(gemm):
    result = run_on_gpus(equal_to_bf16_base, 1, False, gemm)[0]
    assert result["keys"] > 0 and result["logits"] < 2e-2 and result["grads"] < 5e-2, result


def test_fp8_base_equals_bf16_base_of_its_values_loop():
    result = run_on_gpus(equal_to_bf16_base, 1, True)[0]
    assert result["keys"] > 0 and result["logits"] < 2e-2 and result["grads"] < 5e-2, result


def saved_and_synced(rank, world, gemm="kernel"):
    """What one MoE layer over the FP8 base saves for its backward (shapes and dtypes), and any host sync it makes."""
    from types import SimpleNamespace

    from megablocks_utils.moe.layer import ExpertParallelExperts
    from megablocks_utils.moe.quantized import quantize_weight

    experts = ExpertParallelExperts(8, SimpleNamespace(ep_size=1), "silu")
    shapes = [(8, 2048, 512), (8, 512, 1024)]
    experts.set_weights(*(torch.nn.Parameter(0.05 * torch.randn(s, device="cuda", dtype=torch.bfloat16), requires_grad=False)
                          for s in shapes))
    experts.set_quantized_weights(*(quantize_weight(w.detach()) for w in (experts.gate_up_proj, experts.down_proj)))
    experts.gate_up_proj.gemm = experts.down_proj.gemm = gemm
    x = torch.randn(4096, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    top_w, top_i = torch.rand(4096, 2, device="cuda").softmax(-1), torch.randint(0, 8, (4096, 2), device="cuda")
    experts(x, top_i, top_w).float().square().sum().backward()  # warm-up: compiles
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append([list(t.shape), str(t.dtype)]) or t, lambda t: t):
        y = experts(x, top_i, top_w)
    sync = host_sync_error(lambda: experts(x, top_i, top_w).float().square().sum().backward())
    return {"saved": saved, "sync": sync, "finite": bool(torch.isfinite(y).all())}


@pytest.mark.parametrize("gemm", ["kernel", "dequantize"])
def test_fp8_experts_keep_no_dequantized_weight_and_make_no_host_sync(gemm):
    result = run_on_gpus(saved_and_synced, 1, gemm)[0]
    assert result["finite"] and result["sync"] == "", result["sync"]
    weights = [[8, 2048, 512], [8, 512, 1024]]
    assert [[s, "torch.bfloat16"] for s in weights if [s, "torch.bfloat16"] in result["saved"]] == [], result["saved"]
    assert [[8, 2048, 512], "torch.float8_e4m3fn"] in result["saved"], result["saved"]


def mxfp4_equals_its_values(rank, world):
    """gpt-oss's experts held in MXFP4 (as released) against the same layer over bf16 weights holding transformers' own
    dequantization of those bytes: outputs and the input's gradient, grouped GEMMs, bf16."""
    from types import SimpleNamespace

    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from megablocks_utils.moe.layer import ExpertParallelExperts
    from megablocks_utils.moe.quantized import QuantizedWeight

    g = torch.Generator("cuda").manual_seed(0)
    experts, hidden, width = 8, 512, 256
    layers = {}
    blocks = {name: torch.randint(0, 256, (experts, n, k // 32, 16), generator=g, device="cuda", dtype=torch.uint8)
              for name, (n, k) in (("gate_up", (2 * width, hidden)), ("down", (hidden, width)))}
    scales = {name: torch.full(b.shape[:-1], 120, device="cuda", dtype=torch.uint8) for name, b in blocks.items()}
    biases = [0.01 * torch.randn(s, generator=g, device="cuda", dtype=torch.bfloat16) for s in ((experts, 2 * width), (experts, hidden))]
    for kind in ("mxfp4", "bf16"):
        layer = ExpertParallelExperts(experts, SimpleNamespace(ep_size=1), "gpt_oss_swiglu", transposed=True, interleaved=True,
                                      bias=True, alpha=1.702, limit=7.0)
        values = [convert_moe_packed_tensors(blocks[n], scales[n], dtype=torch.bfloat16) for n in ("gate_up", "down")]
        layer.set_weights(*(torch.nn.Parameter(t, requires_grad=False) for t in (*values, *biases)))
        if kind == "mxfp4":
            layer.set_quantized_weights(*(QuantizedWeight("mxfp4", blocks[n], scales[n], transposed=True) for n in ("gate_up", "down")))
        layers[kind] = layer
    x = torch.randn(4096, hidden, device="cuda", dtype=torch.bfloat16)
    top_w, top_i = torch.rand(4096, 4, device="cuda").softmax(-1), torch.randint(0, experts, (4096, 4), device="cuda")
    out = {}
    for kind, layer in layers.items():
        xi = x.clone().requires_grad_()
        y = layer(xi, top_i, top_w)
        y.float().square().sum().backward()
        out[kind] = (y.detach(), xi.grad)
    return {"out": rel(out["mxfp4"][0], out["bf16"][0]), "grad": rel(out["mxfp4"][1], out["bf16"][1])}


def test_mxfp4_experts_equal_their_dequantized_values():
    """The check that lets quantized_base.RAN_ON_GPUS take "mxfp4" (passed on one H200, 2026-12-02)."""
    result = run_on_gpus(mxfp4_equals_its_values, 1)[0]
    assert result["out"] < 1e-2 and result["grad"] < 1e-2, result
