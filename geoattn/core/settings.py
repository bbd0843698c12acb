"""Typed settings from user-written options: one place that checks keys and explains the valid ones.

Every config dataclass a user can reach (``--set model.KEY=...``, ``--set task.KEY=...``, TOML
tables) is built through :func:`settings_from`, so an unknown key or a bad value is a
:class:`~geoattn.core.errors.ConfigError` naming the key and listing the valid ones, and
:func:`describe_settings` can list every key with its type, default and help.
"""

from __future__ import annotations

import dataclasses
import sys
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from geoattn.core.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

T = TypeVar("T")


def read_toml(path: str | Path, what: str) -> dict[str, Any]:
    """The TOML document at ``path``; ConfigError (one line, ``what`` naming the file's role, e.g.
    "config file") when it is missing or not valid TOML."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{what} {path} does not exist")
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"{what} {path} is not valid TOML: {err}") from None


def setting_names(cls: type, exclude: Iterable[str] = ()) -> list[str]:
    """The field names of the dataclass ``cls`` a user may set (all but ``exclude``)."""
    skip = set(exclude)
    return [f.name for f in dataclasses.fields(cls) if f.name not in skip]


def settings_from(
    cls: type[T],
    options: Mapping[str, Any] | None,
    *,
    prefix: str,
    fixed: Mapping[str, Any] | None = None,
    defaults: Mapping[str, Any] | None = None,
) -> T:
    """``cls(**{**defaults, **options, **fixed})`` after checking the keys of ``options``.

    Args:
        cls: a dataclass whose ``__post_init__`` validates values (raising ``ValueError``).
        options: what the user wrote (``--set PREFIX.KEY=VALUE`` / a TOML table).
        prefix: how the user addresses these keys (``"model"``, ``"task"``), for messages.
        fixed: fields the caller decides (the user may not set them).
        defaults: the caller's defaults (e.g. sizes from the run), below the user's options.

    Raises:
        ConfigError: an unknown or fixed key (the message lists the valid keys), or a value the
            dataclass rejects.
    """
    options = dict(options or {})
    fixed = dict(fixed or {})
    valid = setting_names(cls, exclude=fixed)
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ConfigError(
            f"unknown {prefix} setting(s) {', '.join(unknown)} ({cls.__name__}); "
            f"valid: {', '.join(sorted(valid))}"
        )
    try:
        return cls(**{**dict(defaults or {}), **options, **fixed})
    except ConfigError:
        raise
    except (TypeError, ValueError) as err:
        raise ConfigError(f"{prefix} settings: {err}") from None


def describe_settings(cls: type, *, prefix: str, exclude: Iterable[str] = ()) -> list[list[str]]:
    """Rows ``[key, type, default, help]`` for every settable field of the dataclass ``cls``.

    The help is the field's ``metadata["help"]`` when given, else the line of the class docstring
    that names the field before its colon (``name: ...`` or ``a, name, b: ...``), or of a base
    class's docstring for an inherited field.
    """
    hints = typing.get_type_hints(cls)
    docs = "\n".join(klass.__doc__ or "" for klass in cls.__mro__ if dataclasses.is_dataclass(klass))
    doc_lines = [line.strip() for line in docs.splitlines()]
    skip = set(exclude)
    rows = []
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = "(required)"
        text = f.metadata.get("help") or _doc_line(doc_lines, f.name)
        kind = getattr(hints[f.name], "__name__", None) or str(hints[f.name]).replace("typing.", "")
        kind = kind.replace(" | ", " or ")
        rows.append([f"{prefix}.{f.name}", kind, repr(default), text])
    return rows


def _doc_line(lines: list[str], name: str) -> str:
    for line in lines:
        head, colon, rest = line.partition(":")
        if colon and name in (part.strip(" `") for part in head.split(",")):
            return rest.strip()
    return ""
