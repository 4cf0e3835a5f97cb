"""LoRA over a quantized base (``--quantize_base fp8``, gpt-oss's MXFP4 experts): the formats against references written
here and in transformers, the GEMMs that keep only quantized bytes for the backward, and the LoRA model over an FP8
base against transformers + PEFT over the same weights rounded to FP8 (megablocks_utils/moe/quantized.py,
megablocks_utils/model/quantized_base.py)."""

import copy
import json
import os

import pytest
import torch
from conftest import (
    TWO_RANK_ARGS,
    read_jsonl,
    run_ranks,
    standard_args,
    tiny_moe_config,
    train_fsdp2,
)
from test_lora import ALPHA, R, TOL, rel_err

from megablocks_utils.errors import InputError
from megablocks_utils.moe.quantized import (
    FP4_VALUES,
    QuantizedWeight,
    dequantize,
    quantize_fp8,
)


def fp8_rounded(w: torch.Tensor) -> torch.Tensor:
    """The reference: ``w`` [..., out, in] rounded to float8 e4m3 in 128 x 128 blocks, each scaled so that its largest
    magnitude is 448, and scaled back (block by block, in fp32)."""
    out = torch.empty(w.shape, dtype=torch.float32)
    for i in range(0, w.shape[-2], 128):
        for j in range(0, w.shape[-1], 128):
            block = w[..., i:i + 128, j:j + 128].float()
            scale = block.abs().amax(dim=(-2, -1), keepdim=True) / 448
            scale = torch.where(scale > 0, scale, torch.ones_like(scale))
            out[..., i:i + 128, j:j + 128] = (block / scale).to(torch.float8_e4m3fn).float() * scale
    return out.to(w.dtype)


@pytest.mark.parametrize("shape", [(3, 300, 260), (256, 384), (2, 64, 32)])
def test_fp8_blocks_round_like_the_reference(shape):
    """128 x 128 blocks (ragged at the edges), one scale each: dequantized, the reference's values exactly, each within
    e4m3's 3 mantissa bits of the weight."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(shape, generator=g) * torch.rand(shape[:-1] + (1,), generator=g) * 4  # rows of different ranges
    data, scale = quantize_fp8(w, chunk=2)
    assert data.dtype == torch.float8_e4m3fn and data.shape == w.shape
    assert scale.shape == shape[:-2] + (-(-shape[-2] // 128), -(-shape[-1] // 128)) and scale.dtype == torch.float32
    back = dequantize("fp8", data, scale, torch.float32)
    assert torch.equal(back, fp8_rounded(w))
    assert float(((back - w).abs() / w.abs().clamp(min=1e-3)).median()) < 2 ** -4
    assert not torch.equal(back, w)


def test_mxfp4_matches_transformers_dequantization():
    """gpt-oss's released format: our dequantization against transformers' own (its [E, in, out] is our [E, out, in]
    transposed), on random bytes and scales; and one byte by hand."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 8, 4, 16), generator=g, dtype=torch.uint8)  # 3 experts, 8 outputs, 128 inputs
    scales = torch.randint(118, 134, (3, 8, 4), generator=g, dtype=torch.uint8)
    ours = dequantize("mxfp4", blocks, scales, torch.bfloat16)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)
    assert ours.shape == (3, 8, 128) and torch.equal(ours, theirs.transpose(1, 2))
    one = dequantize("mxfp4", torch.tensor([[[0x2B] + [0] * 15]], dtype=torch.uint8), torch.tensor([[128]], dtype=torch.uint8), torch.float32)
    assert one[0, :2].tolist() == [2 * FP4_VALUES[0xB], 2 * FP4_VALUES[0x2]] == [-3.0, 2.0]  # low nibble first, times 2^1


