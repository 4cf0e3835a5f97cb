"""The settings block at the top of a training script (nanoGPT style): --help, --config, --name value, range checks.

One description of every setting, with nothing to keep in sync by hand:
  name and default   the block's ``name = value`` lines (the script passes them in as a dict),
  type               the default's type (bool, int, float or str),
  help               the line's trailing comment (read from the script's source),
  allowed values     ``RULES`` below, keyed by name and shared by both scripts (TrainingArguments'
                     names mean the same here as there).
Adding a setting is one line in the block, plus one line in ``RULES`` when it has a range or choices.

Values come from the block, then a ``--config`` file (YAML or JSON), then the command line, the
last winning. Every value is checked before anything heavy runs; a bad one is a ``SettingsError``
of one line that names the flag and says what to give instead.
"""

import difflib
import json
import math
import os
import sys
import tokenize
from dataclasses import dataclass

from megablocks_utils.config.inputs import parse_bool
from megablocks_utils.errors import SettingsError
from megablocks_utils.model.attention import KERNELS
from megablocks_utils.model.quantized_base import QUANTIZE_BASE
from megablocks_utils.parallel.activation_checkpointing import ACTIVATION_CHECKPOINTING
from megablocks_utils.train.memory_plan import FSDP_WRAP_SETTINGS
from megablocks_utils.train.nonfinite import MODES
from megablocks_utils.train.optim import OPTIMIZERS


@dataclass(frozen=True)
class Number:
    """A finite number from ``low`` to ``high`` (``*_open``: that end excluded), or the ``special`` value,
    which means what ``special_means`` says."""

    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False
    special: float | None = None
    special_means: str = ""

    def _range(self) -> str:
        if self.high < math.inf:
            return f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}{')' if self.high_open else ']'}"
        return f"{'>' if self.low_open else '>='} {self.low:g}"

    def text(self) -> str:
        return self._range() if self.special is None else f"{self.special:g} or {self._range()}"

    def error(self, value) -> str | None:
        if value == self.special:
            return None
        want = f"{'an integer' if isinstance(value, int) else 'a number'} {self._range()}"
        if self.special is not None:
            want = f"{self.special:g} ({self.special_means}) or {want}"
        if not math.isfinite(value):
            return f"is not a finite number; give {want}"
        below = value <= self.low if self.low_open else value < self.low
        above = value >= self.high if self.high_open else value > self.high
        return f"is out of range; give {want}" if below or above else None


@dataclass(frozen=True)
class Choice:
    """One of ``values``; ``bare`` is the value of the flag given without one (``--activation_checkpointing``)."""

    values: tuple[str, ...]
    bare: str | None = None

    def text(self) -> str:
        return "one of " + ", ".join(self.values)

    def error(self, value) -> str | None:
        return None if value in self.values else f"is unknown; choose {self.text()}"


POSITIVE = Number(low=0, low_open=True)
NON_NEGATIVE = Number(low=0)  # where 0 means off (or "all", "the default")
FRACTION = Number(low=0, high=1, high_open=True)

