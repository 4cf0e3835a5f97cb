"""Read a model directory's safetensors: dense weights whole, experts only as this rank's slices.

Real Mixtral checkpoints store every expert separately (hub layout,
``model.layers.{l}.block_sparse_moe.experts.{e}.w1.weight``; Granite stacks each layer's experts in
one tensor); transformers 5's own state dict has them fused
(``model.layers.{l}.mlp.experts.gate_up_proj`` [E, 2I, H]). ``models.py`` names both layouts. Either way a rank reads only the bytes of
its own experts, straight into a preallocated local tensor: no rank ever holds all experts and
nothing is concatenated.

Before any weight is read, from small files only: ``check_model_dir`` and ``check_tokenizer_files`` check the
directory, and ``load_config`` makes the model's config from config.json alone (the fit check plans with it).
"""

import json
import os
import re
from types import SimpleNamespace

import torch
from safetensors import SafetensorError, safe_open

from megablocks_utils.errors import InputError
from megablocks_utils.model.architectures import MOE_SPECS, MoESpec, spec_for

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


def _shard_names(path: str) -> set[str]:
    """The tensor names in one safetensors file; its header is parsed, which finds a truncated or corrupt file."""
    try:
        with safe_open(path, framework="pt") as f:
            return set(f.keys())
    except (SafetensorError, OSError) as e:
        raise InputError(f"{path} is truncated or corrupt ({e}); fetch it again") from e


def weight_map(model_dir: str) -> dict[str, str]:
    """Tensor name -> safetensors file of a model directory, after checking that every file is there and whole.

    Reads the index and each file's header only (a few KB per file), so it is cheap to run before loading.
    """
    index_path = os.path.join(model_dir, INDEX_NAME)
    single_path = os.path.join(model_dir, SINGLE_NAME)
    if os.path.isfile(single_path) and not os.path.isfile(index_path):
        return {name: SINGLE_NAME for name in _shard_names(single_path)}
    if not os.path.isfile(index_path):
        others = sorted(n for n in os.listdir(model_dir) if n.endswith((".bin", ".pt", ".pth", ".safetensors")))
        found = f" (it holds {others[:3]}: convert them with `model.save_pretrained(dir)`, which writes safetensors)" if others else ""
        raise InputError(
            f"no {INDEX_NAME} or {SINGLE_NAME} in {model_dir}{found}; point model_name_or_path at a Hugging Face "
            "model directory saved with safetensors"
        )
    try:
        with open(index_path, encoding="utf-8") as f:
            names = json.load(f)["weight_map"]
        if not isinstance(names, dict):
            raise TypeError(f"weight_map is a {type(names).__name__}")
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise InputError(f"{index_path} is not a valid safetensors index ({e}); re-download or re-export the model") from e
    files = sorted(set(names.values()))
    missing = [file for file in files if not os.path.isfile(os.path.join(model_dir, file))]
    if missing:
        raise InputError(
            f"{index_path} names shard file(s) that are not in {model_dir}: {missing}; "
            "the download is incomplete, fetch the missing files"
        )
    for file in files:
        absent = sorted({n for n, f in names.items() if f == file} - _shard_names(os.path.join(model_dir, file)))
        if absent:
            raise InputError(
                f"{index_path} places {len(absent)} tensor(s) in {file} that it does not hold, e.g. {absent[:2]}; "
                "the index and the shards come from different saves, fetch the model again"
            )
    return names


class Checkpoint:
    """A model directory's safetensors files behind one name -> tensor lookup.

    Files are opened lazily and once. ``read_names`` records every tensor read, whole or sliced,
    so tests can prove a rank read only its own experts.
    """

    def __init__(self, model_dir: str):
        self.model_dir = model_dir
        self.weight_map = weight_map(model_dir)
        self._handles = {}
        self.read_names: list[str] = []

    def _file(self, name: str):
        if name not in self.weight_map:
            raise InputError(
                f"tensor {name!r} is not in the checkpoint at {self.model_dir}; the checkpoint is incomplete "
                "or config.json does not describe these weights"
            )
        file = self.weight_map[name]
        if file not in self._handles:
            path = os.path.join(self.model_dir, file)
            try:
                self._handles[file] = safe_open(path, framework="pt")
            except (SafetensorError, OSError) as e:
                raise InputError(f"cannot read {path} ({e}); the file is truncated or corrupt, fetch it again") from e
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


