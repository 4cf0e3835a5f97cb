"""Micro-steps replayed from CUDA graphs at ep = world size = 2 (train/cuda_graph.py) train as the same steps launched
from Python.

What makes them capturable there: the static exchange (``--ep_capacity_factor``: fixed shapes, each rank reading from
its peers' GPU memory, no host sync; moe/exchange_mode.py, moe/pull_exchange.py) and the dense weights whole on every rank (``--fsdp_wrap none``: no FSDP hook in a
micro-step, their gradients averaged after the step's micro-steps). An overflow is found once a step, after the
micro-steps (``StepLoss(defer_overflow=True)``), and the step is run again eagerly on the exact exchange.

train_fsdp2.py on the tiny model, bf16, --optim adamw_bf16, packed rows (varlen), 2 GPUs, four launches at once:
- factor 1.25 with graphs against the same without graphs (the graphs replay the eager path's kernels);
- factor 0.1 with graphs (capacity 128 rows: every step overflows and is rerun exactly) against the exact exchange;
- the exact exchange with ``--fsdp_wrap none`` against the default (FSDP's whole-model unit): the replicated dense
  weights' average during the last backward (parallel/replicated_grads.py) is FSDP's reduce;
- ``--cuda_graphs segments`` (each layer's norms and attention from graphs, the MoE blocks eager; train/segment_graphs.py;
  fsdp_wrap auto resolved to none) against the same layers launched from Python (``--fsdp_wrap none --cuda_graphs false``);
- the defaults, where ``ep_capacity_factor`` auto takes 2 (train/auto_exchange.py: the static exchange read from the
  peers' memory, fsdp_wrap none, each micro-step one graph) against the exact exchange launched from Python.
Each within the bf16 bound of test_train_parity.py (2e-3).
"""

import os
import re

import pytest

from .launch import gpus, launch_together, metrics, train_fsdp2, worst_relative

pytestmark = gpus(2)
COMMON = ("--max_steps", "8", "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2", "--optim", "adamw_bf16",
          "--dtype", "bf16", "--ep_size", "2")


@pytest.fixture(scope="module")
def wide_model_dir(tiny_model_dir, tmp_path_factory) -> str:
    """The tiny model with 8192 vocabulary rows (its tokenizer's 512 ids among them): a step's 4096 ids (2 ranks x 2
    micro-steps x 4 rows of 256) can touch at most half of the table, so the graphs average the input embedding's
    gradient over the touched rows (parallel/embedding_rows.py)."""
    import shutil

    from transformers import AutoModelForCausalLM

    path = str(tmp_path_factory.mktemp("wide") / "tiny-wide")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model.resize_token_embeddings(8192)
    model.save_pretrained(path)
    for name in os.listdir(tiny_model_dir):  # the tokenizer and chat template
        if not (name.endswith(".safetensors") or name in ("model.safetensors.index.json", "config.json")):
            shutil.copy(os.path.join(tiny_model_dir, name), path)
    return path


@pytest.fixture(scope="module")
def ep_graph_runs(tiny_model_dir, wide_model_dir, tmp_path_factory) -> dict:
    wide = ("--model_name_or_path", wide_model_dir, "--ep_capacity_factor", "1.25", "--fsdp_wrap", "none")
    runs = {
        "graphs": ("--ep_capacity_factor", "1.25", "--fsdp_wrap", "none", "--cuda_graphs", "true"),
        "eager": ("--ep_capacity_factor", "1.25", "--fsdp_wrap", "none", "--cuda_graphs", "false"),
        "overflow_graphs": ("--ep_capacity_factor", "0.1", "--fsdp_wrap", "none", "--cuda_graphs", "true"),
        "exact_replicated": ("--fsdp_wrap", "none", "--cuda_graphs", "false"),
        "segments": ("--cuda_graphs", "segments"),  # fsdp_wrap auto resolves to none for them
        "defaults": (),  # ep_capacity_factor auto: 2 with whole micro-steps as graphs
        "exact_fsdp": ("--cuda_graphs", "false"),  # fsdp_wrap auto: FSDP's whole-model unit
        "wide_graphs": (*wide, "--cuda_graphs", "true"),  # the model named last wins
        "wide_eager": (*wide, "--cuda_graphs", "false"),
    }
    root = tmp_path_factory.mktemp("ep_graphs")
    out = {name: str(root / name) for name in runs}
    logs = launch_together({name: train_fsdp2(2, out[name], "--model_name_or_path", tiny_model_dir, *COMMON, *extra)
                            for name, extra in runs.items()}, timeout=300)  # a hang fails with its output
    return {name: (metrics(path), logs[name]) for name, path in out.items()}


def test_graphed_ep2_steps_equal_eager_ones(ep_graph_runs):
    graphed, log = ep_graph_runs["graphs"]
    assert "cuda_graphs true: each micro-step replayed" in log
    assert "cuda_graphs: captured the first micro-step" in log and "cuda_graphs: captured the later micro-step" in log
    assert "FSDP units: none, dense weights whole on every rank" in log
    eager = ep_graph_runs["eager"][0]
    assert len(graphed) == len(eager) == 8
    assert worst_relative(graphed, eager, "loss") <= 2e-3
    assert graphed[-1]["loss"] < graphed[0]["loss"]
    assert all(r["exchange_reruns"] >= 0 for r in graphed)


