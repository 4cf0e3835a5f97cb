"""train_fsdp2.py and train_fsdp1.py on 4 GPUs (NCCL), the embedded tiny Mixtral (4 experts): every way of laying the
experts over 4 ranks trains as experts replicated on each (ep 1, dp 4) does, LoRA included, and train_fsdp1.py at ep 4
as train_fsdp2.py at ep 4, and the static exchange read from the peers' memory (graphed, at ep 4) as the exact one. The
2-GPU tests cannot show what only appears at ep 4 (one expert a rank, three peers in every exchange) or at ep 2 x dp 2
(experts sharded over dp inside the node, a 2-D mesh).

Bounds are test_train_parity's ep 2 ones, for the same reasons (its docstring): fp32 loss 1e-5 relative; fp32 gradient
norm 1e-5 over the first 4 steps and 1e-4 over 20 (the layouts sum the norm's squares in different orders); bf16 at ep 4
as close to its fp32 run as ep 1 is to its own (1.5x + 1e-4). FSDP1 against FSDP2 in fp32: 1e-5 on both, as
test_fsdp1_vs_fsdp2 at 2 GPUs. Each test's runs start together (tiny: the 4 GPUs take several at once).
"""

import os

from .launch import gpus, launch_together, metrics, train_fsdp1, train_fsdp2, worst_relative

pytestmark = gpus(4)
COMMON = ("--max_steps", "20", "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2")


def assert_same_training(found: list[dict], reference: list[dict], grad_norm: bool = True) -> None:
    assert worst_relative(found, reference, "loss") <= 1e-5
    if grad_norm:
        assert worst_relative(found[:4], reference[:4], "grad_norm") <= 1e-5
        assert worst_relative(found, reference, "grad_norm") <= 1e-4


def test_ep4_and_ep2_dp2_equal_ep1_dp4_full_and_lora(tiny_model_dir, tmp_path):
    """Full fine-tuning at ep 4, ep 2 x dp 2 and ep 1 x dp 4 (fp32 and bf16), and LoRA on attention and experts (the
    default targets) at ep 4 and ep 1 (fp32): the same global batch, the same training."""
    runs = {"fp32_ep4": ("fp32", 4), "fp32_ep2": ("fp32", 2), "fp32_ep1": ("fp32", 1), "bf16_ep4": ("bf16", 4),
            "bf16_ep1": ("bf16", 1), "lora_ep4": ("fp32", 4, "--finetuning", "lora"),
            "lora_ep1": ("fp32", 1, "--finetuning", "lora")}
    out = {name: str(tmp_path / name) for name in runs}
    launch_together({name: train_fsdp2(4, out[name], "--model_name_or_path", tiny_model_dir, *COMMON, "--dtype", dtype,
                                       "--ep_size", str(ep), *extra) for name, (dtype, ep, *extra) in runs.items()}, timeout=600)
    found = {name: metrics(path) for name, path in out.items()}
    assert_same_training(found["fp32_ep4"], found["fp32_ep1"])
    assert_same_training(found["fp32_ep2"], found["fp32_ep1"])
    assert_same_training(found["lora_ep4"], found["lora_ep1"])
    for name in ("lora_ep4", "lora_ep1"):  # LoRA took effect: its final/ is a PEFT adapter
        assert os.path.exists(os.path.join(out[name], "final", "adapter_config.json")), name
    ep4_from_fp32 = worst_relative(found["bf16_ep4"], found["fp32_ep4"], "loss")
    ep1_from_fp32 = worst_relative(found["bf16_ep1"], found["fp32_ep1"], "loss")
    assert ep4_from_fp32 <= 1.5 * ep1_from_fp32 + 1e-4, (ep4_from_fp32, ep1_from_fp32)


def test_fsdp1_equals_fsdp2_at_ep4(tiny_model_dir, tmp_path):
    """README's accelerate command at ep 4 (the experts one a rank, passed to FSDP1 as ignored modules) against the
    FSDP2 script, fp32, 6 steps."""
    args = ("--model_name_or_path", tiny_model_dir, "--max_steps", "6", "--ep_size", "4", "--per_device_train_batch_size",
            "2", "--gradient_accumulation_steps", "2", "--warmup_steps", "1")
    out = {name: str(tmp_path / name) for name in ("fsdp1", "fsdp2")}
    launch_together({"fsdp1": train_fsdp1(4, out["fsdp1"], *args), "fsdp2": train_fsdp2(4, out["fsdp2"], *args, "--dtype", "fp32")})
    assert_same_training(metrics(out["fsdp1"]), metrics(out["fsdp2"]))


def test_the_token_pull_at_ep4_trains_as_the_exact_exchange(tiny_model_dir, tmp_path):
    """Ep 4 (one expert a rank, three peers to read from) on the static exchange read from the peers' memory
    (moe/pull_exchange.py), each micro-step a CUDA graph: at factor 4 (a rank never receives more than every rank's rows:
    no rerun), 0.1 (capacity 128 rows: every micro-step overflows, every step reruns eagerly on the exact exchange) and
    the defaults (auto: 3, reruns allowed),
    against the exact exchange launched from Python, bf16 loss within test_train_parity's 2e-3; in fp32 (no graphs, the
    per-expert loop on the valid rows) at 1.25 within 1e-5."""
    bf16 = ("--max_steps", "8", "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2", "--optim",
            "adamw_bf16", "--dtype", "bf16", "--ep_size", "4", "--fsdp_wrap", "none")
    runs = {"graphs": (*bf16, "--ep_capacity_factor", "4", "--cuda_graphs", "true"),
            "overflow": (*bf16, "--ep_capacity_factor", "0.1", "--cuda_graphs", "true"),
            "exact": (*bf16, "--ep_capacity_factor", "0", "--cuda_graphs", "false"),
            # the exchange's defaults: ep_capacity_factor auto (3 at ep 4, micro-steps as graphs), fsdp_wrap auto (none)
            "defaults": bf16[:-2],
            "fp32_static": (*COMMON, "--dtype", "fp32", "--ep_size", "4", "--ep_capacity_factor", "1.25"),
            "fp32_exact": (*COMMON, "--dtype", "fp32", "--ep_size", "4", "--ep_capacity_factor", "0")}
    out = {name: str(tmp_path / name) for name in runs}
    logs = launch_together({name: train_fsdp2(4, out[name], "--model_name_or_path", tiny_model_dir, *extra)
                            for name, extra in runs.items()}, timeout=600)
    found = {name: metrics(path) for name, path in out.items()}
    assert "cuda_graphs true: each micro-step replayed" in logs["graphs"] and "captured the first micro-step" in logs["graphs"]
    assert [r["exchange_reruns"] for r in found["graphs"]] == [0] * 8
    assert [r["exchange_reruns"] for r in found["overflow"]] == [2] * 8  # both micro-steps of every step
    assert "ep_capacity_factor auto: 3 (ep 4 = world size on one node" in logs["defaults"]
    assert "cuda_graphs auto: each micro-step replayed" in logs["defaults"]
    for name in ("graphs", "overflow", "defaults"):
        assert worst_relative(found[name], found["exact"], "loss") <= 2e-3, name
    assert found["graphs"][-1]["loss"] < found["graphs"][0]["loss"]
    assert_same_training(found["fp32_static"], found["fp32_exact"])
