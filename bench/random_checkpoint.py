"""Random weights of a model's real shape, read as a checkpoint is read: for benches of models larger than a disk or, in
bf16, than the GPU (GLM-4.5-Air's 212 GB, gpt-oss-120b's 234 GB), loaded layer by layer by ``shard_moe`` as from disk.

``RandomCheckpoint(config, release, device)`` answers the loader's reads (``names``, ``get``, ``get_rows``) with tensors
made on ``device`` when asked, from a seed per name, in the layout a release has:
- "bf16": transformers' names (fused experts), normal(0, 0.02) weights, norms at one, biases at zero;
- "fp8": as Qwen3's and GLM-4.5's FP8 releases: experts per expert under the Hub's names, every expert and decoder-layer
  linear weight in float8 e4m3 with ``weight_scale_inv`` (128 x 128 blocks), the rest bf16;
- "mxfp4": as gpt-oss is released: each layer's experts as ``*_blocks`` and ``*_scales`` (values of about 0.02), the rest bf16.
"""

import zlib

import torch

from megablocks_utils.model.architectures import decoder_layers, spec_for
from megablocks_utils.model.lora import meta_model

RELEASES = ("bf16", "fp8", "mxfp4")
STD = 0.02


class RandomCheckpoint:
    def __init__(self, config, release: str, device):
        if release not in RELEASES:
            raise ValueError(f"release {release!r}: choose one of {RELEASES}")
        self.spec, self.release, self.device = spec_for(config), release, torch.device(device)
        self.model_dir = f"random {release} weights"
        self.read_names: list[str] = []
        model = meta_model(config)
        shapes = {n: tuple(t.shape) for n, t in model.state_dict().items()}
        self.shapes: dict[str, tuple] = {}
        self.kind: dict[str, str] = {}  # name -> "bf16", "fp8", "scale" or "blocks"/"scales"
        linears = {f"{n}.weight" for i, layer in enumerate(decoder_layers(model)) for n, m in
                   ((f"model.layers.{i}.{k}", m) for k, m in layer.named_modules()) if isinstance(m, torch.nn.Linear)}
        for name, shape in shapes.items():
            if self.spec.is_expert_name(name) and not name.endswith("_bias"):
                self._experts(name, shape)
            elif release == "fp8" and name in linears:
                self._fp8(name, shape)
            else:
                self.shapes[name], self.kind[name] = shape, "bf16"

    def _fp8(self, name: str, shape: tuple) -> None:
        self.shapes[name], self.kind[name] = shape, "fp8"
        self.shapes[name + "_scale_inv"] = (*shape[:-2], -(-shape[-2] // 128), -(-shape[-1] // 128))
        self.kind[name + "_scale_inv"] = "scale"

    def _experts(self, name: str, shape: tuple) -> None:
        """A fused expert tensor ([E, 2I, H] / [E, H, I], or gpt-oss's [E, in, out]) as the release stores it."""
        if self.release == "bf16":
            self.shapes[name], self.kind[name] = shape, "bf16"
        elif self.release == "mxfp4":  # [E, out, in / 32, 16] bytes and [E, out, in / 32] exponents
            experts, k, n = shape if self.spec.experts_transposed else (shape[0], shape[2], shape[1])
            self.shapes[name + "_blocks"], self.kind[name + "_blocks"] = (experts, n, k // 32, 16), "blocks"
            self.shapes[name + "_scales"], self.kind[name + "_scales"] = (experts, n, k // 32), "scales"
        else:  # per expert, the Hub's names: gate, up [I, H] and down [H, I]
            layer = int(name.split(".")[2])
            experts = shape[0]
            for e in range(experts):
                gate, up, down = self.spec.hub_expert_names(layer, e)
                if name.endswith("gate_up_proj"):
                    self._fp8(gate, (shape[1] // 2, shape[2]))
                    self._fp8(up, (shape[1] // 2, shape[2]))
                else:
                    self._fp8(down, tuple(shape[1:]))

    def names(self) -> list[str]:
        return list(self.shapes)

    def get(self, name: str) -> torch.Tensor:
        self.read_names.append(name)
        return self._make(name, self.shapes[name])

    def get_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        self.read_names.append(f"{name}[{start}:{stop}]")
        return self._make(f"{name}[{start}:{stop}]", (stop - start, *self.shapes[name][1:]), self.kind[name])

    def close(self) -> None:
        pass

    def _make(self, key: str, shape: tuple, kind: str | None = None) -> torch.Tensor:
        kind = kind or self.kind[key]
        g = torch.Generator(self.device).manual_seed(zlib.crc32(key.encode()))
        if kind == "blocks":
            return torch.randint(0, 256, shape, generator=g, device=self.device, dtype=torch.uint8)
        if kind == "scales":  # 2^-7 x e2m1 values of up to 6: about normal(0, 0.02)
            return torch.full(shape, 127 - 7, device=self.device, dtype=torch.uint8)
        if kind == "scale":  # a block's largest magnitude, 4 standard deviations, over e4m3's largest value
            return torch.full(shape, 4 * STD / 448, device=self.device, dtype=torch.float32)
        if key.endswith(("norm.weight", "layernorm.weight")):
            return torch.ones(shape, device=self.device, dtype=torch.bfloat16)
        if key.endswith(("bias", "sinks")):
            return torch.zeros(shape, device=self.device, dtype=torch.bfloat16)
        values = torch.randn(shape, generator=g, device=self.device, dtype=torch.float32)
        if kind == "fp8":
            return (values * 448 / 4).clamp(-448, 448).to(torch.float8_e4m3fn)
        return (values * STD).to(torch.bfloat16)
