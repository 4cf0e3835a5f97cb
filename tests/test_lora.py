"""finetuning="lora": the expert-parallel LoRA model equals transformers + PEFT (loss, logits, every adapter gradient),
its final/ is a PEFT adapter that PEFT loads to our logits, its checkpoints hold only the adapters and resume exactly,
and bad LoRA settings stop with one line (megablocks_utils/model/lora.py, megablocks_utils/moe/lora.py)."""

import copy
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from conftest import (
    ROOT,
    TWO_RANK_ARGS,
    read_jsonl,
    run_ranks,
    standard_args,
    tiny_moe_config,
    train_fsdp2,
)

from megablocks_utils.errors import InputError
from megablocks_utils.model.lora import DEFAULT_TARGETS, check_lora

TOL = 1e-5
R, ALPHA = 4, 8
# (architecture, targets, expert path): fused experts as transformers holds them (Mixtral, Qwen3-MoE) and transposed with
# interleaved gate/up and biases (gpt-oss), each on the per-expert loop and on the grouped GEMM path (torch runs it on
# CPU too); one case adapts down_proj alone (PEFT then wraps the experts once: another key nesting).
CASES = [(arch, DEFAULT_TARGETS, grouped) for arch in ("mixtral", "qwen3_moe", "gpt_oss") for grouped in (False, True)]
CASES.append(("mixtral", "o_proj,experts.down_proj", True))
# Several ranks: each architecture once, on one expert path or the other (a spawned rank costs more per case).
MESH_CASES = [("mixtral", DEFAULT_TARGETS, True), ("qwen3_moe", DEFAULT_TARGETS, False), ("gpt_oss", DEFAULT_TARGETS, True)]
LORA_ARGS = ["--finetuning", "lora", "--lora_dropout", "0.1", "--merge_lora", "true"]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))


def check_matches_peft(rank, world, ep_size, checkpointing, cases):
    for mode in checkpointing.split(","):
        for case in cases:
            try:
                check_one(rank, world, ep_size, *case, activation_checkpointing=mode)
            except AssertionError as e:
                raise AssertionError(f"{mode}, {case}: {e}") from e


def check_one(rank, world, ep_size, arch, targets, grouped, activation_checkpointing="none"):
    """Our model (EP, FSDP2 as the script applies it, LoRA) against PeftModel on transformers' model, the same
    random adapters (B too, so that every gradient is non-zero), fp32, the whole batch in one process.
    ``activation_checkpointing`` "experts": none, and the routed experts recomputed (checkpoint_experts)."""
    from peft import get_peft_model, get_peft_model_state_dict
    from test_equivalence import make_batch, rank_loss
    from transformers import AutoModelForCausalLM

    import megablocks_utils.moe.layer as moe_layer
    from megablocks_utils import build_mesh, shard_moe
    from megablocks_utils.model.lora import (
        LoraSettings,
        add_lora,
        is_adapter_name,
        load_peft_tensors,
        merge_adapters,
        parse_targets,
        peft_config,
        peft_tensors,
    )
    from megablocks_utils.parallel.parallelize import parallelize

    moe_layer.grouped_mm_supported = (lambda x: True) if grouped else (lambda x: False)  # this spawned rank only
    config = tiny_moe_config(arch)
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(config).float()
    model = copy.deepcopy(base)
    lora = LoraSettings(r=R, alpha=ALPHA, dropout=0.0, targets=parse_targets(targets))
    mesh = build_mesh(ep_size, "cpu")
    shard_moe(model, mesh, device="cpu")
    found = add_lora(model, mesh, lora, torch.float32)
    experts = activation_checkpointing == "experts"
    parallelize(model, mesh, param_dtype=torch.float32, activation_checkpointing="none" if experts else activation_checkpointing,
                checkpoint_experts=experts, device="cpu")
    assert any(m.recompute for m in model.modules() if hasattr(m, "recompute")) == experts

    reference = get_peft_model(base, peft_config(lora, found, "", inference_mode=False))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if "lora_" in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    state = get_peft_model_state_dict(reference)
    load_peft_tensors(model, state)  # PEFT's keys into our layout, each rank its shard

    input_ids, mask, labels = make_batch(config.vocab_size)
    ref_out = reference(input_ids, attention_mask=mask, labels=labels, output_router_logits=True)
    ref_out.loss.backward()
    rows, out, stats, loss = rank_loss(model, mesh, config, input_ids, mask, labels, rank, world)
    loss.backward()

    global_loss = loss.detach() / world
    torch.distributed.all_reduce(global_loss)
    assert rel_err(global_loss, ref_out.loss) <= TOL, (float(global_loss), float(ref_out.loss))
    assert rel_err(out.logits, ref_out.logits[rows]) <= TOL
    grads = peft_tensors(model, grads=True)
    ref_grads = {n.replace(".default", ""): p.grad for n, p in reference.named_parameters() if "lora_" in n}
    assert set(grads) == set(ref_grads) == set(state), sorted(set(grads) ^ set(ref_grads))
    for key, grad in grads.items():
        assert grad.shape == ref_grads[key].shape, key
        assert rel_err(grad, ref_grads[key]) <= TOL, (key, rel_err(grad, ref_grads[key]))
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trained and all(is_adapter_name(n) for n in trained), trained
    assert all(p.grad is None for n, p in model.named_parameters() if not is_adapter_name(n)), "a frozen weight got a gradient"
    merge_adapters(model)  # W += s B A into each rank's shard of every weight, adapters removed: PEFT's logits again
    assert not [n for n, _ in model.named_parameters() if is_adapter_name(n)]
    with torch.no_grad():
        merged = model(input_ids[rows], attention_mask=mask[rows]).logits
    assert rel_err(merged, ref_out.logits[rows]) <= TOL, ("merged", rel_err(merged, ref_out.logits[rows]))


