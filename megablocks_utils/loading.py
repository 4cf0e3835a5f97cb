"""Read a model directory's safetensors: dense weights whole, experts only as this rank's slices.

Real Mixtral checkpoints store every expert separately (hub layout,
``model.layers.{l}.block_sparse_moe.experts.{e}.w1.weight``; Granite stacks each layer's experts in
one tensor); transformers 5's own state dict has them fused
(``model.layers.{l}.mlp.experts.gate_up_proj`` [E, 2I, H]). ``models.py`` names both layouts. Either way a rank reads only the bytes of
its own experts, straight into a preallocated local tensor: no rank ever holds all experts and
nothing is concatenated.
"""

import json
import os
import re

import torch
from safetensors import safe_open

from .models import MoESpec

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


class Checkpoint:
    """A model directory's safetensors files behind one name -> tensor lookup.

    Files are opened lazily and once. ``read_names`` records every tensor read, whole or sliced,
    so tests can prove a rank read only its own experts.
    """

    def __init__(self, model_dir: str):
        self.model_dir = model_dir
        index_path = os.path.join(model_dir, INDEX_NAME)
        single_path = os.path.join(model_dir, SINGLE_NAME)
        if os.path.isfile(index_path):
            with open(index_path) as f:
                try:
                    self.weight_map = json.load(f)["weight_map"]
                except (json.JSONDecodeError, KeyError) as e:
                    raise ValueError(f"{index_path} is not a valid safetensors index ({e}); re-download or re-export the model") from e
            missing = sorted({file for file in self.weight_map.values() if not os.path.isfile(os.path.join(model_dir, file))})
            if missing:
                raise FileNotFoundError(
                    f"{index_path} names shard file(s) that are not in {model_dir}: {missing}; "
                    "the download is incomplete, fetch the missing files"
                )
        elif os.path.isfile(single_path):
            with safe_open(single_path, framework="pt") as f:
                self.weight_map = {name: SINGLE_NAME for name in f.keys()}
        else:
            raise FileNotFoundError(
                f"no {INDEX_NAME} or {SINGLE_NAME} in {model_dir}; point model_name_or_path at a Hugging Face "
                "model directory saved with safetensors"
            )
        self._handles = {}
        self.read_names: list[str] = []

    def _file(self, name: str):
        if name not in self.weight_map:
            raise KeyError(f"tensor {name!r} is not in the checkpoint at {self.model_dir}")
        file = self.weight_map[name]
        if file not in self._handles:
            path = os.path.join(self.model_dir, file)
            try:
                self._handles[file] = safe_open(path, framework="pt")
            except Exception as e:
                raise ValueError(f"cannot read {path} ({e}); the file is truncated or corrupt, fetch it again") from e
        return self._handles[file]

    def get(self, name: str) -> torch.Tensor:
        self.read_names.append(name)
        return self._file(name).get_tensor(name)

    def get_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of dim 0, reading only their bytes."""
        self.read_names.append(f"{name}[{start}:{stop}]")
        return self._file(name).get_slice(name)[start:stop]

    def names(self) -> list[str]:
        return list(self.weight_map)

    def close(self) -> None:
        self._handles.clear()


def expert_layout(ckpt: Checkpoint, spec: MoESpec) -> str:
    """'hub' (the Hub's names: per expert, or stacked per layer for Granite) or 'fused' (transformers 5)."""
    if spec.hub_stacked is not None:
        hub_example = spec.hub_stacked_names(0)[0]
    else:
        hub_example = spec.hub_expert_names(0, 0)[0]
    hub = re.compile(re.escape(hub_example).replace(r"layers\.0\.", r"layers\.\d+\.").replace(r"experts\.0\.", r"experts\.\d+\.") + "$")
    fused = re.compile(rf"\.{spec.block_attr}\.{spec.experts_attr}\.gate_up_proj$")
    names = ckpt.names()
    if any(hub.search(n) for n in names):
        return "hub"
    if any(fused.search(n) for n in names):
        return "fused"
    raise ValueError(
        f"the checkpoint in {ckpt.model_dir} has no expert weights in a layout we know "
        f"(neither '{hub_example}' nor '{spec.fused_names(0)[0]}' or their other layers); "
        f"is it a {spec.model_type} MoE checkpoint?"
    )


def load_local_experts(
    ckpt: Checkpoint,
    spec: MoESpec,
    layout: str,
    layer: int,
    experts: range,
    intermediate: int,
    out_gate_up: torch.Tensor,
    out_down: torch.Tensor,
) -> None:
    """Fill out_gate_up [El, 2I, H] and out_down [El, H, I] with experts ``experts`` of ``layer``.

    ``layout`` is what ``expert_layout`` says of the checkpoint. Stacked tensors (transformers'
    fused layout, Granite's hub layout) are read as row slices; per-expert ones whole.
    """
    if layout == "fused" or spec.hub_stacked is not None:
        gate_up_name, down_name = spec.fused_names(layer) if layout == "fused" else spec.hub_stacked_names(layer)
        out_gate_up.copy_(ckpt.get_rows(gate_up_name, experts.start, experts.stop))
        out_down.copy_(ckpt.get_rows(down_name, experts.start, experts.stop))
        return
    for i, e in enumerate(experts):
        gate, up, down = spec.hub_expert_names(layer, e)
        out_gate_up[i, :intermediate].copy_(ckpt.get(gate))
        out_gate_up[i, intermediate:].copy_(ckpt.get(up))
        out_down[i].copy_(ckpt.get(down))
