"""Experts placed on the ep ranks by their load: the same model with each MoE layer's experts renumbered
(``place``; its command line is ``python -m megablocks_utils.tools.place_experts``).

Why: rank r of ep owns a contiguous block of each layer's experts, and every layer's exchange waits for its busiest
rank. With uneven routing that rank gets far more rows than the mean: Qwen3-30B-A3B's shape with its weights' own
routing sends the busiest of 4 ranks 1.66x the mean rows (2.45x in one layer; bench/reports/ep_graphs_h200x4_2026-11-27d.md).
Renumbering the experts so that each rank's block holds a balanced mix of hot and cold ones moves no computation
off the GPUs, it only evens it out; and it needs no setting in the training scripts: train on the placed directory.

The model is the same function: the router's rows (and its bias or score-correction buffer) and every per-expert
tensor move together, so each token picks the same experts under their new numbers. Only the order in which a layer
adds its k experts' outputs may change (an fp32 rounding). The loads come from a run's metrics.jsonl
(``tokens_per_expert``, summed over its steps: a short run on the user's own data is enough, as routing moves slowly in
fine-tuning); ``balanced_placement`` deals the heaviest experts first. ``expert_order.json`` in the placed directory
says, per layer, which original expert each new number holds; ``--undo`` with it renumbers a trained export back.

Not for routers that limit each token to some of several groups of consecutive experts (DeepSeek-V2's group-limited
greedy, DeepSeek-V3 and GLM-4.5 with n_group > 1): renumbering would move experts between groups and change the routing.
"""

import json
import os
import re
import shutil

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megablocks_utils.errors import InputError
from megablocks_utils.model.architectures import MoESpec, spec_for
from megablocks_utils.model.loading import INDEX_NAME, SINGLE_NAME, load_config, weight_map

ORDER_FILE = "expert_order.json"


def balanced_placement(load: list[float], ep: int) -> list[list[int]]:
    """Each of ``ep`` ranks' experts (as many on each), chosen so that the ranks' summed ``load`` is as even as a greedy
    pass gets: the heaviest expert first, each to the least loaded rank that still has room."""
    if len(load) % ep:
        raise InputError(f"{len(load)} experts do not split over ep {ep}; choose an ep that divides them")
    per_rank = len(load) // ep
    ranks, totals = [[] for _ in range(ep)], [0.0] * ep
    for e in sorted(range(len(load)), key=lambda e: -load[e]):
        r = min((r for r in range(ep) if len(ranks[r]) < per_rank), key=lambda r: totals[r])
        ranks[r].append(e)
        totals[r] += load[e]
    return ranks


def expert_loads(metrics_path: str) -> list[list[float]]:
    """Each MoE layer's rows per expert over a run, from its metrics.jsonl (``tokens_per_expert`` of every step)."""
    total = None
    with open(metrics_path, encoding="utf-8") as f:
        for line in f:
            record = json.loads(line)
            counts = record.get("tokens_per_expert")
            if not counts:
                continue
            if total is None:
                total = [[0.0] * len(layer) for layer in counts]
            for row, layer in zip(total, counts):
                for e, n in enumerate(layer):
                    row[e] += n
    if total is None:
        raise InputError(f"{metrics_path} has no tokens_per_expert in any record; give the metrics.jsonl of a "
                         "train_fsdp2.py or train_fsdp1.py run on this model")
    return total


def check_placeable(spec: MoESpec, config) -> None:
    """Refuse routers whose choice depends on the experts' numbering (groups of consecutive experts)."""
    groups = spec.router_options(config).get("num_groups", 1)  # 1 unless the router limits tokens to groups
    if groups > 1:
        raise InputError(f"{spec.model_type}'s router chooses among {groups} groups of consecutive experts; renumbering "
                         "them would change the routing, so its experts cannot be placed")


def _layer_renames(spec: MoESpec, layer: int, order: list[int]) -> dict:
    """For one MoE layer: tensor name -> ("rows", new order of dim 0) or ("rename", new name), in both layouts."""
    position = {old: new for new, old in enumerate(order)}
    plan = {}
    stacked = list(spec.fused_names(layer)) + list(spec.fused_bias_names(layer))
    if spec.hub_stacked is not None:
        stacked += list(spec.hub_stacked_names(layer))
    for name in stacked:
        plan[name] = ("rows", order)
    for old in range(len(order)):
        for name in spec.hub_expert_names(layer, old) if spec.hub_gate else ():
            plan[name] = ("rename", name.replace(f".experts.{old}.", f".experts.{position[old]}.", 1))
    for block, router in ((spec.hub_block_name, spec.hub_router), (spec.block_attr, f"{spec.router_attr}.weight")):
        weight = f"model.layers.{layer}.{block}.{router}"
        plan[weight] = ("rows", order)
        plan[weight.removesuffix("weight") + "bias"] = ("rows", order)
        if spec.score_bias:
            plan[weight.removesuffix("weight") + spec.score_bias] = ("rows", order)
    return plan