FP8_SCALE_SUFFIX = "_scale_inv"  # FP8 checkpoints: <module>.weight (float8 e4m3) and <module>.weight_scale_inv (fp32 blocks)
MXFP4_SUFFIXES = ("_blocks", "_scales")  # gpt-oss's released experts: <stacked name>_blocks and <stacked name>_scales


def checkpoint_quantization(names: list[str]) -> str | None:
    """How a checkpoint's weights are quantized as released: "mxfp4" (gpt-oss's experts), "fp8" (128 x 128 block-scaled
    e4m3, as Qwen3's and GLM-4.5's FP8 releases), or None (bf16 or fp32)."""
    if any(".experts." in n and n.endswith(MXFP4_SUFFIXES) for n in names):
        return "mxfp4"
    if any(n.endswith(".weight" + FP8_SCALE_SUFFIX) for n in names):
        return "fp8"
    return None


def check_not_quantized(names: list[str], spec: MoESpec, model_dir: str) -> None:
    """A checkpoint released quantized trains only as LoRA's frozen base (``--quantize_base fp8``): elsewhere, one line
    saying how to go on."""
    fmt = checkpoint_quantization(names)
    if fmt is None:
        return
    lora = "train LoRA over it as released with train_fsdp2.py --finetuning lora --quantize_base fp8"
    if fmt == "mxfp4":
        raise InputError(
            f"the checkpoint in {model_dir} holds MXFP4-quantized experts (e.g. "
            f"{next(n for n in names if n.endswith(MXFP4_SUFFIXES))!r}): {lora}; for a full fine-tune, dequantize it with "
            "transformers first: AutoModelForCausalLM.from_pretrained(dir, quantization_config=Mxfp4Config(dequantize=True), "
            "dtype=torch.bfloat16).save_pretrained(new_dir), then set model_name_or_path to new_dir"
        )
    raise InputError(
        f"the checkpoint in {model_dir} holds FP8 block-scaled weights (e.g. "
        f"{next(n for n in names if n.endswith(FP8_SCALE_SUFFIX))!r}): {lora}; a full fine-tune needs the model's bf16 "
        "checkpoint"
    )


def expert_layout(names: list[str], spec: MoESpec, model_dir: str, quantized_ok: bool = False) -> str:
    """'hub' (the Hub's names: per expert, or stacked per layer for Granite and gpt-oss), 'fused' (transformers 5), or
    'mxfp4' (gpt-oss's released experts). ``quantized_ok``: a checkpoint released quantized is taken (LoRA's
    ``quantize_base``), else refused with how to go on (``check_not_quantized``)."""
    if not quantized_ok:
        check_not_quantized(names, spec, model_dir)
    if checkpoint_quantization(names) == "mxfp4":
        return "mxfp4"
    if spec.hub_stacked is not None:
        hub_example = spec.hub_stacked_names(0)[0]
    else:
        hub_example = spec.hub_expert_names(0, 0)[0]
    hub = re.compile(re.escape(hub_example).replace(r"layers\.0\.", r"layers\.\d+\.").replace(r"experts\.0\.", r"experts\.\d+\.") + "$")
    fused = re.compile(rf"\.{spec.block_attr}\.{spec.experts_attr}\.gate_up_proj$")
    if any(hub.search(n) for n in names):
        return "hub"
    if any(fused.search(n) for n in names):
        return "fused"
    raise InputError(
        f"the checkpoint in {model_dir} has no expert weights in a layout we know "
        f"(neither '{hub_example}' nor '{spec.fused_names(0)[0]}' or their other layers); "
        f"is it a {spec.model_type} MoE checkpoint? (config.json says it is)"
    )


