"""How a config field becomes an engine argument: its declaration (:func:`engine_arg`), the
table row derived from it (:class:`EngineArg`, :func:`engine_arg_of`), and the checks every
config section raises with (:func:`require`). ``config.py`` holds the sections and the table."""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, get_args, get_origin

if TYPE_CHECKING:
    from corefleet.engine.config import EngineConfig

_ARG_METADATA_KEY = "corefleet.engine_arg"


@dataclass(frozen=True)
class _Declared:
    """What a field's :func:`engine_arg` says; the rest comes from its annotation."""

    help: str
    flag: str | None


def engine_arg(help: str, flag: str | None = None) -> dict[str, object]:
    """The ``metadata`` of a config field that is also an engine argument (a flag, a keyword).

    Use as ``field(default=..., metadata=engine_arg("help text"))``. ``flag`` is vLLM's flag
    name, needed only where it is not ``--`` plus the field name with dashes (``policy`` is
    ``--scheduling-policy``). The keyword is the flag without ``--``, dashes as underscores,
    like vLLM's ``EngineArgs`` fields.
    """
    return {_ARG_METADATA_KEY: _Declared(help, flag)}


def require(ok: bool, name: str, value: object, rule: str) -> None:
    """Raise ``ValueError`` naming the engine argument unless ``ok``."""
    if not ok:
        raise ValueError(f"invalid engine argument {name}={value!r}: {rule}")


def require_choice(name: str, value: object, literal: object) -> None:
    """Raise ``ValueError`` unless ``value`` is one of the ``Literal``'s values."""
    choices = get_args(literal)
    require(value in choices, name, value, "must be one of " + ", ".join(map(str, choices)))


@dataclass(frozen=True)
class EngineArg:
    """One engine argument: where it lives in :class:`EngineConfig` and how it is spelled."""

    section: str  # the EngineConfig attribute holding it: model, cache, scheduler, ...
    name: str  # the field's name in that section's dataclass
    flag: str  # vLLM's flag, e.g. --scheduling-policy
    help: str
    kind: type  # bool (a --x/--no-x flag), int, float or str
    choices: tuple[str, ...] | None  # the values of a Literal annotation
    optional: bool  # None is allowed (and the default): the flag is then left out of an argv
    default: object

    @property
    def keyword(self) -> str:
        """The keyword ``LLM(...)`` and :meth:`EngineConfig.from_kwargs` take (vLLM's name)."""
        return self.flag.removeprefix("--").replace("-", "_")

    def value_in(self, config: EngineConfig) -> object:
        """This argument's value in ``config``."""
        return getattr(getattr(config, self.section), self.name)


_CLI_KINDS = (bool, int, float, str)


def engine_arg_of(section: str, cls: type, f: dataclasses.Field[object]) -> EngineArg:
    """The table row of one field; a field without an :func:`engine_arg` declaration fails."""
    declared = f.metadata.get(_ARG_METADATA_KEY)
    if not isinstance(declared, _Declared):
        raise TypeError(f"{cls.__name__}.{f.name} has no field(metadata=engine_arg(...))")
    kind, optional = _without_none(typing.get_type_hints(cls)[f.name])
    choices: tuple[str, ...] | None = None
    if get_origin(kind) is Literal:
        choices = get_args(kind)
        if not all(isinstance(c, str) for c in choices):
            raise TypeError(f"{cls.__name__}.{f.name}: only Literals of strings are supported")
        kind = str
    if kind not in _CLI_KINDS or (optional and f.default is not None):
        # An X | None field must default to None: None cannot be given on a command line.
        raise TypeError(f"{cls.__name__}.{f.name}: cannot be an engine argument as annotated")
    flag = declared.flag or "--" + f.name.replace("_", "-")
    return EngineArg(section, f.name, flag, declared.help, kind, choices, optional, f.default)


def _without_none(hint: object) -> tuple[type, bool]:
    """``X | None`` -> ``(X, True)``; anything else -> ``(hint, False)``."""
    if get_origin(hint) in (types.UnionType, typing.Union):
        rest = [a for a in get_args(hint) if a is not type(None)]
        if len(rest) == 1:
            return rest[0], True
    return typing.cast(type, hint), False
