"""Every sandbox call against a real server, with both clients (the `api` fixture)."""

from __future__ import annotations

import asyncio
import os
import stat
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import unique

import sandman
from sandman import ExecEvent


async def test_health(api: Any) -> None:
    h = await api.health()
    assert h.status == "ok" and h.provider == "process" and h.version
    # The tests run as root, as CI does: every sandbox is isolated.
    assert h.isolation == "user_namespace"


async def test_create_answers_a_ready_sandbox_with_what_was_asked(api: Any) -> None:
    label = unique("create")
    async with await api.create(
        "host", labels={"test": label}, env={"GREETING": "hi"}, lease=30, ttl=120, idle_timeout=60
    ) as sb:
        info = sb.info
        assert info.id == sb.id and info.state == "ready" and info.live
        assert info.image == "host" and info.provider == "process" and info.isolation == "user_namespace"
        assert info.labels == {"test": label} and info.lease_s == 30
        assert info.lease_expires_at_ms and info.ttl_expires_at_ms and info.idle_expires_at_ms
        assert (await sb.exec("echo $GREETING")).stdout == "hi\n"
        again = await api.get(sb.id)
        assert again.id == sb.id and again.state == "ready"
        assert [s.id for s in await api.list(label=f"test={label}")] == [sb.id]
        assert sb.id in [s.id for s in await api.list(state="ready")]
    gone = await api.get(sb.id)
    assert (gone.state, gone.reason) == ("gone", "released")


async def test_release_is_final_and_idempotent(api: Any) -> None:
    sb = await api.create(lease=30)
    final = await sb.release()
    assert final is not None and (final.state, final.reason) == ("gone", "released")
    assert await sb.release() is None  # already ended: a no-op
    assert await api.release(sb.id) is None
    with pytest.raises(sandman.Gone) as e:
        await sb.exec("true")
    assert e.value.reason == "released" and e.value.code == "gone" and e.value.status == 410


async def test_context_manager_releases_on_exception(api: Any) -> None:
    with pytest.raises(RuntimeError, match="boom"):
        async with await api.create(lease=30) as sb:
            assert (await sb.exec("true")).ok
            raise RuntimeError("boom")
    info = await api.get(sb.id)
    assert (info.state, info.reason) == ("gone", "released")


async def test_keepalive_refresh_handle_and_daemon_info(api: Any) -> None:
    async with await api.create(lease=30) as sb:
        before = sb.info.lease_expires_at_ms
        await asyncio.sleep(0.05)
        after = await sb.keepalive()
        assert after.lease_expires_at_ms > before and sb.info is after
        assert (await api.keepalive(sb.id)).id == sb.id
        handle = api.sandbox(sb.id)  # no call
        assert handle.id == sb.id and handle.info is None
        assert (await handle.refresh()).state == "ready"
        assert (await handle.exec(["echo", "via handle"])).stdout == "via handle\n"
        d = await sb.daemon_info()
        assert d.version and d.lease_ms and d.lease_remaining_ms is not None


async def test_exec_shell_strings_argv_env_cwd_stdin_and_failures(api: Any) -> None:
    async with await api.create(lease=30) as sb:
        r = await sb.exec("echo out; echo err >&2; exit 3")
        assert (r.stdout, r.stderr, r.exit_code, r.ok) == ("out\n", "err\n", 3, False)
        assert r.signal is None and not r.timed_out and r.usage.max_rss_kib > 0
        r = await sb.exec(["printf", "%s|", "a b", "$HOME"])
        assert r.stdout == "a b|$HOME|" and r.ok  # argv: no shell
        r = await sb.exec("echo $A-$B; pwd", env={"A": "1", "B": "2"}, cwd="/tmp")
        assert r.stdout == "1-2\n/tmp\n"
        assert (await sb.exec("tr a-z A-Z", stdin="shout")).stdout == "SHOUT"
        assert (await sb.exec(["cat"], stdin=b"bytes")).stdout == "bytes"
        r = await sb.exec("kill -9 $$")
        assert r.exit_code is None and r.signal == 9 and not r.ok


async def test_exec_timeout_kills_the_tree_and_keeps_partial_output(api: Any) -> None:
    async with await api.create(lease=30) as sb:
        t = time.monotonic()
        r = await sb.exec("echo before; sleep 30 & sleep 30; echo never", timeout=0.5)
        assert time.monotonic() - t < 10
        assert r.timed_out and not r.ok and r.stdout == "before\n"
        assert (await sb.exec("pgrep -x sleep")).exit_code == 1  # the background sleep died too


