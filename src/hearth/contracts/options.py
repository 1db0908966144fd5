"""Options defined once: a config dataclass field carries its flag, aliases, type, choices and help, and the
command-line flags are generated from the fields (as vLLM's `EngineArgs` does from its configs).

`option(default, help=..., ...)` is a `dataclasses.field` with an `Option` in its metadata;
`add_arguments(parser, cls)` adds one flag per such field (default: the field's own default, so it is written
once); `check_choices(obj)` refuses a field value outside its choices, worded the way the flag would be.
Choices may be a `Registry`: the flag then lists its names, read when the parser is built.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Callable, Sequence
from dataclasses import MISSING, dataclass
from typing import Any

from hearth.contracts.registry import Registry, UnknownNameError

OPTION = "option"  # the metadata key


@dataclass(frozen=True)
class Option:
    """How one config field appears on the command line.

    `flags`: the flag, then its aliases (vLLM's spellings, short forms); empty: `--field-name`.
    `group`: the sub-config the option belongs to (the argparse group it is listed in).
    `hidden_negatives`: extra flags that set a boolean field to False, kept working but not listed.
    """

    help: str
    group: str
    flags: tuple[str, ...] = ()
    type: Callable[[str], Any] | None = None
    choices: Sequence[str] | Registry[Any] | None = None
    metavar: str | None = None
    action: str | type[argparse.Action] | None = None
    nargs: str | None = None
    hidden_negatives: tuple[str, ...] = ()

    def flag_names(self, field_name: str) -> tuple[str, ...]:
        return self.flags or ("--" + field_name.replace("_", "-"),)

    def choice_names(self) -> tuple[str, ...] | None:
        if self.choices is None:
            return None
        if isinstance(self.choices, Registry):
            return self.choices.names()
        return tuple(self.choices)


def option(
    default: Any = MISSING,
    *,
    help: str,  # noqa: A002 - argparse's word for it
    group: str,
    flags: Sequence[str] = (),
    type: Callable[[str], Any] | None = None,  # noqa: A002 - argparse's word for it
    choices: Sequence[str] | Registry[Any] | None = None,
    metavar: str | None = None,
    action: str | type[argparse.Action] | None = None,
    nargs: str | None = None,
    hidden_negatives: Sequence[str] = (),
) -> Any:
    """A dataclass field that is also a command-line option (see `Option`)."""
    spec = Option(help, group, tuple(flags), type, choices, metavar, action, nargs, tuple(hidden_negatives))
    return dataclasses.field(default=default, metadata={OPTION: spec})


def not_an_option(default: Any) -> Any:
    """A field with no flag of its own: set by a program (or by a composite flag), never typed."""
    return dataclasses.field(default=default, metadata={OPTION: None})


def options_of(cls: type) -> list[tuple[dataclasses.Field[Any], Option]]:
    """The fields of dataclass `cls` that are command-line options, in field order."""
    return [(f, f.metadata[OPTION]) for f in dataclasses.fields(cls) if f.metadata.get(OPTION) is not None]


def add_arguments(
    parser: argparse.ArgumentParser,
    cls: type,
    group_titles: dict[str, str],
    required: Sequence[str] = (),
) -> dict[str, Any]:
    """One flag per option field of `cls`, in argument groups titled by `group_titles` (keyed by
    `Option.group`, in that order). Fields named in `required` must be given; a field without a default
    defaults to None on the command line (the caller fills it). Returns the groups, so a caller can add
    composite flags beside the generated ones."""
    groups = {key: parser.add_argument_group(title) for key, title in group_titles.items()}
    for f, spec in options_of(cls):
        kwargs: dict[str, Any] = {"dest": f.name, "help": spec.help}
        kwargs["default"] = None if f.default is MISSING else f.default
        if f.name in required:
            kwargs["required"] = True
        for key in ("type", "metavar", "action", "nargs"):
            if getattr(spec, key) is not None:
                kwargs[key] = getattr(spec, key)
        names = spec.choice_names()
        if names is not None:
            kwargs["choices"] = names
        group = groups[spec.group]
        group.add_argument(*spec.flag_names(f.name), **kwargs)
        for negative in spec.hidden_negatives:
            group.add_argument(negative, dest=f.name, action="store_false", help=argparse.SUPPRESS)
    return groups


def check_choices(obj: Any) -> None:
    """Refuse a field value outside its option's choices: an UnknownNameError (a ValueError) naming a
    registry's entries, or a ValueError naming a fixed list. None (an option left unset) passes."""
    for f, spec in options_of(type(obj)):
        value = getattr(obj, f.name)
        if spec.choices is None or value is None:
            continue
        if isinstance(spec.choices, Registry):
            if value not in spec.choices.names():
                raise UnknownNameError(spec.choices.kind, value, spec.choices.names())
        elif value not in spec.choices:
            raise ValueError(f"{f.name} must be one of {', '.join(spec.choices)}, got {value!r}")


# Value types (argparse `type=`) that options of several layers use.

# vLLM's human-readable integers: lowercase k/m/g are powers of 1000, uppercase K/M/G of 1024 (`32k` = 32000,
# `32K` = 32768); decimals allowed with a suffix (`25.6k`).
_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}
_HUMAN_INT = re.compile(r"^(\d+(?:\.\d+)?)([kmgKMG]?)$")


def human_int(text: str) -> int:
    """`4096`, `32k`, `32K`, `1m`, `25.6k` -> tokens."""
    match = _HUMAN_INT.match(text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a token count (a number, optionally with k/K/m/M: 32k = 32000, 32K = 32768)"
        )
    number, suffix = match.groups()
    if suffix:
        value = float(number) * _SUFFIXES[suffix]
        if value != int(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of tokens")
        return int(value)
    if "." in number:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of tokens")
    return int(number)


def on_off(value: str) -> bool:
    if value not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"expected on or off, got {value!r}")
    return value == "on"


def int_list(text: str) -> tuple[int, ...]:
    """`30,31` -> (30, 31)."""
    try:
        return tuple(int(n) for n in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None


def memory_fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a fraction") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"{value} is not a fraction in (0, 1]")
    return value