# Every setting with a range or a set of values, in either script. TrainingArguments' own names
# (learning_rate, save_steps, ...) are checked by these rules in train_fsdp1.py too; its choices
# (optim, lr_scheduler_type, report_to) are TrainingArguments' there, so only the numbers are.
RULES = {
    # data and batches
    "max_length": POSITIVE,
    "per_device_train_batch_size": POSITIVE,
    "gradient_accumulation_steps": POSITIVE,
    "max_steps": Number(low=0, low_open=True, special=-1, special_means="num_train_epochs over the data"),
    "num_train_epochs": POSITIVE,
    "seed": NON_NEGATIVE,
    # parallelism and precision
    "ep_size": NON_NEGATIVE,
    "dp_replicate": POSITIVE,
    "ep_capacity_factor": Number(low=0, special=-1, special_means="auto: megablocks_utils/train/auto_exchange.py"),
    "shard_experts": Choice(("auto", "true", "false"), bare="true"),
    "cuda_graphs": Choice(("auto", "true", "segments", "false"), bare="true"),
    "moe_backend": Choice(("native", "megablocks")),
    "fsdp_wrap": Choice(FSDP_WRAP_SETTINGS),
    "dtype": Choice(("auto", "bf16", "fp32")),
    "activation_checkpointing": Choice((*ACTIVATION_CHECKPOINTING, "true", "false"), bare="full"),
    "activation_checkpointing_layers": Number(low=0, special=-1, special_means="every decoder layer"),
    "gpu_memory_gib": NON_NEGATIVE,
    # finetuning and LoRA (lora_target_modules is checked against the model: megablocks_utils/model/lora.py)
    "finetuning": Choice(("full", "lora")),
    "lora_r": POSITIVE,
    "lora_alpha": POSITIVE,
    "lora_dropout": FRACTION,
    "quantize_base": Choice(QUANTIZE_BASE),
    "collective_timeout_s": POSITIVE,
    "ddp_timeout": POSITIVE,
    # optimizer and learning rate
    "optim": Choice(OPTIMIZERS),
    "learning_rate": POSITIVE,
    # transformers' schedulers that need nothing beyond the warmup and total steps, and cosine_with_min_lr (min_lr_rate)
    "lr_scheduler_type": Choice(("linear", "cosine", "cosine_with_min_lr", "cosine_with_restarts", "polynomial",
                                 "constant", "constant_with_warmup", "inverse_sqrt")),
    "min_lr_rate": Number(low=0, high=1),
    "warmup_steps": NON_NEGATIVE,
    "warmup_ratio": FRACTION,
    "weight_decay": NON_NEGATIVE,
    "adam_beta1": FRACTION,
    "adam_beta2": FRACTION,
    "adam_epsilon": POSITIVE,
    "max_grad_norm": NON_NEGATIVE,
    "router_aux_loss_coef": Number(low=0, special=-1, special_means="the model config's"),
    "load_balance_coeff": NON_NEGATIVE,
    # non-finite steps, checkpoints, logging
    "nonfinite": Choice(MODES),
    "max_consecutive_skips": NON_NEGATIVE,
    "save_steps": NON_NEGATIVE,
    "save_total_limit": Number(low=1),
    "logging_steps": POSITIVE,
    "report_to": Choice(("none", "tensorboard")),
    "eval_split": FRACTION,
    "eval_steps": NON_NEGATIVE,
    "attn_implementation": Choice(KERNELS),
    "peak_tflops": NON_NEGATIVE,
}