def missing_expert_names(names: list[str], spec: MoESpec, layout: str, num_experts: int) -> list[str]:
    """Expert tensors absent from a checkpoint, in every layer that has any: all of a layer's experts must be there."""
    present = set(names)
    layers = set()
    for name in names:
        match = re.match(r"model\.layers\.(\d+)\.", name)
        if match and spec.is_expert_name(name):
            layers.add(int(match.group(1)))
    wanted = []
    for layer in sorted(layers):
        if layout == "fused":
            wanted += spec.fused_names(layer)
        elif layout == "mxfp4":
            wanted += [name + suffix for name in spec.hub_stacked_names(layer) for suffix in MXFP4_SUFFIXES]
        elif spec.hub_stacked is not None:
            wanted += spec.hub_stacked_names(layer)
        else:
            wanted += [name for e in range(num_experts) for name in spec.hub_expert_names(layer, e)]
        if spec.expert_bias:  # stored under the fused names in either layout (gpt-oss's hub layout is fused)
            wanted += spec.fused_bias_names(layer)
    return [name for name in wanted if name not in present]


EXPERT_COUNT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


def check_model_dir(model_dir: str, quantized_ok: bool = False) -> tuple[int | None, str]:
    """Check a model directory without loading it; return (number of experts, the config field naming it).

    config.json of a supported MoE model, every safetensors file there and whole, and expert weights
    in a layout we know, complete in each layer (``quantized_ok``: a checkpoint released quantized too, for LoRA's
    ``quantize_base``). Reads only config.json, the index and file headers.
    """
    if os.path.isfile(model_dir):
        raise InputError(
            f"model_name_or_path {model_dir!r} is a file, not a model directory; set it to the Hugging Face model "
            "directory that holds config.json and the *.safetensors files"
        )
    if not os.path.isdir(model_dir):
        raise InputError(f"model directory {model_dir!r} does not exist; set model_name_or_path to a local Hugging Face model directory")
    config_path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(config_path):
        raise InputError(
            f"{model_dir} has no config.json, so it is not a Hugging Face model directory; set model_name_or_path "
            "to the directory that holds config.json and the *.safetensors files"
        )
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"{config_path} is not valid JSON ({e}); re-download or re-save the model") from e
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if model_type not in MOE_SPECS and isinstance(config, dict) and not any(f in config for f in EXPERT_COUNT_FIELDS):
        raise InputError(
            f"{model_dir} holds a dense model (model_type={model_type!r}, no experts in config.json); this suite "
            f"fine-tunes mixture-of-experts models: set model_name_or_path to a model of type {', '.join(sorted(MOE_SPECS))}"
        )
    try:
        spec = spec_for(SimpleNamespace(model_type=model_type))
    except ValueError as e:
        raise InputError(str(e)) from None
    # The config class's field, or the name config.json stores it under (transformers 5 maps some, e.g.
    # Qwen3-MoE's num_experts to num_local_experts). Absent: the class default, checked when the model is built.
    field = next((f for f in (spec.num_experts_attr, *EXPERT_COUNT_FIELDS) if isinstance(config.get(f), int)), None)
    num_experts = config[field] if field else None
    names = list(weight_map(model_dir))
    layout = expert_layout(names, spec, model_dir, quantized_ok)
    if num_experts is not None:
        missing = missing_expert_names(names, spec, layout, num_experts)
        if missing:
            raise InputError(
                f"the checkpoint in {model_dir} lacks {len(missing)} expert tensor(s), e.g. {missing[:2]}; the download "
                f"is incomplete, or config.json's {field}={num_experts} does not match the weights"
            )
    return num_experts, field or spec.num_experts_attr


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model", "vocab.txt")