@pytest.mark.parametrize("dp,ep,checkpointing,cases", [(1, 1, "none", CASES), (1, 2, "selective,experts", MESH_CASES),
                                                        (2, 2, "full", MESH_CASES)],
                         ids=["one-rank", "ep2-selective-experts", "dp2-ep2-full"])
def test_lora_loss_and_adapter_grads_match_transformers_and_peft(dp, ep, checkpointing, cases):
    """One rank (no FSDP), ep 2 (experts' adapters split over ep, out of FSDP), dp 2 x ep 2 (FSDP shards them over
    dp too); activation checkpointing (and the experts' recompute alone) recomputes the adapters too. One spawn per
    mesh runs its cases."""
    run_ranks(check_matches_peft, dp * ep, ep, checkpointing, cases)


def check_recompute_replays_dropout(rank, world):
    """LoRA with dropout: each recompute (full, selective, the experts alone) gives the adapters the gradients of no
    recompute, from one seed: the recompute replays the forward's dropout masks. Then that replay switched off by hand
    (the masks then differ), to show the comparison can fail."""
    for force_rng in (True, False):
        _recompute_against_none(rank, world, force_rng)


def _recompute_against_none(rank, world, force_rng):
    from test_equivalence import make_batch, rank_loss
    from transformers import AutoModelForCausalLM

    from megablocks_utils import build_mesh, shard_moe
    from megablocks_utils.model.lora import LoraSettings, add_lora, load_peft_tensors, parse_targets, peft_tensors
    from megablocks_utils.moe.layer import ExpertParallelExperts
    from megablocks_utils.parallel.parallelize import parallelize

    config = tiny_moe_config("qwen3_moe")
    lora = LoraSettings(r=R, alpha=ALPHA, dropout=0.3, targets=parse_targets(DEFAULT_TARGETS))
    grads, adapters = {}, None
    for mode in ("none", "full", "selective", "experts"):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).float().train()
        mesh = build_mesh(1, "cpu")
        shard_moe(model, mesh, device="cpu")
        add_lora(model, mesh, lora, torch.float32)
        parallelize(model, mesh, param_dtype=torch.float32, activation_checkpointing="none" if mode == "experts" else mode,
                    checkpoint_experts=mode == "experts", device="cpu")
        experts = [m for m in model.modules() if isinstance(m, ExpertParallelExperts)]
        assert experts and all(m.recompute_rng for m in experts)
        if not force_rng:
            for m in experts:
                m.recompute_rng = False
        if adapters is None:  # random B too, so that every adapter's gradient depends on the masks
            g = torch.Generator().manual_seed(1)
            adapters = {k: 0.2 * torch.randn(v.shape, generator=g) for k, v in peft_tensors(model).items()}
        load_peft_tensors(model, adapters)
        input_ids, mask, labels = make_batch(config.vocab_size)
        torch.manual_seed(5)
        rank_loss(model, mesh, config, input_ids, mask, labels, rank, world)[3].backward()
        grads[mode] = peft_tensors(model, grads=True)
    for mode in ("full", "selective", "experts"):
        worst = max(rel_err(grads[mode][k], grads["none"][k]) for k in grads["none"])
        if force_rng or mode != "experts":
            assert worst <= 1e-6, (mode, worst)
        else:
            assert worst > 1e-3, (mode, worst)  # the experts' recompute without the replay draws other masks
    model = AutoModelForCausalLM.from_config(config).float().train()  # no dropout: no RNG state read
    shard_moe(model, mesh, device="cpu")
    add_lora(model, mesh, LoraSettings(r=R, alpha=ALPHA, dropout=0.0, targets=lora.targets), torch.float32)
    parallelize(model, mesh, param_dtype=torch.float32, activation_checkpointing="full", checkpoint_experts=True, device="cpu")
    assert not any(m.recompute_rng for m in model.modules() if isinstance(m, ExpertParallelExperts))


