"""``finetuning = "lora"``: which weights get adapters, the dense adapters, freezing, and PEFT's adapter format.

Targets (``lora_target_modules``) are PEFT's names, matched as PEFT matches them (a module or parameter whose
name is the target or ends in ".target"): linear layers (``q_proj``, ..., PEFT's ``target_modules``) and the
experts' fused 3-D weights (``experts.gate_up_proj``, ``experts.down_proj``, PEFT's ``target_parameters``).
Routers, norms and embeddings take no adapter. ``auto`` (the default, alone or in a list) stands for the loaded model's
attention projections and routed experts (``auto_targets``); it is resolved before anything is built or saved, so
the run prints and PEFT's config lists the names themselves.

Where the adapters live:
- a targeted ``nn.Linear`` gets children ``lora_A`` (Linear in -> r) and ``lora_B`` (Linear r -> out) and a forward
  hook adding ``s * lora_B(lora_A(dropout(x)))``, s = alpha / r: PEFT's ``lora.Linear``, under PEFT's own parameter
  names, while the base weight keeps transformers' name. FSDP2 shards them with their decoder layer.
- each MoE layer's experts get ``experts.lora`` (``moe/lora.py``): per projection A [E, r, in] and B [E, out, r],
  Shard(0) over ep like the expert weights, run inside the layer's grouped GEMMs.
Every base weight is frozen (no gradient, no optimizer state); the scripts load it in the compute dtype.

PEFT's files (``adapter_config.json`` + ``adapter_model.safetensors``, what ``PeftModel.from_pretrained`` reads):
  dense:   ``base_model.model.<module>.lora_A.weight`` [r, in], ``...lora_B.weight`` [out, r]: ours as they are.
  experts: PEFT wraps ``<experts>`` once per targeted parameter, the last registered (down_proj) outermost, so the
           keys are ``base_model.model.<experts>.lora_A.weight`` for the outer one and ``<experts>.base_layer.lora_A
           .weight`` for the one inside it. PEFT's A is [E * r, in] with expert e in rows e*r..e*r+r-1 (ours reshaped);
           its B is [out, r * E] with expert e in columns j*E + e (ours, B[e, o, j], permuted to [o, j, e]).
PEFT refuses ``lora_dropout`` on fused experts, so with expert targets the saved config says 0 (inference is the
same; the dropout was a training choice).
"""

import functools
import os
import shutil
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

from megablocks_utils.errors import InputError
from megablocks_utils.model.architectures import decoder_layers, spec_for
from megablocks_utils.moe.lora import PROJECTIONS, ExpertLoRA, stacked_adapter
from megablocks_utils.moe.quantized import QuantizedLinear, QuantizedWeight

LINEARS = (nn.Linear, QuantizedLinear)  # what takes a dense adapter: a linear layer, its weight bf16 or quantized

DEFAULT_TARGETS = "auto"  # the model's attention projections and routed experts: auto_targets
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True)
class LoraSettings:
    r: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]

    @property
    def scaling(self) -> float:
        return self.alpha / self.r


@dataclass(frozen=True)
class LoraTargets:
    """What ``targets`` matched in a model: setting names split into PEFT's two lists, and the full names."""

    target_modules: tuple[str, ...]  # names that matched linear layers
    target_parameters: tuple[str, ...]  # names that matched the experts' fused weights
    linears: tuple[str, ...]  # full module names of the targeted linear layers
    experts: dict  # full name of each experts module -> its targeted projections, in PROJECTIONS order


def parse_targets(text: str) -> tuple[str, ...]:
    """``lora_target_modules`` ("q_proj,v_proj,...") as a tuple of names."""
    names = tuple(dict.fromkeys(n.strip() for n in str(text).split(",") if n.strip()))
    if not names:
        raise InputError("--lora_target_modules is empty; give auto or PEFT names separated by commas, e.g. q_proj,v_proj")
    return names


def _matches(key: str, target: str) -> bool:
    return key == target or key.endswith("." + target)  # PEFT's rule for a list of names


