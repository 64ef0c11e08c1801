"""Command-line flags and LORAGW_* variables, generated from config dataclasses.

As vLLM's EngineArgs does, a flag is declared once, on the field it sets:
`setting(default, help=...)` carries the help text and, where the flag is
not named after the field, its name. `add_flags` walks a config *instance*
and gives every flag that instance's value as its default, so a default
lives in the dataclass (or in the profile that built the instance) and
nowhere else. `config_from_args` builds the config back from the parsed
values.

Names: `max_num_seqs` is `--max-num-seqs`. A trailing `_s` (seconds) is
dropped: `drain_timeout_s` is `--drain-timeout`. A bool that is on by
default gets an off switch, `--no-<name>` without a leading `enable_`:
`enable_tiers` is `--no-tiers`. A section's fields take the section's
prefix: `premium: TierLimits` gives `--premium-max-waiting`. A name given
in `flag=` is used as is. Every flag defaults to $LORAGW_<FLAG> when that
variable is set (`--max-num-seqs`: LORAGW_MAX_NUM_SEQS).
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, Callable, Mapping

ENV_PREFIX = "LORAGW_"
_TRUTHY = ("1", "true", "yes", "on")
_DERIVED = object()  # `flag` metadata: name the flag after the field
_SCALARS = (int, float, str, Path)


def setting(default: Any = dataclasses.MISSING, *, help: str, flag: Any = _DERIVED,
            zero_is_none: bool = False, choices: tuple | None = None, env: str | None = None,
            default_factory: Any = dataclasses.MISSING, repr: bool = True) -> Any:
    """A config field and its flag. `flag=None`: no flag (set in code, or
    derived by the CLI). `zero_is_none`: the flag's 0 means None ("no
    limit"). `env`: a variable name other than LORAGW_<FLAG>."""
    metadata = {"help": help, "flag": flag, "zero_is_none": zero_is_none, "choices": choices, "env": env}
    return dataclasses.field(default=default, default_factory=default_factory, repr=repr, metadata=metadata)


def section(factory: Callable[[], Any], *, prefix: str = "", title: str | None = None) -> Any:
    """A nested config whose fields become flags named with `prefix`,
    listed under `title` in --help."""
    return dataclasses.field(default_factory=factory, metadata={"section": prefix, "title": title})


def is_section(f: dataclasses.Field) -> bool:
    return "section" in f.metadata


def env_name(flag: str) -> str:
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()


def env_flag(parser, flag: str, *, environ: Mapping[str, str], default: Any = None, help: str = "",
             env: str | None = None, **kwargs) -> None:
    """`flag`, defaulting to $LORAGW_<FLAG> (or `env`) when that is set,
    else to `default`. argparse applies `type` to a string default, so a
    variable is parsed and checked like the flag; a switch is on when its
    variable is 1, true, yes or on."""
    env = env or env_name(flag)
    raw = environ.get(env)
    action = kwargs.get("action")
    if action in ("store_true", "store_false"):
        if raw is not None and raw.lower() in _TRUTHY:
            default = action == "store_true"
    elif raw is not None:
        default = _comma_separated(raw) if action is _Extend else raw
    quiet = default is None or isinstance(default, bool) or default == ()
    shown = "" if quiet else "default: %(default)s; "
    help = help.replace("%", "%%")  # argparse formats help with %
    parser.add_argument(flag, default=default, help=f"{help} [{shown}env {env}]".strip(), **kwargs)


def add_flags(parser: argparse.ArgumentParser, config: Any, *, environ: Mapping[str, str]) -> list[str]:
    """One flag per field of `config` and of its sections, except those
    declared with flag=None. Each flag's dest is the field's dotted path
    (`engine.scheduler.max_num_seqs`); the dests are returned."""
    return _add_flags(parser, parser, config, environ, "", "")


def _add_flags(root, group, config, environ, path, prefix) -> list[str]:
    hints = typing.get_type_hints(type(config))
    dests = []
    for f in dataclasses.fields(config):
        dest, value = path + f.name, getattr(config, f.name)
        if is_section(f):
            title = f.metadata["title"]
            target = root.add_argument_group(title) if title else group
            dests += _add_flags(root, target, value, environ, dest + ".", prefix + f.metadata["section"])
            continue
        if "help" not in f.metadata:
            raise TypeError(f"{type(config).__name__}.{f.name}: declare it with setting(...) or section(...)")
        option = _option_name(f, prefix)
        if option is not None:
            kwargs = _parse_kwargs(f, hints[f.name])
            if "type" in kwargs and "choices" not in kwargs:
                name = option.removeprefix("--").replace("-", "_").upper()
                kwargs["metavar"] = f"{name}[,...]" if kwargs.get("action") is _Extend else name
            env_flag(group, option, environ=environ, default=value, help=f.metadata["help"],
                     env=f.metadata["env"], dest=dest, **kwargs)
            dests.append(dest)
    return dests


def _option_name(f: dataclasses.Field, prefix: str) -> str | None:
    flag = f.metadata["flag"]
    if flag is not _DERIVED:
        return flag
    name = f.name.removesuffix("_s")
    if f.default is True:
        name = "no_" + name.removeprefix("enable_")
    return "--" + prefix + name.replace("_", "-")


def _parse_kwargs(f: dataclasses.Field, hint: Any) -> dict:
    tp = _unwrap_optional(hint)
    if tp is bool:
        return {"action": "store_false" if f.default is True else "store_true"}
    if typing.get_origin(tp) is tuple:
        if typing.get_args(tp) != (str, ...):
            raise TypeError(f"{f.name}: only tuple[str, ...] fields can be flags, not {hint}")
        return {"action": _Extend, "type": _comma_separated}
    if tp not in _SCALARS:
        raise TypeError(f"{f.name}: a {hint} field cannot be a flag; give it flag=None")
    convert = _zero_is_none(tp) if f.metadata["zero_is_none"] else tp
    kwargs = {"type": convert}
    if f.metadata["choices"]:
        kwargs["choices"] = f.metadata["choices"]
    return kwargs


def _unwrap_optional(hint: Any) -> Any:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return hint


def _zero_is_none(tp: type) -> Callable[[str], Any]:
    def convert(text: str):
        value = tp(text)
        return None if value == 0 else value

    convert.__name__ = tp.__name__  # argparse names the type in "invalid int value"
    return convert


def _comma_separated(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


class _Extend(argparse.Action):
    """Repeatable, each value comma-separated. The first use replaces the
    default; argparse's own "append" would add to it."""

    def __call__(self, parser, namespace, values, option_string=None):
        current = getattr(namespace, self.dest)
        setattr(namespace, self.dest, (() if current is self.default else current) + values)


def config_from_args(config: Any, values: Mapping[str, Any]) -> Any:
    """`config` with every field whose dotted path is a key of `values`
    (`vars(args)`, plus what the CLI derives) set to that value, sections
    included; the dataclasses validate the result."""
    return _from_args(config, values, "")


def _from_args(config: Any, values: Mapping[str, Any], path: str) -> Any:
    changes = {}
    for f in dataclasses.fields(config):
        dest = path + f.name
        if is_section(f):
            changes[f.name] = _from_args(getattr(config, f.name), values, dest + ".")
        elif dest in values:
            changes[f.name] = values[dest]
    return dataclasses.replace(config, **changes)
