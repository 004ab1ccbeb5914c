"""A sweep's spec: the swept fields and their values, the seeds, the runs they make.

``--sweep=model.num_heads=1,2`` is an :class:`Axis` (values typed as the field); fields
joined by ``+`` move together (a zip, not a product); a value holding commas goes in a
JSON list. :class:`Sweep` is the cross product of its axes times ``seeds``, each point a
:class:`RunSpec` with its folder and its ``train`` command. A bad spec (no ``=``, an
unknown field, a value of the wrong type, an empty list, a point whose config does not
validate) fails before anything runs, with one line naming it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import sys
import typing
from typing import Any

from flaxformer_lite.config.experiment import SECTIONS
from flaxformer_lite.config.fields import ConfigError, type_name
from flaxformer_lite.config.files import load_config
from flaxformer_lite.config.model import ModelConfig

_ALL_SECTIONS = {"model": ModelConfig, **SECTIONS}


class SweepError(ValueError):
    """A sweep spec or folder is unusable; the message names the value and the fix."""


@dataclasses.dataclass(frozen=True)
class Axis:
    """One swept field (``model.num_heads``) and its values, typed as the field. Fields
    joined by ``+`` (``model.num_encoder_layers+model.num_decoder_layers``) take the
    same value together."""

    field: str
    values: tuple

    @property
    def fields(self) -> tuple[str, ...]:
        return tuple(self.field.split("+"))

    @property
    def name(self) -> str:
        return "+".join(f.partition(".")[2] for f in self.fields)


def _field(key: str) -> dataclasses.Field:
    section, _, name = key.partition(".")
    kind = _ALL_SECTIONS.get(section)
    fields = {f.name: f for f in dataclasses.fields(kind)} if kind else {}
    if name not in fields:
        raise SweepError(
            f"--sweep: unknown config field {key!r}; fields look like model.num_heads "
            "(python -m flaxformer_lite.main fields lists them)"
        )
    return fields[name]


def _kind(key: str) -> Any:
    """The value type of a field, ``X | None`` read as X (None cannot be swept)."""
    field = _field(key)
    if field.metadata.get("parse") is not None:
        return str  # held as text in the ml_collections layer
    section = _ALL_SECTIONS[key.partition(".")[0]]
    kind = typing.get_type_hints(section)[field.name]
    args = [k for k in typing.get_args(kind) if k is not type(None)]
    return args[0] if len(args) == 1 else kind


def coerce(key: str, raw: Any) -> Any:
    """``raw`` (text from the command line, or a JSON value) as a value of field ``key``."""
    kind = _kind(key)
    bad = SweepError(f"--sweep {key}: {raw!r} is not a {type_name(kind)}")
    if isinstance(raw, str):
        text = raw.strip()
        if kind is str:
            return text
        if kind is bool:
            if text.lower() in ("true", "1", "yes"):
                return True
            if text.lower() in ("false", "0", "no"):
                return False
            raise bad
        try:
            return kind(text) if kind is not int else int(text, 10)
        except (TypeError, ValueError):
            raise bad from None
    if kind is float and isinstance(raw, int) and not isinstance(raw, bool):
        return float(raw)
    if kind in (int, float) and isinstance(raw, bool):
        raise bad
    if not isinstance(raw, kind):
        raise bad
    return raw


def parse_axis(spec: str) -> Axis:
    """``section.field=v1,v2`` (or ``section.field=[JSON list]``) as an :class:`Axis`;
    ``section.a+section.b=v1,v2`` sets both fields to each value."""
    key, sep, text = spec.partition("=")
    key = "+".join(part.strip() for part in key.split("+"))
    if not sep or not key:
        raise SweepError(
            f"--sweep {spec!r} has no '='; write it as section.field=value1,value2, "
            "e.g. --sweep=model.num_heads=1,4,8"
        )
    fields = key.split("+")
    for field in fields:
        _field(field)
    text = text.strip()
    if text.startswith("["):
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise SweepError(f"--sweep {key}: {text!r} is not a JSON list ({e.msg})") from None
    else:
        raw = text.split(",") if text else []
    if not raw:
        raise SweepError(f"--sweep {key}: the list of values is empty; give at least one")
    if any(isinstance(v, str) and not v.strip() for v in raw):
        raise SweepError(f"--sweep {key}={text}: an empty value; separate values by single commas")
    if any(v is None for v in raw):
        raise SweepError(
            f"--sweep {key}: None cannot be swept from the command line; leave it "
            "out of the list and set it in the config file instead"
        )
    values = tuple(coerce(fields[0], v) for v in raw)
    for field in fields[1:]:  # linked fields take the same values
        if _kind(field) is not _kind(fields[0]):
            raise SweepError(
                f"--sweep {key}: linked fields must have one type; {fields[0]} is a "
                f"{type_name(_kind(fields[0]))}, {field} a {type_name(_kind(field))}"
            )
    if len(set(values)) != len(values):
        raise SweepError(f"--sweep {key}={text}: a value appears twice")
    return Axis(key, values)


def _format(value: Any) -> str:
    """A value as the command line writes it (``--config.x=<this>``)."""
    return str(value)


NAME_BYTES = 200  # a point's folder name at most (file systems allow 255 bytes)


def folder_name(label: str) -> str:
    """A point's label (``ffn=swiglu,num_heads=4``) as one folder name inside the sweep
    folder, whatever the values hold: a separator or control character (``/``, NUL)
    becomes ``_``, a name of dots (``..``) is prefixed, and a name too long for a file
    system ends in a hash of the whole label instead."""
    name = "".join("_" if c in "/\\" or ord(c) < 32 else c for c in label)
    if not name.strip("."):
        name = f"_{name}"
    if len(name.encode()) > NAME_BYTES:
        digest = hashlib.sha256(label.encode()).hexdigest()[:12]
        name = name.encode()[: NAME_BYTES - 13].decode(errors="ignore") + "-" + digest
    return name


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One run of a sweep: a point of the grid and a seed."""

    point: tuple[tuple[str, Any], ...]  # ((field, value), ...) in axis order
    seed: int
    folder: str  # relative to the sweep folder: <point>/seed<N>

    @property
    def overrides(self) -> dict[str, Any]:
        return dict(self.point)


