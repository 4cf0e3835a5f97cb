"""The training scripts' settings: every value is checked before anything heavy, with one line naming the flag;
--help, --config and bare true/false flags work (megablocks_utils/config/settings.py).

The sweep calls the parser in-process on the scripts' own settings blocks; a few real runs of the
scripts (no launcher: the checks come before the launch check) prove the wiring.
"""

import json
import math
import os
import re
import subprocess
import sys

import pytest
from conftest import ROOT

from megablocks_utils.config.settings import (
    RULES,
    Choice,
    Number,
    check_values,
    help_comments,
    parse_settings,
)
from megablocks_utils.errors import SettingsError

FSDP2 = os.path.join(ROOT, "train_fsdp2.py")
FSDP1 = os.path.join(ROOT, "train_fsdp1.py")


def settings_block(script: str) -> dict:
    """The values of ``script``'s settings block, as the script sees them (the block's lines, executed)."""
    lines = open(script).read().split("\n")
    start = next(i for i, line in enumerate(lines) if line.startswith("# ---") and line.endswith(" settings"))
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("# ---"))
    values = {}
    exec("\n".join(lines[start + 1 : end]), {}, values)
    return values


BLOCK = settings_block(FSDP2)
NUMBERS = sorted(name for name, value in BLOCK.items() if isinstance(value, (int, float)) and not isinstance(value, bool))
CHOICES = sorted(name for name in BLOCK if isinstance(RULES.get(name), Choice))


def parse(*argv: str, settings: dict | None = None) -> dict:
    settings = dict(BLOCK if settings is None else settings)
    parse_settings(settings, FSDP2, list(argv))
    return settings


def bad_values(name: str) -> list[str]:
    """Values that break ``name``'s rule: below it, above it, and not finite (float settings)."""
    rule, is_float = RULES[name], isinstance(BLOCK[name], float)
    step = 0.5 if is_float else 1
    below = rule.low if rule.low_open else rule.low - step
    if below == rule.special:
        below -= step
    values = [below] if math.isfinite(rule.low) else []
    if math.isfinite(rule.high):
        values.append(rule.high if rule.high_open else rule.high + step)
    values = [f"{v:g}" for v in values]
    return values + ["nan", "inf", "-inf"] if is_float else values


def test_every_setting_has_help_and_every_number_a_range():
    helps = help_comments(FSDP2)
    assert not [name for name in BLOCK if not helps.get(name)], "settings without a '# help' comment"
    assert not [name for name in NUMBERS if not isinstance(RULES.get(name), Number)], "numeric settings without a range in RULES"
    assert len(NUMBERS) >= 25 and len(CHOICES) >= 7, (NUMBERS, CHOICES)


def test_the_defaults_pass():
    parse()
    check_values(settings_block(FSDP1))
    check_values(settings_block(FSDP1)["trainer_defaults"], numbers_only=True)


@pytest.mark.parametrize("name", NUMBERS)
def test_a_bad_number_is_one_line_naming_the_flag(name):
    for value in bad_values(name):
        with pytest.raises(SettingsError) as error:
            parse(f"--{name}", value)
        message = str(error.value)
        assert message.startswith(f"--{name} {value} is ") and "; give " in message and "\n" not in message, message


@pytest.mark.parametrize("name", [n for n in NUMBERS if isinstance(BLOCK[n], int)])
def test_an_integer_setting_refuses_nan_and_fractions(name):
    for value in ("nan", "1.5"):
        with pytest.raises(SettingsError, match=f"^--{name} expects an integer, got '{value}'$"):
            parse(f"--{name}", value)


@pytest.mark.parametrize("name", CHOICES)
def test_an_unknown_choice_names_the_valid_ones(name):
    with pytest.raises(SettingsError) as error:
        parse(f"--{name}", "bogus")
    assert str(error.value) == f"--{name} bogus is unknown; choose one of {', '.join(RULES[name].values)}"


def test_trainer_arguments_of_train_fsdp1_get_the_same_checks():
    """TrainingArguments' names (batch size, learning rate, save_steps, ...) have the same ranges in train_fsdp1.py."""
    trainer = settings_block(FSDP1)["trainer_defaults"]
    checked = [name for name in trainer if isinstance(RULES.get(name), Number)]
    assert {"per_device_train_batch_size", "gradient_accumulation_steps", "learning_rate", "max_steps"} <= set(checked)
    for name in checked:
        bad = {"max_steps": 0, "learning_rate": math.nan, "save_steps": -3}.get(name, -5)
        with pytest.raises(SettingsError, match=f"^--{name} "):
            check_values({**trainer, name: bad}, numbers_only=True)
    check_values({**trainer, "optim": "adamw_torch_fused"}, numbers_only=True)  # Trainer's choices are its own


