"""Typed config fields: each declared once with its type, default, allowed values and meaning.

A config section is a frozen dataclass whose fields are made with :func:`option`::

    @dataclasses.dataclass(frozen=True)
    class TrainConfig(Section):
        batch_size: int = option(64, "rows per step, all devices together", rule=POSITIVE)

``Section.__post_init__`` checks every field against its declaration (type,
``choices``, ``rule``) and then the section's own cross-field ``check()``, so a
bad value fails when the section is built, with one message naming
``config.<section>.<field>``, the value and what is allowed. :func:`describe`
lists the fields for ``python -m flaxformer_lite.main fields``.

A field whose command-line form is text but whose value is structured (the
``split:N`` lists) declares ``parse`` (text -> value) and ``unparse`` (value ->
text): the ml_collections layer and ``config.json`` hold the text, the
dataclass the parsed value.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and the fix."""


@dataclasses.dataclass(frozen=True)
class Rule:
    """A condition on a field's value and how the error says it (``must be > 0``)."""

    test: Callable[[Any], bool]
    text: str


POSITIVE = Rule(lambda v: v > 0, "must be > 0")
NON_NEGATIVE = Rule(lambda v: v >= 0, "must be >= 0")
RATE = Rule(lambda v: 0.0 <= v < 1.0, "must be in [0, 1)")
UNIT_INTERVAL = Rule(lambda v: 0.0 <= v <= 1.0, "must be in [0, 1]")


def option(
    default: Any,
    doc: str,
    *,
    choices: tuple | None = None,
    rule: Rule | None = None,
    parse: Callable[[str], Any] | None = None,
    unparse: Callable[[Any], str] | None = None,
) -> Any:
    """A dataclass field with its meaning (``doc``, one line) and its checks."""
    metadata = {"doc": doc, "choices": choices, "rule": rule, "parse": parse, "unparse": unparse}
    return dataclasses.field(default=default, metadata=metadata)


def _hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _type_ok(value: Any, kind: Any) -> bool:
    """Whether ``value`` fits the annotation ``kind`` (int, float, str, bool, X | None, tuple)."""
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        return any(_type_ok(value, k) for k in typing.get_args(kind))
    if kind is type(None):
        return value is None
    if kind is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    origin = typing.get_origin(kind) or kind
    return isinstance(value, origin)


def type_name(kind: Any) -> str:
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        return " | ".join(type_name(k) for k in typing.get_args(kind))
    if kind is type(None):
        return "None"
    return getattr(kind, "__name__", str(kind))


class Section:
    """Base of the frozen config sections; subclasses set ``NAME`` and may add ``check()``."""

    NAME = ""

    def __post_init__(self):
        hints = _hints(type(self))
        for f in dataclasses.fields(self):
            value, meta = getattr(self, f.name), f.metadata
            where = f"config.{self.NAME}.{f.name}={value!r}"
            if meta.get("parse") is None and not _type_ok(value, hints[f.name]):
                raise ConfigError(f"{where} must be of type {type_name(hints[f.name])}")
            if meta.get("choices") is not None and value not in meta["choices"]:
                allowed = ", ".join(str(c) for c in meta["choices"])
                raise ConfigError(f"{where} is not allowed; choose one of {allowed}")
            rule = meta.get("rule")
            if rule is not None and not rule.test(value):
                raise ConfigError(f"{where} {rule.text}")
        self.check()

    def check(self) -> None:
        """Cross-field checks of the section (raise ConfigError)."""

    def replace(self, **changes: Any):
        """A copy with some fields changed (checked again)."""
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise ConfigError(unknown_message(type(self), unknown))
        return dataclasses.replace(self, **changes)

    # Conversion -------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, values: Mapping[str, Any]):
        """The section from plain values (``parse`` applied to text forms). A missing
        field takes its default: a saved run written before the field existed means it."""
        if hasattr(values, "to_dict"):
            values = values.to_dict()
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - set(fields))
        if unknown:
            raise ConfigError(unknown_message(cls, unknown))
        kwargs = {}
        for name, value in values.items():
            parse = fields[name].metadata.get("parse")
            if parse is not None:
                if not isinstance(value, str):
                    raise ConfigError(f"config.{cls.NAME}.{name}={value!r} must be of type str")
                try:
                    value = parse(value)
                except ConfigError as e:
                    raise ConfigError(f"config.{cls.NAME}.{name}={value!r}: {e}") from None
            kwargs[name] = value
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        """Plain values (text forms for parsed fields), as the config file and CLI hold them."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            unparse = f.metadata.get("unparse")
            out[f.name] = unparse(value) if unparse is not None else value
        return out


def unknown_message(cls, unknown: list[str]) -> str:
    known = ", ".join(f.name for f in dataclasses.fields(cls))
    return f"config.{cls.NAME}: unknown fields {unknown}; known fields are: {known}"


def describe(cls) -> list[tuple[str, str, str, str]]:
    """(name, type, default, meaning) of every field of a section, in declaration order."""
    hints, rows = _hints(cls), []
    for f in dataclasses.fields(cls):
        meta = f.metadata
        default = f.default
        if meta.get("unparse") is not None:
            default = meta["unparse"](default)
        kind = "str" if meta.get("parse") is not None else type_name(hints[f.name])
        meaning = meta.get("doc", "")
        if meta.get("choices") is not None:
            meaning += f" [{' | '.join(str(c) for c in meta['choices'])}]"
        if meta.get("rule") is not None:
            meaning += f" ({meta['rule'].text})"
        rows.append((f.name, kind, repr(default), meaning))
    return rows


def json_of(text: str, shape: type, where: str) -> Any:
    """``text`` parsed as JSON of ``shape`` (dict or list): a run's files are data, read
    as such; any other content is a ConfigError naming ``where`` and what it holds."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where} is not valid JSON ({e})") from None
    if not isinstance(value, shape):
        raise ConfigError(
            f"{where} holds {type(value).__name__}, not the {shape.__name__} of its format"
        )
    return value
