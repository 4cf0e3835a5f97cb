"""bench/segment_graphs_probe.py --smoke: its decoder stacks, rebuilt around the segments it graphs on GPUs (the dense
part, and the dense part with the MoE block's routing and dispatch), give the model's own output on 2 gloo ranks (ep 2),
and it times the eager way (the graphed ways need CUDA)."""

import json

from conftest import run_script


def test_probe_stack_is_the_models_and_times_the_eager_way(tmp_path):
    out = tmp_path / "probe.jsonl"
    result = run_script("bench/segment_graphs_probe.py", 2, "--smoke", "--layers", "2", "--seq", "64", "--iters", "2",
                        "--warmup", "1", "--dir", str(tmp_path / "model"), "--out", str(out), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    records = {r["way"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert records.keys() == {"stack_vs_model", "routed_stack_vs_model", "eager", "graphed", "graphed_routed"}, records
    assert records["stack_vs_model"]["output_max_abs_diff"] <= 1e-5, records["stack_vs_model"]
    assert records["routed_stack_vs_model"]["output_max_abs_diff"] <= 1e-5, records["routed_stack_vs_model"]
    assert records["eager"]["ep"] == 2 and records["eager"]["micro_step_ms"] > 0 and records["eager"]["forward_host_ms_per_layer"] > 0
    for way in ("graphed", "graphed_routed"):
        assert records[way] == {**records[way], "skipped": "make_graphed_callables needs CUDA"}