async def test_exec_output_is_truncated_at_max_output_bytes(api: Any) -> None:
    async with await api.create(lease=30) as sb:
        r = await sb.exec("head -c 5000 /dev/zero | tr '\\0' x", max_output_bytes=100)
        assert r.stdout_truncated and len(r.stdout) == 100 and not r.stderr_truncated


async def test_exec_stream_yields_output_as_it_comes(api: Any) -> None:
    async with await api.create(lease=30) as sb:
        start = time.monotonic()
        events = []
        arrivals = []
        async with sb.exec_stream("echo one; echo err >&2; sleep 1; echo two") as stream:
            async for ev in stream:
                events.append(ev)
                arrivals.append(time.monotonic() - start)
        kinds = [e.type for e in events]
        assert kinds[0] == "started" and events[0].pid and kinds[-1] == "exit"
        out = [e for e in events if e.type == "stdout"]
        assert "".join(e.data for e in out) == "one\ntwo\n"
        assert [e.data for e in events if e.type == "stderr"] == ["err\n"]
        # `one` arrived while the command was still sleeping, not with the end
        first = arrivals[kinds.index("stdout")]
        assert first < arrivals[-1] - 0.5
        assert stream.exit is not None and stream.exit.ok and events[-1].exit == stream.exit


async def test_exec_stream_closed_early_kills_the_command(api: Any) -> None:
    # The daemon notices a closed stream when it next writes to it, so the command keeps writing.
    async with await api.create(lease=30) as sb:
        stream = sb.exec_stream(["sh", "-c", "while :; do echo tick; sleep 0.05; done"])
        async for ev in stream:
            if ev.type == "stdout":
                break
        await stream.aclose()
        for _ in range(100):
            if (await sb.exec(["pgrep", "-f", "echo tick"])).exit_code == 1:
                break
            await asyncio.sleep(0.05)
        else:
            pytest.fail("the streamed command outlived its stream")


async def test_exec_stream_timeout_and_exit_status(api: Any) -> None:
    async with await api.create(lease=30) as sb:
        stream = sb.exec_stream("echo x; sleep 10", timeout=0.3, env={"Z": "1"}, cwd="/tmp")
        events = [e async for e in stream]
        assert isinstance(events[-1], ExecEvent) and events[-1].exit.timed_out
        assert stream.exit.timed_out and not stream.exit.ok


async def test_background_processes(api: Any) -> None:
    async with await api.create(lease=30) as sb:
        p = await sb.start("cat; echo bye >&2", tag="cat", stdin=True)
        assert p.info.state == "running" and p.info.tag == "cat" and p.info.stdin_open
        info = await p.write_stdin("hello\n")
        assert info.stdin_open
        for _ in range(100):
            chunk = await p.output()
            if chunk.data:
                break
            await asyncio.sleep(0.02)
        assert (chunk.data, chunk.offset, chunk.next_offset, chunk.eof) == ("hello\n", 0, 6, False)
        still = await p.wait(timeout=0.1)
        assert still.running
        await p.close_stdin()
        done = await p.wait()
        assert not done.running and done.exit is not None and done.exit.exit_code == 0
        assert (await p.output(stream="stderr")).data == "bye\n"
        tail = await p.output(offset=2, max_bytes=2)
        assert tail.data == "ll" and tail.next_offset == 4
        assert (await sb.process("cat").status()).id == p.id  # by tag
        assert [q.tag for q in await sb.processes()] == ["cat"]
        followed = [e async for e in p.follow()]
        assert [e.type for e in followed] == ["data", "exit"] and followed[0].data == "hello\n"
        assert followed[-1].next_offset == 6 and followed[-1].exit.ok
        with pytest.raises(sandman.Conflict):
            await sb.start("true", tag="cat")  # the tag is taken until the process is killed
        await p.kill()
        with pytest.raises(sandman.NotFound):
            await p.status()
        await p.kill()  # already forgotten: a no-op