@pytest.mark.parametrize("grouped", [False, True])
def test_frozen_matmul_keeps_only_quantized_bytes(grouped):
    """x @ W^T over a quantized W: the dequantized weight's output and input gradient, with no tensor of the weight's
    dequantized size saved for the backward (what keeps a layer's bf16 weights alive) and no weight gradient."""
    g = torch.Generator().manual_seed(0)
    experts, out_f, in_f = 3, 160, 136
    w = torch.randn(experts, out_f, in_f, generator=g)
    q = QuantizedWeight("fp8", *quantize_fp8(w))
    w_deq = q.dequantized(torch.float32)
    x = torch.randn(10, in_f, generator=g, requires_grad=True)
    offs = torch.tensor([4, 4, 10], dtype=torch.int32)  # an expert with no rows
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append((t.shape, t.dtype)) or t, lambda t: t):
        y = q.matmul(x, offs) if grouped else q.matmul(x, expert=1)
    ref_x = x.detach().clone().requires_grad_()
    ref = torch.cat([ref_x[a:b] @ w_deq[e].T for e, (a, b) in enumerate(zip([0, 4, 4], [4, 4, 10]))]) if grouped else ref_x @ w_deq[1].T
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    grad = torch.randn(y.shape, generator=g)
    y.backward(grad)
    ref.backward(grad)
    torch.testing.assert_close(x.grad, ref_x.grad, rtol=1e-5, atol=1e-5)
    assert all(dtype != torch.float32 or shape[-1] != in_f or len(shape) != len(w_deq.shape[grouped is False:])
               for shape, dtype in saved), saved  # no dequantized weight among the saved tensors
    assert (torch.Size([experts, out_f, in_f]) if grouped else torch.Size([out_f, in_f]), torch.float8_e4m3fn) in saved


# ----------------------------------------------------------------------------- the model against transformers + PEFT
def _round_base_to_fp8(model, arch):
    """transformers' model with every weight ``quantize_base fp8`` quantizes rounded as the reference rounds it."""
    from megablocks_utils.model.architectures import spec_for
    from megablocks_utils.model.quantized_base import dense_linears

    spec = spec_for(model.config)
    with torch.no_grad():
        for linear in dense_linears(model).values():
            linear.weight.copy_(fp8_rounded(linear.weight))
        for name, module in model.named_modules():
            if name.endswith(f".{spec.block_attr}.{spec.experts_attr}"):
                for proj in ("gate_up_proj", "down_proj"):
                    w = getattr(module, proj)
                    w.copy_(fp8_rounded(w.transpose(-2, -1)).transpose(-2, -1) if spec.experts_transposed else fp8_rounded(w))


def check_fp8_base_matches_peft(rank, world, ep_size, cases):
    from peft import get_peft_model, get_peft_model_state_dict
    from test_equivalence import make_batch, rank_loss
    from transformers import AutoModelForCausalLM

    import megablocks_utils.moe.layer as moe_layer
    from megablocks_utils import build_mesh, shard_moe
    from megablocks_utils.model.lora import LoraSettings, add_lora, load_peft_tensors, merge_adapters, parse_targets, peft_config, peft_tensors
    from megablocks_utils.model.quantized_base import dequantize_base
    from megablocks_utils.moe.blocks import expert_parameters
    from megablocks_utils.parallel.parallelize import parallelize
    from megablocks_utils.train.metrics import active_params

    for arch, grouped, checkpointing in cases:
        moe_layer.grouped_mm_supported = (lambda x: True) if grouped else (lambda x: False)
        config = tiny_moe_config(arch)
        torch.manual_seed(0)
        base = AutoModelForCausalLM.from_config(config).float()
        model = copy.deepcopy(base)
        _round_base_to_fp8(base, arch)
        lora = LoraSettings(r=R, alpha=ALPHA, dropout=0.0, targets=parse_targets("auto"))
        mesh = build_mesh(ep_size, "cpu")
        shard_moe(model, mesh, device="cpu", quantize_base="fp8")
        found = add_lora(model, mesh, lora, torch.float32)
        parallelize(model, mesh, param_dtype=torch.float32, activation_checkpointing=checkpointing, device="cpu")
        kinds = {type(m).__name__ for m in model.modules()}
        assert "QuantizedLinear" in kinds and "QuantizedWeight" in kinds and "Linear" in kinds  # lm_head stays
        plain = copy.deepcopy(base)  # the same model unquantized: the MFU's active parameters count them alike
        plain_mesh = build_mesh(ep_size, "cpu")
        shard_moe(plain, plain_mesh, device="cpu")
        add_lora(plain, plain_mesh, lora, torch.float32)
        assert active_params(model, config, expert_parameters(model)) == active_params(plain, config, expert_parameters(plain)) > 0
        assert found.experts and found.linears

        reference = get_peft_model(base, peft_config(lora, found, "", inference_mode=False))
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for name, p in reference.named_parameters():
                if "lora_" in name:
                    p.copy_(0.2 * torch.randn(p.shape, generator=g))
        load_peft_tensors(model, get_peft_model_state_dict(reference))
        input_ids, mask, labels = make_batch(config.vocab_size)
        ref_out = reference(input_ids, attention_mask=mask, labels=labels, output_router_logits=True)
        ref_out.loss.backward()
        rows, out, _, loss = rank_loss(model, mesh, config, input_ids, mask, labels, rank, world)
        loss.backward()
        where = f"{arch}, grouped {grouped}, {checkpointing}"
        global_loss = loss.detach() / world
        torch.distributed.all_reduce(global_loss)
        assert rel_err(global_loss, ref_out.loss) <= TOL, (where, float(global_loss), float(ref_out.loss))
        assert rel_err(out.logits, ref_out.logits[rows]) <= TOL, where
        grads = peft_tensors(model, grads=True)
        ref_grads = {n.replace(".default", ""): p.grad for n, p in reference.named_parameters() if "lora_" in n}
        assert set(grads) == set(ref_grads)
        for key, grad in grads.items():
            assert rel_err(grad, ref_grads[key]) <= TOL, (where, key, rel_err(grad, ref_grads[key]))
        dequantize_base(model, torch.float32)  # the merged export: the rounded base in fp32, plus s B A
        assert not any(isinstance(m, QuantizedWeight) for m in model.modules())
        merge_adapters(model)
        if world > 1:  # FSDP's dense units no longer hold the new weights: what export_hf writes, not a forward
            continue
        with torch.no_grad():
            merged = model(input_ids[rows], attention_mask=mask[rows]).logits
        assert rel_err(merged, ref_out.logits[rows]) <= TOL, (where, "merged")


