"""The real `e2b` SDK, sync, against `sandman serve`: what the issue lists, on every provider."""

from __future__ import annotations

import threading
import uuid

import pytest
from e2b import (
    CommandExitException,
    FileNotFoundException,
    NotFoundException,
    Sandbox,
    SandboxException,
    SandboxQuery,
    SandboxState,
    TimeoutException,
)

from conftest import E2bServer


def tag() -> str:
    return uuid.uuid4().hex[:8]


@pytest.fixture
def sbx(e2b_env: E2bServer):
    s = Sandbox.create(e2b_env.template, timeout=120, envs={"SB_VAR": "from-create"}, metadata={"suite": "sync"})
    try:
        yield s
    finally:
        s.kill()


def test_create_info_list_and_timeout(e2b_env: E2bServer) -> None:
    mark = tag()
    s = Sandbox.create(e2b_env.template, timeout=60, metadata={"mark": mark, "sandman.job": f"e2b-{mark}"})
    try:
        assert s.is_running()
        info = s.get_info()
        assert info.metadata == {"mark": mark, "sandman.job": f"e2b-{mark}"}
        assert info.sandbox_id == s.sandbox_id and info.template_id == e2b_env.template
        listed = Sandbox.list(query=SandboxQuery(metadata={"mark": mark})).next_items()
        assert [i.sandbox_id for i in listed] == [s.sandbox_id]
        assert Sandbox.list(query=SandboxQuery(metadata={"mark": "no-such-" + mark})).next_items() == []
        before = info.end_at
        s.set_timeout(600)
        after = s.get_info().end_at
        assert (after - before).total_seconds() > 500, (before, after)
        s.set_timeout(30)
        assert (s.get_info().end_at - after).total_seconds() < -500
    finally:
        assert s.kill()


def test_list_pages_by_next_token(e2b_env: E2bServer) -> None:
    mark = tag()
    made = [Sandbox.create(e2b_env.template, timeout=60, metadata={"page": mark}) for _ in range(3)]
    try:
        pager = Sandbox.list(query=SandboxQuery(metadata={"page": mark}), limit=2)
        seen = []
        while pager.has_next:
            page = pager.next_items()
            assert len(page) <= 2
            seen += [i.sandbox_id for i in page]
        assert sorted(seen) == sorted(s.sandbox_id for s in made)
    finally:
        for s in made:
            s.kill()


def test_streamed_output_arrives_while_the_command_runs(sbx: Sandbox) -> None:
    # The command prints, then waits for a file that only the stdout callback writes: were the
    # first chunk held back until the end, the command would never end.
    gate = f"/tmp/gate-{tag()}"
    chunks = []

    def on_stdout(chunk: str) -> None:
        chunks.append(chunk)
        if "first" in chunk:
            sbx.files.write(gate, "go")

    r = sbx.commands.run(
        f"echo first; while [ ! -e {gate} ]; do sleep 0.05; done; echo second $FOO $SB_VAR; pwd",
        envs={"FOO": "bar"},
        cwd="/tmp",
        on_stdout=on_stdout,
        timeout=60,
    )
    assert r.exit_code == 0
    assert r.stdout == "first\nsecond bar from-create\n/tmp\n"
    assert "first" in chunks[0] and len(chunks) >= 2


def test_a_failing_command_raises_with_its_code_and_stderr(sbx: Sandbox) -> None:
    with pytest.raises(CommandExitException) as e:
        sbx.commands.run("echo out; echo oops >&2; exit 3")
    assert e.value.exit_code == 3
    assert e.value.stderr == "oops\n" and e.value.stdout == "out\n"


def test_a_command_past_its_timeout_raises_the_timeout_error(sbx: Sandbox) -> None:
    with pytest.raises(TimeoutException):
        sbx.commands.run("sleep 30", timeout=1)
    # The sandbox goes on.
    assert sbx.commands.run("echo alive").stdout == "alive\n"


def test_background_commands_stdin_list_connect_and_kill(sbx: Sandbox) -> None:
    cat = sbx.commands.run("cat", background=True, stdin=True)
    assert cat.pid in [p.pid for p in sbx.commands.list()]
    sbx.commands.send_stdin(cat.pid, "hello\n")
    again = sbx.commands.connect(cat.pid)
    sbx.commands.close_stdin(cat.pid)
    assert again.wait().exit_code == 0
    assert cat.wait().stdout == "hello\n"

    sleeper = sbx.commands.run("sleep 60", background=True)
    assert sbx.commands.kill(sleeper.pid) is True
    assert sbx.commands.kill(sleeper.pid) is False
    assert sleeper.pid not in [p.pid for p in sbx.commands.list()]
    with pytest.raises(CommandExitException):
        sleeper.wait()


