"""A torchtitan 0.3.0 config for the Mixtral-width benchmark, for when the GPU image has torch >= 2.14 (NOT RUN:
torchtitan 0.3.0 does not import on torch 2.11; see bench/reports/peers_memory_models_h100-h200_2026-11-22-23.md, "Peers (issue #17)").

It trains a Mixtral checkpoint's shape through torchtitan's transformers backend, which replaces the model's MoE
blocks with torchtitan's own (router, grouped experts, all-to-all EP); attention, norms and embeddings stay
transformers'. `python bench/run.py peers --torchtitan` launches it so (4 GPUs, 2 sequences x 2 micro-steps of 4096
tokens per GPU, as its other rows):

    PYTHONPATH=/tmp/site:bench HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TT_HF_DIR=/tmp/mixtral-L8 TT_DATA_DIR=/tmp/tt_data \\
    torchrun --standalone --nproc_per_node=4 -m torchtitan.train --module torchtitan_mixtral --config mixtral_bench \\
      --hf-assets-path /tmp/mixtral-L8 --training.seq_len 4096 --training.local_batch_size 2 \\
      --training.global_batch_size 16 --training.steps 9 --parallelism.expert_parallel_degree 4 \\
      --training.disable_cuda_graphs --metrics.log_freq 1 --dump_folder $OUT/tt

TT_HF_DIR's config.json needs "architectures": ["MixtralForCausalLM"]; TT_DATA_DIR holds JSON lines {"text": ...}
(torchtitan has no synthetic-token dataset). Weights are random unless --checkpoint.enable
--checkpoint.initial_load_in_hf --checkpoint.initial_load_path DIR. torchtitan's MoE defaults to aux-loss-free
balancing (load_balance_coeff 1e-3), which moves routing over the steps: turn it off for a like-for-like row.
"""

import os

from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.loss import CrossEntropyLoss
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
from torchtitan.config import DebugConfig, ParallelismConfig, TrainingConfig
from torchtitan.experiments.transformers_modeling_backend import (
    HFTransformerModel,
    TitanMoeModelConfig,
    model_registry,
)
from torchtitan.experiments.transformers_modeling_backend.configs import (
    TransformersBackendConfig,
)
from torchtitan.experiments.transformers_modeling_backend.tokenizer import (
    HFBackendTokenizer,
)
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader

HF_DIR = os.environ.get("TT_HF_DIR", "/tmp/mixtral-L8")
DATA_DIR = os.environ.get("TT_DATA_DIR", "/tmp/tt_data")
LAYERS = int(os.environ.get("TT_LAYERS", "0")) or None  # None: config.json's num_hidden_layers


def mixtral_bench() -> TransformersBackendConfig:
    spec = model_registry("full_moe")  # an MoE entry; its model is replaced by the checkpoint's below
    spec.model = HFTransformerModel.Config(model_config=TitanMoeModelConfig(n_layers=LAYERS, experts_implementation="grouped_mm"))
    return TransformersBackendConfig(
        hf_model=HF_DIR,
        hf_assets_path=HF_DIR,
        model_spec=spec,
        tokenizer=HFBackendTokenizer.Config(),
        loss=CrossEntropyLoss.Config(),
        optimizer=default_adamw(lr=1e-5),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=1),
        training=TrainingConfig(local_batch_size=2, seq_len=4096, steps=9, max_norm=1.0, mixed_precision_param="bfloat16"),
        dataloader=HuggingFaceTextDataLoader.Config(dataset="c4_test", dataset_path=DATA_DIR),
        metrics=MetricsProcessor.Config(log_freq=1),
        parallelism=ParallelismConfig(data_parallel_shard_degree=-1, expert_parallel_degree=4),
        checkpoint=CheckpointManager.Config(enable=False),
        debug=DebugConfig(print_config=False, seed=0),
    )
