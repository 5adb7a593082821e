"""Errors and retries: the exception classes of every wire code, what the real server answers, and
which calls are sent again after a failure (only the safe ones)."""

from __future__ import annotations

import json
import secrets
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Dict, List

import httpx
import pytest
from conftest import Server, start_server, state_base, unique

import sandman
from sandman import AsyncSandman, Sandman
from sandman.errors import error_from_response

CODES: Dict[str, tuple] = {
    "invalid_argument": (sandman.InvalidArgument, 400),
    "unauthorized": (sandman.Unauthorized, 401),
    "forbidden": (sandman.Forbidden, 403),
    "not_found": (sandman.NotFound, 404),
    "gone": (sandman.Gone, 410),
    "conflict": (sandman.Conflict, 409),
    "too_large": (sandman.TooLarge, 413),
    "timeout": (sandman.Timeout, 408),
    "quota_exceeded": (sandman.QuotaExceeded, 429),
    "unavailable": (sandman.Unavailable, 503),
    "internal": (sandman.Internal, 500),
}


def _answering(code: str, status: int, reason: Any = None) -> httpx.MockTransport:
    detail = {"code": code, "message": f"it is {code}"}
    if reason:
        detail["reason"] = reason
    return httpx.MockTransport(lambda req: httpx.Response(status, json={"error": detail}))


class _AsyncMock(httpx.AsyncBaseTransport):
    def __init__(self, handler: Any) -> None:
        self.handler = handler

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return self.handler(request)


@pytest.mark.parametrize("code", sorted(CODES))
async def test_every_wire_code_raises_its_class_with_code_message_reason(code: str) -> None:
    cls, status = CODES[code]
    transport = _answering(code, status, reason="lease_expired" if code == "gone" else None)
    with Sandman("http://sandman.test", "t", transport=transport, retries=0) as c:
        with pytest.raises(cls) as e:
            c.get("sb-1")
    async with AsyncSandman(
        "http://sandman.test", "t", transport=_AsyncMock(transport.handler), retries=0
    ) as a:  # type: ignore[arg-type]
        with pytest.raises(cls) as ea:
            await a.get("sb-1")
    for err in (e.value, ea.value):
        assert isinstance(err, sandman.SandmanError)
        assert (err.code, err.message, err.status) == (code, f"it is {code}", status)
        assert err.reason == ("lease_expired" if code == "gone" else None)
        assert str(err) == f"it is {code}"


def test_answers_without_the_error_body_map_by_status() -> None:
    err = error_from_response(502, b"<html>bad gateway</html>")
    assert isinstance(err, sandman.Unavailable) and "bad gateway" in err.message and err.status == 502
    err = error_from_response(418, b"")
    assert isinstance(err, sandman.InvalidArgument)
    err = error_from_response(400, json.dumps({"error": {"code": "brand_new", "message": "m"}}).encode())
    assert type(err) is sandman.SandmanError and err.code == "brand_new"
    assert "reason='r'" in repr(sandman.Gone("g", reason="r"))


def test_an_unreachable_server_is_a_transport_error_with_a_hint() -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    with Sandman(f"http://127.0.0.1:{port}", "t", retries=1) as c:
        with pytest.raises(sandman.TransportError) as e:
            c.health()
    assert isinstance(e.value, sandman.Unavailable) and e.value.reason == "connect_failed"
    assert "sandman serve" in str(e.value) and isinstance(e.value.__cause__, httpx.ConnectError)


async def test_what_the_real_server_refuses(api: Any, server: Server) -> None:
    with pytest.raises(sandman.NotFound) as nf:
        await api.get("sb-doesnotexist")
    assert nf.value.status == 404 and nf.value.reason is None
    # An image no registry serves (loopback's discard port refuses the connection: nothing leaves
    # this machine) fails with the registry's reason.
    with pytest.raises(sandman.InvalidArgument, match="Connection refused") as pull:
        await api.create("127.0.0.1:9/absent:1")
    assert pull.value.reason == "image_pull_failed"
    with pytest.raises(sandman.InvalidArgument, match="Python:3.12"):
        await api.create("Python:3.12")
    with pytest.raises((sandman.InvalidArgument, sandman.NotFound), match="pool"):
        await api.create("host", pool=unique("no-such-pool"))  # passed through, and refused
    with pytest.raises(sandman.InvalidArgument):
        await api.create("host", profile="fastest")
    bad = AsyncSandman(server.url, "wrong-token")
    try:
        with pytest.raises(sandman.Unauthorized):
            await bad.list()
    finally:
        await bad.aclose()


