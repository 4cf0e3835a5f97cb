"""train_fsdp2.py on GPUs (NCCL) gives the same training whatever the mesh and whether attention and norms are compiled.

Each case launches the script on the embedded tiny Mixtral, 20 steps (4 rows x 2 micro-steps per rank), and compares
the per-step loss and gradient norm of metrics.jsonl. The runs of a test start together: they are small.
Tolerances: fp32 1e-5 relative (the CPU suite's equality bound); bf16 2e-3 on the loss, half the bf16 unit roundoff
2^-8: two bf16 runs that round at different points drift as near-tie routing decisions flip (measured 5.3e-4 and 1.0e-3
after 20 steps); their gradient norm is no criterion (one routing flip at a gradient spike moved it 2e-1). Across
meshes (ep 2 against ep 1) two bf16 runs drifted 1.2e-2 apart at a spike both had, so there each bf16 run is held to
its own mesh's fp32 run.
"""

import os

import pytest

from .launch import gpus, launch_together, metrics, train_fsdp2, worst_relative

pytestmark = gpus(1)
COMMON = ("--max_steps", "20", "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2")


@gpus(2)
def test_ep2_equals_ep1_dp2(tiny_model_dir, tmp_path):
    """Experts split over 2 GPUs against experts replicated (ep = 1, dp = 2), same global batch: the fp32 loss equal to
    1e-5 (measured on 2 H200s: 1.9e-7, 2026-11-27), the fp32 gradient norm to 1e-5 over the first 4 steps (as before) and
    1e-4 over 20: the two layouts sum the norm's squares (and the experts' gradients) in different orders, which
    deterministic CPU runs of this command show as 2.4e-5 at step 10 (2 gloo ranks; the code of 4272322 and today's,
    every fsdp_wrap: `bench/ep_parity.py --wraps model,layer`), and 2 H200s as 1.7e-5 (2026-11-27, eleventh session).
    In bf16, ep 2 within 2x of ep 1's distance from its own fp32 run: the two bf16 runs are no criterion for each other,
    since both drift from the fp32 run as bf16 training does (2.1e-2 and 2.1e-2 at this seed's step-10 spike, where they
    are 1.2e-2 apart; seed 1: 6.2e-4 and 4.6e-4 from fp32, 2.0e-4 apart; bench/ep_parity.py on 2 H200s, 2026-11-27).
    That distance is itself a sample of chaotic drift: ep 1's was 2.06e-2 on 2 x H200 (2026-11-27) and 1.34e-2 on 4 x
    H200 (2026-11-28, twice alike; ep 2's 2.13e-2 there, a ratio of 1.59 that failed the former 1.5x bound) on code whose
    ep 1 x dp 2 path computes the same operators, compiled attention and norms choosing their kernel configs by timing on
    each machine. LoRA (fp32, the default targets: attention and every expert) the same way as the full fine-tune."""
    runs = {f"{dtype}_ep{ep}": (dtype, ep) for dtype in ("fp32", "bf16") for ep in (2, 1)}
    runs.update({f"lora_ep{ep}": ("fp32", ep, "--finetuning", "lora") for ep in (2, 1)})
    out = {name: str(tmp_path / name) for name in runs}
    launch_together({name: train_fsdp2(2, out[name], "--model_name_or_path", tiny_model_dir, *COMMON, "--dtype", dtype,
                                       "--ep_size", str(ep), *extra) for name, (dtype, ep, *extra) in runs.items()})
    found = {name: metrics(path) for name, path in out.items()}
    for run, reference in (("fp32_ep2", "fp32_ep1"), ("lora_ep2", "lora_ep1")):
        assert worst_relative(found[run], found[reference], "loss") <= 1e-5, run
        assert worst_relative(found[run][:4], found[reference][:4], "grad_norm") <= 1e-5, run
        assert worst_relative(found[run], found[reference], "grad_norm") <= 1e-4, run
    assert os.path.exists(os.path.join(out["lora_ep2"], "final", "adapter_config.json"))  # LoRA took effect
    ep2_from_fp32 = worst_relative(found["bf16_ep2"], found["fp32_ep2"], "loss")
    ep1_from_fp32 = worst_relative(found["bf16_ep1"], found["fp32_ep1"], "loss")
    assert ep2_from_fp32 <= 2 * ep1_from_fp32 + 1e-4, (ep2_from_fp32, ep1_from_fp32)


@pytest.fixture(scope="module")
def compile_runs(tiny_model_dir, tmp_path_factory) -> dict:
    """compile_dense true and false on one GPU, fp32 and bf16, and compiled under full activation checkpointing (bf16)
    and under checkpoint_experts (fp32 and bf16: the compiled SwiGLU and the Triton gathers recomputed); the seven
    launches together. The loss from full logits in every run: compile_dense also compiles the chunked loss's
    element-wise step, whose last-bit differences in fp32 grew to 2.5e-4 over 20 steps (one H200, 2026-11-24); the
    compiled chunked loss has its own checks (test_chunked_loss.py), this test is about attention and norms."""
    runs = {"fp32_compiled": ("fp32", "true"), "fp32_eager": ("fp32", "false"), "bf16_compiled": ("bf16", "true"),
            "bf16_eager": ("bf16", "false"), "bf16_compiled_ac": ("bf16", "true", "--activation_checkpointing", "full"),
            "fp32_compiled_experts": ("fp32", "true", "--checkpoint_experts", "true"),
            "bf16_compiled_experts": ("bf16", "true", "--checkpoint_experts", "true")}
    root = tmp_path_factory.mktemp("compile")
    out = {name: str(root / name) for name in runs}
    launch_together({name: train_fsdp2(1, out[name], "--model_name_or_path", tiny_model_dir, *COMMON, "--dtype", dtype,
                                       "--compile_dense", compile_dense, "--chunked_loss", "false", *extra)
                     for name, (dtype, compile_dense, *extra) in runs.items()})
    return {name: metrics(path) for name, path in out.items()}


