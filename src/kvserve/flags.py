"""Command-line flags generated from dataclass fields: one field, one flag, one help text, and a
default written once (the field's).

Every command (serve, generate, plan, bench serve, eval-kv) declares its options as frozen
dataclasses and builds its parser with `add_fields`, then its config with `from_args`; so the
command line and the Python API cannot drift apart.  A field becomes a flag when its metadata
has "help"; other metadata keys:

    choices      the allowed values
    parse="size" a memory size given as text (512MiB, 2GiB); the field holds bytes
    nargs        as argparse's (the field is a tuple)
    action       "append" for a repeatable flag (the field is a tuple)
    env          an environment variable that gives the default when set
    metavar      as argparse's
    required     as argparse's (the flag must be given)

It imports nothing from kvserve but config.py (itself a leaf), so any command may use it.
"""

from __future__ import annotations

import argparse
import os
import types
import typing
from dataclasses import MISSING, Field, fields, is_dataclass
from typing import Any, TypeVar

from kvserve.config import ENGINE_PARTS, EngineConfig, LoadConfig, parse_size
from kvserve.errors import ParameterError

T = TypeVar("T")


def flag_name(field_name: str) -> str:
    """max_model_len -> --max-model-len (vLLM's spelling)."""
    return "--" + field_name.replace("_", "-")


def field_help(cls: type, name: str) -> str:
    """The help text of one field, for commands that declare a flag by hand (positionals)."""
    return next(f.metadata["help"] for f in fields(cls) if f.name == name)


def flag_fields(cls: type) -> list[Field]:
    """The fields of `cls` that are flags (nested configs and internal fields are not)."""
    return [f for f in fields(cls) if "help" in f.metadata]


def add_fields(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    skip: tuple[str, ...] = (),
    only: tuple[str, ...] | None = None,
) -> None:
    """A flag for every flag field of `cls` (those in `only`, when given) except `skip`."""
    hints = typing.get_type_hints(cls)
    for f in flag_fields(cls):
        if f.name not in skip and (only is None or f.name in only):
            parser.add_argument(flag_name(f.name), dest=f.name, **_argparse_kwargs(f, hints))


def _argparse_kwargs(f: Field, hints: dict[str, Any]) -> dict[str, Any]:
    meta = f.metadata
    default = _default(f)
    kwargs: dict[str, Any] = {"help": meta["help"], "default": default}
    base = _base_type(hints[f.name])
    if base is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
    elif "action" in meta:
        kwargs["action"] = meta["action"]
        kwargs["default"] = None  # argparse appends to a list of its own
    elif "nargs" in meta:
        kwargs["nargs"] = meta["nargs"]
    elif meta.get("parse") == "size":
        kwargs["type"] = str
    elif base in (int, float, str):
        kwargs["type"] = base
    for key in ("choices", "metavar", "required"):
        if key in meta:
            kwargs[key] = meta[key]
    return kwargs


def _default(f: Field) -> Any:
    env = f.metadata.get("env")
    if env and os.environ.get(env):
        return os.environ[env]
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    return None


def _base_type(annotation: Any) -> Any:
    """int | None -> int; tuple[str, ...] -> tuple."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _base_type(args[0]) if len(args) == 1 else str
    return typing.get_origin(annotation) or annotation


def from_args(cls: type[T], args: argparse.Namespace, **given: Any) -> T:
    """An instance of `cls` from the parsed flags (nested dataclass fields from `given`; fields
    the command has no flag for keep their defaults).
    ValueError names the flag for a size that does not parse; the dataclass's own checks
    name the flag for the rest."""
    hints = typing.get_type_hints(cls)
    values = dict(given)
    for f in flag_fields(cls):
        if f.name in values or not hasattr(args, f.name):
            continue  # given, or not a flag of this command: the field's default
        value = getattr(args, f.name)
        if f.metadata.get("parse") == "size" and value is not None:
            try:
                value = parse_size(value)
            except ValueError as exc:
                raise ParameterError(flag_name(f.name), str(exc)) from None
        elif _base_type(hints[f.name]) is tuple:
            value = _declared_default(f) if value is None else tuple(value)
        values[f.name] = value
    return cls(**values)


def non_default_flags(configs: list[Any]) -> dict[str, Any]:
    """{flag field: value} of every flag field whose value differs from its default, for the
    start-up log line ("non-default args")."""
    changed = {}
    for config in configs:
        for f in flag_fields(type(config)):
            value = getattr(config, f.name)
            if value != _declared_default(f):
                changed[f.name] = value
        for f in fields(config):
            value = getattr(config, f.name)
            if is_dataclass(value) and "help" not in f.metadata:
                changed.update(non_default_flags([value]))
    return changed


def _declared_default(f: Field) -> Any:
    if f.default is not MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not MISSING else None


def add_engine_args(parser: argparse.ArgumentParser, positional_model: bool = True) -> None:
    """Flags for every EngineConfig field, a group per part; MODEL positional by default."""
    for _, cls in ENGINE_PARTS:
        skip = ("model",) if cls is LoadConfig and positional_model else ()
        add_fields(parser.add_argument_group(cls.__name__), cls, skip)
    if positional_model:
        parser.add_argument("model", nargs="?", default=None, help=field_help(LoadConfig, "model"))


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig of the parsed flags; ValueError names the flag (and the fix)."""
    return EngineConfig(**{name: from_args(cls, args) for name, cls in ENGINE_PARTS})