@pytest.mark.parametrize("ep,cases", [
    (1, [("mixtral", False, "none"), ("mixtral", True, "none"), ("qwen3_moe", True, "selective"), ("gpt_oss", True, "none"),
         ("gpt_oss", False, "full")]),
    (2, [("mixtral", True, "full"), ("gpt_oss", False, "none")]),
], ids=["one-rank", "ep2"])
def test_lora_over_fp8_base_matches_peft_over_the_rounded_weights(ep, cases):
    """Loss, logits and every adapter gradient equal PEFT's on transformers' model whose base weights are rounded to FP8
    by the reference above (fp32, 1e-5), on the per-expert loop and the grouped GEMMs, with activation checkpointing, on
    one rank and at ep 2; the merged model (dequantized, then merged) gives the same logits."""
    run_ranks(check_fp8_base_matches_peft, ep, ep, cases)


# ----------------------------------------------------------------------------- settings and the script
@pytest.mark.parametrize("changes,message", [
    (dict(finetuning="full"), "--quantize_base fp8 holds frozen weights quantized, which only --finetuning lora has"),
    (dict(quantize_base="int4"), "--quantize_base 'int4': choose one of none, fp8"),
])
def test_bad_quantize_base_names_the_fix(changes, message):
    from megablocks_utils.model.quantized_base import check_quantize_base

    settings = dict(quantize_base="fp8", finetuning="lora", device_type="cpu", world_size=2)
    with pytest.raises(InputError) as error:
        check_quantize_base(**{**settings, **changes})
    assert message in str(error.value), str(error.value)


@pytest.mark.parametrize("capability,world,message", [
    ((8, 0), 1, "needs float8, which this GPU (A100, sm80) lacks"),
    ((9, 0), 2, "has run on 1 GPU so far, not yet on 2"),
    ((9, 0), 1, None),
])
def test_quantized_base_guards_on_gpus(monkeypatch, capability, world, message):
    """Before sm89, one clear error; above the GPU count it has run on, refused (the guard QUANTIZED_BASE_RAN_ON_GPUS)."""
    from megablocks_utils.model import quantized_base

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "A100")
    check = lambda: quantized_base.check_quantize_base("fp8", finetuning="lora", device_type="cuda", world_size=world)  # noqa: E731
    if message is None:
        check()
        return
    with pytest.raises(InputError) as error:
        check()
    assert message in str(error.value), str(error.value)


