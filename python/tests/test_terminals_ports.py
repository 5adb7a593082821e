"""What agent harnesses need from a sandbox, against a real server with both clients: merged
output, session timeouts that keep the shell, terminals, a default user, and ports."""

from __future__ import annotations

import base64
import io
import json
import socket
import tarfile
from typing import Any, Dict
from urllib.parse import urlsplit

import pytest
from conftest import REPO

import sandman

# Uploaded into each sandbox before it runs: the checkout may lie where a sandbox cannot see.
WEB_APP_SOURCE = (REPO / "crates" / "sandmand" / "tests" / "fixtures" / "web.py").read_text()
WEB_APP = "/tmp/web.py"
SCRIPT = "for i in 1 2 3; do echo out$i; echo err$i >&2; done"
MERGED = "out1\nerr1\nout2\nerr2\nout3\nerr3\n"


async def test_merged_output_keeps_the_order_on_one_stream(api: Any) -> None:
    async with await api.create("host", lease=60) as sb:
        r = await sb.exec(SCRIPT, merge_output=True)
        assert (r.stdout, r.stderr) == (MERGED, "")
        chunks = []
        async for ev in sb.exec_stream(SCRIPT, merge_output=True):
            assert ev.type != "stderr"
            if ev.type == "stdout":
                chunks.append(ev.data)
        assert "".join(chunks) == MERGED
        p = await sb.start(SCRIPT, merge_output=True)
        await p.wait(timeout=20)
        assert (await p.output()).data == MERGED
        async with await sb.session() as sh:
            r = await sh.run(SCRIPT, merge_output=True)
            assert (r.stdout, r.stderr) == (MERGED, "")


async def test_a_session_timeout_interrupts_and_keeps_the_shell(api: Any) -> None:
    async with await api.create("host", lease=60) as sb:
        async with await sb.session() as sh:
            await sh.run("cd /tmp && export KEPT=yes")
            r = await sh.run("sh -c 'trap \"\" INT; echo started; exec sleep 60'", timeout=0.5)
            assert (r.timed_out, r.stdout, r.exit_code) == (True, "started\n", 137)
            r = await sh.run('echo "$PWD $KEPT"')
            assert (r.stdout, r.exit_code, r.timed_out) == ("/tmp yes\n", 0, False)


async def test_a_terminal_runs_a_repl_and_follows_resizes(api: Any, monkeypatch: Any) -> None:
    # Short follows: `read_until` on a silent terminal reconnects several times within its timeout.
    monkeypatch.setattr(sandman._core, "READ_UNTIL_STEP", 0.2)
    async with await api.create("host", lease=60) as sb:
        py = await sb.pty(["python3", "-i", "-q"], rows=24, cols=80, tag="repl")
        assert py.info.pty == sandman.TerminalSize(24, 80)
        await py.read_until(">>> ")
        await py.write("print(6 * 7)\r")
        assert "42\r\n" in await py.read_until(">>> ")
        await py.resize(40, 100)
        await py.write("import shutil; shutil.get_terminal_size()\r")
        await py.read_until("os.terminal_size(columns=100, lines=40)")
        # Reattached by tag from another handle, reading on where this one stopped.
        again = sb.pty_of("repl", offset=py.offset)
        await again.write(b"raise SystemExit(5)\r")
        assert (await again.wait(timeout=20)).exit.exit_code == 5
        with pytest.raises(sandman.Conflict):
            await again.read_until("never printed", timeout=10)

        shell = await sb.pty(["sh"], rows=10, cols=40)
        await shell.write("stty size\r")
        await shell.read_until("10 40")
        await shell.write("echo wh''ich-one-7\r")
        index, text = await shell.expect([r"never", r"which-one-\d"])
        assert index == 1 and text.endswith("which-one-7"), (index, text)
        await shell.write("exit 3\r")
        assert (await shell.wait(timeout=20)).exit.exit_code == 3
        less = await sb.pty(["sh", "-c", "seq 1 500 | less"], rows=10, cols=40, env={"LESS": ""})
        await less.read_until("9\r\n")
        await less.write("G")
        await less.read_until("500")
        await less.write("q")
        assert (await less.wait(timeout=20)).exit.exit_code == 0
        silent = await sb.pty(["sh", "-c", "sleep 1; echo late; sleep 30"])
        with pytest.raises(sandman.Timeout):
            await silent.read_until("late", timeout=0.3)
        assert "late" in await silent.read_until("late", timeout=20)
        await silent.kill()