@dataclasses.dataclass(frozen=True)
class Sweep:
    """A sweep over ``axes`` x ``seeds`` of the config ``config`` (``path[:arg]``)
    with the base ``overrides`` ({"train.num_steps": 20}) applied to every run."""

    config: str
    axes: tuple[Axis, ...] = ()
    seeds: int = 3
    overrides: dict[str, Any] = dataclasses.field(default_factory=dict)
    split: str = "test"  # scored with BLEU after training (translation); '' = none
    limit: int = 0  # sentences of that split (0 = all)
    decode_flags: tuple[str, ...] = ()  # extra evaluate flags, e.g. ("--beam_size=1",)
    baseline: str = ""  # a point (its folder or fields) the report compares the others with

    def __post_init__(self):
        if self.seeds < 1:
            raise SweepError(f"--seeds={self.seeds} must be >= 1")
        fields = [f for a in self.axes for f in a.fields]
        twice = sorted({f for f in fields if fields.count(f) > 1})
        if twice:
            raise SweepError(f"--sweep names {twice} more than once; give each field one list")
        both = sorted(set(fields) & set(self.overrides))
        if both:
            raise SweepError(
                f"{both} is both swept and set by --config.{both[0]}=...; drop one of the two"
            )
        if "train.seed" in fields:
            raise SweepError("train.seed is not swept with --sweep; use --seeds=N")

    @property
    def config_path(self) -> str:
        return self.config.partition(":")[0]

    @property
    def config_arg(self) -> str | None:
        return self.config.partition(":")[2] or None

    def base(self):
        """The ml_collections config of every run before the point and the seed."""
        try:
            return load_config(self.config_path, self.config_arg, self.overrides)
        except ConfigError as e:
            raise SweepError(f"the base config: {e}") from None

    def runs(self) -> list[RunSpec]:
        first_seed = int(self.base().train.seed)
        names = [a.name for a in self.axes]
        out = []
        for values in itertools.product(*(a.values for a in self.axes)):
            point = tuple((f, v) for a, v in zip(self.axes, values, strict=True) for f in a.fields)
            labels = [
                f"{a.field if names.count(a.name) > 1 else a.name}={_format(v)}"
                for a, v in zip(self.axes, values, strict=True)
            ]
            name = folder_name(",".join(labels)) if labels else "base"
            for i in range(self.seeds):
                seed = first_seed + i
                out.append(RunSpec(point, seed, f"{name}/seed{seed}"))
        return out

    def validate(self) -> list[RunSpec]:
        """Every run's config checked (types, ranges, cross-field rules) before any runs."""
        runs = self.runs()
        if self.baseline:  # a typo fails now, not after the runs
            find_baseline([(r.folder.rpartition("/")[0], r.overrides) for r in runs], self.baseline)
        for spec in runs[:: self.seeds]:
            try:
                load_config(self.config_path, self.config_arg, {**self.overrides, **spec.overrides})
            except ConfigError as e:
                shown = ", ".join(f"{k}={v!r}" for k, v in spec.point)
                raise SweepError(f"--sweep point {shown}: {e}") from None
        return runs

    def score_command(self, spec: RunSpec, workdir) -> list[str]:
        """The ``evaluate`` command of one run (what its ``score.txt`` says)."""
        return [
            sys.executable, "-m", "flaxformer_lite.main", "evaluate",
            f"--workdir={workdir / spec.folder}", f"--split={self.split}",
            f"--limit={self.limit}",
            "--trust_extensions",  # its own runs: the code the sweep's config trained
            *self.decode_flags,
        ]  # fmt: skip

    def command(self, spec: RunSpec, workdir) -> list[str]:
        """The ``train`` command of one run (what its ``command.txt`` says): the run's own
        overrides, not the sweep's launch settings (``config.launch``)."""
        values = {**self.run_overrides, **spec.overrides, "train.seed": spec.seed}
        return [
            sys.executable,
            "-m",
            "flaxformer_lite.main",
            f"--config={self.config}",
            *(f"--config.{k}={_format(v)}" for k, v in values.items()),
            f"--workdir={workdir / spec.folder}",
        ]

    @property
    def run_overrides(self) -> dict[str, Any]:
        """The base overrides that make the runs (all but ``launch.*``, which say where
        they run: a sweep may move between launchers and keep its runs)."""
        return {k: v for k, v in self.overrides.items() if not k.startswith("launch.")}

    def to_json(self) -> dict[str, Any]:
        return {
            "config": self.config,
            "overrides": self.run_overrides,
            "axes": {a.field: list(a.values) for a in self.axes},
            "seeds": self.seeds,
            "split": self.split,
            "limit": self.limit,
            "baseline": self.baseline,
        }


def find_baseline(points: list[tuple[str, dict[str, Any]]], baseline: str) -> str:
    """The folder name of the point ``baseline`` names: its folder (``ffn=standard``) or
    its fields (``model.ffn=standard``, several joined by ``,``)."""
    for folder, overrides in points:
        long = ",".join(f"{k}={v}" for k, v in overrides.items())
        if baseline in (folder, long):
            return folder
    names = ", ".join(f for f, _ in points)
    raise SweepError(f"--baseline={baseline!r} is not a point of this sweep; its points: {names}")