def assert_fp32_equal(a: list[dict], b: list[dict]) -> None:
    """fp32 runs that differ only where a kernel rounds its last bit: within 1e-6 over the first 4 steps, 1e-3 over all 20.

    On one H200 (2026-11-24) compiled and eager attention/norms first differ at step 4 (5e-10 relative), and a last-bit
    difference then grows as near-tie routing choices flip, to 4.4e-5 by step 16; the same settings run twice differ
    too (a kernel that sums in no fixed order: 5e-6 at step 5 in one of four runs). A wrong mask or a lost gradient
    shows at steps 1-2 (a lost gradient in the next step's loss), far above 1e-6; 1e-3 over 20 steps is half the bf16
    runs' bound. (The gradient norm is not compared: its first steps were not recorded when the bound was set.)"""
    assert worst_relative(a[:4], b[:4], "loss") <= 1e-6
    assert worst_relative(a, b, "loss") <= 1e-3


def test_compiled_attention_and_norms_equal_eager_in_fp32(compile_runs):
    assert_fp32_equal(compile_runs["fp32_compiled"], compile_runs["fp32_eager"])


def test_recomputing_the_experts_changes_nothing_in_fp32(compile_runs):
    """checkpoint_experts reruns the experts' kernels (compiled SwiGLU, Triton gathers) in the backward: the same
    training as keeping their activations, to fp32 rounding."""
    assert_fp32_equal(compile_runs["fp32_compiled_experts"], compile_runs["fp32_compiled"])


@pytest.mark.parametrize("run", ["bf16_compiled", "bf16_compiled_ac", "bf16_compiled_experts"])
def test_compiled_attention_and_norms_equal_eager_in_bf16(compile_runs, run):
    """Also with full activation checkpointing around the compiled parts (measured on 4 H200s: 3.4e-4, with
    checkpointing 4.3e-4)."""
    assert worst_relative(compile_runs[run], compile_runs["bf16_eager"], "loss") <= 2e-3


@gpus(2)
def test_static_exchange_equals_the_exact_exchange(tiny_model_dir, tmp_path):
    """``--ep_capacity_factor`` at ep 2 (moe/exchange_mode.py) against the exact exchange, fp32 and bf16: 1.25 (the
    blocks a GPU run would use; it overflows only where a rank sends a peer more than 62.5% of its rows) and 0.1
    (capacity 128 rows of about 1024 per peer: every micro-step rerun exactly, 2 reruns per step). fp32 loss to 1e-5 and
    grad norm to 1e-5 over 4 steps and 1e-4 over 20 (fp32 takes the per-expert loop on the valid rows: the exact path's
    GEMMs, bit for bit on CPU); bf16 loss to 2e-3, this file's bound for two bf16 runs of one mesh: its grouped GEMM
    runs over the padded blocks (offsets ending at the valid rows), whose tiling may round differently from the exact
    path's. Written 2026-11-27; its CPU counterpart passes on gloo ranks (tests/test_exchange_mode.py), not yet on GPUs."""
    runs = {f"{dtype}_{name}": (dtype, factor) for dtype in ("fp32", "bf16")
            for name, factor in (("exact", "0"), ("static", "1.25"), ("overflow", "0.1"))}
    out = {name: str(tmp_path / name) for name in runs}
    launch_together({name: train_fsdp2(2, out[name], "--model_name_or_path", tiny_model_dir, *COMMON, "--dtype", dtype,
                                       "--ep_size", "2", "--ep_capacity_factor", factor)
                     for name, (dtype, factor) in runs.items()})
    found = {name: metrics(path) for name, path in out.items()}
    for run in ("fp32_static", "fp32_overflow"):
        assert worst_relative(found[run], found["fp32_exact"], "loss") <= 1e-5, run
        assert worst_relative(found[run][:4], found["fp32_exact"][:4], "grad_norm") <= 1e-5, run
        assert worst_relative(found[run], found["fp32_exact"], "grad_norm") <= 1e-4, run
    for run in ("bf16_static", "bf16_overflow"):
        assert worst_relative(found[run], found["bf16_exact"], "loss") <= 2e-3, run
    for dtype in ("fp32", "bf16"):
        assert [r["exchange_reruns"] for r in found[f"{dtype}_overflow"]] == [2] * len(found[f"{dtype}_overflow"])
        assert all(r["exchange_reruns"] >= 0 for r in found[f"{dtype}_static"])
        assert "exchange_reruns" not in found[f"{dtype}_exact"][0]