def check_tokenizer_files(model_dir: str) -> None:
    """The scripts tokenize with the model's own tokenizer: its files must be in the model directory."""
    if not any(os.path.isfile(os.path.join(model_dir, name)) for name in TOKENIZER_FILES):
        raise InputError(
            f"{model_dir} has no tokenizer files (none of {', '.join(TOKENIZER_FILES)}); copy the tokenizer files "
            "of the model's hub repository into this directory (train with the tokenizer the model was trained with)"
        )


def load_config(config_or_dir):
    """A transformers config from a config object, a config.json dict, or a model directory (reads only config.json)."""
    if not isinstance(config_or_dir, (str, os.PathLike, dict)):
        return config_or_dir
    values = config_or_dir
    name = values.get("_name_or_path", "") if isinstance(values, dict) else ""
    if not isinstance(values, dict):
        path = os.path.join(config_or_dir, "config.json")
        name = os.path.basename(os.path.normpath(config_or_dir))
        if not os.path.isfile(path):
            raise InputError(f"{path} does not exist; point --model_name_or_path at a Hugging Face model directory")
        try:
            with open(path, encoding="utf-8") as f:
                values = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise InputError(f"{path} is not valid JSON ({e}); re-download or re-save the model") from e
        if not isinstance(values, dict):
            raise InputError(f"{path} holds a {type(values).__name__}, not a JSON object of config fields")
    values = dict(values)
    model_type = values.pop("model_type", None)
    try:
        spec_for(type("Config", (), {"model_type": model_type}))
    except ValueError as e:
        raise InputError(str(e)) from None
    from transformers import AutoConfig  # lazily: importing this module stays light

    try:
        config = AutoConfig.for_model(model_type, **values)
    except (TypeError, ValueError) as e:
        raise InputError(f"config.json of {name or model_type} does not make a {model_type} config: {e}") from e
    config._memory_name = name  # the name the fit check prints (train/memory_plan.py)
    return config


def _copy_checked(out: torch.Tensor, value: torch.Tensor, name: str) -> None:
    if out.shape != value.shape:
        raise InputError(
            f"checkpoint tensor {name!r} has shape {tuple(value.shape)} but config.json implies {tuple(out.shape)}; "
            "config.json does not match the weights"
        )
    out.copy_(value)


def load_local_experts(
    ckpt: Checkpoint,
    spec: MoESpec,
    layout: str,
    layer: int,
    experts: range,
    intermediate: int,
    out_gate_up: torch.Tensor,
    out_down: torch.Tensor,
    out_gate_up_bias: torch.Tensor | None = None,
    out_down_bias: torch.Tensor | None = None,
) -> None:
    """Fill out_gate_up [El, 2I, H] and out_down [El, H, I] (or the row's transposed layout) with experts
    ``experts`` of ``layer``, and the expert biases where the row has them.

    ``layout`` is what ``expert_layout`` says of the checkpoint. Stacked tensors (transformers'
    fused layout, Granite's and gpt-oss's hub layouts) are read as row slices; per-expert ones whole.
    """
    if layout == "fused" or spec.hub_stacked is not None:
        gate_up_name, down_name = spec.fused_names(layer) if layout == "fused" else spec.hub_stacked_names(layer)
        outputs = {gate_up_name: out_gate_up, down_name: out_down}
        if spec.expert_bias:
            outputs.update(zip(spec.fused_bias_names(layer), (out_gate_up_bias, out_down_bias)))
        for name, out in outputs.items():
            _copy_checked(out, ckpt.get_rows(name, experts.start, experts.stop), name)
        return
    for i, e in enumerate(experts):
        gate, up, down = spec.hub_expert_names(layer, e)
        _copy_checked(out_gate_up[i, :intermediate], ckpt.get(gate), gate)
        _copy_checked(out_gate_up[i, intermediate:], ckpt.get(up), up)
        _copy_checked(out_down[i], ckpt.get(down), down)


