"""The CPU engine's idle-sleep default and its switch."""

from __future__ import annotations

import pytest

from sglang_dart.cpu import idle_sleep


@pytest.mark.parametrize(("value", "expected"), [(None, True), ("", True), ("1", True), (" 0 ", False)])
def test_the_switch_defaults_to_sleeping(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv(idle_sleep.ENV, raising=False)
    else:
        monkeypatch.setenv(idle_sleep.ENV, value)
    assert idle_sleep.wanted() is expected


@pytest.mark.parametrize("value", ["yes", "2", "off"])
def test_other_values_are_refused_by_name(monkeypatch, value):
    monkeypatch.setenv(idle_sleep.ENV, value)
    with pytest.raises(ValueError, match=idle_sleep.ENV):
        idle_sleep.wanted()