def test_train_fsdp2_lora_over_fp8_base(tiny_model_dir, small_data, tmp_path):
    """Two ranks at ep 2 load the base into FP8 (each layer's experts as read), say so first, train the adapters (the
    loss falls), write final/ as a PEFT adapter of the original model and merged/ dequantized."""
    out = str(tmp_path / "run")
    result = train_fsdp2(2, out, *standard_args(tiny_model_dir, small_data), *TWO_RANK_ARGS, "--finetuning", "lora",
                         "--quantize_base", "fp8", "--merge_lora", "true")
    assert "frozen base: experts in fp8" in result.stdout and "linear layers in fp8" in result.stdout, result.stdout[-2000:]
    losses = [r["loss"] for r in read_jsonl(os.path.join(out, "metrics.jsonl"))]
    assert all(map(lambda v: v == v, losses)) and losses[-1] < losses[0], losses
    assert os.path.isfile(os.path.join(out, "final", "adapter_model.safetensors"))
    assert os.path.isfile(os.path.join(out, "merged", "config.json"))


KERNEL_CHECK = """
import json, torch
from megablocks_utils.moe.fp8_gemm_kernel import fp8_grouped_mm
from megablocks_utils.moe.quantized import dequantize, quantize_fp8
g = torch.Generator().manual_seed(0)
out = {}
# the last field: row tiles per group of the launch order (1: column tiles first; 3 and 2 leave a smaller last group)
for n, k, counts, configs in [(160, 200, [5, 0, 40, 19], [(16, 32, 32, 4, 1, 1), (16, 32, 32, 4, 1, 3)]),
                              (256, 128, [70, 3], [(32, 64, 64, 4, 1, 2), (32, 64, 64, 4, 1, 4096)])]:
    data, scale = quantize_fp8(torch.randn(len(counts), n, k, generator=g))
    w = dequantize("fp8", data, scale, torch.float32)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    rows = int(offs[-1])
    for transpose in (True, False):
        x = torch.randn(rows + 3, k if transpose else n, generator=g)  # 3 padding rows past the last offset
        ref = torch.nn.functional.grouped_mm(x[:rows], w.transpose(-2, -1) if transpose else w, offs=offs)
        for config in configs:
            got = fp8_grouped_mm(x, data, scale, offs, transpose, config)[:rows]
            out[f"{n}x{k}_{transpose}_{config[-1]}"] = float((got - ref).abs().max() / ref.abs().max())
print(json.dumps(out))
"""


def test_fp8_grouped_kernel_equals_dequantized_grouped_mm():
    """The GPU kernel (Triton's interpreter on CPU): each expert's rows times its dequantized weight, both ways (the
    forward's W^T and the input gradient's W), ragged blocks, an expert with no rows, tiles finding their expert from
    the counts on the device, each launch order (row tiles in groups of 1, 2, 3 and all)."""
    from conftest import run_in_triton_interpreter

    errors = run_in_triton_interpreter(KERNEL_CHECK)
    assert len(errors) == 8 and max(errors.values()) < 1e-5, errors  # two shapes, two ways, two tilings each


DEQUANTIZE_KERNEL_CHECK = """
import json, torch
from megablocks_utils.moe.fp8_gemm_kernel import dequantize_fp8_blocks
from megablocks_utils.moe.quantized import dequantize, quantize_fp8
g = torch.Generator().manual_seed(0)
out = {}
for shape in [(3, 300, 260), (2, 256, 384), (1, 64, 32)]:
    data, scale = quantize_fp8(torch.randn(shape, generator=g) * torch.rand(shape[:-1] + (1,), generator=g))
    got = dequantize_fp8_blocks(data, scale, torch.float32)
    out[str(shape)] = float((got - dequantize("fp8", data, scale, torch.float32)).abs().max())
print(json.dumps(out))
"""


def test_fp8_dequantize_kernel_equals_the_dequantized_weight():
    """The GPU kernel of ``gemm="dequantize"`` (Triton's interpreter on CPU): every 128 x 128 block, ragged at the edges,
    the same values as ``dequantize``."""
    from conftest import run_in_triton_interpreter

    errors = run_in_triton_interpreter(DEQUANTIZE_KERNEL_CHECK)
    assert len(errors) == 3 and max(errors.values()) == 0.0, errors