def _fp8_pair(ckpt: Checkpoint, name: str, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A released FP8 weight and its block scales, checked against the shape config.json implies."""
    data, scale = ckpt.get(name), ckpt.get(name + FP8_SCALE_SUFFIX)
    blocks = tuple(-(-n // 128) for n in shape)
    if data.dtype != torch.float8_e4m3fn or tuple(data.shape) != shape or tuple(scale.shape) != blocks:
        raise InputError(f"checkpoint tensor {name!r} is {data.dtype} {tuple(data.shape)} with scales {tuple(scale.shape)}, where "
                         f"config.json implies float8_e4m3fn {shape} with 128 x 128 block scales {blocks}; the checkpoint is not "
                         "block-scaled FP8 as Qwen3's and GLM-4.5's releases are")
    return data, scale.float()


def load_local_quantized_experts(ckpt: Checkpoint, spec: MoESpec, layout: str, layer: int, experts: range, hidden: int,
                                 intermediate: int, device, out_biases=()) -> tuple:
    """This rank's experts of ``layer`` as released quantized, without a bf16 copy: (gate_up, down) ``QuantizedWeight``;
    ``out_biases`` (gate_up's [El, 2I] and down's [El, H], where the row has them) filled from the bf16 biases.

    "mxfp4": gpt-oss's ``<stacked>_blocks`` and ``_scales``, row slices. "hub" with FP8 tensors: each expert's gate, up
    and down with their block scales, gate and up stacked (which keeps each 128-row scale block whole only where the
    moe width is a multiple of 128)."""
    from megablocks_utils.moe.quantized import QuantizedWeight

    for name, out in zip(spec.fused_bias_names(layer) if spec.expert_bias else (), out_biases):
        _copy_checked(out, ckpt.get_rows(name, experts.start, experts.stop), name)
    if layout == "mxfp4":
        out = []
        for name, (n, k) in zip(spec.hub_stacked_names(layer), ((2 * intermediate, hidden), (hidden, intermediate))):
            blocks = ckpt.get_rows(name + "_blocks", experts.start, experts.stop)
            scales = ckpt.get_rows(name + "_scales", experts.start, experts.stop)
            if tuple(blocks.shape) != (len(experts), n, k // 32, 16) or tuple(scales.shape) != (len(experts), n, k // 32):
                raise InputError(f"checkpoint tensors {name}_blocks {tuple(blocks.shape)} and _scales {tuple(scales.shape)} do not "
                                 f"hold {n} x {k} MXFP4 weights per expert as config.json implies")
            out.append(QuantizedWeight("mxfp4", blocks.to(device), scales.to(device), transposed=spec.experts_transposed))
        return tuple(out)
    if layout != "hub" or spec.hub_stacked is not None or spec.experts_transposed:
        raise InputError(f"FP8 experts are read in the Hub's per-expert layout (Qwen3's and GLM-4.5's FP8 releases); this "
                         f"{spec.model_type} checkpoint's are {layout}: dequantize it to bf16, or use --quantize_base fp8 on its bf16 checkpoint")
    if intermediate % 128:
        raise InputError(f"FP8 experts of moe width {intermediate} (not a multiple of 128) cannot stack gate and up with whole "
                         "scale blocks; use the bf16 checkpoint with --quantize_base fp8 (quantized at load)")
    gate_up, gate_up_scale, down, down_scale = [], [], [], []
    for e in experts:
        gate, up, down_name = spec.hub_expert_names(layer, e)
        pairs = [_fp8_pair(ckpt, n, (intermediate, hidden)) for n in (gate, up)]
        gate_up.append(torch.cat([d for d, _ in pairs]))
        gate_up_scale.append(torch.cat([s for _, s in pairs]))
        d, s = _fp8_pair(ckpt, down_name, (hidden, intermediate))
        down.append(d)
        down_scale.append(s)
    return (QuantizedWeight("fp8", torch.stack(gate_up).to(device), torch.stack(gate_up_scale).to(device)),
            QuantizedWeight("fp8", torch.stack(down).to(device), torch.stack(down_scale).to(device)))