# ---- retries ----


class _LoseAnswers(httpx.HTTPTransport):
    """Sends requests to the real server, then loses the answer of the first `lose` matching ones
    (as a connection reset after the server acted would)."""

    def __init__(self, path_suffix: str, lose: int = 1) -> None:
        super().__init__()
        self.path_suffix = path_suffix
        self.lose = lose
        self.seen: List[str] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = super().handle_request(request)
        if request.url.path.endswith(self.path_suffix):
            self.seen.append(request.method)
            if self.lose > 0:
                self.lose -= 1
                response.read()
                response.close()
                raise httpx.ReadError("connection reset (lost on purpose)", request=request)
        return response


class _AsyncLoseAnswers(httpx.AsyncHTTPTransport):
    def __init__(self, path_suffix: str, lose: int = 1) -> None:
        super().__init__()
        self.path_suffix = path_suffix
        self.lose = lose
        self.seen: List[str] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await super().handle_async_request(request)
        if request.url.path.endswith(self.path_suffix):
            self.seen.append(request.method)
            if self.lose > 0:
                self.lose -= 1
                await response.aread()
                await response.aclose()
                raise httpx.ReadError("connection reset (lost on purpose)", request=request)
        return response


def test_a_create_whose_answer_is_lost_is_retried_and_returns_the_same_sandbox(server: Server) -> None:
    label = unique("retry")
    transport = _LoseAnswers("/v1/sandboxes")
    with Sandman(server.url, server.token, transport=transport) as c:
        with c.create(labels={"t": label}, lease=30) as sb:
            assert transport.seen == ["POST", "POST"]  # sent twice, one sandbox
            assert [s.id for s in c.list(label=f"t={label}")] == [sb.id]


async def test_an_async_create_whose_answer_is_lost_returns_the_same_sandbox(server: Server) -> None:
    label = unique("aretry")
    transport = _AsyncLoseAnswers("/v1/sandboxes")
    async with AsyncSandman(server.url, server.token, transport=transport) as c:
        async with await c.create(labels={"t": label}, lease=30) as sb:
            assert transport.seen == ["POST", "POST"]
            assert [s.id for s in await c.list(label=f"t={label}")] == [sb.id]


def test_an_explicit_idempotency_key_returns_the_same_sandbox(client: Sandman) -> None:
    key = unique("key")
    a = client.create(idempotency_key=key, lease=30)
    b = client.create(idempotency_key=key, lease=30)
    assert a.id == b.id
    a.release()


def test_an_exec_whose_answer_is_lost_is_not_sent_again(server: Server) -> None:
    transport = _LoseAnswers("/exec")
    with Sandman(server.url, server.token, transport=transport) as c:
        with c.create(lease=30) as sb:
            with pytest.raises(sandman.TransportError) as e:
                sb.exec("echo ran >> /tmp/count")
            assert e.value.reason == "connection_lost"
            assert transport.seen == ["POST"]
            assert sb.read_text("/tmp/count") == "ran\n"  # it ran exactly once


