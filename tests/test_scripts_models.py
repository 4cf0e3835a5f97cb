"""Both training scripts take non-Mixtral models from the table (Qwen2-MoE, with its shared expert; DeepSeek-V3;
GLM-4.5; DeepSeek-V2; gpt-oss, with expert biases, its clamped SwiGLU and sliding-window attention with sinks)."""

import json
import os

import pytest
import torch
from conftest import ROOT, read_jsonl, run_script, tiny_moe_config
from test_train_fsdp1 import accelerate_launch, assert_same_steps, readme_command

STEPS = ["--max_steps", "2", "--gradient_accumulation_steps", "2", "--warmup_steps", "1", "--per_device_train_batch_size", "2"]


def make_model_dir(path: str, data_path: str, model_type: str) -> None:
    """A tiny random model of ``model_type`` as transformers saves it (hub layout), with a tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM

    from megablocks_utils.model.tiny import train_tokenizer

    tokenizer = train_tokenizer(data_path)
    config = tiny_moe_config(
        model_type, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, max_position_embeddings=512,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path, max_shard_size="200KB")
    tokenizer.save_pretrained(path)


@pytest.mark.parametrize("model_type,extra", [
    ("qwen2_moe", []), ("deepseek_v3", ["--load_balance_coeff", "0.01"]), ("glm4_moe", []), ("deepseek_v2", []),
    # Weight decay strong enough to show in step 2's loss (no warmup: step 1 updates): norms and biases undecayed in both.
    ("gpt_oss", ["--weight_decay", "1.0", "--warmup_steps", "0", "--learning_rate", "0.05"]),
])
def test_model_trains_the_same_in_both_scripts(tmp_path, model_type, extra):
    """train_fsdp1 wraps the model's own decoder layer (not accelerate.yaml's Mixtral class) and equals
    train_fsdp2: Qwen2-MoE (shared expert, a dense layer between MoE layers), DeepSeek-V3 (sigmoid
    group-limited routing, no aux loss, MLA, a dense first layer; GLM-4.5 shares its MoE block), whose
    routing bias both scripts update after each optimizer step (load_balance_coeff), GLM-4.5 (DeepSeek-V3's
    router and shared experts, with its own attention: q/k norms and biases), DeepSeek-V2 (softmax group-limited
    routing, V2-Lite's attention), and gpt-oss
    (expert biases, clamped SwiGLU, sliding-window attention with sinks). No attention setting: auto picks a kernel
    every model can run (eager for gpt-oss's sinks on CPU)."""
    with open(os.path.join(ROOT, "data.json")) as f:
        (tmp_path / "data.json").write_text(json.dumps(json.load(f)[:40]))
    model_dir = str(tmp_path / f"tiny-{model_type}")
    make_model_dir(model_dir, str(tmp_path / "data.json"), model_type)
    model = ["--model_name_or_path", model_dir, "--data_path", str(tmp_path / "data.json"), "--ep_size", "2"]
    fsdp2 = run_script("train_fsdp2.py", 2, *model, "--output_dir", str(tmp_path / "fsdp2"), *STEPS, "--save_steps", "2", *extra)
    assert fsdp2.returncode == 0, fsdp2.stderr[-4000:]
    accelerate_launch(readme_command(), *model, "--output_dir", str(tmp_path / "fsdp1"), *STEPS, *extra)  # extra last: it wins
    fsdp1_records = read_jsonl(str(tmp_path / "fsdp1" / "metrics.jsonl"))
    fsdp2_records = read_jsonl(str(tmp_path / "fsdp2" / "metrics.jsonl"))
    assert len(fsdp2_records) == 2
    assert_same_steps(fsdp1_records, fsdp2_records, rel=1e-5)
    # The export command on the last checkpoint writes the model the run itself exported (the model's own
    # expert layout, biases included, through DCP and back).
    from transformers import AutoModelForCausalLM

    out = str(tmp_path / "exported")
    ckpt = str(tmp_path / "fsdp2" / "checkpoints" / "step_00000002")
    from megablocks_utils.tools import export

    assert export.main([ckpt, out]) == 0  # the command's entry point, in this process (test_checkpoint runs the command)
    ids = torch.tensor([[1, 7, 42, 9, 3, 25]])
    exported = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")(ids).logits
    final = AutoModelForCausalLM.from_pretrained(str(tmp_path / "fsdp2" / "final"), attn_implementation="eager")(ids).logits
    torch.testing.assert_close(exported, final, rtol=0, atol=0)
    if model_type == "deepseek_v3":  # both moved DeepSeek-V3's own bias the same way, and exported it
        fsdp1_bias, fsdp2_bias = (score_biases(str(tmp_path / run / "final")) for run in ("fsdp1", "fsdp2"))
        assert sorted(fsdp2_bias) == ["model.layers.1.mlp.gate.e_score_correction_bias", "model.layers.2.mlp.gate.e_score_correction_bias"]
        for name, bias in fsdp2_bias.items():
            assert bias.abs().max() > 0 and bias.dtype == torch.float32, name  # the sum of 2 steps of +-0.01
            assert torch.equal(bias, fsdp1_bias[name]), name


def score_biases(model_dir: str) -> dict:
    from safetensors import safe_open

    with open(os.path.join(model_dir, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    out = {}
    for name, file in weight_map.items():
        if name.endswith("e_score_correction_bias"):
            with safe_open(os.path.join(model_dir, file), "pt") as f:
                out[name] = f.get_tensor(name)
    return out
