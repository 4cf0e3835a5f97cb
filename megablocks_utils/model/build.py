"""``shard_moe``: turn a transformers MoE model into an expert-parallel one, loading only local experts."""

import os
import re
from datetime import timedelta

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from transformers import AutoConfig, AutoModelForCausalLM

from megablocks_utils.model.architectures import MoESpec, decoder_layers, spec_for
from megablocks_utils.model.attention import choose_attention
from megablocks_utils.model.loading import (
    FP8_SCALE_SUFFIX,
    Checkpoint,
    checkpoint_quantization,
    expert_layout,
    load_local_experts,
    load_local_quantized_experts,
)
from megablocks_utils.model.quantized_base import quantize_linears
from megablocks_utils.moe.blocks import moe_blocks, remember_moe_blocks
from megablocks_utils.moe.layer import ExpertParallelExperts, ExpertParallelMoE
from megablocks_utils.moe.megablocks_backend import MegablocksExperts, check_megablocks
from megablocks_utils.moe.quantized import quantize_weight
from megablocks_utils.moe.router import TopKRouter
from megablocks_utils.mesh import MoEMesh, build_mesh

BACKENDS = ("native", "megablocks")


def check_backend(moe_backend: str, device_type: str | None = None) -> None:
    """Raise a clear error unless ``moe_backend`` is known and can run here (never a silent fallback)."""
    if moe_backend not in BACKENDS:
        raise ValueError(f"moe_backend={moe_backend!r} is unknown; choose one of {BACKENDS}")
    if moe_backend == "megablocks":
        check_megablocks(device_type)


def check_megablocks_model(spec: MoESpec) -> None:
    """megablocks' GLU has no expert biases, clamped SwiGLU or transposed/interleaved weights (gpt-oss)."""
    if spec.expert_bias or spec.expert_act is not None or spec.experts_transposed or spec.gate_up_interleaved:
        raise ValueError(
            f"moe_backend='megablocks' does not support {spec.model_type}: its experts have biases and a clamped SwiGLU "
            "on transposed, interleaved weights, which megablocks' GLU does not compute; use moe_backend='native'"
        )


def local_expert_weights(experts: nn.Module) -> tuple[torch.Tensor, ...]:
    """This ep rank's whole expert blocks (gate_up [El, 2I, H], down [El, H, I], then the biases where the
    model has them; ``experts.expert_tensors()``), gathered over dp if FSDP shards them. Collective when
    sharded: every rank must call it for the same module."""
    out = []
    for p in experts.expert_tensors():
        p = p.detach()
        if isinstance(p, DTensor) and p.device_mesh.ndim > 1:  # FSDP-sharded: (replicate, shard, ep)
            p = p.redistribute(placements=[Replicate()] * (p.device_mesh.ndim - 1) + [Shard(0)])
        out.append(p.to_local() if isinstance(p, DTensor) else p)
    return tuple(out)


def _start_recording_router(model: nn.Module, args) -> None:
    for block in moe_blocks(model):
        block.record_router = True


def _as_expert_dtensor(local: torch.Tensor, mesh: MoEMesh) -> DTensor:
    return DTensor.from_local(local, mesh.ep, [Shard(0)], run_check=False)


def expert_shapes(spec: MoESpec, config, num_experts: int) -> tuple[tuple[int, ...], ...]:
    """Shapes of one layer's ``num_experts`` experts' tensors, in ``expert_tensors()`` order, in the row's layout."""
    hidden, intermediate = config.hidden_size, getattr(config, spec.intermediate_attr)
    if spec.experts_transposed:
        shapes = [(num_experts, hidden, 2 * intermediate), (num_experts, intermediate, hidden)]
    else:
        shapes = [(num_experts, 2 * intermediate, hidden), (num_experts, hidden, intermediate)]
    if spec.expert_bias:
        shapes += [(num_experts, 2 * intermediate), (num_experts, hidden)]
    return tuple(shapes)


def expert_options(spec: MoESpec, config) -> dict:
    """The expert module's layout and activation, from the model table row and the config."""
    options = dict(transposed=spec.experts_transposed, interleaved=spec.gate_up_interleaved, bias=spec.expert_bias)
    if spec.expert_act == "gpt_oss_swiglu":
        options.update(alpha=config.swiglu_alpha, limit=config.swiglu_limit)
    return options


