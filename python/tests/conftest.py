"""Fixtures: one real `sandman serve` (process provider) for the session, and the two clients.

The server binary is `$SANDMAN_BIN`, else `target/debug/sandman` of this repository (build it with
`cargo build -p sandman-cli -p sandmand`). Its state directory lives under `target/py-tests/`, not
under /tmp, so that sandboxes get namespaces of their own when the tests run as root.

Most tests take the `api` fixture and run twice: with `AsyncSandman`, and with the sync `Sandman`
behind `SyncAsAsync`, a proxy that makes its calls awaitable. The proxy checks as it goes that
every sync call it is asked for has an async twin of the same kind (a coroutine there, a plain
call here), so one test body exercises both clients and their parity.
"""

from __future__ import annotations

import inspect
import os
import re
import secrets
import shutil
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Dict, Iterator

import httpx
import pytest

import sandman
from sandman import AsyncSandman, Sandman
from sandman._async import client as async_client
from sandman._sync import client as sync_client

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Server:
    url: str
    token: str
    state: Path
    proc: "subprocess.Popen[bytes]"
    log: Path


def _binary() -> Path:
    path = Path(os.environ.get("SANDMAN_BIN") or REPO / "target" / "debug" / "sandman")
    if not path.exists():
        raise RuntimeError(
            f"no sandman binary at {path}: build it with `cargo build -p sandman-cli -p sandmand`, or set SANDMAN_BIN"
        )
    return path


def state_base() -> Path:
    """Where the tests' state directories go. Not under /tmp: an isolated sandbox gets a /tmp of
    its own, which would hide the server's state kept there (as it is when the checkout itself is
    under /tmp)."""
    base = REPO / "target" / "py-tests"
    if str(base.resolve()).startswith("/tmp/"):
        base = Path("/var/tmp/sandman-tests/py")
    base.mkdir(parents=True, exist_ok=True)
    return base


def start_server(state: Path, token: str, *args: str) -> Server:
    """Starts `sandman serve` (process provider) on `state`, on a free loopback port and on the
    Unix socket `state/sandman.sock`; answers once it said where it listens. Its log is
    `state/serve.log` (appended to, so a restarted server's follows)."""
    log = state / "serve.log"
    start = log.stat().st_size if log.exists() else 0
    env = dict(os.environ, SANDMAN_TOKEN=token)
    env.pop("SANDMAN_URL", None)
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [str(_binary()), "serve", "--listen", "127.0.0.1:0", "--state-dir", str(state), *args],
            stdout=out,
            stderr=out,
            env=env,
            start_new_session=True,
        )
    url = None
    deadline = time.monotonic() + 30
    while url is None:
        with open(log, "rb") as f:
            f.seek(start)
            m = re.search(r"sandman serving on (http://\S+)", f.read().decode(errors="replace"))
        if m:
            url = m.group(1)
        elif proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"sandman serve did not start:\n{log.read_text(errors='replace')}")
        else:
            time.sleep(0.05)
    return Server(url, token, state, proc, log)


@pytest.fixture(scope="session")
def server() -> Iterator[Server]:
    base = state_base()
    state = Path(tempfile.mkdtemp(prefix="s-", dir=base))
    token = secrets.token_hex(16)
    srv = start_server(state, token)
    url, proc, log = srv.url, srv.proc, srv.log
    try:
        yield srv
    finally:
        # A stopped server leaves its sandboxes running for its next start: release them first.
        try:
            with Sandman(url, token) as c:
                for sb in c.list():
                    if sb.live:
                        c.release(sb.id)
        finally:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
            shutil.copy(log, base / "last-serve.log")
            shutil.rmtree(state, ignore_errors=True)


@pytest.fixture
def client(server: Server) -> Iterator[Sandman]:
    with Sandman(server.url, server.token) as c:
        yield c


@pytest.fixture
async def aclient(server: Server) -> AsyncIterator[AsyncSandman]:
    async with AsyncSandman(server.url, server.token) as c:
        yield c


@pytest.fixture(params=["async", "sync"])
async def api(request: Any, server: Server) -> AsyncIterator[Any]:
    """The async client, or the sync one made awaitable (see the module's docstring)."""
    if request.param == "async":
        async with AsyncSandman(server.url, server.token) as c:
            yield c
    else:
        c = Sandman(server.url, server.token)
        try:
            yield SyncAsAsync(c)
        finally:
            c.close()


@pytest.fixture(params=["async", "sync"])
def mock_api(request: Any) -> Callable[[Callable[[httpx.Request], httpx.Response]], Any]:
    """Makes a client of a fake server: `mock_api(handler)` answers every request with
    `handler(request)` (an `httpx.MockTransport`), without retries. Async, or the sync client
    behind `SyncAsAsync`, as the `api` fixture; use it as an async context manager."""

    def make(handler: Callable[[httpx.Request], httpx.Response]) -> Any:
        transport = httpx.MockTransport(handler)
        if request.param == "async":
            return AsyncSandman("http://sandman.test", "t", transport=transport, retries=0)
        return SyncAsAsync(Sandman("http://sandman.test", "t", transport=transport, retries=0))

    return make


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


# ---- the sync client made awaitable ----

#: Each sync class and its async twin.
TWINS: Dict[type, type] = {
    getattr(sync_client, name[len("Async") :]): getattr(async_client, name)
    for name in async_client.__all__
    if name.startswith("Async")
}
RENAMED = {"aclose": "close"}


class _Done:
    """An awaitable that is already done."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __await__(self) -> Any:
        return self.value
        yield  # makes this a generator


def wrap(value: Any) -> Any:
    if isinstance(value, tuple(TWINS)):
        return SyncAsAsync(value)
    if isinstance(value, list):
        return [wrap(v) for v in value]
    return value


class SyncAsAsync:
    """A sync SDK object with the async twin's surface: its coroutine methods return awaitables,
    its context managers and iterators are async ones."""

    def __init__(self, target: Any) -> None:
        object.__setattr__(self, "_target", target)

    @property
    def target(self) -> Any:
        return object.__getattribute__(self, "_target")

    def __repr__(self) -> str:
        return f"SyncAsAsync({self.target!r})"

    def __getattr__(self, name: str) -> Any:
        target = self.target
        twin = TWINS[type(target)]
        twin_attr = inspect.getattr_static(twin, name, None)
        attr = getattr(target, RENAMED.get(name, name))
        if twin_attr is None and not name.startswith("_"):
            # instance attributes (set in __init__) have no class attribute
            assert not callable(attr) or isinstance(attr, type), f"{twin.__name__} has no `{name}`"
        if callable(attr) and twin_attr is not None and inspect.isfunction(twin_attr):
            is_coro = inspect.iscoroutinefunction(twin_attr)
            assert not inspect.iscoroutinefunction(attr)

            def call(*args: Any, **kwargs: Any) -> Any:
                result = wrap(attr(*args, **kwargs))
                return _Done(result) if is_coro else result

            return call
        return wrap(attr)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.target, name, value)

    async def __aenter__(self) -> Any:
        return wrap(self.target.__enter__())

    async def __aexit__(self, *exc: Any) -> Any:
        return self.target.__exit__(*exc)

    def __aiter__(self) -> "SyncAsAsync":
        return self

    async def __anext__(self) -> Any:
        try:
            return wrap(next(self.target))
        except StopIteration:
            raise StopAsyncIteration from None


__all__ = ["Server", "SyncAsAsync", "unique", "sandman", "REPO"]