def check_replay_kept_on_two_ranks(rank, world):
    """Above the GPU count the skipped replay has run on (SKIPPED_RNG_REPLAY_RAN_ON_GPUS) the recompute replays the RNG
    state as before, dropout or not."""
    from transformers import AutoModelForCausalLM

    from megablocks_utils import build_mesh, shard_moe
    from megablocks_utils.moe.layer import ExpertParallelExperts
    from megablocks_utils.parallel.activation_checkpointing import SKIPPED_RNG_REPLAY_RAN_ON_GPUS
    from megablocks_utils.parallel.parallelize import parallelize

    assert world > SKIPPED_RNG_REPLAY_RAN_ON_GPUS
    model = AutoModelForCausalLM.from_config(tiny_moe_config("qwen3_moe")).float().train()
    mesh = build_mesh(2, "cpu")
    shard_moe(model, mesh, device="cpu")
    parallelize(model, mesh, param_dtype=torch.float32, activation_checkpointing="full", checkpoint_experts=True, device="cpu")
    experts = [m for m in model.modules() if isinstance(m, ExpertParallelExperts)]
    assert experts and all(m.recompute_rng for m in experts)


def test_recompute_replays_lora_dropout_and_skips_the_rng_without_it(tiny_model_dir):
    """With dropout every recompute replays the forward's RNG state; without any, none is read (a CUDA graph capture
    cannot read it: train/cuda_graph.py)."""
    from transformers import AutoModelForCausalLM

    from megablocks_utils.parallel.activation_checkpointing import trains_with_dropout

    run_ranks(check_recompute_replays_dropout, 1)
    run_ranks(check_replay_kept_on_two_ranks, 2)
    assert not trains_with_dropout(AutoModelForCausalLM.from_pretrained(tiny_model_dir))


def test_expert_adapter_dropout_acts_in_training_only():
    """dropout(x) feeds only the adapter: in eval the output is dropout-free; in training it differs, and the base
    projection is untouched (zero adapters give the base output whatever the dropout)."""
    from megablocks_utils.moe.layer import ExpertParallelExperts
    from megablocks_utils.moe.lora import ExpertLoRA, StackedAdapter

    g = torch.Generator().manual_seed(0)
    experts = ExpertParallelExperts(4, SimpleNamespace(ep_size=1), "silu")
    experts.set_weights(torch.nn.Parameter(torch.randn(4, 16, 8, generator=g)), torch.nn.Parameter(torch.randn(4, 8, 8, generator=g)))
    x, top_i, top_w = torch.randn(10, 8, generator=g), torch.randint(0, 4, (10, 2), generator=g), torch.rand(10, 2, generator=g)
    base = experts(x, top_i, top_w)
    adapter = {"gate_up_proj": StackedAdapter(torch.randn(4, 2, 8, generator=g), torch.randn(4, 16, 2, generator=g))}
    outputs = {}
    for p in (0.0, 0.5):
        experts.lora = ExpertLoRA(adapter, r=2, alpha=4, dropout=p)
        for training in (False, True):
            experts.train(training)
            outputs[p, training] = experts(x, top_i, top_w)
    assert rel_err(outputs[0.0, False], base) > 1e-2
    assert torch.equal(outputs[0.5, False], outputs[0.0, False]) and torch.equal(outputs[0.0, True], outputs[0.0, False])
    assert not torch.allclose(outputs[0.5, True], outputs[0.0, True])
    with torch.no_grad():
        adapter["gate_up_proj"].lora_B.zero_()
    experts.lora = ExpertLoRA(adapter, r=2, alpha=4, dropout=0.5)
    torch.testing.assert_close(experts.train()(x, top_i, top_w), base)