async def test_background_process_follow_signal_and_timeout(api: Any) -> None:
    async with await api.create(lease=30) as sb:
        p = await sb.start(["sh", "-c", "trap 'echo term; exit 7' TERM; echo up; while :; do sleep 0.05; done"])
        stream = p.follow()
        first = await stream.__anext__()
        assert first.type == "data" and first.data == "up\n"
        await p.signal("TERM")
        rest = [e async for e in stream]
        assert rest[-1].type == "exit" and rest[-1].exit.exit_code == 7 and stream.exit is not None
        assert "term\n" in "".join(e.data for e in rest)
        q = await sb.start("sleep 30", timeout=0.3, env={"X": "1"}, cwd="/tmp", retain_bytes=1024)
        ended = await q.wait(timeout=10)
        assert ended.exit is not None and ended.exit.timed_out


async def test_a_followed_output_says_where_its_bytes_end_and_resumes_there(api: Any) -> None:
    # Before, a client resuming a follow computed where it was from the text: an invalid byte
    # arrives as U+FFFD (three bytes of text for one of output), and half a character is held
    # back for the next event. `next_offset` is where the event's bytes end.
    async with await api.create(lease=30) as sb:
        script = "printf 'x\\377y\\342\\202'; read l; printf '\\254z'"
        p = await sb.start(script, stdin=True)
        stream = p.follow()
        text = ""
        while "y" not in text:
            ev = await stream.__anext__()
            assert ev.type == "data"
            text += ev.data
        await stream.aclose()
        assert text == "x\ufffdy" and len(text.encode()) == 5
        assert ev.next_offset == 3 and stream.offset == 3
        await p.write_stdin("go\n")
        rest = [e async for e in p.follow(offset=stream.offset)]
        data = [e for e in rest if e.type == "data"]
        assert data[0].offset == 3 and "".join(e.data for e in data) == "\u20acz"
        assert data[-1].next_offset == 7 and rest[-1].type == "exit" and rest[-1].next_offset == 7


async def test_sessions_keep_shell_state(api: Any) -> None:
    async with await api.create(lease=30) as sb:
        async with await sb.session(env={"S": "session"}, cwd="/tmp") as sh:
            assert sh.info.alive and sh.info.shell
            assert (await sh.run("cd /var && export X=42 && f() { echo fn; }")).ok
            r = await sh.run("pwd; echo $X $S; f; echo e >&2; false")
            assert (r.stdout, r.stderr, r.exit_code) == ("/var\n42 session\nfn\n", "e\n", 1)
            r = await sh.run("sleep 10", timeout=0.3)
            assert r.timed_out
            await sh.interrupt()  # nothing running: harmless
            assert [s.id for s in await sb.sessions()] == [sh.id]
        assert await sb.sessions() == [] or not (await sb.sessions())[0].alive
        with pytest.raises(sandman.NotFound):
            await sh.run("true")
        await sh.close()  # already closed: a no-op


async def test_files(api: Any) -> None:
    async with await api.create(lease=30) as sb:
        st = await sb.write_file("/tmp/w/a/b.txt", "héllo\n", mode=0o600)
        assert st.kind == "file" and st.size == len("héllo\n".encode()) and st.mode == 0o600
        assert await sb.read_file("/tmp/w/a/b.txt") == "héllo\n".encode()
        assert await sb.read_text("/tmp/w/a/b.txt") == "héllo\n"
        assert await sb.read_file("/tmp/w/a/b.txt", offset=1, length=2) == "é".encode()
        await sb.write_file("/tmp/w/bin.dat", bytes(range(256)))
        assert await sb.read_file("/tmp/w/bin.dat") == bytes(range(256))
        assert (await sb.stat("/tmp/w/a")).kind == "dir"
        listing = await sb.list_dir("/tmp/w", depth=3)
        assert [e.path for e in listing.entries] == ["/tmp/w/a", "/tmp/w/a/b.txt", "/tmp/w/bin.dat"]
        assert not listing.truncated
        assert [e.path for e in (await sb.list_dir("/tmp/w")).entries] == ["/tmp/w/a", "/tmp/w/bin.dat"]
        assert (await sb.mkdir("/tmp/w/x/y", mode=0o700)).mode == 0o700
        moved = await sb.move("/tmp/w/bin.dat", "/tmp/w/x/y/bin.dat")
        assert moved.path == "/tmp/w/x/y/bin.dat"
        await sb.write_file("/tmp/w/other", "o")
        with pytest.raises(sandman.Conflict):
            await sb.move("/tmp/w/other", "/tmp/w/a/b.txt")
        await sb.move("/tmp/w/other", "/tmp/w/a/b.txt", overwrite=True)
        assert await sb.read_text("/tmp/w/a/b.txt") == "o"
        with pytest.raises(sandman.Conflict):
            await sb.remove("/tmp/w/x")
        await sb.remove("/tmp/w/x", recursive=True)
        await sb.remove("/tmp/w/a/b.txt")
        with pytest.raises(sandman.NotFound):
            await sb.stat("/tmp/w/x")
        with pytest.raises(sandman.NotFound):
            await sb.read_file("/tmp/w/a/b.txt")
        with pytest.raises(sandman.InvalidArgument, match="not absolute"):
            await sb.write_file("relative.txt", "x")
        # Durable on request: the daemon takes `fsync` (an unknown parameter would be refused).
        st = await sb.write_file("/tmp/w/durable.txt", "kept", fsync=True)
        assert st.size == 4 and await sb.read_text("/tmp/w/durable.txt") == "kept"


