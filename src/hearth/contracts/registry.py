"""`Registry[T]`: the things a user chooses by name (models, quantization methods, attention backends, KV
transports and stores, proposers, parsers, routing policies, PD protocols), one type for all of them.

An entry is either the object itself or a lazy `"module:attr"` string, imported on first `get`: naming
every built-in in the registry's own module costs no import, so listing the choices (CLI `choices=`,
config validation) never loads torch or an implementation, and an implementation module never has to
be imported for its side effect of registering itself. Each entry may carry aliases (other spellings,
such as vLLM's) and metadata that callers read without loading it (e.g. whether a proposer needs a
draft model).

Contract: a name or alias is registered once (a second registration is a bug and raises ValueError);
an unknown name raises `UnknownNameError`, whose message lists the valid choices.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Generic, TypeVar

T = TypeVar("T")
X = TypeVar("X")


class UnknownNameError(KeyError, ValueError):
    """A name no entry of a registry answers to. A KeyError (a lookup that failed) and a ValueError (a
    bad option value), so callers of either kind of lookup catch it."""

    def __init__(self, kind: str, name: object, choices: Iterable[str]) -> None:
        self.kind = kind
        self.name = name
        self.choices = tuple(choices)
        super().__init__(f"unknown {kind} {name!r}; choose one of {', '.join(self.choices)}")

    def __str__(self) -> str:
        # KeyError's own __str__ would print the message as a quoted repr.
        return str(self.args[0])


@dataclass
class Entry(Generic[T]):
    """One registered name. `target` is the object, or its `"module:attr"` until first loaded."""

    name: str
    target: T | str
    aliases: tuple[str, ...] = ()
    metadata: Mapping[str, Any] = field(default_factory=dict)

    @property
    def loaded(self) -> bool:
        return not isinstance(self.target, str)

    def load(self) -> T:
        if isinstance(self.target, str):
            module_name, sep, attr = self.target.partition(":")
            if not sep or not module_name or not attr:
                raise ValueError(f"{self.name!r}: lazy target {self.target!r} is not 'module:attr'")
            obj: Any = importlib.import_module(module_name)
            for part in attr.split("."):
                obj = getattr(obj, part)
            self.target = obj
        return self.target  # type: ignore[return-value]  # narrowed above; a str target is replaced


class Registry(Generic[T]):
    """Named entries of one kind. `kind` words the errors ("unknown KV transport 'x'; choose one of ...")."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, Entry[T]] = {}
        self._aliases: dict[str, str] = {}  # alias -> name

    def add(self, name: str, target: T | str, *, aliases: Iterable[str] = (), **metadata: Any) -> None:
        """Register `target` (an object, or `"module:attr"` to import on first use) as `name`."""
        aliases = tuple(aliases)
        for spelling in (name, *aliases):
            if spelling in self._entries or spelling in self._aliases:
                owner = self._aliases.get(spelling, spelling)
                raise ValueError(f"{self.kind} {spelling!r} is already registered (by {owner!r})")
        if len(set((name, *aliases))) != 1 + len(aliases):
            raise ValueError(f"{self.kind} {name!r}: a name or alias is given twice")
        self._entries[name] = Entry(name, target, aliases, MappingProxyType(dict(metadata)))
        for alias in aliases:
            self._aliases[alias] = name

    def register(self, name: str, *, aliases: Iterable[str] = (), **metadata: Any) -> Callable[[X], X]:
        """Decorator form of `add`, for an object defined where it is registered (extensions, tests)."""

        def wrap(obj: X) -> X:
            self.add(name, obj, aliases=aliases, **metadata)  # type: ignore[arg-type]  # X is a T
            return obj

        return wrap

    def canonical(self, name: str) -> str:
        """The registered name `name` spells (itself, or the name it is an alias of)."""
        if name in self._entries:
            return name
        if name in self._aliases:
            return self._aliases[name]
        raise UnknownNameError(self.kind, name, self.names())

    def entry(self, name: str) -> Entry[T]:
        return self._entries[self.canonical(name)]

    def get(self, name: str) -> T:
        """The object registered as `name` (or an alias), imported now if it was lazy."""
        return self.entry(name).load()

    def __getitem__(self, name: str) -> T:
        return self.get(name)

    def metadata(self, name: str) -> Mapping[str, Any]:
        """The entry's metadata, read without loading the entry."""
        return self.entry(name).metadata

    def names(self) -> tuple[str, ...]:
        """Registered names, sorted; aliases left out."""
        return tuple(sorted(self._entries))

    def choices(self) -> tuple[str, ...]:
        """Every spelling accepted: names and aliases, sorted."""
        return tuple(sorted((*self._entries, *self._aliases)))

    def copy(self) -> Registry[T]:
        """An independent registry with the same entries (a test registers into it and throws it away)."""
        other: Registry[T] = Registry(self.kind)
        other._entries = {
            name: Entry(e.name, e.target, e.aliases, e.metadata) for name, e in self._entries.items()
        }
        other._aliases = dict(self._aliases)
        return other

    def __contains__(self, name: object) -> bool:
        return name in self._entries or name in self._aliases

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {list(self.names())})"