def test_load_shedding_is_retried_even_for_exec_but_other_503s_are_not() -> None:
    answers = [
        httpx.Response(503, headers={"Retry-After": "0"}, json={"error": {"code": "unavailable", "message": "shed"}}),
        httpx.Response(200, json={"exit_code": 0, "stdout": "ok", "stderr": ""}),
    ]
    sent: List[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(request.url.path)
        return answers.pop(0)

    with Sandman("http://sandman.test", "t", transport=httpx.MockTransport(handler)) as c:
        assert c.sandbox("sb-1").exec("true").stdout == "ok"
    assert sent == ["/v1/sandboxes/sb-1/exec"] * 2

    def no_retry_after(request: httpx.Request) -> httpx.Response:
        sent.append("again")
        return httpx.Response(503, json={"error": {"code": "unavailable", "message": "daemon down"}})

    sent.clear()
    with Sandman("http://sandman.test", "t", transport=httpx.MockTransport(no_retry_after)) as c:
        with pytest.raises(sandman.Unavailable, match="daemon down"):
            c.sandbox("sb-1").exec("true")
    assert sent == ["again"]


def test_a_replicas_unanswered_503_is_resent_only_for_idempotent_calls() -> None:
    lost = httpx.Response(
        503,
        headers={"X-Sandman-Unanswered": "1"},
        json={"error": {"code": "unavailable", "message": "the leader went away", "reason": "leader_lost"}},
    )
    sandbox = {"id": "sb-1", "image": "host", "state": "ready", "created_at_ms": 1}
    sent: List[str] = []
    answers = {"/v1/sandboxes": [lost, httpx.Response(200, json=sandbox)], "/v1/sandboxes/sb-1/exec": [lost]}

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(request.url.path)
        return answers[request.url.path].pop(0)

    with Sandman("http://sandman.test", "t", transport=httpx.MockTransport(handler)) as c:
        # A create carries an idempotency key: sent again, it answers the sandbox made under it.
        assert c.create("host", idempotency_key="k").id == "sb-1"
        with pytest.raises(sandman.Unavailable, match="the leader went away"):
            c.sandbox("sb-1").exec("true")
    assert sent == ["/v1/sandboxes", "/v1/sandboxes", "/v1/sandboxes/sb-1/exec"]


class _DropFirst:
    """A real TCP server that reads each request whole and, for the first `drops[path]` requests
    of a path, closes the connection without answering (a server replica killed mid-call); it
    answers the rest with `answer`. `seen` lists every request as `METHOD path`."""

    def __init__(self, drops: Dict[str, int], answer: Dict[str, Any]) -> None:
        self.drops = dict(drops)
        self.answer = json.dumps(answer).encode()
        self.seen: List[str] = []
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._connection, args=(conn,), daemon=True).start()

    def _connection(self, conn: socket.socket) -> None:
        with conn, conn.makefile("rb") as f:
            while True:
                head = []
                while True:
                    line = f.readline()
                    if not line:
                        return
                    if line == b"\r\n":
                        break
                    head.append(line.decode())
                method, path = head[0].split()[:2]
                length = next((int(h.split(":", 1)[1]) for h in head if h.lower().startswith("content-length:")), 0)
                f.read(length)
                self.seen.append(f"{method} {path}")
                if self.drops.get(path, 0) > 0:
                    self.drops[path] -= 1
                    return  # closed without an answer
                conn.sendall(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                    % (len(self.answer), self.answer)
                )

    def close(self) -> None:
        self.sock.close()


_SANDBOX = {"id": "sb-1", "image": "host", "provider": "process", "state": "ready", "created_at_ms": 1}


def test_a_read_cut_off_by_a_server_going_away_is_sent_again_until_it_is_answered() -> None:
    srv = _DropFirst({"/v1/sandboxes/sb-1": 2}, _SANDBOX)
    try:
        with Sandman(srv.url, "t", retries=5, retry_deadline=60) as c:
            assert c.get("sb-1").id == "sb-1"
        assert srv.seen == ["GET /v1/sandboxes/sb-1"] * 3
    finally:
        srv.close()


async def test_an_exec_cut_off_by_a_server_going_away_is_sent_exactly_once() -> None:
    srv = _DropFirst({"/v1/sandboxes/sb-1/exec": 1}, {"exit_code": 0, "stdout": "ok", "stderr": ""})
    try:
        async with AsyncSandman(srv.url, "t", retries=5, retry_deadline=60) as c:
            with pytest.raises(sandman.TransportError, match="not idempotent") as e:
                await c.sandbox("sb-1").exec("true")
            assert e.value.reason == "connection_lost" and e.value.attempts == 1
            assert srv.seen == ["POST /v1/sandboxes/sb-1/exec"]
            assert (await c.sandbox("sb-1").exec("true")).stdout == "ok"
        assert srv.seen == ["POST /v1/sandboxes/sb-1/exec"] * 2
    finally:
        srv.close()


