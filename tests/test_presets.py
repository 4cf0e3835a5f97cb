"""The shipped presets (configs/*.yaml): every key a valid train_fsdp2.py setting, and the plan fits the GPUs it names.

Each preset is parsed by train_fsdp2.py's own settings parser (``--config``), then given to the fit check with the
published model's config.json (tests/configs) on the node it is written for: 8 GPUs of 80 GB.
"""

import glob
import os

import pytest
from conftest import ROOT
from test_settings import BLOCK, FSDP2

from megablocks_utils.config.settings import parse_settings
from megablocks_utils.train.memory_fit import checkpointing_hint, fit_error
from megablocks_utils.train.memory_plan import estimate_memory

PRESETS = sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml")))
# preset -> (the published config.json it is for, GPUs, GiB per GPU)
TARGETS = {
    "mixtral-8x7b-8gpu.yaml": ("mixtral-8x7b", 8, 80),
    "qwen3-30b-a3b-8gpu.yaml": ("qwen3-30b-a3b", 8, 80),
}


def test_every_preset_has_a_target():
    assert sorted(os.path.basename(p) for p in PRESETS) == sorted(TARGETS)


@pytest.mark.parametrize("preset", sorted(TARGETS))
def test_preset_parses_and_fits_its_gpus(preset):
    settings = dict(BLOCK)
    parse_settings(settings, FSDP2, ["--config", os.path.join(ROOT, "configs", preset)])
    model, gpus, gib = TARGETS[preset]
    plan = estimate_memory(os.path.join(ROOT, "tests", "configs", model), world_size=gpus, ep_size=settings["ep_size"],
                           optim=settings["optim"], shard_experts=settings["shard_experts"], nproc_per_node=gpus,
                           max_length=settings["max_length"], per_device_train_batch_size=settings["per_device_train_batch_size"],
                           gradient_accumulation_steps=settings["gradient_accumulation_steps"],
                           activation_checkpointing=settings["activation_checkpointing"],
                           activation_checkpointing_layers=settings["activation_checkpointing_layers"])
    assert fit_error(plan, gib * 2**30) is None, fit_error(plan, gib * 2**30)
    assert plan.total <= 0.9 * gib * 2**30  # the fit check's margin
    # the preset checkpoints no more layers than needed: the hint would name a smaller count
    assert checkpointing_hint(plan, gib * 2**30) is None, checkpointing_hint(plan, gib * 2**30)
