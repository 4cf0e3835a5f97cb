"""gpt-oss's expert block through our layer: the clamped SwiGLU and biases against transformers' own
``GptOssExperts`` and router, and the clear errors for what we do not support (MXFP4 checkpoints,
megablocks, sdpa). The whole model is covered by the architecture-parametrized tests (TINY_EXTRAS)."""

import os
from types import SimpleNamespace

import pytest
import torch
from conftest import tiny_moe_config

from megablocks_utils.errors import InputError
from megablocks_utils.model.architectures import spec_for
from megablocks_utils.model.build import check_megablocks_model, expert_options, load_model
from megablocks_utils.model.loading import check_model_dir
from megablocks_utils.moe.layer import ExpertParallelExperts
from megablocks_utils.moe.router import TopKRouter

TOL = 1e-5


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))


def test_clamped_swiglu_experts_match_transformers():
    """Random weights and biases large enough that many gate/up values pass the clamp limit on both sides:
    outputs and every gradient equal ``GptOssExperts`` in fp32."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    config = tiny_moe_config("gpt_oss", swiglu_limit=1.0)
    spec = spec_for(config)
    g = torch.Generator().manual_seed(0)
    reference = GptOssExperts(config)
    with torch.no_grad():
        for p in reference.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    ours = ExpertParallelExperts(4, SimpleNamespace(ep_size=1), spec.expert_act, **expert_options(spec, config))
    ours.set_weights(*(torch.nn.Parameter(getattr(reference, n).detach().clone()) for n in
                       ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")))

    tokens = 40
    x = torch.randn(tokens, config.hidden_size, generator=g)
    top_i = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(tokens)])
    top_w = torch.softmax(torch.randn(tokens, 2, generator=g), dim=-1)
    gate_up = torch.einsum("th,ehi->tei", x, reference.gate_up_proj.detach()) + reference.gate_up_proj_bias.detach()
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    assert (gate > 1.0).float().mean() > 0.1 and (up < -1.0).float().mean() > 0.1 and (up > 1.0).float().mean() > 0.1

    x_ref, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    expected = reference(x_ref, top_i, top_w)
    got = ours(x_ours, top_i, top_w)
    assert rel_err(got, expected) <= TOL
    probe = torch.randn(expected.shape, generator=g)
    (expected * probe).sum().backward()
    (got * probe).sum().backward()
    assert rel_err(x_ours.grad, x_ref.grad) <= TOL
    for name, p in reference.named_parameters():
        assert rel_err(getattr(ours, name).grad, p.grad) <= TOL, name


def test_grouped_gemm_path_equals_the_expert_loop(monkeypatch):
    """The transposed weights and per-row biases on the grouped GEMM path (torch runs it on CPU too)."""
    from megablocks_utils.moe import experts as moe_experts

    config = tiny_moe_config("gpt_oss", swiglu_limit=1.0)
    spec = spec_for(config)
    experts = ExpertParallelExperts(4, SimpleNamespace(ep_size=1), spec.expert_act, **expert_options(spec, config))
    g = torch.Generator().manual_seed(0)
    experts.set_weights(*(torch.nn.Parameter(torch.randn(s, generator=g) * 0.3) for s in [(4, 64, 64), (4, 32, 64), (4, 64), (4, 64)]))
    x = torch.randn(30, 64, generator=g)
    counts = torch.tensor([10, 0, 12, 8])  # an expert without rows
    loop = experts.compute(x, counts, counts.tolist())
    monkeypatch.setattr(moe_experts, "grouped_mm_supported", lambda x: True)
    torch.testing.assert_close(experts.compute(x, counts, counts.tolist()), loop, rtol=TOL, atol=1e-6)


def test_router_with_bias_matches_transformers():
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter

    config = tiny_moe_config("gpt_oss")
    torch.manual_seed(0)
    reference = GptOssTopKRouter(config)
    torch.nn.init.normal_(reference.weight)
    torch.nn.init.normal_(reference.bias)
    ours = TopKRouter(config.hidden_size, 4, 2, False, spec_for(config).router, bias=True)
    ours.load_state_dict(reference.state_dict())
    x = torch.randn(16, config.hidden_size)
    logits, scores, indices = reference(x)
    probs, top_w, top_i = ours(x)
    assert torch.equal(top_i, indices)
    torch.testing.assert_close(top_w, scores, rtol=TOL, atol=0)
    torch.testing.assert_close(probs, torch.softmax(logits, dim=-1), rtol=TOL, atol=0)


def test_mxfp4_checkpoint_is_a_clear_error(tmp_path):
    """The released checkpoints store experts as MXFP4 blocks and scales: we say how to dequantize them."""
    from safetensors.torch import save_file

    tiny_moe_config("gpt_oss").save_pretrained(tmp_path)
    prefix = "model.layers.0.mlp.experts."
    tensors = {prefix + n: torch.zeros(4, 2, dtype=torch.uint8) for n in ("gate_up_proj_blocks", "gate_up_proj_scales")}
    save_file({**tensors, "model.norm.weight": torch.ones(64)}, os.path.join(tmp_path, "model.safetensors"))
    with pytest.raises(InputError, match=r"MXFP4-quantized experts .*Mxfp4Config\(dequantize=True\)"):
        check_model_dir(str(tmp_path))


def test_megablocks_and_sdpa_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="moe_backend='megablocks' does not support gpt_oss.*use moe_backend='native'"):
        check_megablocks_model(spec_for(tiny_moe_config("gpt_oss")))
    check_megablocks_model(spec_for(tiny_moe_config("mixtral")))  # the other rows pass
    tiny_moe_config("gpt_oss").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="gpt_oss has no sdpa attention.*'eager' or 'flex_attention'"):
        load_model(str(tmp_path), 1, device="cpu", attn_implementation="sdpa")


@pytest.mark.parametrize("arch", ["gpt_oss", "mixtral"])
def test_one_local_expert_gemm_equals_the_expert_loop(monkeypatch, arch):
    """ep = number of experts: the grouped GEMM path runs plain GEMMs for the one local expert (biases too)."""
    from megablocks_utils.moe import experts as moe_experts

    config = tiny_moe_config(arch, **({"swiglu_limit": 1.0} if arch == "gpt_oss" else {}))
    spec = spec_for(config)
    experts = ExpertParallelExperts(4, SimpleNamespace(ep_size=4), spec.expert_act or config.hidden_act, **expert_options(spec, config))
    assert experts.num_local_experts == 1
    g = torch.Generator().manual_seed(0)
    shapes = [(1, 64, 64), (1, 32, 64), (1, 64), (1, 64)] if arch == "gpt_oss" else [(1, 64, 64), (1, 64, 32)]
    experts.set_weights(*(torch.randn(s, generator=g) * 0.3 for s in shapes))
    params = list(experts.expert_tensors())
    x = torch.randn(30, 64, generator=g, requires_grad=True)
    counts = torch.tensor([30])
    loop = experts.compute(x, counts, [30])
    loop_grads = torch.autograd.grad(loop.square().sum(), [x, *params])
    monkeypatch.setattr(moe_experts, "grouped_mm_supported", lambda t: True)
    monkeypatch.setattr(moe_experts, "grouped_mm", lambda *a, **k: pytest.fail("one local expert must not use grouped_mm"))
    gemm = experts.compute(x, counts)
    torch.testing.assert_close(gemm, loop, rtol=TOL, atol=1e-6)
    for got, expected in zip(torch.autograd.grad(gemm.square().sum(), [x, *params]), loop_grads):
        torch.testing.assert_close(got, expected, rtol=TOL, atol=1e-5)