# ----------------------------------------------------------------------------- settings
LORA = dict(finetuning="lora", r=16, alpha=32, dropout=0.0, target_modules=DEFAULT_TARGETS, moe_backend="native",
            load_balance_coeff=0.0, merge_lora=False)


@pytest.mark.parametrize("changes,message", [
    (dict(target_modules="q_proj,gate"), "'gate' names MixtralTopKRouter modules (model.layers.0.mlp.gate), which take no adapter"),
    (dict(target_modules="qproj"), "'qproj' matches nothing in mixtral; adaptable names: k_proj, lm_head, o_proj, q_proj, v_proj, "
                                   "experts.gate_up_proj, experts.down_proj"),
    (dict(target_modules=" , "), "--lora_target_modules is empty"),
    (dict(moe_backend="megablocks"), "--finetuning lora runs on moe_backend native"),
    (dict(load_balance_coeff=0.01), "--load_balance_coeff trains a routing bias, which a PEFT adapter cannot hold"),
    (dict(finetuning="full", merge_lora=True), "--merge_lora true needs --finetuning lora"),
])
def test_bad_lora_settings_name_the_fix(changes, message):
    with pytest.raises(InputError) as error:
        check_lora(tiny_moe_config("mixtral"), **{**LORA, **changes})
    assert message in str(error.value) and "\n" not in str(error.value), str(error.value)


def test_targets_split_into_peft_modules_and_parameters():
    from megablocks_utils.model.lora import find_targets, meta_model

    found = find_targets(meta_model(tiny_moe_config("qwen2_moe")), ("q_proj", "down_proj", "experts.gate_up_proj"))
    # down_proj: the shared expert's and the dense layer's linear layers, and the experts' fused weight
    assert found.target_modules == ("q_proj", "down_proj") and found.target_parameters == ("down_proj", "experts.gate_up_proj")
    assert "model.layers.0.mlp.shared_expert.down_proj" in found.linears and "model.layers.1.mlp.down_proj" in found.linears
    assert found.experts == {f"model.layers.{i}.mlp.experts": ("gate_up_proj", "down_proj") for i in (0, 2)}
    assert check_lora(tiny_moe_config("mixtral"), **LORA).targets == ("q_proj", "k_proj", "v_proj", "o_proj", "experts.gate_up_proj",
                                                                      "experts.down_proj")  # auto, resolved
    assert check_lora(tiny_moe_config("mixtral"), **{**LORA, "finetuning": "full"}) is None