def _shown(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def check_values(values: dict, numbers_only: bool = False) -> None:
    """Raise a SettingsError for the first value that breaks its rule (``numbers_only``: skip choices)."""
    for name, value in values.items():
        rule = RULES.get(name)
        if rule is None or value is None or (numbers_only and not isinstance(rule, Number)):
            continue
        problem = rule.error(value)
        if problem:
            raise SettingsError(f"--{name} {_shown(value)} {problem}")


def _parse(name: str, text: str, default):
    if isinstance(default, bool):
        flag = parse_bool(text)
        if flag is not None:
            return flag
        raise SettingsError(f"--{name} expects true or false, got {text!r}")
    if default is None or isinstance(default, str):
        return None if text.lower() == "none" and default is None else text
    try:
        return type(default)(text)
    except ValueError:
        kind = "an integer" if isinstance(default, int) else "a number"
        raise SettingsError(f"--{name} expects {kind}, got {text!r}") from None


def _unknown(name: str, settings: dict, extra: set, extra_kind: str, where: str = "") -> SettingsError:
    close = difflib.get_close_matches(name, [*settings, *extra], n=1)
    hint = f" (did you mean --{close[0]}?)" if close else ""
    also = f", and every {extra_kind}" if extra_kind else ""
    return SettingsError(f"{where}unknown setting --{name}{hint}; valid settings: {', '.join(sorted(settings))}{also}")


def read_config(path: str) -> dict:
    """The ``--config`` file: a YAML (.yaml/.yml) or JSON mapping of setting names to values."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise SettingsError(f"--config {path}: {e.strerror}; give a YAML or JSON file of settings") from None
    if path.endswith((".yaml", ".yml")):
        import yaml

        try:
            values = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise SettingsError(f"--config {path} is not valid YAML ({' '.join(str(e).split())}); fix the file") from None
    else:
        try:
            values = json.loads(text)
        except ValueError as e:
            raise SettingsError(f"--config {path} is not valid JSON ({e}); fix the file (or name it .yaml)") from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise SettingsError(f"--config {path} holds a {type(values).__name__}, not a mapping of setting names to values")
    return values


def _config_text(path: str, name: str, value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None or isinstance(value, (int, float, str)):
        return str(value)
    raise SettingsError(f"--config {path}: {name} is a {type(value).__name__}; give a single value")


def help_comments(script: str) -> dict[str, str]:
    """``name = value  # help`` (or ``name=value,  # help`` inside a dict(...)) lines of ``script``: name -> help."""
    found = {}
    with open(script, "rb") as f:
        tokens = list(tokenize.tokenize(f.readline))
    skip = (tokenize.INDENT, tokenize.DEDENT, tokenize.NL, tokenize.NEWLINE, tokenize.ENCODING)
    by_row = {}
    for token in tokens:
        if token.type not in skip:
            by_row.setdefault(token.start[0], []).append(token)
    for row in by_row.values():
        if len(row) >= 3 and row[0].type == tokenize.NAME and row[1].string == "=" and row[-1].type == tokenize.COMMENT:
            found.setdefault(row[0].string, row[-1].string.lstrip("#").strip())
    return found


def describe(values: dict, helps: dict, numbers_only: bool = False) -> str:
    """One entry per setting: flag, type, default and range (``numbers_only``: no choices), then its help."""
    lines = []
    for name, value in values.items():
        kind = type(value).__name__ if value is not None else "str"
        rule = RULES.get(name)
        if numbers_only and not isinstance(rule, Number):
            rule = None
        allowed = f"  ({rule.text()})" if rule else ""
        bare = " (alone: true)" if isinstance(value, bool) else (f" (alone: {rule.bare})" if getattr(rule, "bare", None) else "")
        lines.append(f"  --{name} {kind.upper()}  default {json.dumps(value)}{allowed}{bare}")
        if helps.get(name):
            lines.append(f"        {helps[name]}")
    return "\n".join(lines)


def parse_settings(
    settings: dict,
    script: str,
    argv: list[str] | None = None,
    known_extra: set[str] = frozenset(),
    extra_kind: str = "",
    doc: str = "",
    more_help=None,
) -> list[str]:
    """Set ``settings`` in place from ``--config FILE`` and ``--name value`` arguments, then check them all.

    ``--help`` prints ``doc``, every setting (``script``'s comments are the help) and ``more_help()``,
    then exits 0. A bool setting given alone means true. Arguments (and config keys) whose names are
    in ``known_extra`` are returned, config first, for another parser whose flags ``extra_kind``
    names; any other unknown name is an error that suggests the closest valid name.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--help" in argv or "-h" in argv:
        if os.environ.get("RANK", "0") == "0":
            print(f"{doc.strip()}\n\nSettings: the block at the top of {os.path.basename(script)}; a --config file "
                  "overrides them, the command line overrides both.")
            print("  --config FILE  YAML or JSON mapping of setting names to values")
            print(describe(settings, help_comments(script)))
            if more_help:
                print(more_help())
        sys.exit(0)
    rest = []
    for i, arg in enumerate(argv):
        if arg == "--config" or arg.startswith("--config="):
            path = arg.partition("=")[2] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else "")
            if not path:
                raise SettingsError("--config needs a file: --config run.yaml")
            del argv[i : i + (1 if "=" in arg else 2)]
            for name, value in read_config(path).items():
                if name in known_extra:
                    values = value if isinstance(value, list) else [value]
                    rest += [f"--{name}", *(_config_text(path, name, v) for v in values)]
                elif name in settings:
                    settings[name] = _parse(name, _config_text(path, name, value), settings[name])
                else:
                    raise _unknown(name, settings, known_extra, extra_kind, where=f"--config {path}: ")
            break
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise SettingsError(f"unexpected argument {arg!r}; settings are given as --name value (--help lists them)")
        name, has_equals, value = arg[2:].partition("=")
        has_value = has_equals or (i + 1 < len(argv) and not argv[i + 1].startswith("--"))
        if name in known_extra:
            rest += argv[i : i + (2 if has_value and not has_equals else 1)]
            i += 2 if has_value and not has_equals else 1
            continue
        if name not in settings:
            raise _unknown(name, settings, known_extra, extra_kind)
        if not has_value:
            bare = True if isinstance(settings[name], bool) else getattr(RULES.get(name), "bare", None)
            if bare is None:
                raise SettingsError(f"--{name} needs a value")
            settings[name] = bare
            i += 1
            continue
        if not has_equals:
            value = argv[i + 1]
            i += 1
        settings[name] = _parse(name, value, settings[name])
        i += 1
    check_values(settings)
    return rest