def test_the_last_error_says_how_many_attempts_were_made() -> None:
    srv = _DropFirst({"/v1/sandboxes/sb-1": 100}, _SANDBOX)
    try:
        with Sandman(srv.url, "t", retries=3, retry_deadline=60) as c:
            with pytest.raises(sandman.TransportError, match=r"\(4 attempts\)") as e:
                c.get("sb-1")
        assert e.value.attempts == 4 and len(srv.seen) == 4
        # No deadline left after the first failure: sent once, however many retries are allowed.
        with Sandman(srv.url, "t", retries=100, retry_deadline=0) as c:
            with pytest.raises(sandman.TransportError) as e:
                c.get("sb-1")
        assert e.value.attempts == 1 and len(srv.seen) == 5
    finally:
        srv.close()


def test_calls_go_on_across_a_real_server_restart_but_an_exec_cut_off_is_not_sent_again() -> None:
    """A server killed and started again on its state directory, as a replica replaced in a
    rolling update: an exec in flight when it dies is not sent again (it ran once); a read and an
    exec made while nothing listens are sent until the new server answers them."""
    state = Path(tempfile.mkdtemp(prefix="r-", dir=state_base()))
    token = secrets.token_hex(16)
    srv = start_server(state, token)
    url = f"unix:{state / 'sandman.sock'}"
    try:
        with Sandman(url, token, retries=100, retry_deadline=120) as c:
            sb = c.create(lease=600)
            outcome: Dict[str, Any] = {}

            def call(name: str, f: Any) -> threading.Thread:
                def run() -> None:
                    try:
                        outcome[name] = f()
                    except sandman.SandmanError as e:
                        outcome[name] = e

                t = threading.Thread(target=run, daemon=True)
                t.start()
                return t

            cut = call("cut", lambda: sb.exec("echo ran >> /tmp/count; sleep 600", timeout=900))
            deadline = time.monotonic() + 60
            while True:
                try:
                    if sb.read_text("/tmp/count") == "ran\n":
                        break
                except sandman.NotFound:
                    pass
                assert time.monotonic() < deadline, "the exec never started"
                time.sleep(0.05)
            srv.proc.kill()
            srv.proc.wait()
            cut.join(60)
            err = outcome["cut"]
            assert isinstance(err, sandman.TransportError), err
            assert err.reason == "connection_lost" and "not idempotent" in str(err) and err.attempts == 1, err

            # Refused while nothing listens, and sent again until the new server answers.
            waiting = [call("get", lambda: c.get(sb.id)), call("exec", lambda: sb.exec("echo after the restart"))]
            srv = start_server(state, token)
            for t in waiting:
                t.join(120)
            assert outcome["get"].id == sb.id, outcome["get"]
            assert outcome["exec"].stdout == "after the restart\n", outcome["exec"]
            assert sb.read_text("/tmp/count") == "ran\n"  # the cut exec ran once
            sb.release()
    finally:
        try:
            with Sandman(url, token, retries=0) as c:
                for info in c.list():
                    if info.live:
                        c.release(info.id)
        except sandman.SandmanError:
            pass
        # Stopped, not killed: with no sandbox left it unmounts the tmpfs its sandboxes'
        # directories were on, so that the state directory goes whole.
        srv.proc.terminate()
        try:
            srv.proc.wait(15)
        except subprocess.TimeoutExpired:
            srv.proc.kill()
            srv.proc.wait()
        shutil.rmtree(state, ignore_errors=True)