def test_files(sbx: Sandbox) -> None:
    root = f"/tmp/files-{tag()}"
    assert sbx.files.make_dir(root) is True
    assert sbx.files.make_dir(root) is False

    blob = bytes(range(256)) * 4096  # 1 MiB, every byte value
    sbx.files.write(f"{root}/blob.bin", blob)
    assert bytes(sbx.files.read(f"{root}/blob.bin", format="bytes")) == blob
    assert sbx.files.get_info(f"{root}/blob.bin").size == len(blob)
    sbx.files.write(f"{root}/raw.bin", blob, use_octet_stream=True)
    assert bytes(sbx.files.read(f"{root}/raw.bin", format="bytes")) == blob

    sbx.files.write(f"{root}/note.txt", "héllo\n")
    assert sbx.files.read(f"{root}/note.txt") == "héllo\n"
    names = sorted(e.name for e in sbx.files.list(root))
    assert names == ["blob.bin", "note.txt", "raw.bin"]
    assert sbx.files.exists(f"{root}/note.txt") and not sbx.files.exists(f"{root}/none")

    moved = sbx.files.rename(f"{root}/note.txt", f"{root}/moved.txt")
    assert moved.path == f"{root}/moved.txt" and moved.name == "moved.txt"
    assert not sbx.files.exists(f"{root}/note.txt")
    sbx.files.remove(f"{root}/moved.txt")
    assert not sbx.files.exists(f"{root}/moved.txt")

    with pytest.raises(FileNotFoundException):
        sbx.files.read(f"{root}/missing")
    with pytest.raises(FileNotFoundException):
        sbx.files.get_info(f"{root}/missing")


def test_watch_dir_sees_a_new_file(sbx: Sandbox) -> None:
    root = f"/tmp/watch-{tag()}"
    sbx.files.make_dir(root)
    handle = sbx.files.watch_dir(root)
    try:
        sbx.files.write(f"{root}/new.txt", "x")
        events = handle.get_new_events()
        assert [(e.name, e.type.name) for e in events] == [("new.txt", "CREATE")]
        sbx.files.remove(f"{root}/new.txt")
        assert [(e.name, e.type.name) for e in handle.get_new_events()] == [("new.txt", "REMOVE")]
    finally:
        handle.stop()


def test_connect_then_kill(e2b_env: E2bServer) -> None:
    s = Sandbox.create(e2b_env.template, timeout=60)
    other = Sandbox.connect(s.sandbox_id)
    assert other.commands.run("echo via-connect").stdout == "via-connect\n"
    assert s.kill() is True
    assert s.is_running() is False
    assert Sandbox.kill(s.sandbox_id) is False
    with pytest.raises(NotFoundException):
        Sandbox.connect(s.sandbox_id)


def test_what_is_not_supported_fails_at_once(e2b_env: E2bServer) -> None:
    with pytest.raises(SandboxException, match="not supported"):
        Sandbox.create(e2b_env.template, timeout=60, lifecycle={"on_timeout": "pause"})


def test_pause_keeps_processes_and_files_and_connect_resumes(e2b_env: E2bServer) -> None:
    s = Sandbox.create(e2b_env.template, timeout=120)
    try:
        s.files.write("/tmp/kept.txt", "before the pause")
        busy = s.commands.run("i=0; while :; do i=$((i+1)); done", background=True)
        assert s.pause() is True
        # Pausing a paused sandbox answers False, as on E2B; `beta_pause` is the same call.
        assert Sandbox.pause(s.sandbox_id) is False
        assert s.beta_pause() is False
        assert Sandbox.get_info(s.sandbox_id).state.value == "paused"
        paused = Sandbox.list(query=SandboxQuery(state=[SandboxState.PAUSED])).next_items()
        assert s.sandbox_id in [i.sandbox_id for i in paused]
        running = Sandbox.list(query=SandboxQuery(state=[SandboxState.RUNNING])).next_items()
        assert s.sandbox_id not in [i.sandbox_id for i in running]
        # Connecting resumes it: its files and its running process are still there.
        again = Sandbox.connect(s.sandbox_id)
        assert Sandbox.get_info(s.sandbox_id).state.value == "running"
        assert again.files.read("/tmp/kept.txt") == "before the pause"
        assert busy.pid in [p.pid for p in again.commands.list()]
        again.commands.kill(busy.pid)
    finally:
        s.kill()


def test_a_wrong_key_is_refused(e2b_env: E2bServer) -> None:
    from e2b import AuthenticationException

    with pytest.raises(AuthenticationException):
        Sandbox.create(e2b_env.template, api_key="wrong")


def test_parallel_commands_on_one_sandbox(sbx: Sandbox) -> None:
    out = {}

    def run(i: int) -> None:
        out[i] = sbx.commands.run(f"echo {i}").stdout

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert out == {i: f"{i}\n" for i in range(8)}


def test_a_terminal_runs_bash_and_resizes(sbx: Sandbox) -> None:
    from e2b import PtySize

    out = []
    term = sbx.pty.create(PtySize(rows=24, cols=80))
    sbx.pty.resize(term.pid, PtySize(rows=40, cols=100))
    sbx.pty.send_stdin(term.pid, b"stty size; echo $((6*7)); exit\n")
    term.wait(on_pty=out.append)
    text = b"".join(out).decode(errors="replace")
    assert "40 100" in text and "42" in text, text


def test_a_retried_create_with_its_idempotency_key_is_the_same_sandbox(e2b_env: E2bServer) -> None:
    key = f"retry-{tag()}"
    first = Sandbox.create(e2b_env.template, timeout=60, idempotency_key=key)
    try:
        again = Sandbox.create(e2b_env.template, timeout=60, idempotency_key=key)
        assert again.sandbox_id == first.sandbox_id
    finally:
        first.kill()