def test_train_fsdp1_refuses_lora_in_one_line():
    result = subprocess.run([sys.executable, os.path.join(ROOT, "train_fsdp1.py"), "--finetuning", "lora"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == "error: --finetuning lora is not supported by train_fsdp1.py; use train_fsdp2.py --finetuning lora"


# ----------------------------------------------------------------------------- the fit check
def test_fit_check_plans_frozen_weights_and_adapters():
    """Frozen weights at 2 bytes with no gradient or state; the adapters (as many as PEFT makes) at the optimizer's
    bytes; dropout adds to the activations; one rank needs no FSDP."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from megablocks_utils.model.lora import (
        LoraSettings,
        find_targets,
        parse_targets,
        peft_config,
    )
    from megablocks_utils.train.memory_plan import estimate_memory

    config = tiny_moe_config("qwen3_moe")
    plan = dict(world_size=2, ep_size=2, optim="adamw_torch", max_length=64, per_device_train_batch_size=2)
    full = estimate_memory(config, **plan)
    lora = estimate_memory(config, **plan, finetuning="lora", lora_r=R)
    model = AutoModelForCausalLM.from_config(config)
    settings = LoraSettings(R, ALPHA, 0.0, parse_targets(DEFAULT_TARGETS))
    peft = get_peft_model(model, peft_config(settings, find_targets(model, settings.targets), ""))
    assert lora.adapters == sum(p.numel() for n, p in peft.named_parameters() if "lora_" in n) > 0
    counts = full.counts
    shards = counts.dense / 2 + counts.expert / 2  # dense over both ranks, experts over ep 2
    assert lora.params == pytest.approx(2 * shards + 4 * lora.adapters / 2)
    assert lora.grads == pytest.approx(4 * lora.adapters / 2) and lora.optimizer_state == pytest.approx(8 * lora.adapters / 2)
    assert lora.activations > full.activations and lora.total < full.total
    assert estimate_memory(config, **plan, finetuning="lora", lora_r=R, lora_dropout=0.1).activations > lora.activations
    assert not estimate_memory(config, **{**plan, "world_size": 1, "ep_size": 1}, finetuning="lora").fsdp


# ----------------------------------------------------------------------------- train_fsdp2.py
@pytest.fixture(scope="module")
def lora_run(tiny_model_dir, small_data, tmp_path_factory) -> str:
    """train_fsdp2.py --finetuning lora on 2 ranks (ep 2, full checkpointing, adapter dropout 0.1, checkpoints at
    steps 2 and 4, --merge_lora true). Returns its output_dir."""
    out = str(tmp_path_factory.mktemp("lora") / "run")
    train_fsdp2(2, out, *standard_args(tiny_model_dir, small_data), *TWO_RANK_ARGS, *LORA_ARGS)
    return out


def check_peft_gives_our_logits(rank, world, model_dir, final, merged):
    """PeftModel.from_pretrained(base, final/) == our model with final/'s adapters == the merged export, logits in fp32."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from megablocks_utils import load_model
    from megablocks_utils.model.lora import LoraSettings, add_lora, load_peft_tensors

    with open(os.path.join(final, "adapter_config.json")) as f:
        saved = json.load(f)
    ids = torch.tensor([[1, 7, 42, 99, 3, 250, 17, 5]])
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    base_logits = base(ids).logits
    peft_logits = PeftModel.from_pretrained(base, final)(ids).logits
    merged_logits = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)(ids).logits
    ours, mesh = load_model(model_dir, 1, device="cpu")
    lora = LoraSettings(saved["r"], saved["lora_alpha"], 0.0, tuple(saved["target_modules"]) + tuple(saved["target_parameters"]))
    add_lora(ours, mesh, lora, torch.float32)
    load_peft_tensors(ours, load_file(os.path.join(final, "adapter_model.safetensors")))
    ours.eval()
    our_logits = ours(ids).logits
    assert rel_err(peft_logits, base_logits) > 1e-3, "the adapter changes nothing: it did not train or was not loaded"
    assert rel_err(peft_logits, our_logits) <= TOL, rel_err(peft_logits, our_logits)
    assert rel_err(merged_logits, our_logits) <= TOL, rel_err(merged_logits, our_logits)


def test_final_is_a_peft_adapter_that_gives_our_logits(lora_run, tiny_model_dir):
    final = os.path.join(lora_run, "final")
    assert sorted(n for n in os.listdir(final) if n.startswith("adapter")) == ["adapter_config.json", "adapter_model.safetensors"]
    assert not [n for n in os.listdir(final) if n.startswith("model")], "final/ holds model weights, not only the adapter"
    with open(os.path.join(final, "adapter_config.json")) as f:
        saved = json.load(f)
    assert (saved["peft_type"], saved["task_type"], saved["r"], saved["lora_alpha"]) == ("LORA", "CAUSAL_LM", 16, 32)
    assert sorted(saved["target_modules"]) == ["k_proj", "o_proj", "q_proj", "v_proj"]
    assert saved["target_parameters"] == ["experts.gate_up_proj", "experts.down_proj"] and saved["lora_dropout"] == 0.0
    run_ranks(check_peft_gives_our_logits, 1, tiny_model_dir, final, os.path.join(lora_run, "merged"))


def test_checkpoints_hold_only_adapters_and_resume_exactly(lora_run, tiny_model_dir, small_data, tmp_path, capsys):
    """No frozen weight (nor its optimizer state) in a checkpoint (the export command says so and stops); resuming from
    step 2 repeats steps 3 and 4 bit for bit (adapter dropout included: the RNG state is restored) and ends with the
    same adapter."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    from megablocks_utils.model.lora import is_adapter_name

    ckpt = os.path.join(lora_run, "checkpoints", "step_00000002")
    keys = dcp.FileSystemReader(ckpt).read_metadata().state_dict_metadata
    model_keys = [k for k in keys if k.startswith("model.")]
    state_keys = [k for k in keys if k.startswith("optim.state.")]
    assert model_keys and all(is_adapter_name(k) for k in model_keys), [k for k in model_keys if not is_adapter_name(k)][:5]
    assert state_keys and all(is_adapter_name(k) for k in state_keys), [k for k in state_keys if not is_adapter_name(k)][:5]
    from megablocks_utils.tools import export

    assert export.main([ckpt, str(tmp_path / "hf")]) == 2  # the command's entry point, in this process
    printed = capsys.readouterr().out
    assert "is a LoRA run's checkpoint: it holds the adapters only" in printed, printed

    out = str(tmp_path / "resumed")
    train_fsdp2(2, out, *standard_args(tiny_model_dir, small_data), *TWO_RANK_ARGS, *LORA_ARGS, "--resume", ckpt)
    expected = [(r["step"], r["loss"], r["grad_norm"]) for r in read_jsonl(os.path.join(lora_run, "metrics.jsonl"))]
    got = [(r["step"], r["loss"], r["grad_norm"]) for r in read_jsonl(os.path.join(out, "metrics.jsonl"))]
    assert [s for s, _, _ in got] == [3, 4] and got == expected[2:], (got, expected)
    first, second = (load_file(os.path.join(d, "final", "adapter_model.safetensors")) for d in (lora_run, out))
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


def test_readme_lora_commands_parse_and_fit():
    """README's LoRA commands: train_fsdp2.py's parser takes them, the LoRA checks pass, and the fit check says they fit
    the GPU the README names (the published config.json in tests/configs)."""
    import re
    import shlex

    from test_settings import BLOCK, FSDP2

    from megablocks_utils.config.settings import parse_settings
    from megablocks_utils.model.loading import load_config
    from megablocks_utils.train.memory_fit import fit_error
    from megablocks_utils.train.memory_plan import estimate_memory

    gpus = {"Qwen3-30B-A3B": ("qwen3-30b-a3b", 141), "Mixtral-8x7B-v0.1": ("mixtral-8x7b", 80)}
    text = open(os.path.join(ROOT, "README.md")).read().split("\n## LoRA on every expert\n", 1)[1].split("\n## ", 1)[0]
    commands = [c for block in re.findall(r"```bash\n(.*?)```", text, re.S) for c in block.replace("\\\n", " ").splitlines()]
    assert len(commands) == 2 and all("--finetuning lora" in c for c in commands), commands
    for command in commands:
        words = shlex.split(command)
        nproc = int(words[1].split("=")[1])
        settings = dict(BLOCK)
        parse_settings(settings, FSDP2, words[3:])
        model, gib = gpus[os.path.basename(settings["model_name_or_path"])]
        config = load_config(os.path.join(ROOT, "tests", "configs", model))
        check_lora(config, finetuning=settings["finetuning"], r=settings["lora_r"], alpha=settings["lora_alpha"],
                   dropout=settings["lora_dropout"], target_modules=settings["lora_target_modules"], moe_backend=settings["moe_backend"],
                   load_balance_coeff=settings["load_balance_coeff"], merge_lora=settings["merge_lora"])
        plan = estimate_memory(config, world_size=nproc, ep_size=settings["ep_size"], optim=settings["optim"], nproc_per_node=nproc,
                               max_length=settings["max_length"], per_device_train_batch_size=settings["per_device_train_batch_size"],
                               gradient_accumulation_steps=settings["gradient_accumulation_steps"],
                               activation_checkpointing=settings["activation_checkpointing"], finetuning=settings["finetuning"],
                               lora_r=settings["lora_r"], lora_dropout=settings["lora_dropout"],
                               lora_target_modules=settings["lora_target_modules"])
        assert fit_error(plan, gib * 2**30) is None and plan.total <= 0.9 * gib * 2**30, (command, plan.total / 2**30)
