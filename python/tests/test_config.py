"""Where the clients find the server and its token: arguments, SANDMAN_URL / SANDMAN_TOKEN, and the
token file the server writes into its state directory (found as the Rust CLI finds it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import Server

import sandman
from sandman import AsyncSandman, Sandman
from sandman._core import default_state_dir, resolve_token, resolve_url


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> pytest.MonkeyPatch:
    for var in ("SANDMAN_URL", "SANDMAN_TOKEN", "SANDMAN_STATE_DIR", "XDG_STATE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return monkeypatch


def test_url_from_argument_then_env_then_default(clean_env: pytest.MonkeyPatch) -> None:
    assert resolve_url(None) == "http://127.0.0.1:7777"
    clean_env.setenv("SANDMAN_URL", "http://10.0.0.1:7777/")
    assert resolve_url(None) == "http://10.0.0.1:7777"
    assert resolve_url("http://other:1") == "http://other:1"
    with pytest.raises(sandman.InvalidArgument):
        resolve_url("ftp://x")


async def test_without_a_url_the_clients_find_a_local_server_on_its_socket(
    clean_env: pytest.MonkeyPatch, server: Server
) -> None:
    # Regression (issue 29): a client sent its token to whatever listened on the server's TCP
    # address. The socket is in the state directory, where only the server's user can make one.
    clean_env.setenv("SANDMAN_STATE_DIR", str(server.state))
    clean_env.setenv("SANDMAN_TOKEN", server.token)
    socket = server.state / "sandman.sock"
    assert resolve_url(None) == f"unix:{socket}"
    with Sandman() as c:
        assert c.url == f"unix:{socket}" and c.health().status == "ok"
        with c.create("host", lease=60) as sb:
            assert sb.exec("echo through the socket").stdout == "through the socket\n"
    async with AsyncSandman() as a:
        assert (await a.health()).status == "ok"
    # A URL given wins, and no socket leaves the TCP default.
    clean_env.setenv("SANDMAN_URL", server.url)
    assert resolve_url(None) == server.url
    clean_env.delenv("SANDMAN_URL")
    clean_env.setenv("SANDMAN_STATE_DIR", str(server.state / "nowhere"))
    assert resolve_url(None) == "http://127.0.0.1:7777"


def test_token_from_argument_then_env_then_state_dir(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    home_state = tmp_path / "home" / ".local" / "state" / "sandman"
    assert default_state_dir() == home_state
    with pytest.raises(sandman.Unauthorized, match=str(home_state / "token")):
        resolve_token(None)
    home_state.mkdir(parents=True)
    (home_state / "token").write_text("from-home\n")
    assert resolve_token(None) == "from-home"
    xdg = tmp_path / "xdg"
    (xdg / "sandman").mkdir(parents=True)
    (xdg / "sandman" / "token").write_text("from-xdg")
    clean_env.setenv("XDG_STATE_HOME", str(xdg))
    assert resolve_token(None) == "from-xdg"
    clean_env.setenv("XDG_STATE_HOME", "relative/ignored")
    assert resolve_token(None) == "from-home"
    state = tmp_path / "state"
    state.mkdir()
    (state / "token").write_text("  from-state-dir  \n")
    clean_env.setenv("SANDMAN_STATE_DIR", str(state))
    assert resolve_token(None) == "from-state-dir"
    clean_env.setenv("SANDMAN_TOKEN", "from-env")
    assert resolve_token(None) == "from-env"
    assert resolve_token("explicit") == "explicit"


async def test_clients_configured_from_the_environment_reach_the_server(
    clean_env: pytest.MonkeyPatch, server: Server
) -> None:
    clean_env.setenv("SANDMAN_URL", server.url)
    clean_env.setenv("SANDMAN_STATE_DIR", str(server.state))
    (server.state / "token").write_text(server.token)  # as a server without SANDMAN_TOKEN writes it
    with Sandman() as c:
        assert c.url == server.url and c.health().status == "ok"
        assert repr(c) == f"Sandman({server.url!r})"
    async with AsyncSandman() as a:
        assert (await a.health()).status == "ok"
    clean_env.setenv("SANDMAN_TOKEN", server.token + "-wrong")
    with Sandman() as c:
        with pytest.raises(sandman.Unauthorized):
            c.list()


def test_every_public_name_is_exported() -> None:
    for name in sandman.__all__:
        assert getattr(sandman, name) is not None, name
    assert sandman.__version__ == "0.1.0"
    assert (Path(sandman.__file__).parent / "py.typed").exists()


def _unused(*_: Any) -> None:
    pass