# ----------------------------------------------------------------------------- checkpoints released quantized
def fp8_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A released FP8 weight as the reference writes it: float8 data, one scale per 128 x 128 block (ragged at the
    edges), and the values they hold (fp32)."""
    n, k = w.shape
    data, values = torch.empty(n, k, dtype=torch.float8_e4m3fn), torch.empty(n, k)
    scale = torch.empty(-(-n // 128), -(-k // 128))
    for i in range(0, n, 128):
        for j in range(0, k, 128):
            block = w[i:i + 128, j:j + 128].float()
            scale[i // 128, j // 128] = s = block.abs().max() / 448
            data[i:i + 128, j:j + 128] = (block / s).to(torch.float8_e4m3fn)
            values[i:i + 128, j:j + 128] = data[i:i + 128, j:j + 128].float() * s
    return data, scale, values


def write_fp8_release(path: str, reference_path: str) -> None:
    """A tiny Qwen3-MoE checkpoint as Qwen3's FP8 release lays it out (hub names per expert; every expert and attention
    projection in float8 with ``weight_scale_inv``; the rest bf16), and beside it the same weights' values in fp32 (the
    reference transformers loads)."""
    from transformers import AutoModelForCausalLM

    from megablocks_utils.model.export import hub_state_dict, write_shards

    config = tiny_moe_config("qwen3_moe", hidden_size=128, moe_intermediate_size=128, head_dim=32)
    torch.manual_seed(5)
    tensors = hub_state_dict(AutoModelForCausalLM.from_config(config))
    released, values = {}, {}
    for name, value in tensors.items():
        if name.endswith("_proj.weight") and (".experts." in name or ".self_attn." in name):
            released[name], released[name + "_scale_inv"], values[name] = fp8_blocks(value)
        else:
            released[name] = value.to(torch.bfloat16)
            values[name] = released[name].float()
    for folder, weights in ((path, released), (reference_path, values)):
        names = sorted(weights)
        os.makedirs(folder)
        write_shards(folder, [{n: weights[n] for n in names[i::2]} for i in range(2)])
        config.save_pretrained(folder)
    config.quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    config.save_pretrained(path)


def _tensor(path: str, name: str) -> torch.Tensor:
    from safetensors import safe_open

    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(path, f), "pt") as handle:
                if name in handle.keys():
                    return handle.get_tensor(name)
    raise KeyError(name)


def check_fp8_release(rank, world, path, reference_path):
    from transformers import AutoModelForCausalLM

    from megablocks_utils import load_model
    from megablocks_utils.moe.quantized import QuantizedLinear

    model, _ = load_model(path, 1, device="cpu", quantize_base="fp8")
    up = _tensor(path, "model.layers.1.mlp.experts.2.up_proj.weight")
    q = _tensor(path, "model.layers.0.self_attn.q_proj.weight")
    gate_up, q_proj = model.model.layers[1].mlp.experts.gate_up_proj, model.model.layers[0].self_attn.q_proj
    same_bytes = (isinstance(q_proj, QuantizedLinear) and torch.equal(gate_up.data[2, 128:].view(torch.uint8), up.view(torch.uint8))
                  and torch.equal(q_proj.weight.data.view(torch.uint8), q.view(torch.uint8)))
    reference = AutoModelForCausalLM.from_pretrained(reference_path, dtype=torch.float32)
    ids = torch.tensor([[1, 7, 42, 9, 3, 50, 17, 5]])
    model.eval()
    err = rel_err(model(ids).logits, reference(ids).logits)
    assert same_bytes and err <= TOL, (same_bytes, err)


def test_fp8_release_loads_as_released(tmp_path):
    """Qwen3's FP8 layout: experts and attention kept as the checkpoint's bytes (no round trip through bf16), the model
    gives the logits of transformers' model holding the released values; without --quantize_base fp8 the checkpoint is
    refused with what to do."""
    from megablocks_utils.model.loading import check_model_dir

    path, reference_path = str(tmp_path / "fp8"), str(tmp_path / "values")
    write_fp8_release(path, reference_path)
    with pytest.raises(InputError) as error:
        check_model_dir(path)
    assert "holds FP8 block-scaled weights" in str(error.value) and "--finetuning lora --quantize_base fp8" in str(error.value)
    assert check_model_dir(path, quantized_ok=True)[0] == 4
    run_ranks(check_fp8_release, 1, path, reference_path)


def write_mxfp4_release(path: str, reference_path: str) -> None:
    """A tiny gpt-oss checkpoint as gpt-oss is released (each layer's experts as ``*_blocks`` and ``*_scales``, the rest
    unquantized), and beside it transformers' own dequantization of the experts with the attention projections rounded
    to FP8 by the reference above (what ``--quantize_base fp8`` holds them as)."""
    from transformers import AutoModelForCausalLM
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from megablocks_utils.model.export import hub_state_dict, write_shards

    config = tiny_moe_config("gpt_oss")
    torch.manual_seed(6)
    tensors = hub_state_dict(AutoModelForCausalLM.from_config(config))
    g = torch.Generator().manual_seed(7)
    released, values = {}, {}
    for name, value in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # [E, in, out] in transformers' layout
            experts, k, n = value.shape
            blocks = torch.randint(0, 256, (experts, n, k // 32, 16), generator=g, dtype=torch.uint8)
            scales = torch.randint(120, 126, (experts, n, k // 32), generator=g, dtype=torch.uint8)
            released[name + "_blocks"], released[name + "_scales"] = blocks, scales
            values[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        else:
            released[name] = value
            values[name] = fp8_rounded(value) if ".self_attn." in name and name.endswith("_proj.weight") else value
    for folder, weights in ((path, released), (reference_path, values)):
        os.makedirs(folder)
        write_shards(folder, [weights])
        config.save_pretrained(folder)


def check_mxfp4_release(rank, world, path, reference_path):
    from transformers import AutoModelForCausalLM

    from megablocks_utils import load_model

    model, _ = load_model(path, 1, device="cpu", quantize_base="fp8")
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.fmt == "mxfp4" and experts.gate_up_proj.data.dtype == torch.uint8
    assert torch.equal(experts.down_proj.data, _tensor(path, "model.layers.0.mlp.experts.down_proj_blocks"))
    reference = AutoModelForCausalLM.from_pretrained(reference_path, dtype=torch.float32)
    ids = torch.tensor([[1, 7, 42, 9, 3, 50, 17, 5]])
    model.eval()
    err = rel_err(model(ids).logits, reference(ids).logits)
    assert err <= TOL, err


def test_mxfp4_release_keeps_gpt_oss_experts_in_mxfp4(tmp_path, monkeypatch):
    """gpt-oss's released MXFP4 experts stay MXFP4 (the checkpoint's bytes), the attention goes to FP8, and the model
    gives the logits of transformers' model holding transformers' dequantization of the same bytes; without
    --quantize_base fp8 the checkpoint is refused with what to do; on a GPU (where it has run) it is taken."""
    from megablocks_utils.model.loading import check_model_dir
    from megablocks_utils.model.quantized_base import check_quantize_base, released_format

    path, reference_path = str(tmp_path / "mxfp4"), str(tmp_path / "values")
    write_mxfp4_release(path, reference_path)
    with pytest.raises(InputError) as error:
        check_model_dir(path)
    assert "holds MXFP4-quantized experts" in str(error.value) and "--quantize_base fp8" in str(error.value)
    assert released_format(path) == "mxfp4" and released_format(reference_path) is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    check_quantize_base("fp8", finetuning="lora", device_type="cuda", world_size=1, released="mxfp4")  # no error
    monkeypatch.setattr("megablocks_utils.model.quantized_base.RAN_ON_GPUS", ("fp8",))  # the guard, for a format not yet run
    with pytest.raises(InputError, match="mxfp4 experts have not run on a GPU yet"):
        check_quantize_base("fp8", finetuning="lora", device_type="cuda", world_size=1, released="mxfp4")
    run_ranks(check_mxfp4_release, 1, path, reference_path)


# ----------------------------------------------------------------------------- the fit check
PLAN = dict(world_size=1, ep_size=1, optim="adamw_bf16", max_length=4096, per_device_train_batch_size=1,
            gradient_accumulation_steps=4, finetuning="lora", checkpoint_experts=True, fsdp_wrap="layer", ep_capacity_factor=0)


def test_fit_check_counts_the_fp8_base_and_offers_it():
    """With --quantize_base fp8 the frozen experts and decoder linear layers (counted here on transformers' model of
    Qwen3-30B-A3B's published config, on the meta device) take 1 byte and a 128 x 128 block's share of a 4-byte scale
    where they took 2; the rest is unchanged. Where the bf16 base does not fit and the FP8 one does, the fit check's
    error offers it."""
    from torch import nn

    from megablocks_utils.model.architectures import decoder_layers
    from megablocks_utils.model.lora import meta_model
    from megablocks_utils.model.loading import load_config
    from megablocks_utils.train.memory_fit import fit_error
    from megablocks_utils.train.memory_plan import estimate_memory

    path = os.path.join(os.path.dirname(__file__), "configs", "qwen3-30b-a3b")
    model = meta_model(load_config(path))
    quantized = sum(m.weight.numel() for layer in decoder_layers(model) for m in layer.modules() if isinstance(m, nn.Linear))
    quantized += sum(p.numel() for n, p in model.named_parameters() if n.endswith(("experts.gate_up_proj", "experts.down_proj")))
    bf16, fp8 = (estimate_memory(path, **PLAN, quantize_base=q) for q in ("none", "fp8"))
    assert bf16.params - fp8.params == pytest.approx(quantized * (2 - 1 - 4 / 128**2), rel=1e-3)
    assert bf16.activations == fp8.activations and "frozen in fp8" in fp8.describe()
    gpu = 64 * 2**30  # between the two estimates (80.1 and 50.8 GiB)
    assert fp8.total < gpu < bf16.total
    assert "--quantize_base fp8 (" in fit_error(bf16, gpu) and fit_error(fp8, gpu) is None


def test_expert_gemms_dequantize_first_from_512_rows_per_expert():
    """auto: torch's bf16 grouped GEMM after a pass writing the weight where the experts have 512 rows each on average
    (Mixtral-8x7B's 4,096 tokens x top-2 over 8 experts: 1,024), the in-register kernel below (Qwen3-30B-A3B's x top-8
    over 128: 256); kernel and dequantize as asked; a name not known is refused."""
    from megablocks_utils.moe.quantized import dequantizes_first

    assert dequantizes_first("auto", 4096 * 2, 8) and not dequantizes_first("auto", 4096 * 8, 128)
    assert dequantizes_first("auto", 512 * 8, 8) and not dequantizes_first("auto", 512 * 8 - 1, 8)
    assert dequantizes_first("dequantize", 1, 128) and not dequantizes_first("kernel", 10**6, 8)
    with pytest.raises(ValueError, match="choose one of"):
        dequantizes_first("fast", 1, 1)


def test_run_start_names_the_experts_gemm_way(monkeypatch):
    """The run's line about the frozen base says, on a GPU, which way the FP8 experts' GEMMs take at the micro-step's
    rows per expert (Mixtral's top-2 over 8 experts: 4,096 tokens give 1,024 rows each, 1,024 tokens 256); CPU ranks
    (which always dequantize first) get no such clause."""
    from types import SimpleNamespace

    from torch import nn
    from transformers import MixtralConfig

    from megablocks_utils.model.quantized_base import describe_base

    model = nn.Module()
    model.config = MixtralConfig(num_local_experts=8, num_experts_per_tok=2)
    block = nn.Module()
    block.mlp = nn.Module()
    block.mlp.experts = nn.Module()
    block.mlp.experts.gate_up_proj = QuantizedWeight("fp8", *quantize_fp8(torch.randn(8, 256, 128)))
    model.layers = nn.ModuleList([block])
    on_cpu = describe_base(model, 4096)
    assert on_cpu.startswith("frozen base: experts in fp8") and "GEMMs" not in on_cpu, on_cpu
    monkeypatch.setattr(QuantizedWeight, "device", property(lambda self: SimpleNamespace(type="cuda")))
    assert describe_base(model, 4096).endswith("; the experts' GEMMs write each layer's bf16 weight first (1,024 rows per expert a micro-step)")
    assert describe_base(model, 1024).endswith("; the experts' GEMMs dequantize in registers (256 rows per expert a micro-step)")
    assert "GEMMs" not in describe_base(model)  # rows not given


AUTO_DISPATCH_CHECK = """
import json, torch
import megablocks_utils.moe.fp8_gemm_kernel as kernels
import megablocks_utils.moe.quantized as q
calls = []
for name in ("dequantize_fp8_blocks", "fp8_grouped_mm"):  # counted, then run as they are
    setattr(kernels, name, lambda *a, _f=getattr(kernels, name), _n=name: calls.append(_n) or _f(*a))
q._in_kernel = lambda x, fmt, offs: offs is not None and fmt == "fp8"  # as on a GPU (the kernels in the interpreter)
g = torch.Generator().manual_seed(0)
data, scale = q.quantize_fp8(torch.randn(2, 64, 32, generator=g))
w = q.dequantize("fp8", data, scale, torch.float32)
out = {}
for rows in (1024, 1022):  # 512 and 511 rows per expert
    offs = torch.tensor([rows // 2, rows], dtype=torch.int32)
    x = torch.randn(rows, 32, generator=g, requires_grad=True)
    calls.clear()
    y = q.frozen_matmul(x, "fp8", data, scale, offs)
    y.square().sum().backward()
    ref_x = x.detach().clone().requires_grad_()
    ref = torch.nn.functional.grouped_mm(ref_x, w.transpose(-2, -1), offs=offs)
    ref.square().sum().backward()
    out[str(rows)] = {"calls": list(calls), "out": float((y - ref).abs().max() / ref.abs().max()),
                      "grad": float((x.grad - ref_x.grad).abs().max() / ref_x.grad.abs().max())}
print(json.dumps(out))
"""


def test_auto_takes_each_way_by_rows_per_expert_forward_and_backward():
    """frozen_matmul's default (auto) on the GPU path (the kernels in Triton's interpreter): at 512 rows per expert the
    forward and the input's gradient each write the bf16 weight first, at 511 each runs the in-register kernel; both
    give the product and gradient of the dequantized weight."""
    from conftest import run_in_triton_interpreter

    result = run_in_triton_interpreter(AUTO_DISPATCH_CHECK)
    assert result["1024"]["calls"] == ["dequantize_fp8_blocks"] * 2, result
    assert result["1022"]["calls"] == ["fp8_grouped_mm"] * 2, result
    assert max(max(r["out"], r["grad"]) for r in result.values()) < 1e-5, result


def test_fit_check_counts_the_bf16_copy_where_the_experts_dequantize_first():
    """Where auto writes the experts' bf16 weight before their GEMM (rows per expert >= 512), the plan holds the
    largest one, a layer's gate and up projections (2 x 14336 x 4096 x 8 experts in bf16 at Mixtral-8x7B's width); at
    fewer rows per expert, or over a bf16 base, none."""
    from megablocks_utils.train.memory_plan import estimate_memory

    path = os.path.join(os.path.dirname(__file__), "configs", "mixtral-8x7b")
    plan = dict(PLAN, quantize_base="fp8")
    short, long = (estimate_memory(path, **dict(plan, max_length=n)) for n in (2048, 4096))  # 512 and 1,024 rows per expert
    shorter = estimate_memory(path, **dict(plan, max_length=2040))  # 510
    assert short.params - shorter.params == long.params - shorter.params == 2 * 14336 * 4096 * 8 * 2
    assert estimate_memory(path, **dict(plan, quantize_base="none")).params == estimate_memory(path, **dict(plan, quantize_base="none", max_length=2040)).params


def test_fit_check_counts_released_mxfp4_experts_at_their_bytes(tmp_path):
    """A checkpoint whose experts are released in MXFP4 is planned at their bytes (half a byte a weight and a byte per 32),
    read from the checkpoint's tensors themselves: the difference from planning them in FP8."""
    from megablocks_utils.train.memory_plan import estimate_memory

    path = str(tmp_path / "mxfp4")
    write_mxfp4_release(path, str(tmp_path / "values"))
    weights = sum(_tensor(path, f"model.layers.{i}.mlp.experts.{p}_blocks").numel() * 2 for i in range(2) for p in ("gate_up_proj", "down_proj"))
    plan = dict(PLAN, max_length=64, optim="adamw_torch")
    released = estimate_memory(path, **plan, quantize_base="fp8")
    as_config = estimate_memory(json.load(open(os.path.join(path, "config.json"))), **plan, quantize_base="fp8")
    assert released.plan.released == "mxfp4" and as_config.plan.released is None
    assert as_config.params - released.params == pytest.approx(weights * ((1 + 4 / 128**2) - (0.5 + 1 / 32)), rel=1e-6)

