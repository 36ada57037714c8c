"""Boolean environment flags: one strict parser (``scheduler.env_flags``) for OVERLAP_DEBUG and
OVERLAP_VERIFY alike; 'off' and 'no' mean off everywhere, and a typo is an error naming the variable."""
from __future__ import annotations

import pytest
from torch import nn

import overlap
from overlap import desync
from scheduler import Scheduler
from scheduler.env_flags import OFF_VALUES, ON_VALUES, EnvFlagError, env_flag, parse_flag
from scheduler.replay import VERIFY_ENV

SPELLINGS_ON = [*ON_VALUES, "TRUE", " On ", "Yes"]
SPELLINGS_OFF = [*OFF_VALUES, "OFF", " no ", "False"]
NEITHER = ["2", "of", "enable", "y", "n", "none", "-1"]


@pytest.mark.parametrize("text", SPELLINGS_ON)
def test_on_spellings(text: str) -> None:
    assert parse_flag("X", text) is True


@pytest.mark.parametrize("text", SPELLINGS_OFF)
def test_off_spellings(text: str) -> None:
    assert parse_flag("X", text) is False


@pytest.mark.parametrize("text", NEITHER)
def test_anything_else_is_an_error_naming_the_variable_and_the_values(text: str) -> None:
    with pytest.raises(EnvFlagError) as info:
        parse_flag("OVERLAP_SOMETHING", text)
    message = str(info.value)
    assert message.startswith("OVERLAP_SOMETHING must be one of") and repr(text) in message
    assert "'1', 'true', 'yes', 'on' (on)" in message and "'0', 'false', 'no', 'off', '' (off)" in message
    assert isinstance(info.value, ValueError)


def test_unset_gives_the_default_and_bad_arguments_are_named() -> None:
    assert env_flag("X", environ={}) is False and env_flag("X", True, environ={}) is True
    assert env_flag("X", True, environ={"X": "off"}) is False
    with pytest.raises(TypeError, match="default must be a bool"):
        env_flag("X", default="no")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="name must be a non-empty str"):
        env_flag("")
    with pytest.raises(TypeError, match="value of X must be a str"):
        parse_flag("X", 1)  # type: ignore[arg-type]


@pytest.mark.parametrize(("text", "expected"), [("off", False), ("no", False), ("OFF", False), ("0", False),
                                              ("", False), ("on", True), ("yes", True), ("1", True)])
def test_overlap_verify_uses_the_strict_parser(text: str, expected: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(VERIFY_ENV, text)
    sched = Scheduler(nn.Linear(2, 2))
    try:
        assert sched.verify is expected, "OVERLAP_VERIFY=off/no used to turn verify mode on"
    finally:
        sched.close()


def test_overlap_verify_typo_raises_before_hooking_the_model(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(VERIFY_ENV, "of")
    model = nn.Linear(2, 2)
    with pytest.raises(EnvFlagError, match="OVERLAP_VERIFY must be one of .*got 'of'"):
        Scheduler(model)
    assert not model._forward_pre_hooks and not model._forward_hooks, "nothing was changed"


@pytest.mark.parametrize(("text", "expected"), [("off", False), ("no", False), ("on", True), ("yes", True)])
def test_overlap_debug_uses_the_same_parser(text: str, expected: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(desync.DEBUG_ENV, text)
    previous = overlap.set_debug(None)
    try:
        assert overlap.debug_enabled() is expected
    finally:
        monkeypatch.delenv(desync.DEBUG_ENV)
        overlap.set_debug(previous)


def test_a_switch_reads_its_variable_when_first_needed_and_after_set_none(monkeypatch: pytest.MonkeyPatch) -> None:
    from scheduler.env_flags import Switch

    switch = Switch("OVERLAP_TEST_SWITCH", "set_test_switch")
    monkeypatch.setenv("OVERLAP_TEST_SWITCH", "yes")
    assert switch.on  # not read yet: on, so that hot paths call resolve()
    monkeypatch.setenv("OVERLAP_TEST_SWITCH", "off")
    assert switch.resolve() is False and switch.on is False  # read now, not at construction
    monkeypatch.setenv("OVERLAP_TEST_SWITCH", "on")
    assert switch.resolve() is False  # read once
    assert switch.set(True) is None and switch.on is True
    with switch.scoped(False):
        assert switch.resolve() is False
    assert switch.resolve() is True  # the explicit setting restored
    assert switch.set(None) is True and switch.resolve() is True  # follows the variable again: on
    monkeypatch.setenv("OVERLAP_TEST_SWITCH", "of")
    switch.set(None)
    with pytest.raises(EnvFlagError, match="OVERLAP_TEST_SWITCH must be one of .*got 'of'"):
        switch.resolve()
    with pytest.raises(TypeError, match="set_test_switch: on must be True, False or None, got 1"):
        switch.set(1)  # type: ignore[arg-type]
