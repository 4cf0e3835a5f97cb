"""Micro-steps replayed from CUDA graphs (train/cuda_graph.py) train as the same micro-steps launched from Python.

fp32 on rows that are each one whole document (sdpa_causal; the per-expert loop, fp32 has no grouped GEMM): the graph
replays the very kernels of the eager step, and gradients zeroed in place instead of freed add 0 exactly, so the runs
are equal to the last bit. bf16 on packed rows (varlen with its document boundaries padded by empty documents, the
grouped GEMMs with the weight gradient added in their backward): within the bf16 bound of test_train_parity.py.
"""

import json
import os

import pytest
import torch

from .launch import ROOT, gpus, launch_together, metrics, train_fsdp2, worst_relative

pytestmark = gpus(1)
COMMON = ("--max_steps", "8", "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2")


@pytest.fixture(scope="module")
def whole_document_data(tmp_path_factory) -> str:
    """Text records longer than max_length 128: each row one truncated document, nothing to mask but the causal
    triangle, so auto picks sdpa_causal, also in fp32."""
    with open(os.path.join(ROOT, "data.json")) as f:
        records = json.load(f)
    words = " ".join(" ".join(str(v) for v in r.values() if isinstance(v, str)) for r in records).split()
    path = tmp_path_factory.mktemp("data") / "long.jsonl"
    with open(path, "w") as f:
        for i in range(64):
            f.write(json.dumps({"text": " ".join(words[(i * 97) % 500:][:400])}) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def graph_runs(tiny_model_dir, whole_document_data, tmp_path_factory) -> dict:
    """Graphs on and off: fp32 whole documents, bf16 packed rows (varlen); the four launches together."""
    runs = {
        "fp32_graphs": ("fp32", "true", "--data_path", whole_document_data, "--max_length", "128"),
        "fp32_eager": ("fp32", "false", "--data_path", whole_document_data, "--max_length", "128"),
        "bf16_graphs": ("bf16", "true"),
        "bf16_eager": ("bf16", "false"),
    }
    root = tmp_path_factory.mktemp("graphs")
    out = {name: str(root / name) for name in runs}
    logs = launch_together({name: train_fsdp2(1, out[name], "--model_name_or_path", tiny_model_dir, *COMMON, "--dtype", dtype,
                                              "--cuda_graphs", graphs, *extra)
                            for name, (dtype, graphs, *extra) in runs.items()})
    return {name: (metrics(path), logs[name]) for name, path in out.items()}


def test_graphed_micro_steps_equal_eager_ones_in_fp32(graph_runs):
    graphed, log = graph_runs["fp32_graphs"]
    assert "sdpa_causal" in log and "cuda_graphs true: each micro-step replayed" in log
    eager = graph_runs["fp32_eager"][0]
    assert len(graphed) == 8
    assert worst_relative(graphed, eager, "loss") == 0.0
    assert worst_relative(graphed, eager, "grad_norm") == 0.0


def test_graphed_micro_steps_train_as_eager_ones_in_bf16_varlen(graph_runs):
    graphed, log = graph_runs["bf16_graphs"]
    assert "varlen" in log and "cuda_graphs true: each micro-step replayed" in log
    eager = graph_runs["bf16_eager"][0]
    assert worst_relative(graphed, eager, "loss") <= 2e-3
    assert graphed[-1]["loss"] < graphed[0]["loss"]


def test_empty_documents_change_nothing_in_varlen():
    """Boundaries padded with empty documents (what a graph per document count needs) give the same outputs and
    gradients as the plain boundaries, to the bit."""
    from megablocks_utils.model.attention import register_varlen, varlen_attention, varlen_inputs

    register_varlen()
    torch.manual_seed(0)
    device = torch.device("cuda", 0)
    positions = torch.cat([torch.arange(100), torch.arange(156), torch.arange(50), torch.arange(206)]).view(2, 256)
    results = []
    for multiple in (1, 64):
        inputs = varlen_inputs(positions, multiple)
        assert len(inputs["cu_seq_lens_q"]) == (5 if multiple == 1 else 65)
        torch.manual_seed(0)
        q, k, v = (torch.randn(2, 4, 256, 64, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))

        class Module(torch.nn.Module):
            pass

        module = Module()
        module.training = True
        out, _ = varlen_attention(module, q, k, v, None, scaling=0.125, cu_seq_lens_q=inputs["cu_seq_lens_q"].to(device),
                                  max_length_q=inputs["max_length_q"])
        out.float().square().sum().backward()
        results.append((out.detach(), q.grad, k.grad, v.grad))
    for plain, padded in zip(*results):
        assert torch.equal(plain, padded)
