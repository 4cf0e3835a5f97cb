"""Micro-steps replayed from CUDA graphs (train/cuda_graph.py) train as the same micro-steps launched from Python.

``MicroStepGraphs`` alone: the graph replays the very kernels of the eager micro-step, so over steps whose label-token
counts, inputs and gradients change, the gradients and the step's sums equal the eager ones to the last bit.
train_fsdp2.py on the tiny model, bf16: rows of one whole document each (sdpa_causal) and packed rows (varlen, its
document boundaries padded with empty documents), within the bf16 bound of test_train_parity.py (the first micro-step
of a step adds its expert gradient into zeros with our kernel where the eager step writes torch's GEMM: last bits).
"""

import json
import os

import pytest
import torch

from .launch import ROOT, gpus, launch_together, metrics, run_on_gpus, train_fsdp2, worst_relative

pytestmark = gpus(1)
# adamw_bf16: bf16 weights, which one GPU trains without FSDP (FSDP's cast hooks keep graphs off)
COMMON = ("--max_steps", "8", "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2", "--optim", "adamw_bf16")


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
    """Graphs on and off: rows of whole documents, packed rows (varlen); the four launches together."""
    runs = {
        "whole_graphs": ("bf16", "true", "--data_path", whole_document_data, "--max_length", "128"),
        "whole_eager": ("bf16", "false", "--data_path", whole_document_data, "--max_length", "128"),
        "packed_graphs": ("bf16", "true"),
        "packed_eager": ("bf16", "false"),
    }
    root = tmp_path_factory.mktemp("graphs")
    out = {name: str(root / name) for name in runs}
    logs = launch_together({name: train_fsdp2(1, out[name], "--model_name_or_path", tiny_model_dir, *COMMON, "--dtype", dtype,
                                              "--cuda_graphs", graphs, *extra)
                            for name, (dtype, graphs, *extra) in runs.items()})
    return {name: (metrics(path), logs[name]) for name, path in out.items()}


@pytest.mark.parametrize("rows,attention", [("whole", "sdpa_causal"), ("packed", "varlen")])
def test_graphed_training_equals_eager_training(graph_runs, rows, attention):
    graphed, log = graph_runs[f"{rows}_graphs"]
    assert attention in log and "cuda_graphs true: each micro-step replayed" in log
    assert "cuda_graphs: captured the first micro-step" in log and "cuda_graphs: captured the later micro-step" in log
    eager = graph_runs[f"{rows}_eager"][0]
    assert len(graphed) == 8
    # Both eager in the first step: the same computation, yet not always the same bits. The four runs share one GPU
    # and each process tunes its compiled kernels under the others' load, so two eager processes may tile a reduction
    # differently (packed varlen rows, 2 x H200: 6.281476 against 6.281468 (1.3e-6) in the eleventh session, passing when
    # re-run; the test failed again in the twelfth, whose cut run printed no detail: not shown to be this line).
    assert graphed[0]["loss"] == pytest.approx(eager[0]["loss"], rel=1e-5, abs=0)
    assert worst_relative(graphed, eager, "loss") <= 2e-3
    assert graphed[-1]["loss"] < graphed[0]["loss"]


class _Loss:
    """What MicroStepGraphs needs of StepLoss, over a model of one plain and one DTensor weight: the loss's scale and
    the step's sums change every step, as StepLoss's do."""

    micro_steps, aux_coef, world_size = 2, 0.0, 1

    def __init__(self, label_tokens: int, device):
        self.label_tokens = self.denominator = label_tokens
        self.sums = torch.zeros(2, dtype=torch.float64, device=device)

    def loss_and_numbers(self, model, batch, loss_scale=None):
        out = model(batch["model_inputs"]["input_ids"])
        ce_sum = (out.float() * batch["labels"]).square().sum()
        loss = ce_sum / self.denominator if loss_scale is None else ce_sum * loss_scale
        return loss, {"ce_sum": ce_sum.detach(), "tokens": batch["labels"].sum()}, out

    def add(self, numbers, batch):
        self.sums += torch.stack([numbers["ce_sum"].double(), numbers["tokens"].double()])

    def micro_batch(self, model, batch):
        loss, numbers, out = self.loss_and_numbers(model, batch)
        self.add(numbers, batch)
        return loss, out


def _micro_steps_on_one_gpu(rank, world, graphed: bool) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from megablocks_utils.train.cuda_graph import MicroStepGraphs, zero_grads

    device = torch.device("cuda", 0)
    torch.manual_seed(0)
    mesh = init_device_mesh("cuda", (1,))

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.plain = torch.nn.Parameter(torch.randn(64, 64, device=device) / 8)
            self.sharded = torch.nn.Parameter(DTensor.from_local(torch.randn(64, 32, device=device) / 8, mesh, [Shard(0)]))

        def forward(self, x):
            return torch.tanh(x @ self.plain) @ self.sharded.to_local()

    model = Model()
    graphs = MicroStepGraphs(model, device, warmup_steps=1) if graphed else None
    generator = torch.Generator().manual_seed(1)
    grads, sums = [], []
    for step in range(4):
        step_loss = _Loss(100 + 7 * step, device)
        for micro in range(2):
            x = torch.randn(16, 64, generator=generator).to(device)
            batch = {"input_ids": x, "labels": torch.randn(16, 32, generator=generator).to(device), "attention_sq": 1.0,
                     "model_inputs": {"input_ids": x, "use_cache": False}}
            if graphed:
                graphs.micro_step(step_loss, batch, steps_done=step, first=micro == 0)
            else:
                loss, _ = step_loss.micro_batch(model, batch)
                loss.backward()
        grads.append([model.plain.grad.clone().cpu().tolist(), model.sharded.grad.to_local().clone().cpu().tolist()])
        sums.append(step_loss.sums.cpu().tolist())
        with torch.no_grad():  # an optimizer's step: the weights change between steps
            model.plain -= 0.1 * model.plain.grad
            model.sharded.to_local().sub_(0.1 * model.sharded.grad.to_local())
        if graphed:
            graphs.zero_grads()
        else:
            zero_grads(model.parameters())
    return {"grads": grads, "sums": sums, "graphs": len(graphs.graphs) if graphed else 0}


def test_replayed_micro_steps_equal_eager_ones_to_the_bit():
    eager = run_on_gpus(_micro_steps_on_one_gpu, 1, False)[0]
    graphed = run_on_gpus(_micro_steps_on_one_gpu, 1, True)[0]
    assert graphed["graphs"] == 2  # the first micro-step's and the later one's
    assert graphed["sums"] == eager["sums"]
    assert graphed["grads"] == eager["grads"]


def test_empty_documents_change_nothing_in_varlen():
    """Boundaries padded with empty documents (what a graph per document count needs) give the same outputs and
    gradients as the plain boundaries, to the bit."""
    from megablocks_utils.data.packing import varlen_inputs
    from megablocks_utils.model.attention import register_varlen, varlen_attention

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
