"""The CLI's default operator name: ``user@host``, always one an event can hold."""

from __future__ import annotations

import getpass
import socket

import pytest

from orders.cli.app import default_actor_name
from orders.domain import ACTOR_MAX_LENGTH, Actor, ActorKind


def test_the_default_is_the_login_name_at_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOGNAME", "ann")  # getpass.getuser() reads it first
    assert default_actor_name() == f"ann@{socket.gethostname()}"


def test_a_user_without_a_name_is_unknown_at_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_name() -> str:
        raise OSError("no login name")  # as getpass does without LOGNAME or a passwd entry

    monkeypatch.setattr(getpass, "getuser", no_name)
    assert default_actor_name() == f"unknown@{socket.gethostname()}"


@pytest.mark.parametrize("login", ["u" * 300, "u" * (ACTOR_MAX_LENGTH - 1) + " x"])
def test_a_long_login_name_is_cut_to_what_an_event_holds(
    monkeypatch: pytest.MonkeyPatch, login: str
) -> None:
    monkeypatch.setenv("LOGNAME", login)
    name = default_actor_name()
    assert len(name) <= ACTOR_MAX_LENGTH
    assert login.startswith(name)
    assert Actor.of(name, ActorKind.OPERATOR) == Actor(ActorKind.OPERATOR, name)