def _materialize_dense(model: nn.Module, ckpt: Checkpoint, spec: MoESpec, device: torch.device) -> dict:
    """Allocate the meta skeleton's dense tensors on ``device`` and fill them from the checkpoint. A linear layer's weight
    released in FP8 (with ``weight_scale_inv``) is not read into it: returned as {module name: (fp8 data, scales)} on
    ``device``, for its ``QuantizedLinear`` (``quantized_base.quantize_linears``)."""
    model.to_empty(device=device)
    for module in model.modules():  # a checkpoint without the routers' selection bias means zeros
        if isinstance(module, TopKRouter) and module.bias_name is not None:
            module.score_bias.zero_()
    # Non-persistent buffers (rotary inv_freq) are not in checkpoints; transformers computes them
    # in its per-module init, the same routine from_pretrained runs after building on meta.
    for module in model.modules():
        if any(name in module._non_persistent_buffers_set for name, _ in module.named_buffers(recurse=False)):
            model._init_weights(module)
    targets = dict(model.named_parameters())
    targets.update(model.state_dict(keep_vars=True))  # persistent buffers too
    loaded = set()
    released = {}
    fp8_weights = {n[: -len(FP8_SCALE_SUFFIX)] for n in ckpt.names() if n.endswith(".weight" + FP8_SCALE_SUFFIX)}
    # Tensors without a place that transformers' from_pretrained ignores too: DeepSeek-V3's MTP layer (model.layers.61.*).
    ignored = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()]
    with torch.no_grad():
        for name in ckpt.names():
            if spec.is_expert_name(name) or name.endswith(FP8_SCALE_SUFFIX):
                continue
            target = spec.hub_to_model(name)
            if name in fp8_weights and target in targets:  # kept as released, for the layer's QuantizedLinear
                value, scale = ckpt.get(name), ckpt.get(name + FP8_SCALE_SUFFIX)
                if tuple(value.shape) != tuple(targets[target].shape):
                    raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(value.shape)} but the model expects "
                                     f"{tuple(targets[target].shape)}; config.json does not match the weights")
                released[target.removesuffix(".weight")] = (value.to(device), scale.float().to(device))
                loaded.add(target)
                continue
            if target not in targets:
                if "rotary_emb.inv_freq" in target:  # old checkpoints carry it; it is recomputed above
                    continue
                if any(p.search(name) for p in ignored):
                    continue
                raise ValueError(
                    f"checkpoint tensor {name!r} has no place in {type(model).__name__}; "
                    "the checkpoint and config.json do not belong to the same model"
                )
            value = ckpt.get(name)
            if targets[target].shape != value.shape:
                raise ValueError(
                    f"checkpoint tensor {name!r} has shape {tuple(value.shape)} but the model expects "
                    f"{tuple(targets[target].shape)}; config.json does not match the weights"
                )
            targets[target].copy_(value)
            loaded.add(target)
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
        loaded.update(n for n, p in model.named_parameters(remove_duplicate=False) if n.startswith("lm_head"))
    missing = sorted(set(dict(model.named_parameters())) - loaded)  # experts are not attached yet
    if missing:
        raise ValueError(f"the checkpoint in {ckpt.model_dir} lacks {len(missing)} weight(s), e.g. {missing[:3]}")
    return released