def test_expect_picks_the_earliest_match_as_pexpect_does() -> None:
    import re

    pats = [re.compile(p) for p in (r"b+", r"a", r"ab")]
    assert sandman._core.first_match(pats, "xxabbb") == (1, 3)  # `a` and `ab` start together: lowest index
    assert sandman._core.first_match(pats, "xbxa") == (0, 2)
    assert sandman._core.first_match(pats, "xyz") is None


def test_text_positions_map_to_the_bytes_of_the_events() -> None:
    offsets = sandman._core.TextOffsets(10)
    assert (offsets.end, offsets.at(0)) == (10, 10)
    offsets.add(10, 14, "a\u20ac")  # four bytes: `a` and the euro sign
    offsets.add(14, 16, "\ufffdb")  # an invalid byte, then `b`: two bytes, not four
    assert [offsets.at(i) for i in range(5)] == [10, 11, 14, 15, 16]
    assert offsets.end == 16


async def test_a_terminal_reads_on_exactly_after_bytes_that_are_not_utf8(api: Any) -> None:
    # Before, the offset after `expect` was counted from the text: each invalid byte (one byte,
    # shown as U+FFFD, three bytes of text) moved it two bytes too far, and the next read
    # lost the start of what followed.
    async with await api.create("host", lease=60) as sb:
        pty = await sb.pty(["sh", "-c", "printf 'ab\\377\\377\\377\\377 ready'; read l; echo after"])
        before = await pty.read_until("ready")
        assert before == "ab\ufffd\ufffd\ufffd\ufffd ready", before
        assert pty.offset == 12
        await pty.write("\r")
        assert (await pty.read_until("after")).lstrip("\r\n") == "after"


