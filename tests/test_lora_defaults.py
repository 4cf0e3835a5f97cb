"""lora_target_modules="auto" (the default): every architecture of the model table gets its attention projections and
its routed experts, trains at ep 2, and PEFT loads the adapter it saves (megablocks_utils/model/lora.py)."""

import copy
import json
import os

import torch
from conftest import ARCHITECTURES, run_ranks, tiny_moe_config
from test_lora import ALPHA, R, TOL, rel_err

from megablocks_utils.model.lora import DEFAULT_TARGETS, check_lora

EXPERTS = ("experts.gate_up_proj", "experts.down_proj")


def default_lora(config):
    return check_lora(config, finetuning="lora", r=R, alpha=ALPHA, dropout=0.0, target_modules=DEFAULT_TARGETS,
                      moe_backend="native", load_balance_coeff=0.0, merge_lora=False)


def test_auto_targets_are_the_attention_projections_and_routed_experts():
    """MLA with the q low-rank path (DeepSeek-V3), without it (DeepSeek-V2-Lite's layout), gpt-oss's attention with
    sinks; no router, shared expert or dense MLP. An explicit list keeps its names, and auto in it adds the defaults."""
    from megablocks_utils.model.lora import meta_model, resolve_targets

    assert DEFAULT_TARGETS == "auto"
    expected = {
        "deepseek_v3": ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj") + EXPERTS,
        "deepseek_v2": ("q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj") + EXPERTS,
        "gpt_oss": ("q_proj", "k_proj", "v_proj", "o_proj") + EXPERTS,
    }
    for arch, targets in expected.items():
        assert default_lora(tiny_moe_config(arch)).targets == targets, arch
    model = meta_model(tiny_moe_config("deepseek_v3"))
    assert resolve_targets(model, ("o_proj", "experts.down_proj")) == ("o_proj", "experts.down_proj")
    assert resolve_targets(model, ("auto", "shared_experts.gate_proj"))[-1] == "shared_experts.gate_proj"


def train_default_lora_on_every_architecture(rank, world, out_root):
    for arch in ARCHITECTURES:
        try:
            train_save_and_load_in_peft(rank, world, arch, os.path.join(out_root, arch))
        except AssertionError as e:
            raise AssertionError(f"{arch}: {e}") from e


def train_save_and_load_in_peft(rank, world, arch, out_dir):
    """LoRA at the default targets on ep 2 (FSDP2 on the dense weights, as the script applies it), two AdamW steps on
    each rank's rows: finite losses, every adapter's gradient non-zero by the second step; the adapter saved as the
    script saves it, and PeftModel.from_pretrained on transformers' model of the same weights gives our logits."""
    from peft import PeftModel
    from test_equivalence import make_batch, rank_loss
    from transformers import AutoModelForCausalLM

    from megablocks_utils import build_mesh, shard_moe, spec_for
    from megablocks_utils.model.lora import add_lora, peft_tensors, save_peft_adapter
    from megablocks_utils.parallel.parallelize import parallelize

    config = tiny_moe_config(arch)
    spec = spec_for(config)
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(config).float()
    model = copy.deepcopy(base)
    mesh = build_mesh(2, "cpu")
    shard_moe(model, mesh, device="cpu")
    lora = default_lora(config)
    found = add_lora(model, mesh, lora, torch.float32)
    assert found.linears and all(".self_attn." in n for n in found.linears), found.linears  # attention only
    assert found.target_parameters == EXPERTS and all(ps == ("gate_up_proj", "down_proj") for ps in found.experts.values())
    assert len(found.experts) == sum(1 for name, _ in model.named_modules() if name.endswith(f".{spec.block_attr}.experts"))
    parallelize(model, mesh, param_dtype=torch.float32, device="cpu")
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, foreach=False)

    input_ids, mask, labels = make_batch(config.vocab_size)
    for step in (1, 2):
        _, _, _, loss = rank_loss(model, mesh, config, input_ids, mask, labels, rank, world)
        loss.backward()
        global_loss = loss.detach() / world
        torch.distributed.all_reduce(global_loss)
        assert torch.isfinite(global_loss), (step, float(global_loss))
        grads = peft_tensors(model, grads=True)
        zero = [k for k, g in grads.items() if not g.abs().sum() > 0 and (step == 2 or "lora_B" in k)]  # A's waits for B != 0
        assert grads and not zero, (step, zero)
        optimizer.step()
        optimizer.zero_grad()

    save_peft_adapter(model, lora, found, out_dir, "")
    model.eval()
    with torch.no_grad():
        ours = model(input_ids, attention_mask=mask).logits
    if rank == 0:
        with open(os.path.join(out_dir, "adapter_config.json")) as f:
            saved = json.load(f)
        assert saved["target_modules"] is not None and sorted(saved["target_modules"]) == sorted(found.target_modules), saved
        assert saved["target_parameters"] == list(EXPERTS), saved["target_parameters"]
        base.eval()
        with torch.no_grad():
            base_logits = base(input_ids, attention_mask=mask).logits
            peft_logits = PeftModel.from_pretrained(base, out_dir)(input_ids, attention_mask=mask).logits
        assert rel_err(peft_logits, base_logits) > 1e-3, "the adapter changes nothing: it did not train or was not loaded"
        assert rel_err(peft_logits, ours) <= TOL, rel_err(peft_logits, ours)
    torch.distributed.barrier()


def test_lora_at_default_targets_trains_on_every_architecture_and_peft_loads_it(tmp_path):
    """Every architecture of the model table, one spawn of 2 ranks at ep 2 for all of them."""
    run_ranks(train_default_lora_on_every_architecture, 2, str(tmp_path))