def test_the_embedding_averaged_over_its_touched_rows_trains_as_every_row(ep_graph_runs):
    """Under the graphs the input embedding's gradient is averaged over the rows the step's tokens touched; the eager
    run averages every row during the backward (parallel/replicated_grads.py): the same training."""
    graphed, log = ep_graph_runs["wide_graphs"]
    assert "input embedding: its gradient averaged over the rows a step's tokens touch (at most 4096 of 8192)" in log
    assert "cuda_graphs: captured the first micro-step" in log
    eager, eager_log = ep_graph_runs["wide_eager"]
    assert "input embedding" not in eager_log
    assert len(graphed) == len(eager) == 8
    assert worst_relative(graphed, eager, "loss") <= 2e-3
    # Step 3, the first replayed, from the same weights as the eager run's: an embedding row left unaveraged or
    # averaged twice moves the norm (CPU: tests/test_embedding_rows.py checks the average to the bit)
    assert abs(graphed[2]["grad_norm"] / eager[2]["grad_norm"] - 1) <= 1e-2


def test_an_overflow_under_graphs_reruns_the_step_on_the_exact_exchange(ep_graph_runs):
    overflow, log = ep_graph_runs["overflow_graphs"]
    assert "cuda_graphs: captured the first micro-step" in log
    assert [r["exchange_reruns"] for r in overflow] == [2] * 8  # both micro-steps of every step
    assert worst_relative(overflow, ep_graph_runs["exact_replicated"][0], "loss") <= 2e-3


def test_replicated_dense_weights_train_as_fsdp(ep_graph_runs):
    replicated, fsdp = ep_graph_runs["exact_replicated"][0], ep_graph_runs["exact_fsdp"][0]
    assert "cuda_graphs false" in ep_graph_runs["exact_replicated"][1]
    assert "FSDP units: the whole model" in ep_graph_runs["exact_fsdp"][1]
    assert worst_relative(replicated, fsdp, "loss") <= 2e-3
    # The first step's gradients come from the same weights: a dense gradient left unaveraged, or averaged twice, moves
    # its norm by far more than 1e-2. Later steps' norms drift apart in bf16 (CPU, 2 gloo ranks: both 2-6% from fp32's at
    # step 7, 6% apart on 2 x H200), as the weights they come from do.
    assert abs(replicated[0]["grad_norm"] / fsdp[0]["grad_norm"] - 1) <= 1e-2


def test_segment_graphs_train_as_the_layers_launched_from_python(ep_graph_runs):
    segmented, log = ep_graph_runs["segments"]
    assert "cuda_graphs segments: each decoder layer's norms and attention" in log
    # after the 2 warm-up steps (steps 3 to 8 replay them); every layer's graph reaching to its MoE block's exchange
    # where ROUTE_IN_GRAPH is on, none where off
    from megablocks_utils.train.segment_graphs import ROUTE_IN_GRAPH

    captured = re.search(r"(\d+) layers' dense segments(?: \((\d+) with their MoE block's routing and dispatch\))? captured", log)
    assert captured and captured[1] != "0" and captured[2] == (captured[1] if ROUTE_IN_GRAPH else None), log[-2000:]
    assert "FSDP units: none, dense weights whole on every rank" in log  # fsdp_wrap auto, resolved for the segments
    eager = ep_graph_runs["exact_replicated"][0]
    assert len(segmented) == len(eager) == 8
    assert worst_relative(segmented, eager, "loss") <= 2e-3
    # Step 3 is the first from graphs, on the same weights as the eager run's step 3 (steps 1-2 ran the same eager
    # kernels): a segment gradient taken over by autograd (the static buffer the next micro-step's replay rewrites) or
    # left unaveraged would move its norm far more than 1e-2.
    assert abs(segmented[2]["grad_norm"] / eager[2]["grad_norm"] - 1) <= 1e-2
    assert segmented[-1]["loss"] < segmented[0]["loss"]


def test_the_defaults_at_ep_2_train_as_the_exact_exchange(ep_graph_runs):
    auto, log = ep_graph_runs["defaults"]
    assert "ep_capacity_factor auto: 2 (ep 2 = world size on one node" in log
    assert "cuda_graphs auto: each micro-step replayed" in log and "cuda_graphs: captured the first micro-step" in log
    assert "FSDP units: none, dense weights whole on every rank" in log
    exact = ep_graph_runs["exact_replicated"][0]
    assert len(auto) == len(exact) == 8 and [r["exchange_reruns"] for r in auto] == [0] * 8  # 2 never overflows at ep 2
    assert worst_relative(auto, exact, "loss") <= 2e-3
    assert auto[-1]["loss"] < auto[0]["loss"]