def _tree(root: Path) -> None:
    (root / "pkg" / "sub").mkdir(parents=True)
    (root / "pkg" / "__init__.py").write_text("")
    (root / "pkg" / "sub" / "data.bin").write_bytes(os.urandom(2048))
    run = root / "run.sh"
    run.write_text("#!/bin/sh\necho ran\n")
    run.chmod(0o755)
    (root / "link").symlink_to("run.sh")


def _snapshot(root: Path) -> dict:
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if p.is_symlink():
            out[rel] = ("link", os.readlink(p))
        elif p.is_dir():
            out[rel] = ("dir",)
        else:
            out[rel] = ("file", p.read_bytes(), stat.S_IMODE(p.stat().st_mode) & 0o111)
    return out


async def test_upload_and_download_directories(api: Any, tmp_path: Path) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    _tree(src)
    async with await api.create(lease=30) as sb:
        res = await sb.upload(src, "/tmp/project")
        assert res.path == "/tmp/project" and res.entries >= 5 and res.bytes >= 2048
        assert (await sb.exec("./run.sh && ./link", cwd="/tmp/project")).stdout == "ran\nran\n"
        assert (await sb.stat("/tmp/project/link")).kind == "symlink"
        await sb.exec("echo made > /tmp/project/pkg/new.txt")
        got = await sb.download("/tmp/project", dst)
        assert got == dst
        expected = _snapshot(src)
        expected["pkg/new.txt"] = ("file", b"made\n", 0)
        assert _snapshot(dst) == expected
        # one file
        await sb.upload(src / "run.sh", "/tmp/single")
        assert (await sb.exec("ls /tmp/single")).stdout == "run.sh\n"
        # raw tars
        tar = await sb.download_tar("/tmp/project/pkg")
        res = await sb.upload_tar(tar, "/tmp/copy")
        assert res.entries >= 3
        res = await sb.upload_tar(tar, "/tmp/copy-durable", fsync=True)
        assert res.entries >= 3
        assert await sb.read_file("/tmp/copy/sub/data.bin") == (src / "pkg" / "sub" / "data.bin").read_bytes()


async def test_events_list_and_follow(api: Any) -> None:
    job = unique("events")
    before = await api.events()
    after = before[-1].seq if before else None
    async with await api.create(job=job, lease=30) as sb:
        pass
    evs = await api.events(job=job)
    assert [(e.sandbox, e.state, e.reason) for e in evs] == [
        (sb.id, "creating", None),
        (sb.id, "ready", None),
        (sb.id, "releasing", "released"),
        (sb.id, "gone", "released"),
    ]
    assert all(e.job == job for e in evs)
    assert [e.seq for e in await api.events(job=job, after=evs[1].seq)] == [evs[2].seq, evs[3].seq]
    got = []
    async with api.follow_events(job=job, after=after) as stream:
        async for e in stream:
            got.append(e)
            if e.state == "gone":
                break
    assert [e.seq for e in got] == [e.seq for e in evs]


async def test_exec_results_carry_duration_and_usage(api: Any) -> None:
    async with await api.create(lease=30) as sb:
        r = await sb.exec("i=0; while [ $i -lt 100000 ]; do i=$((i+1)); done")
        assert r.ok and r.duration_ms > 0
        assert r.usage.cpu_user_ms + r.usage.cpu_system_ms > 0 and r.usage.max_rss_kib > 0
        stream = sb.exec_stream("i=0; while [ $i -lt 100000 ]; do i=$((i+1)); done")
        async for _ in stream:
            pass
        assert stream.exit.duration_ms > 0 and stream.exit.usage.cpu_user_ms + stream.exit.usage.cpu_system_ms > 0