def shard_moe(
    model: nn.Module,
    mesh: MoEMesh | int,
    *,
    model_dir: str | None = None,
    device: torch.device | str | None = None,
    moe_backend: str = "native",
    timeout: timedelta | None = None,
    force_loop: bool = False,
    compile_elementwise: bool = True,
    overlap_chunks: int = 1,
    quantize_base: str = "none",
    checkpoint: Checkpoint | None = None,
) -> MoEMesh:
    """Swap every MoE block for ``ExpertParallelMoE`` and give each rank its own experts.

    ``moe_backend``: "native" (this package's expert-parallel layer) or "megablocks" (megablocks'
    dropless MoE moves the tokens, grouped_gemm runs the experts; CUDA only; ``megablocks_backend.py``).
    Both hold the same weights in the same places.

    ``model`` is either built on the meta device (then ``model_dir`` supplies every weight: dense
    ones whole, experts as this rank's slices only) or a materialised transformers model (then the
    local experts are sliced out of it). Returns the mesh; the model is modified in place.
    ``mesh``: the script's ``build_mesh(...)``, or an ep size (then a mesh is built with its defaults
    and ``timeout``, which bounds the collectives on the mesh's groups; see ``build_mesh``).
    FSDP (``parallelize``) is applied afterwards; until then each expert DTensor is Shard(0) over ep.
    ``force_loop``, ``compile_elementwise``, ``overlap_chunks``: the experts' settings (``ExpertParallelExperts``;
    megablocks' forward has no ``overlap_chunks``). ``checkpoint``: the weights' reader in place of
    ``Checkpoint(model_dir)`` (benches: random weights of a model's shape, read as from disk). ``quantize_base`` "fp8":
    the experts held in FP8, each layer's quantized as it is read, then the decoder layers' linear layers; weights
    released quantized kept as they are (``model/quantized_base.py``; LoRA).
    """
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    config = model.config
    spec = spec_for(config)
    if moe_backend == "megablocks":
        check_megablocks_model(spec)
        if overlap_chunks != 1:
            raise ValueError(f"overlap_chunks={overlap_chunks} needs moe_backend='native' (megablocks moves the tokens itself); use it or overlap_chunks=1")
    check_backend(moe_backend, device.type)
    num_experts = getattr(config, spec.num_experts_attr)
    top_k = getattr(config, spec.top_k_attr)
    intermediate = getattr(config, spec.intermediate_attr)
    renormalize = spec.renormalize if isinstance(spec.renormalize, bool) else getattr(config, spec.renormalize)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if isinstance(mesh, int):
        mesh = build_mesh(mesh, device.type, num_experts, spec.num_experts_attr, timeout=timeout)
    elif num_experts % mesh.ep_size != 0:
        raise ValueError(f"{spec.num_experts_attr}={num_experts} is not divisible by the mesh's ep size {mesh.ep_size}")
    on_meta = any(p.is_meta for p in model.parameters())
    if on_meta and model_dir is None and checkpoint is None:
        raise ValueError("the model is on the meta device: pass model_dir so shard_moe can load its weights")

    old_blocks = {}
    for index, layer in enumerate(decoder_layers(model)):
        old = getattr(layer, spec.block_attr, None)
        if old is None or not hasattr(old, spec.experts_attr):
            continue
        dtype = getattr(old, spec.router_attr).weight.dtype
        with torch.device("meta" if on_meta else device):
            if moe_backend == "megablocks":
                experts = MegablocksExperts(
                    num_experts, mesh, config.hidden_act,
                    top_k=top_k, hidden_size=config.hidden_size, intermediate_size=intermediate,
                    force_loop=force_loop, compile_elementwise=compile_elementwise,
                )
            else:
                experts = ExpertParallelExperts(
                    num_experts, mesh, spec.expert_act or config.hidden_act, **expert_options(spec, config),
                    force_loop=force_loop, compile_elementwise=compile_elementwise, overlap_chunks=overlap_chunks,
                )
            new = ExpertParallelMoE(
                config.hidden_size, num_experts, top_k, renormalize, mesh, config.hidden_act,
                router_attr=spec.router_attr, router_mode=spec.router, router_options=spec.router_options(config),
                router_bias=spec.router_bias, returns_scores=spec.block_returns_scores, experts=experts,
            )
        new.to(dtype)
        new.top_k_router.keep_bias_fp32()
        if spec.shared_expert_attr is not None:  # transformers' own modules, weights and all
            gate = getattr(old, spec.shared_gate_attr) if spec.shared_gate_attr else None
            new.add_shared_expert(spec.shared_expert_attr, getattr(old, spec.shared_expert_attr), spec.shared_gate_attr, gate)
        old_blocks[index] = old
        setattr(layer, spec.block_attr, new)
    if not old_blocks:
        raise ValueError(
            f"{type(model).__name__} has no MoE blocks (no decoder layer has `{spec.block_attr}.{spec.experts_attr}`); "
            "shard_moe needs a mixture-of-experts model"
        )

    ckpt = checkpoint if checkpoint is not None else Checkpoint(model_dir) if model_dir is not None else None
    released = {}  # linear layers' weights released in FP8: kept as they are (quantize_base)
    if on_meta:
        released = _materialize_dense(model, ckpt, spec, device)
    else:
        model.to(device)

    quantized_ok = quantize_base == "fp8"
    layout = expert_layout(ckpt.names(), spec, ckpt.model_dir, quantized_ok) if ckpt is not None else None
    released_experts = ckpt is not None and checkpoint_quantization(ckpt.names()) is not None
    local = num_experts // mesh.ep_size
    mine = range(mesh.ep_rank * local, (mesh.ep_rank + 1) * local)
    layers = decoder_layers(model)
    for index, old in old_blocks.items():
        new = getattr(layers[index], spec.block_attr)
        dtype = new.top_k_router.weight.dtype
        shapes = expert_shapes(spec, config, local)
        if released_experts:  # as released, quantized; the bf16 gate_up and down are never made (biases are bf16)
            tensors = [torch.empty(shape, dtype=dtype, device="meta" if i < 2 else device) for i, shape in enumerate(shapes)]
            with torch.no_grad():
                quantized = load_local_quantized_experts(ckpt, spec, layout, index, mine, config.hidden_size, intermediate,
                                                         device, tensors[2:])
            new.experts.set_weights(*(_as_expert_dtensor(t, mesh) for t in tensors))
            new.experts.set_quantized_weights(*quantized)
            continue
        tensors = [torch.empty(shape, dtype=dtype, device=device) for shape in shapes]
        with torch.no_grad():
            if on_meta:
                load_local_experts(ckpt, spec, layout, index, mine, intermediate, *tensors)
            else:
                old_experts = getattr(old, spec.experts_attr)
                names = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")
                for name, tensor in zip(names, tensors):
                    tensor.copy_(getattr(old_experts, name)[mine.start : mine.stop])
                old_router = getattr(old, spec.router_attr)
                new.top_k_router.weight.copy_(old_router.weight)
                if spec.router_bias:
                    new.top_k_router.bias.copy_(old_router.bias)
                if spec.score_bias is not None:
                    new.top_k_router.score_bias.copy_(getattr(old_router, spec.score_bias))
        new.experts.set_weights(*(_as_expert_dtensor(t, mesh) for t in tensors))
        if quantize_base == "fp8":  # this layer's bf16 experts are freed here, before the next layer is read
            new.experts.set_quantized_weights(*(quantize_weight(t, spec.experts_transposed) for t in tensors[:2]))
        del tensors
    if ckpt is not None:
        ckpt.close()
    if quantize_base == "fp8":
        quantize_linears(model, released)
    elif released:
        raise ValueError("the checkpoint holds FP8 linear layers: load it with quantize_base fp8")
    remember_moe_blocks(model)
    model.register_forward_pre_hook(_start_recording_router)
    # transformers' own aux loss would look for its router class's outputs and find none; ours is
    # computed over the global token set by aux_loss.router_stats instead.
    config.output_router_logits = False
    return mesh