def _tar(files: Dict[str, bytes]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


async def test_a_creates_user_is_every_commands_default(api: Any) -> None:
    async with await api.create("host", lease=60, user="65534") as sb:
        assert (sb.info.user, sb.info.image_config) == ("65534", None)
        # The process provider's default cwd is the sandbox's directory, which only root may enter.
        assert (await sb.exec(["id", "-u"], cwd="/")).stdout == "65534\n"
        assert (await sb.exec(["id", "-u"], user="0")).stdout == "0\n"
        async with await sb.session(cwd="/") as sh:
            assert (await sh.run("id -u")).stdout == "65534\n"
        assert (await api.get(sb.id)).user == "65534"
        # What file and archive calls create is the default user's too: it may change it.
        written = await sb.write_file("/tmp/mine/f.txt", "x")
        assert (written.uid, written.gid) == (65534, 65534)
        assert (await sb.mkdir("/tmp/mine/d")).uid == 65534
        await sb.upload_tar(_tar({"t/u.txt": b"u"}), "/tmp/mine/tar")
        owners = await sb.exec("stat -c %u /tmp/mine /tmp/mine/tar/t/u.txt && echo y >> /tmp/mine/f.txt", cwd="/")
        assert (owners.stdout, owners.exit_code) == ("65534\n65534\n", 0), owners
        # A call's own user wins: root's file, which the default user may not change.
        assert (await sb.write_file("/tmp/mine/root.txt", "r", user="0")).uid == 0
        assert (await sb.exec("echo z >> /tmp/mine/root.txt", cwd="/")).exit_code != 0


async def _web_app(sb: Any) -> int:
    await sb.write_file(WEB_APP, WEB_APP_SOURCE)
    app = await sb.start(["python3", WEB_APP], tag="web")
    out = ""
    for _ in range(200):
        out = (await app.output()).data
        if "\n" in out:
            return int(out.strip())
        await app.wait(timeout=0.1)
    raise AssertionError(f"the web app printed no port: {out!r}")


def test_ports_through_the_server_with_the_sync_client(client: sandman.Sandman) -> None:
    with client.create("host", lease=60) as sb:
        sb.write_file("/tmp/site/hello.txt", "hello over http\n")
        port = int(
            sb.start("exec python3 -u -m http.server 0 --bind 127.0.0.1 --directory /tmp/site", tag="site")
            .follow()
            .__next__()
            .data.split(" port ")[1]
            .split()[0]
        )
        assert sb.port_url(port, "hello.txt") == f"{client.url}/v1/sandboxes/{sb.id}/ports/{port}/hello.txt"
        with sb.port_client(port) as http:
            r = http.get("/hello.txt")
            assert (r.status_code, r.text) == (200, "hello over http\n")
        with pytest.raises(ValueError):
            sb.port_url(70000)

        sb.write_file(WEB_APP, WEB_APP_SOURCE)
        ws_port = int(sb.start(["python3", WEB_APP]).follow().__next__().data)
        _websocket_echo(sb, ws_port)


async def test_ports_through_the_server_with_the_async_client(aclient: sandman.AsyncSandman) -> None:
    async with await aclient.create("host", lease=60) as sb:
        port = await _web_app(sb)
        async with sb.port_client(port) as http:
            r = await http.post("/echo?x=1", content=b"payload")
            seen = r.json()
            assert (r.status_code, seen["path"], seen["body"]) == (200, "/echo?x=1", "payload")
            assert seen["authorization"] is None, "a token reached the app"
            missing = await http.get("/nothing-here")
            assert missing.status_code == 404
        _websocket_echo(sb, port)


def _websocket_echo(sb: Any, port: int) -> None:
    """A WebSocket through the server and the daemon, with the server's token."""
    url = urlsplit(sb.port_url(port, "chat"))
    key = base64.b64encode(b"sixteen byte key").decode()
    with socket.create_connection((url.hostname, url.port), timeout=20) as s:
        head = (
            f"GET {url.path} HTTP/1.1\r\nHost: {url.netloc}\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
            f"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: {key}\r\n"
            + "".join(f"{k}: {v}\r\n" for k, v in sb.port_headers().items())
            + "\r\n"
        )
        s.sendall(head.encode())
        answer = b""
        while b"\r\n\r\n" not in answer:
            answer += s.recv(1)
        assert answer.startswith(b"HTTP/1.1 101"), answer
        for text in ("hello", json.dumps({"n": 1})):
            data = text.encode()
            mask = b"\x01\x02\x03\x04"
            s.sendall(bytes([0x81, 0x80 | len(data)]) + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(data)))
            frame = s.recv(2)
            body = b""
            while len(body) < frame[1] & 0x7F:
                body += s.recv(frame[1] & 0x7F - len(body))
            assert body.decode() == f"echo: {text}"


def test_iterating_a_terminal_yields_what_it_shows_until_it_exits(client: sandman.Sandman) -> None:
    with client.create("host", lease=60) as sb:
        pty = sb.pty(["sh", "-c", "echo first; echo second"])
        shown = "".join(pty)
        assert shown == "first\r\nsecond\r\n", shown
        assert pty.offset == len(shown)


async def test_iterating_a_terminal_with_the_async_client(aclient: sandman.AsyncSandman) -> None:
    async with await aclient.create("host", lease=60) as sb:
        pty = await sb.pty(["sh", "-c", "printf 'a\\nb\\n'"])
        shown = "".join([text async for text in pty])
        assert shown == "a\r\nb\r\n", shown
