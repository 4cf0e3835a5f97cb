"""Command-line overrides for the settings block at the top of a training script (nanoGPT style)."""

import difflib
import sys

from .inputs import InputError


class SettingsError(InputError):
    pass


def _parse(name: str, text: str, default):
    if isinstance(default, bool):
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off"):
            return False
        raise SettingsError(f"--{name} expects true or false, got {text!r}")
    if default is None or isinstance(default, str):
        return None if text.lower() == "none" and default is None else text
    try:
        return type(default)(text)
    except ValueError:
        kind = "an integer" if isinstance(default, int) else "a number"
        raise SettingsError(f"--{name} expects {kind}, got {text!r}") from None


def apply_overrides(
    settings: dict, argv: list[str] | None = None, known_extra: set[str] = frozenset(), extra_kind: str = ""
) -> list[str]:
    """Override ``settings`` in place from ``--name value`` / ``--name=value`` arguments.

    Returns the arguments whose names are in ``known_extra`` (left for another parser, whose flags
    ``extra_kind`` names); any other unknown name is an error that suggests the closest valid name
    and lists the valid ones.
    """
    argv = sys.argv[1:] if argv is None else argv
    rest, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise SettingsError(f"unexpected argument {arg!r}; settings are given as --name value")
        name, _, value = arg[2:].partition("=")
        takes_value = not _
        if name in known_extra:
            rest.append(arg)
            if takes_value and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                rest.append(argv[i + 1])
                i += 1
            i += 1
            continue
        if name not in settings:
            close = difflib.get_close_matches(name, [*settings, *known_extra], n=1)
            hint = f" (did you mean --{close[0]}?)" if close else ""
            also = f", and every {extra_kind}" if extra_kind else ""
            raise SettingsError(f"unknown setting --{name}{hint}; valid settings: {', '.join(sorted(settings))}{also}")
        if takes_value:
            if i + 1 >= len(argv):
                raise SettingsError(f"--{name} needs a value")
            value = argv[i + 1]
            i += 1
        settings[name] = _parse(name, value, settings[name])
        i += 1
    return rest
