"""Boolean environment flags (``OVERLAP_DEBUG``, ``OVERLAP_VERIFY``, ...): one strict parser for all.

Contract
--------
* On: ``1``, ``true``, ``yes``, ``on``. Off: ``0``, ``false``, ``no``, ``off`` and the empty string.
  Case and surrounding whitespace are ignored. Unset: the caller's default (off unless stated).
* Anything else raises :class:`EnvFlagError` (a ``ValueError``) naming the variable, the value and
  the values allowed, so a typo such as ``OVERLAP_VERIFY=of`` never silently picks a mode.
* Reading a flag has no side effect and caches nothing: each caller decides when to read
  (``overlap.desync`` at the first collective, ``scheduler.Scheduler`` at construction).

It lives in ``scheduler`` because ``scheduler`` must not import ``overlap`` and both need it.
"""
from __future__ import annotations

import os
from typing import Mapping, Optional

__all__ = ["ON_VALUES", "OFF_VALUES", "EnvFlagError", "env_flag", "parse_flag"]

ON_VALUES: tuple[str, ...] = ("1", "true", "yes", "on")
OFF_VALUES: tuple[str, ...] = ("0", "false", "no", "off", "")


class EnvFlagError(ValueError):
    """A boolean environment variable holds something other than an on or off value."""


def _allowed() -> str:
    on = ", ".join(repr(v) for v in ON_VALUES)
    off = ", ".join(repr(v) for v in OFF_VALUES)
    return f"{on} (on) or {off} (off), case-insensitive, or unset"


def _check_name(name: object, fn: str) -> None:
    if not isinstance(name, str) or not name:
        raise TypeError(f"{fn}: name must be a non-empty str (the variable's name), got {name!r}")


def parse_flag(name: str, value: str) -> bool:
    """``value`` (the text of environment variable ``name``) as a bool; raises :class:`EnvFlagError`."""
    _check_name(name, "parse_flag")
    if not isinstance(value, str):
        raise TypeError(f"parse_flag: value of {name} must be a str, got {type(value).__name__}")
    text = value.strip().lower()
    if text in ON_VALUES:
        return True
    if text in OFF_VALUES:
        return False
    raise EnvFlagError(f"{name} must be one of {_allowed()}; got {value!r}")


def env_flag(name: str, default: bool = False, environ: Optional[Mapping[str, str]] = None) -> bool:
    """The boolean flag ``name`` from ``environ`` (default ``os.environ``); ``default`` when unset.

    Raises :class:`EnvFlagError` for a value that is neither on nor off (see the module docstring).
    """
    if not isinstance(default, bool):
        raise TypeError(f"env_flag: default must be a bool, got {default!r}")
    _check_name(name, "env_flag")
    source = os.environ if environ is None else environ
    value = source.get(name)
    if value is None:
        return default
    return parse_flag(name, value)