def _moe_layers(names: list[str], spec: MoESpec) -> list[int]:
    return sorted({int(m.group(1)) for n in names if spec.is_expert_name(n) and (m := re.match(r"model\.layers\.(\d+)\.", n))})


def renumber(src: str, dst: str, orders: dict[int, list[int]]) -> None:
    """Write ``src``'s model to ``dst`` with layer l's experts renumbered: new expert j is old expert ``orders[l][j]``.
    Shard by shard (one in memory at a time); every other file copied."""
    config = load_config(src)
    spec = spec_for(config)
    names_to_file = weight_map(src)
    plan = {}
    for layer, order in orders.items():
        plan.update(_layer_renames(spec, layer, order))
    moved = {n for n in names_to_file if spec.is_expert_name(n)} - set(plan)
    if moved:
        raise InputError(f"{src}: expert tensors of a layout the placement does not know, e.g. {sorted(moved)[:2]}")
    os.makedirs(dst, exist_ok=True)
    new_map = {}
    for file in sorted(set(names_to_file.values())):
        out = {}
        with safe_open(os.path.join(src, file), framework="pt") as f:
            metadata = f.metadata()
            for name in f.keys():
                tensor = f.get_tensor(name)
                kind, how = plan.get(name, (None, None))
                if kind == "rows":
                    tensor = tensor.index_select(0, torch.tensor(how))
                elif kind == "rename":
                    name = how
                out[name] = tensor.contiguous()
                new_map[name] = file
        save_file(out, os.path.join(dst, file), metadata=metadata or {"format": "pt"})
    if os.path.isfile(os.path.join(src, INDEX_NAME)):
        with open(os.path.join(src, INDEX_NAME), encoding="utf-8") as f:
            index = json.load(f)
        index["weight_map"] = dict(sorted(new_map.items()))
        with open(os.path.join(dst, INDEX_NAME), "w", encoding="utf-8") as f:
            json.dump(index, f, indent=2)
    for entry in os.listdir(src):
        path = os.path.join(src, entry)
        if os.path.isfile(path) and not entry.endswith(".safetensors") and entry not in (INDEX_NAME, SINGLE_NAME, ORDER_FILE):
            shutil.copy2(path, os.path.join(dst, entry))


def place(src: str, dst: str, loads: list[list[float]], ep: int) -> dict[int, list[int]]:
    """``src`` renumbered into ``dst`` so that ep's contiguous blocks are balanced for ``loads`` (one row per MoE
    layer, in layer order); writes ``dst/expert_order.json``. Returns the orders."""
    config = load_config(src)
    spec = spec_for(config)
    check_placeable(spec, config)
    layers = _moe_layers(list(weight_map(src)), spec)
    experts = getattr(config, spec.num_experts_attr)
    if len(loads) != len(layers) or any(len(load) != experts for load in loads):
        raise InputError(f"the loads have {len(loads)} MoE layers of {sorted({len(x) for x in loads})} experts, the model in "
                         f"{src} {len(layers)} of {experts}: they come from another model")
    orders = {layer: [e for rank in balanced_placement(load, ep) for e in rank] for layer, load in zip(layers, loads)}
    renumber(src, dst, orders)
    with open(os.path.join(dst, ORDER_FILE), "w", encoding="utf-8") as f:
        json.dump({"ep": ep, "source": os.path.abspath(src), "orders": {str(k): v for k, v in orders.items()},
                   "note": "new expert j of layer l is expert orders[l][j] of the source"}, f, indent=1)
    return orders


def undo(src: str, dst: str, order_file: str) -> None:
    """A placed model (or a trained export of one) back in the source's numbering."""
    with open(order_file, encoding="utf-8") as f:
        orders = {int(k): v for k, v in json.load(f)["orders"].items()}
    inverse = {layer: sorted(range(len(order)), key=lambda j: order[j]) for layer, order in orders.items()}
    renumber(src, dst, inverse)

