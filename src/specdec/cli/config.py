"""serve's configuration as the ecosystem gives it: `--config FILE` (YAML whose keys are the flags,
vLLM's convention: `max-batch: 8` or `max_batch: 8`) and `SPECDEC_<FLAG>` environment variables
(llama-server's LLAMA_ARG_* convention: SPECDEC_MAX_BATCH=8). A flag on the command line wins over
the environment, which wins over the file. A key the command does not take, or a value its flag
would refuse, is one line and exit 2 (an environment variable that names no flag is left alone:
SPECDEC_HOME and its kind are not flags)."""

from __future__ import annotations

import argparse
import os

from ..errors import SpecdecError
from ..paths import read_text

PREFIX = "SPECDEC_"
TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _flags(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """The command's long flags by name without dashes ('max-batch'), each to its action."""
    return {
        option[2:]: action
        for action in parser._actions
        for option in action.option_strings
        if option.startswith("--") and option not in ("--help", "--config")
    }


def _value(action: argparse.Action, raw, where: str):
    """`raw` (a YAML value or an environment string) as the flag's action would store it."""
    flag = action.option_strings[0]
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        word = raw if isinstance(raw, bool) else str(raw).strip().lower()
        if word not in (True, False, *TRUE, *FALSE):
            raise SpecdecError(f"{where}: {flag} takes true or false, got {raw!r}")
        on = word is True or word in TRUE
        return on if isinstance(action, argparse._StoreTrueAction) else not on
    if action.nargs not in (None, "?") or isinstance(raw, (list, dict)):
        raise SpecdecError(f"{where}: {flag} takes one value, got {raw!r}")
    text = str(raw)
    try:
        value = action.type(text) if action.type is not None else text
    except (argparse.ArgumentTypeError, ValueError, TypeError) as exc:
        raise SpecdecError(f"{where}: {flag} {text!r}: {exc}") from None
    if action.choices is not None and value not in action.choices:
        raise SpecdecError(f"{where}: {flag} must be one of {', '.join(map(str, action.choices))}, got {text!r}")
    return value


def _read(path: str) -> dict:
    text = read_text(path, f"--config {path}")
    try:
        import yaml
    except ImportError:
        raise SpecdecError(
            "--config reads YAML, which needs PyYAML: pip install -e '.[serve]' (in specdec's checkout)"
        ) from None

    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise SpecdecError(f"--config {path}: not YAML ({str(exc).splitlines()[0]})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise SpecdecError(f"--config {path}: give a mapping of flags to values, like `max-batch: 8`")
    return data


def defaults(parser: argparse.ArgumentParser, config: str | None, environ=os.environ) -> dict:
    """The defaults the file and the environment give the command's flags (by dest), the
    environment's over the file's."""
    flags = _flags(parser)
    out = {}
    for key, raw in (_read(config) if config else {}).items():
        name = str(key).replace("_", "-")
        if name not in flags:
            raise SpecdecError(f"--config {config}: unknown key {key!r}: its keys are the flags, like max-batch")
        out[flags[name].dest] = _value(flags[name], raw, f"--config {config}")
    for name, action in flags.items():
        variable = PREFIX + name.upper().replace("-", "_")
        if variable in environ:
            out[action.dest] = _value(action, environ[variable], f"${variable}")
    return out
