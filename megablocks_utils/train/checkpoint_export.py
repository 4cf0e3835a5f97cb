"""A training checkpoint (train_fsdp2's DCP one or train_fsdp1's Trainer one) written as a Hugging Face model in
hub layout, offline: ``export_from_checkpoint``, what ``python -m megablocks_utils.tools.export`` runs.

Its own module beside ``train/checkpoint``, not in it: that module saves and resumes a run (collective, during
training), this one converts a saved checkpoint (one process, no process group). It reads the checkpoint's
layout from ``train/checkpoint`` and writes with ``model/export``'s writers, so ``model/`` never imports ``train/``.
"""

import os
import shutil

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from transformers import AutoConfig, AutoTokenizer

from megablocks_utils.errors import CheckpointError
from megablocks_utils.model.architectures import spec_for
from megablocks_utils.model.export import dense_hub_name, expert_hub_tensors, is_score_bias, shard_file_name, write_index
from megablocks_utils.moe.router import TopKRouter
from megablocks_utils.train.checkpoint import STATE_NAME, describe_failure


def export_from_checkpoint(checkpoint_dir: str, out_dir: str, dtype: torch.dtype | None = None) -> None:
    """Turn a training checkpoint (train_fsdp2's DCP one or train_fsdp1's Trainer one) into a hub-layout
    HF checkpoint; no process group needed.

    Reads the dense weights at once and the experts one layer at a time (only that layer's experts
    are ever in memory), on the CPU.
    """
    if not os.path.isfile(os.path.join(checkpoint_dir, STATE_NAME)):
        raise CheckpointError(f"{checkpoint_dir} is not a complete training checkpoint (no {STATE_NAME})")
    config = AutoConfig.from_pretrained(checkpoint_dir)
    spec = spec_for(config)
    # A train_fsdp1.py (Trainer + accelerate FSDP1) checkpoint keeps the same DCP keys in a subfolder.
    trainer_dcp = os.path.join(checkpoint_dir, "pytorch_model_fsdp_0")
    dcp_dir = trainer_dcp if os.path.isdir(trainer_dcp) else checkpoint_dir
    try:
        metadata = dcp.FileSystemReader(dcp_dir).read_metadata().state_dict_metadata
    except Exception as e:
        raise CheckpointError(f"cannot read the DCP metadata of {checkpoint_dir} ({e}); the checkpoint is incomplete") from e
    prefix = "model."
    shapes = {k[len(prefix):]: m for k, m in metadata.items() if k.startswith(prefix) and hasattr(m, "size")}
    if any(".lora_A" in n for n in shapes):
        raise CheckpointError(f"{checkpoint_dir} is a LoRA run's checkpoint: it holds the adapters only. The run's final/ is a "
                              "PEFT adapter of the base model; --merge_lora true also writes the merged model")
    expert_suffix = f".{spec.block_attr}.{spec.experts_attr}."

    def read(names):
        target = {n: torch.empty(shapes[n].size, dtype=shapes[n].properties.dtype) for n in names}
        try:
            dcp.load({"model": target}, checkpoint_id=dcp_dir, no_dist=True)
        except (Exception, dcp.CheckpointException) as e:  # the latter is a BaseException
            raise CheckpointError(f"the checkpoint {checkpoint_dir} is corrupt or truncated ({describe_failure(e)})") from e
        # The routers' selection bias stays fp32, as transformers keeps it.
        return {n: t if dtype is None or is_score_bias(n, spec) else t.to(dtype) for n, t in target.items()}

    tmp_dir = out_dir.rstrip("/") + ".tmp"
    shutil.rmtree(tmp_dir, ignore_errors=True)
    os.makedirs(tmp_dir)
    layers = sorted({int(n.split(".")[2]) for n in shapes if expert_suffix in n})
    n_files = 1 + len(layers)
    # Not exported: the selection bias that load_balance_coeff added to a model that has none of its own.
    added_bias = f".{TopKRouter.ADDED_BIAS}"
    dense = read([n for n in shapes if expert_suffix not in n and not n.endswith(added_bias)])
    dense = {dense_hub_name(n, spec): t for n, t in dense.items()}
    save_file(dense, os.path.join(tmp_dir, shard_file_name(0, n_files)), metadata={"format": "pt"})
    weight_map = {n: shard_file_name(0, n_files) for n in dense}
    total = sum(t.numel() * t.element_size() for t in dense.values())
    for i, layer in enumerate(layers):
        base = f"model.layers.{layer}{expert_suffix}"
        names = [base + n for n in ("gate_up_proj", "down_proj")]
        if spec.expert_bias:
            names += [base + n for n in ("gate_up_proj_bias", "down_proj_bias")]
        fused = read(names)  # all experts of the layer
        tensors = expert_hub_tensors(spec, layer, 0, *(fused[n] for n in names))
        save_file(tensors, os.path.join(tmp_dir, shard_file_name(1 + i, n_files)), metadata={"format": "pt"})
        weight_map.update({n: shard_file_name(1 + i, n_files) for n in tensors})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    write_index(tmp_dir, weight_map, total)
    config.save_pretrained(tmp_dir)
    if os.path.isfile(os.path.join(checkpoint_dir, "tokenizer_config.json")):
        AutoTokenizer.from_pretrained(checkpoint_dir).save_pretrained(tmp_dir)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp_dir, out_dir)