def test_bare_booleans_and_bare_modes():
    assert parse("--overwrite_output_dir")["overwrite_output_dir"] is True
    assert parse("--overwrite_output_dir", "--max_steps", "3")["overwrite_output_dir"] is True
    assert parse("--compile_dense", "false")["compile_dense"] is False
    assert parse("--compile_dense=off")["compile_dense"] is False
    assert parse("--activation_checkpointing")["activation_checkpointing"] == "full"
    assert parse("--shard_experts", "--ep_size", "1")["shard_experts"] == "true"
    assert parse("--router_aux_loss_coef", "-1")["router_aux_loss_coef"] == -1.0  # a negative number is a value
    with pytest.raises(SettingsError, match="^--model_name_or_path needs a value$"):
        parse("--model_name_or_path")
    with pytest.raises(SettingsError, match="^--compile_dense expects true or false, got 'maybe'$"):
        parse("--compile_dense", "maybe")


def test_config_file_then_command_line(tmp_path):
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text("max_steps: 7\nlearning_rate: 1e-3\noverwrite_output_dir: true\nresume: auto\nwarmup_steps: 0.1\n")
    values = parse("--config", str(yaml_file), "--max_steps", "9")
    assert (values["max_steps"], values["learning_rate"], values["overwrite_output_dir"]) == (9, 1e-3, True)
    assert (values["resume"], values["warmup_steps"]) == ("auto", 0.1)
    json_file = tmp_path / "run.json"
    json_file.write_text(json.dumps({"per_device_train_batch_size": 2, "dtype": "fp32"}))
    values = parse("--dtype", "bf16", f"--config={json_file}")
    assert (values["per_device_train_batch_size"], values["dtype"]) == (2, "bf16")  # the command line wins wherever it is


def test_a_runs_settings_json_is_a_config_that_repeats_it(tmp_path):
    """train_fsdp2.py writes its settings to output_dir/settings.json: --config takes that file back."""
    earlier = {**BLOCK, "max_steps": 11, "optim": "adamw_bf16", "overwrite_output_dir": True, "activation_checkpointing": "full"}
    (tmp_path / "settings.json").write_text(json.dumps(earlier, indent=1))
    assert parse("--config", str(tmp_path / "settings.json")) == earlier


def test_config_file_errors(tmp_path):
    cases = {
        "typo.yaml": ("ep_sise: 2\n", "--config {}: unknown setting --ep_sise (did you mean --ep_size?); valid settings: "),
        "bad.yaml": ("save_steps: -3\n", "--save_steps -3 is out of range; give an integer >= 0"),
        "nan.yaml": ("learning_rate: .nan\n", "--learning_rate nan is not a finite number; give a number > 0"),
        "list.json": ('{"max_steps": [1, 2]}', "--config {}: max_steps is a list; give a single value"),
        "broken.json": ("{oops", "--config {} is not valid JSON (Expecting property name"),
        "list.yaml": ("- 1\n", "--config {} holds a list, not a mapping of setting names to values"),
    }
    for name, (text, message) in cases.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(SettingsError) as error:
            parse("--config", str(tmp_path / name))
        assert str(error.value).startswith(message.format(tmp_path / name)), str(error.value)
    with pytest.raises(SettingsError, match="No such file or directory"):
        parse("--config", str(tmp_path / "missing.yaml"))


def test_config_keys_for_another_parser_come_before_its_command_line_flags(tmp_path):
    """train_fsdp1.py: TrainingArguments keys of the file go to HfArgumentParser, before the command line's (last wins)."""
    (tmp_path / "run.yaml").write_text("learning_rate: 0.001\nbf16: true\nreport_to: [tensorboard]\nep_size: 1\n")
    settings = {"ep_size": 0, "max_length": 256}
    rest = parse_settings(settings, FSDP1, ["--learning_rate", "0.01", "--config", str(tmp_path / "run.yaml"), "--bf16"],
                          known_extra={"learning_rate", "bf16", "report_to"}, extra_kind="TrainingArguments flag")
    assert settings["ep_size"] == 1
    assert rest == ["--learning_rate", "0.001", "--bf16", "true", "--report_to", "tensorboard", "--learning_rate", "0.01", "--bf16"]


def test_missing_tensorboard_is_one_line(monkeypatch):
    import importlib.util

    from megablocks_utils.errors import InputError
    from megablocks_utils.train.tensorboard_writer import require_tensorboard

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(InputError, match="pip install tensorboard"):
        require_tensorboard()