def one_dtype(model: nn.Module, dtype: torch.dtype) -> list[str]:
    """Every floating-point parameter of ``model`` in ``dtype``; the names of those cast.

    transformers keeps some weights in fp32 whatever dtype is asked (``_keep_in_fp32_modules_strict``: DeepSeek-V2's
    router weights from transformers 5.24), where the optimizers here update one dtype (``optim.param_dtype``). The rule:
    such weights take the asked dtype, as transformers up to 5.23 built them, and the routers that transformers computes
    in fp32 still compute in fp32 here whatever their weight's dtype (``router.py`` upcasts). Buffers (rotary
    frequencies) keep their dtype."""
    cast = []
    for module_name, module in model.named_modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if p.is_floating_point() and p.dtype != dtype:
                setattr(module, name, nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad))
                cast.append(f"{module_name}.{name}" if module_name else name)
    return cast


def load_model(
    model_dir: str,
    mesh: MoEMesh | int,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
    moe_backend: str = "native",
    timeout: timedelta | None = None,
    attn_implementation: str | None = None,
    force_loop: bool = False,
    compile_elementwise: bool = True,
    overlap_chunks: int = 1,
    quantize_base: str = "none",
) -> tuple[nn.Module, MoEMesh]:
    """Build the model skeleton on meta (no expert memory) with every parameter in ``dtype`` (``one_dtype``), then
    ``shard_moe`` it from ``model_dir``.

    ``mesh``: the script's ``build_mesh(...)`` (or an ep size, see ``shard_moe``); ``timeout``: for a
    mesh built here (see ``build_mesh``); ``force_loop``, ``compile_elementwise``, ``overlap_chunks``: the
    experts' settings, ``quantize_base`` the frozen base's format (see ``shard_moe``).
    """
    if not os.path.isdir(model_dir):
        raise FileNotFoundError(f"model directory {model_dir!r} does not exist; set model_name_or_path to a local model")
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise FileNotFoundError(f"{model_dir} has no config.json; it is not a Hugging Face model directory")
    config = AutoConfig.from_pretrained(model_dir)
    spec_for(config)  # fail early, with the list of supported models
    if attn_implementation is not None:  # "auto" resolved, an explicit kernel checked (varlen registered)
        device_type = torch.device(device).type if device is not None else "cpu"
        attn_implementation = choose_attention(attn_implementation, config, device_type)[0]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    one_dtype(model, dtype)
    mesh = shard_moe(
        model, mesh, model_dir=model_dir, device=device, moe_backend=moe_backend, timeout=timeout,
        force_loop=force_loop, compile_elementwise=compile_elementwise, overlap_chunks=overlap_chunks,
        quantize_base=quantize_base,
    )
    return model, mesh