def test_retries_come_from_the_environment_and_bad_values_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SANDMAN_RETRIES", "0")
    monkeypatch.setenv("SANDMAN_RETRY_DEADLINE", "2.5")
    with Sandman("http://sandman.test", "t") as c:
        assert (c.retries, c.retry_deadline) == (0, 2.5)
    with Sandman("http://sandman.test", "t", retries=2, retry_deadline=1) as c:
        assert (c.retries, c.retry_deadline) == (2, 1.0)
    monkeypatch.setenv("SANDMAN_RETRIES", "many")
    with pytest.raises(sandman.InvalidArgument, match="SANDMAN_RETRIES"):
        Sandman("http://sandman.test", "t")
    with pytest.raises(sandman.InvalidArgument, match="retries=101"):
        AsyncSandman("http://sandman.test", "t", retries=101)
    with pytest.raises(sandman.InvalidArgument, match="retry_deadline"):
        Sandman("http://sandman.test", "t", retries=1, retry_deadline=float("nan"))


def test_the_token_and_agent_are_sent_and_ids_are_escaped() -> None:
    seen: List[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"status": "ok", "version": "x", "provider": "p"})

    with Sandman("http://sandman.test/", "s3cret", transport=httpx.MockTransport(handler)) as c:
        c.health()
        c.sandbox("a/b c").daemon_info()
    assert seen[0].headers["authorization"] == "Bearer s3cret"
    assert seen[0].headers["user-agent"].startswith("sandman-sdk-python/")
    assert seen[1].url.raw_path == b"/v1/sandboxes/a%2Fb%20c/info"


def test_pool_and_admission_settings_are_sent_as_given() -> None:
    bodies: List[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        bodies.append(body)
        if request.url.path.startswith("/v1/jobs/"):
            return httpx.Response(200, json={"name": "j", "spec": body, "live": 0, "created": 0})
        return httpx.Response(200, json={"id": "sb-1", "state": "ready", "lease_s": 9})

    with Sandman("http://sandman.test", "t", transport=httpx.MockTransport(handler)) as c:
        c.create(
            "img", pool="warm", job="j", resources={"cpu": "500m"}, profile="eval", network="none", ttl=60,
            idle_timeout=30, lease=9, env={"A": "1"}, labels={"l": "v"}, provider="docker",
            idempotency_key="k", wait=False, wait_timeout=5,
        )
        job = c.job("j", max_sandboxes=3, lease=9, create_rate=2.5, weight=0.5, heartbeat=False)
    assert bodies[0] == {
        "image": "img", "pool": "warm", "job": "j", "resources": {"cpu": "500m"}, "profile": "eval",
        "network": "none", "ttl_s": 60, "idle_timeout_s": 30, "lease_s": 9, "env": {"A": "1"},
        "labels": {"l": "v"}, "provider": "docker", "idempotency_key": "k", "wait": False, "wait_timeout_s": 5,
    }
    assert bodies[1] == {"max_sandboxes": 3, "lease_s": 9, "create_rate": 2.5, "weight": 0.5}
    assert job.info.spec["create_rate"] == 2.5


def test_a_failed_release_never_hides_the_blocks_own_exception() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.method == "DELETE":
            return httpx.Response(500, json={"error": {"code": "internal", "message": "release broke"}})
        return httpx.Response(200, json={"id": "sb-1", "state": "ready", "lease_s": 9})

    with Sandman("http://sandman.test", "t", transport=httpx.MockTransport(handler)) as c:
        with pytest.raises(KeyError):
            with c.create():
                raise KeyError("the block's")
        with pytest.raises(sandman.Internal, match="release broke"):
            with c.create():
                pass


def test_a_stream_line_that_is_not_json_is_an_error() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=b'{"event":"started","pid":1}\nnot json\n')

    with Sandman("http://sandman.test", "t", transport=httpx.MockTransport(handler)) as c:
        stream = c.sandbox("sb-1").exec_stream("true")
        assert next(stream).type == "started"
        with pytest.raises(sandman.Internal, match="not JSON"):
            next(stream)
        with pytest.raises(StopIteration):
            next(stream)


def test_a_stream_cut_before_exit_is_unavailable() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=b'{"event":"started","pid":1}\n{"event":"stdout","data":"x"}\n')

    with Sandman("http://sandman.test", "t", transport=httpx.MockTransport(handler)) as c:
        with pytest.raises(sandman.Unavailable) as e:
            list(c.sandbox("sb-1").exec_stream("true"))
    assert e.value.reason == "stream_ended"