# ----------------------------------------------------------------------------- the scripts themselves, without a launcher


def run(script: str, *args: str, cwd: str = ROOT) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return subprocess.run([sys.executable, script, *args], cwd=cwd, env=dict(env, CUDA_VISIBLE_DEVICES=""),
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("script", ["train_fsdp2.py", "train_fsdp1.py"])
def test_help_lists_every_setting(script):
    result = run(script, "--help")
    assert result.returncode == 0, result.stderr[-2000:]
    settings = settings_block(os.path.join(ROOT, script))
    for name in [*settings, *settings.get("trainer_defaults", {})]:
        if name != "trainer_defaults":
            assert f"  --{name} " in result.stdout, name
    assert "--learning_rate FLOAT  default 0.002  (> 0)" in result.stdout
    if script == "train_fsdp1.py":
        assert "Every other TrainingArguments flag works too" in result.stdout


def test_a_bad_value_from_the_config_file_is_reported_before_the_launch_check(tmp_path):
    """`python train_fsdp2.py` (no torchrun) reads the file and the command line and names the bad setting."""
    (tmp_path / "run.yaml").write_text("per_device_train_batch_size: 2\nmax_steps: 0\n")
    result = run(FSDP2, "--config", str(tmp_path / "run.yaml"), "--max_steps", "3", "--gradient_accumulation_steps", "0")
    assert result.returncode == 2
    assert result.stderr.strip() == "error: --gradient_accumulation_steps 0 is out of range; give an integer > 0"
    result = run(FSDP2, "--config", str(tmp_path / "run.yaml"))
    assert result.stderr.strip().startswith("error: --max_steps 0 is out of range; give -1 (num_train_epochs over the data)")


def test_one_parser_reads_true_false_words_for_every_setting():
    """settings, activation_checkpointing, shard_experts and the fit check read true/false the same way."""
    from megablocks_utils.config.inputs import parse_bool, resolve_shard_experts
    from megablocks_utils.parallel.activation_checkpointing import (
        parse_activation_checkpointing,
    )
    from megablocks_utils.train.memory_activations import checkpointing_mode

    for word, value in [("1", True), ("True", True), ("yes", True), ("ON", True), ("0", False), ("false", False),
                        ("No", False), ("off", False)]:
        assert parse_bool(word) is value
        assert parse("--packing", word)["packing"] is value
        assert parse_activation_checkpointing(word) == checkpointing_mode(word) == ("full" if value else "none")
        assert resolve_shard_experts(word, 8, 8) is value
    assert parse_bool("auto") is None and parse_bool("full") is None


@pytest.mark.parametrize("script", ["train_fsdp2.py", "train_fsdp1.py"])
def test_settings_are_only_the_declared_ones(script):
    """--help, the YAML configs and README's settings table name the settings block's settings and nothing else: a
    constant the script imports (cuda_graph.WARMUP_STEPS, auto_exchange.AUTO) never becomes a setting (it could change
    the library's behaviour from the command line)."""
    import glob

    import yaml

    declared = settings_block(os.path.join(ROOT, script))
    names = set(declared) - {"trainer_defaults"} | set(declared.get("trainer_defaults", {}))
    listed = set(re.findall(r"^  --(\w+) ", run(script, "--help").stdout, re.M))
    assert listed == names | {"config"}, (sorted(listed - names - {"config"}), sorted(names - listed))
    if script == "train_fsdp2.py":
        for path in glob.glob(os.path.join(ROOT, "configs", "*.yaml")):
            assert set(yaml.safe_load(open(path))) <= names, path
        table = open(os.path.join(ROOT, "README.md")).read().split("\n## Settings\n", 1)[1].split("\n## ", 1)[0]
        assert set(re.findall(r"^\| `(\w+)` \|", table, re.M)) <= names
        result = run(script, "--WARMUP_STEPS", "0")
        assert result.returncode == 2 and "WARMUP_STEPS" in result.stderr, result.stderr[-500:]


@pytest.mark.parametrize("script", ["train_fsdp2.py", "train_fsdp1.py"])
def test_each_setting_is_one_short_line(script):
    """nanoGPT's block: a setting, its default and a one-line comment; the long why lives in README and docs/."""
    lines = open(os.path.join(ROOT, script)).read().split("\n")
    start = next(i for i, line in enumerate(lines) if line.startswith("# ---") and line.endswith(" settings"))
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("# ---"))
    long = [line[:40] for line in lines[start + 1 : end] if len(line) > 150]
    assert not long, long
