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

import contextlib
import os
from typing import Iterator, Mapping, Optional

__all__ = ["ON_VALUES", "OFF_VALUES", "EnvFlagError", "Switch", "env_flag", "parse_flag"]

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


class Switch:
    """A process-wide on/off setting: set explicitly, or read from environment variable ``env`` when
    first needed (not at import) and again after ``set(None)``.

    Hot paths read ``switch.on`` (one attribute) and call :meth:`resolve` only when it is True:
    ``on`` is True until the variable is read, then the setting (``if s.on and s.resolve(): ...``).
    ``name`` is the public setter's name, used in its error messages.
    """

    def __init__(self, env: str, name: str, default: bool = False) -> None:
        self.env, self.name, self.default = env, name, default
        self.on = True
        self._resolved = False
        self._explicit: Optional[bool] = None

    def resolve(self) -> bool:
        """The setting; reads the variable if nothing has yet (raises :class:`EnvFlagError` for a bad value)."""
        if not self._resolved:
            self.on, self._resolved = env_flag(self.env, self.default), True
        return self.on

    def set(self, on: Optional[bool]) -> Optional[bool]:
        """Set it (``None``: follow the variable again); returns the previous explicit setting."""
        if on is not None and not isinstance(on, bool):
            raise TypeError(f"{self.name}: on must be True, False or None, got {on!r}")
        previous, self._explicit = self._explicit, on
        self.on, self._resolved = (True, False) if on is None else (on, True)
        return previous

    @contextlib.contextmanager
    def scoped(self, on: bool) -> Iterator[None]:
        """On (or off) inside the block; the previous explicit setting is restored on exit."""
        previous = self.set(on)
        try:
            yield
        finally:
            self.set(previous)