def _experts_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The fused experts modules (transformers' or ours), by full name."""
    spec = spec_for(model.config)
    suffix = f".{spec.block_attr}.{spec.experts_attr}"
    return {n: m for n, m in model.named_modules() if n.endswith(suffix) and isinstance(getattr(m, "gate_up_proj", None), (torch.Tensor, QuantizedWeight))}


def auto_targets(model: nn.Module) -> tuple[str, ...]:
    """What ``auto`` adapts in ``model``: every linear layer of each decoder layer's attention, by its leaf name
    (q_proj, k_proj, v_proj, o_proj; MLA's q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj, or q_proj without
    the q low-rank path), and the routed experts' fused weights. Not the routers, shared experts or dense MLPs."""
    spec = spec_for(model.config)
    attention = [n.rsplit(".", 1)[-1] for layer in decoder_layers(model) for n, m in layer.self_attn.named_modules()
                 if isinstance(m, LINEARS)]
    return tuple(dict.fromkeys(attention)) + tuple(f"{spec.experts_attr}.{p}" for p in PROJECTIONS)


def resolve_targets(model: nn.Module, targets: tuple[str, ...]) -> tuple[str, ...]:
    """``targets`` with ``auto`` replaced by ``auto_targets(model)``."""
    return tuple(dict.fromkeys(n for t in targets for n in (auto_targets(model) if t == "auto" else (t,))))


def find_targets(model: nn.Module, targets: tuple[str, ...]) -> LoraTargets:
    """Match ``targets`` (``auto`` resolved) in ``model`` (plain transformers or expert-parallel: the names are the
    same); a name that matches nothing, or only modules that take no adapter, is an InputError naming what can be
    adapted."""
    spec = spec_for(model.config)
    targets = resolve_targets(model, targets)
    experts = _experts_modules(model)
    linears = [n for n, m in model.named_modules() if isinstance(m, LINEARS) and not any(n.startswith(e + ".") for e in experts)]
    adaptable = sorted({n.rsplit(".", 1)[-1] for n in linears}) + [f"{spec.experts_attr}.{p}" for p in PROJECTIONS]
    modules, parameters, chosen, chosen_experts = [], [], set(), {}
    for target in targets:
        hit_linear = [n for n in linears if _matches(n, target)]
        hit_experts = [(e, p) for e in experts for p in PROJECTIONS if _matches(f"{e}.{p}", target)]
        if not hit_linear and not hit_experts:
            other = [(n, m) for n, m in model.named_modules() if n and _matches(n, target)]
            what = f"names {type(other[0][1]).__name__} modules ({other[0][0]}), which take no adapter" if other else "matches nothing"
            raise InputError(f"--lora_target_modules: {target!r} {what} in {model.config.model_type}; "
                             f"adaptable names: {', '.join(adaptable)}")
        if hit_linear:
            modules.append(target)
            chosen.update(hit_linear)
        if hit_experts:
            parameters.append(target)
            for e, p in hit_experts:
                chosen_experts.setdefault(e, set()).add(p)
    return LoraTargets(
        target_modules=tuple(modules),
        target_parameters=tuple(parameters),
        linears=tuple(n for n in linears if n in chosen),
        experts={e: tuple(p for p in PROJECTIONS if p in ps) for e, ps in chosen_experts.items()},
    )


def meta_model(config) -> nn.Module:
    """The transformers model of ``config`` on the meta device (no memory): for names and shapes."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def check_lora(config, *, finetuning: str, r: int, alpha: float, dropout: float, target_modules: str, moe_backend: str,
               load_balance_coeff: float, merge_lora: bool) -> LoraSettings | None:
    """The LoRA settings checked against each other and the model (its config only, on the meta device), ``auto``
    resolved to the model's names; None for a full fine-tune."""
    if finetuning != "lora":
        if merge_lora:
            raise InputError("--merge_lora true needs --finetuning lora (a full fine-tune's final/ is already the whole model)")
        return None
    if moe_backend != "native":
        raise InputError(f"--finetuning lora runs on moe_backend native (the {moe_backend} kernels have no adapter path); "
                         "drop --moe_backend")
    if load_balance_coeff > 0:
        raise InputError("--load_balance_coeff trains a routing bias, which a PEFT adapter cannot hold; "
                         "use --load_balance_coeff 0 with --finetuning lora")
    model = meta_model(config)
    lora = LoraSettings(r=r, alpha=alpha, dropout=dropout, targets=resolve_targets(model, parse_targets(target_modules)))
    find_targets(model, lora.targets)
    return lora


# ----------------------------------------------------------------------------- adapters in the model
def is_adapter_name(name: str) -> bool:
    """Whether a parameter name is an adapter's (dense ``...lora_A.weight``, experts' ``...lora.gate_up_proj.lora_A``)."""
    return ".lora_A" in name or ".lora_B" in name


def _uniform(shape, fan_in: int, generator: torch.Generator) -> torch.Tensor:
    """PEFT's A init, ``kaiming_uniform_(a=sqrt(5))`` of a Linear with ``fan_in`` inputs: U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
    bound = 1 / fan_in**0.5
    return torch.empty(shape).uniform_(-bound, bound, generator=generator)


def _add_dense_lora(module: nn.Linear, args, output: torch.Tensor) -> torch.Tensor:
    x = args[0]
    a, b = module.lora_A.weight, module.lora_B.weight  # cast by FSDP's mixed precision, else here (one rank)
    return output + nn.functional.linear(nn.functional.linear(module.lora_dropout(x), a.to(x.dtype)), b.to(x.dtype)) * module.lora_scaling


def _attach_dense(linear: nn.Linear, lora: LoraSettings, generator: torch.Generator, dtype: torch.dtype) -> None:
    device = linear.weight.device
    linear.lora_A = nn.Linear(linear.in_features, lora.r, bias=False, device=device, dtype=dtype)
    linear.lora_B = nn.Linear(lora.r, linear.out_features, bias=False, device=device, dtype=dtype)
    with torch.no_grad():
        linear.lora_A.weight.copy_(_uniform((lora.r, linear.in_features), linear.in_features, generator))
        linear.lora_B.weight.zero_()
    linear.lora_dropout = nn.Dropout(lora.dropout) if lora.dropout > 0 else nn.Identity()
    linear.lora_scaling = lora.scaling
    linear.lora_hook = linear.register_forward_hook(_add_dense_lora)


def reattach_hook(old: nn.Module, new: nn.Linear) -> None:
    """Move a dense adapter's forward hook from ``old`` to ``new`` (its attributes already moved): the quantized base's
    linear layer replaced by its dequantized one (``quantized_base.dequantize_base``)."""
    old.lora_hook.remove()
    new.lora_hook = new.register_forward_hook(_add_dense_lora)


def _projection_dims(experts: nn.Module, name: str) -> tuple[int, int]:
    """(in, out) of an expert projection, from its stacked weight's layout."""
    shape = getattr(experts, name).shape
    return (shape[1], shape[2]) if experts.local.transposed else (shape[2], shape[1])


def add_lora(model: nn.Module, mesh, lora: LoraSettings, dtype: torch.dtype, seed: int = 0) -> LoraTargets:
    """Freeze ``model`` and attach the adapters, in ``dtype`` (the optimizer's), after ``shard_moe`` and before
    ``parallelize``. A starts as PEFT's does (B at zero: the model is unchanged), drawn from one generator in module
    order for all experts of a layer at once, so every rank and every (dp, ep) layout gets the same adapters."""
    from megablocks_utils.moe.layer import ExpertParallelExperts

    targets = find_targets(model, lora.targets)
    for p in model.parameters():
        p.requires_grad_(False)
    generator = torch.Generator().manual_seed(seed)
    modules = dict(model.named_modules())
    for name, module in modules.items():
        if name in targets.linears:
            _attach_dense(module, lora, generator, dtype)
        elif name in targets.experts:
            if type(module) is not ExpertParallelExperts:
                raise InputError(f"--finetuning lora needs moe_backend native; {name} is {type(module).__name__}")
            adapters = {}
            for proj in targets.experts[name]:
                fan_in, out = _projection_dims(module, proj)
                full_A = _uniform((module.num_experts, lora.r, fan_in), fan_in, generator)
                full_B = torch.zeros(module.num_experts, out, lora.r)
                device = getattr(module, proj).device
                adapters[proj] = stacked_adapter(full_A, full_B, mesh, device, dtype)
            module.lora = ExpertLoRA(adapters, lora.r, lora.alpha, lora.dropout)
    return targets


# ----------------------------------------------------------------------------- PEFT's layout
def _a_to_peft(t: torch.Tensor) -> torch.Tensor:  # [E, r, in] -> [E * r, in]
    return t.reshape(-1, t.shape[-1])


def _b_to_peft(t: torch.Tensor) -> torch.Tensor:  # [E, out, r] -> [out, r * E], column j * E + e
    return t.permute(1, 2, 0).reshape(t.shape[1], -1)


def _a_from_peft(t: torch.Tensor, experts: int) -> torch.Tensor:
    return t.reshape(experts, -1, t.shape[-1])


def _b_from_peft(t: torch.Tensor, experts: int) -> torch.Tensor:
    return t.reshape(t.shape[0], -1, experts).permute(2, 0, 1)


def _same(t: torch.Tensor, *_) -> torch.Tensor:
    return t


def _adapter_entries(model: nn.Module):
    """(adapter parameter, PEFT key, to PEFT layout, from PEFT layout) for every adapter, in module order."""
    from megablocks_utils.moe.layer import ExpertParallelExperts

    for name, module in model.named_modules():
        if isinstance(module, LINEARS) and hasattr(module, "lora_hook"):
            for ab in ("lora_A", "lora_B"):
                yield getattr(module, ab).weight, f"{PEFT_PREFIX}{name}.{ab}.weight", _same, _same
        elif isinstance(module, ExpertParallelExperts) and module.lora is not None:
            names = module.lora.names
            for i, proj in enumerate(names):
                key = PEFT_PREFIX + name + ".base_layer" * (len(names) - 1 - i)  # PEFT's nesting: the last one outermost
                adapter = getattr(module.lora, proj)
                e = module.num_experts
                yield adapter.lora_A, f"{key}.lora_A.weight", _a_to_peft, functools.partial(_a_from_peft, experts=e)
                yield adapter.lora_B, f"{key}.lora_B.weight", _b_to_peft, functools.partial(_b_from_peft, experts=e)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def peft_tensors(model: nn.Module, grads: bool = False) -> dict[str, torch.Tensor]:
    """Every adapter (or its gradient) whole, in PEFT's keys and layout, on every rank. Collective."""
    out = {}
    for p, key, to_peft, _ in _adapter_entries(model):
        t = p.grad if grads else p
        out[key] = to_peft(_full(t.detach()))
    return out


@torch.no_grad()
def load_peft_tensors(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Set the adapters from PEFT's keys (``get_peft_model_state_dict`` or a saved adapter), each rank its shard."""
    for p, key, _, from_peft in _adapter_entries(model):
        if key not in state:
            raise KeyError(f"the adapter has no {key}; it was made for other targets or another model")
        full = from_peft(state[key]).to(p.device if not isinstance(p, DTensor) else p.to_local().device, p.dtype)
        if isinstance(p, DTensor):
            p.to_local().copy_(distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local())
        else:
            p.copy_(full)


def peft_config(lora: LoraSettings, targets: LoraTargets, base_model_name_or_path: str, inference_mode: bool = True):
    """PEFT's ``LoraConfig`` that rebuilds these adapters on the transformers model (``inference_mode``: frozen, as
    PEFT saves it)."""
    from peft import LoraConfig

    return LoraConfig(
        r=lora.r, lora_alpha=lora.alpha, lora_dropout=0.0 if targets.target_parameters else lora.dropout,
        target_modules=list(targets.target_modules),  # [] rather than None: None means PEFT's defaults for the model
        target_parameters=list(targets.target_parameters) or None, bias="none", task_type="CAUSAL_LM",
        base_model_name_or_path=base_model_name_or_path, inference_mode=inference_mode,
    )


def save_peft_adapter(model: nn.Module, lora: LoraSettings, targets: LoraTargets, out_dir: str, base_model_name_or_path: str,
                      tokenizer=None) -> None:
    """Write ``out_dir`` as PEFT writes an adapter (config + safetensors), whole, from rank 0; it appears under its
    final name only when complete. Collective."""
    from safetensors.torch import save_file

    tensors = peft_tensors(model)
    if dist.get_rank() == 0:
        tmp = out_dir.rstrip("/") + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        save_file({k: v.cpu().contiguous() for k, v in tensors.items()}, os.path.join(tmp, ADAPTER_WEIGHTS), metadata={"format": "pt"})
        peft_config(lora, targets, base_model_name_or_path).save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        shutil.rmtree(out_dir, ignore_errors=True)
        os.replace(tmp, out_dir)
    dist.barrier()


# ----------------------------------------------------------------------------- merging
def _ep_local(t: torch.Tensor) -> torch.Tensor:
    """This ep rank's whole experts of an expert tensor (gathered over dp where FSDP shards it). Collective."""
    if isinstance(t, DTensor) and t.device_mesh.ndim > 1:
        t = t.redistribute(placements=[Replicate()] * (t.device_mesh.ndim - 1) + [t.placements[-1]])
    return t.to_local() if isinstance(t, DTensor) else t


def _add_dense(weight: torch.Tensor, delta: torch.Tensor) -> None:
    if isinstance(weight, DTensor):
        weight.to_local().add_(distribute_tensor(delta.to(weight.dtype), weight.device_mesh, weight.placements, src_data_rank=None).to_local())
    else:
        weight.add_(delta.to(weight.dtype))


def _add_experts(weight: torch.Tensor, delta: torch.Tensor) -> None:
    """Add ``delta`` [El, ...] (this ep rank's experts, whole) to an expert weight, each rank to its shard."""
    delta = delta.to(weight.dtype)
    if isinstance(weight, DTensor) and weight.device_mesh.ndim > 1:
        whole = DTensor.from_local(delta, weight.device_mesh, [Replicate()] * (weight.device_mesh.ndim - 1) + [weight.placements[-1]],
                                   run_check=False, shape=weight.shape, stride=weight.stride())
        delta = whole.redistribute(placements=weight.placements).to_local()  # Replicate -> Shard over dp: a slice
    (weight.to_local() if isinstance(weight, DTensor) else weight).add_(delta)


@torch.no_grad()
def merge_adapters(model: nn.Module) -> None:
    """Fold every adapter into its base weight (W += s * B A, in fp32, then the weight's dtype, as PEFT's merge) and
    remove the adapters: the model is then a plain one that ``export_hf`` writes. Collective."""
    from megablocks_utils.moe.layer import ExpertParallelExperts

    if any(isinstance(m, QuantizedWeight) for m in model.modules()):
        raise ValueError("the base is quantized: dequantize it first (model/quantized_base.dequantize_base), then merge")
    for module in list(model.modules()):
        if isinstance(module, LINEARS) and hasattr(module, "lora_hook"):
            a, b = _full(module.lora_A.weight).float(), _full(module.lora_B.weight).float()
            _add_dense(module.weight, (b @ a) * module.lora_scaling)
            module.lora_hook.remove()
            for attr in ("lora_A", "lora_B", "lora_dropout", "lora_scaling", "lora_hook"):
                delattr(module, attr)
        elif isinstance(module, ExpertParallelExperts) and module.lora is not None:
            for proj in module.lora.names:
                adapter = getattr(module.lora, proj)
                a, b = _ep_local(adapter.lora_A).float(), _ep_local(adapter.lora_B).float()
                delta = torch.bmm(b, a) * module.lora.scaling  # [El, out, in]
                _add_experts(getattr(module, proj), delta.transpose(-2, -1) if module.local.transposed else delta)
            module.lora = None


# ----------------------------------------------------------------------------- the fit check's numbers
@dataclass(frozen=True)
class AdapterCounts:
    """Adapter parameters of a model (global counts) and, per decoder layer, the widths its activations add per token."""

    dense: int  # adapters outside the experts
    expert: int  # the experts' adapters, all layers and experts
    dense_layer: int  # the largest decoder layer's dense adapters
    expert_layer: int  # one MoE layer's experts' adapters, all experts
    layers: tuple  # per decoder layer: (dense r, dense in, dense out, expert r, expert in, expert out), per token (copy)


_COUNTS: dict = {}  # adapter_counts per (config, targets, r): the fit check asks for many plans of one model


def _count_adapters(config, targets: tuple[str, ...], r: int) -> AdapterCounts:
    spec = spec_for(config)
    model = meta_model(config)
    found = find_targets(model, targets)
    modules = dict(model.named_modules())
    num_layers = config.num_hidden_layers
    per_layer = [[0] * 6 for _ in range(num_layers)]
    dense = expert = 0
    dense_by_layer, expert_by_layer = [0] * num_layers, [0] * num_layers
    for name in found.linears:
        m = modules[name]
        n = r * (m.in_features + m.out_features)
        dense += n
        if name.startswith("model.layers."):
            i = int(name.split(".")[2])
            dense_by_layer[i] += n
            row = per_layer[i]
            row[0], row[1], row[2] = row[0] + r, row[1] + m.in_features, row[2] + m.out_features
    for name, projections in found.experts.items():
        i = int(name.split(".")[2])
        for proj in projections:
            shape = getattr(modules[name], proj).shape
            fan_in, out = (shape[1], shape[2]) if spec.experts_transposed else (shape[2], shape[1])
            n = shape[0] * r * (fan_in + out)
            expert += n
            expert_by_layer[i] += n
            row = per_layer[i]
            row[3], row[4], row[5] = row[3] + r, row[4] + fan_in, row[5] + out
    return AdapterCounts(dense, expert, max(dense_by_layer, default=0), max(expert_by_layer, default=0),
                         tuple(tuple(row) for row in per_layer))


def adapter_counts(config, target_modules: str, r: int) -> AdapterCounts:
    """The adapters ``target_modules`` gives the model of ``config`` (built on the meta device; cached)."""
    key = (config.to_json_string(use_diff=False), parse_targets(target_modules), r)
    if key not in _COUNTS:
        _COUNTS[key] = _count_adapters(config, key[1], r)
    return _COUNTS[key]
