"""The real `e2b` SDK, asyncio, against `sandman serve`: the sync suite's checks through
`AsyncSandbox`, on every provider."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from e2b import (
    AsyncSandbox,
    CommandExitException,
    FileNotFoundException,
    NotFoundException,
    SandboxQuery,
    TimeoutException,
)

from conftest import E2bServer


def tag() -> str:
    return uuid.uuid4().hex[:8]


@pytest.fixture
async def sbx(e2b_env: E2bServer):
    s = await AsyncSandbox.create(
        e2b_env.template, timeout=120, envs={"SB_VAR": "from-create"}, metadata={"suite": "async"}
    )
    try:
        yield s
    finally:
        await s.kill()


async def test_create_info_list_and_timeout(e2b_env: E2bServer) -> None:
    mark = tag()
    s = await AsyncSandbox.create(e2b_env.template, timeout=60, metadata={"mark": mark})
    try:
        assert await s.is_running()
        info = await s.get_info()
        assert info.metadata == {"mark": mark}
        assert info.template_id == e2b_env.template
        listed = await AsyncSandbox.list(query=SandboxQuery(metadata={"mark": mark})).next_items()
        assert [i.sandbox_id for i in listed] == [s.sandbox_id]
        before = info.end_at
        await s.set_timeout(600)
        assert ((await s.get_info()).end_at - before).total_seconds() > 500
    finally:
        assert await s.kill()


async def test_streamed_output_arrives_while_the_command_runs(sbx: AsyncSandbox) -> None:
    gate = f"/tmp/gate-{tag()}"
    chunks = []

    async def on_stdout(chunk: str) -> None:
        chunks.append(chunk)
        if "first" in chunk:
            await sbx.files.write(gate, "go")

    r = await sbx.commands.run(
        f"echo first; while [ ! -e {gate} ]; do sleep 0.05; done; echo second $FOO $SB_VAR; pwd",
        envs={"FOO": "bar"},
        cwd="/tmp",
        on_stdout=on_stdout,
        timeout=60,
    )
    assert r.stdout == "first\nsecond bar from-create\n/tmp\n"
    assert "first" in chunks[0] and len(chunks) >= 2


async def test_a_failing_command_raises_with_its_code_and_stderr(sbx: AsyncSandbox) -> None:
    with pytest.raises(CommandExitException) as e:
        await sbx.commands.run("echo oops >&2; exit 7")
    assert e.value.exit_code == 7 and e.value.stderr == "oops\n"


async def test_a_command_past_its_timeout_raises_the_timeout_error(sbx: AsyncSandbox) -> None:
    with pytest.raises(TimeoutException):
        await sbx.commands.run("sleep 30", timeout=1)
    assert (await sbx.commands.run("echo alive")).stdout == "alive\n"


async def test_background_commands_stdin_list_connect_and_kill(sbx: AsyncSandbox) -> None:
    cat = await sbx.commands.run("cat", background=True, stdin=True)
    assert cat.pid in [p.pid for p in await sbx.commands.list()]
    await sbx.commands.send_stdin(cat.pid, "hello\n")
    again = await sbx.commands.connect(cat.pid)
    await sbx.commands.close_stdin(cat.pid)
    assert (await again.wait()).exit_code == 0
    assert (await cat.wait()).stdout == "hello\n"

    sleeper = await sbx.commands.run("sleep 60", background=True)
    assert await sbx.commands.kill(sleeper.pid) is True
    assert await sbx.commands.kill(sleeper.pid) is False
    with pytest.raises(CommandExitException):
        await sleeper.wait()


async def test_files(sbx: AsyncSandbox) -> None:
    root = f"/tmp/files-{tag()}"
    assert await sbx.files.make_dir(root) is True
    assert await sbx.files.make_dir(root) is False
    blob = bytes(range(256)) * 4096
    await sbx.files.write(f"{root}/blob.bin", blob)
    assert bytes(await sbx.files.read(f"{root}/blob.bin", format="bytes")) == blob
    assert (await sbx.files.get_info(f"{root}/blob.bin")).size == len(blob)
    await sbx.files.write(f"{root}/note.txt", "text\n")
    assert await sbx.files.read(f"{root}/note.txt") == "text\n"
    assert sorted(e.name for e in await sbx.files.list(root)) == ["blob.bin", "note.txt"]
    assert await sbx.files.exists(f"{root}/note.txt")
    await sbx.files.rename(f"{root}/note.txt", f"{root}/moved.txt")
    assert not await sbx.files.exists(f"{root}/note.txt")
    await sbx.files.remove(f"{root}/moved.txt")
    assert not await sbx.files.exists(f"{root}/moved.txt")
    with pytest.raises(FileNotFoundException):
        await sbx.files.read(f"{root}/missing")


async def test_watch_dir_sees_a_new_file(sbx: AsyncSandbox) -> None:
    root = f"/tmp/watch-{tag()}"
    await sbx.files.make_dir(root)
    seen: asyncio.Queue = asyncio.Queue()
    handle = await sbx.files.watch_dir(root, on_event=seen.put_nowait)
    try:
        await sbx.files.write(f"{root}/new.txt", "x")
        event = await asyncio.wait_for(seen.get(), 30)
        assert (event.name, event.type.name) == ("new.txt", "CREATE")
    finally:
        await handle.stop()


async def test_connect_then_kill(e2b_env: E2bServer) -> None:
    s = await AsyncSandbox.create(e2b_env.template, timeout=60)
    other = await AsyncSandbox.connect(s.sandbox_id)
    assert (await other.commands.run("echo via-connect")).stdout == "via-connect\n"
    assert await s.kill() is True
    assert await s.is_running() is False
    assert await AsyncSandbox.kill(s.sandbox_id) is False
    with pytest.raises(NotFoundException):
        await AsyncSandbox.connect(s.sandbox_id)


async def test_pause_keeps_processes_and_files_and_connect_resumes(e2b_env: E2bServer) -> None:
    s = await AsyncSandbox.create(e2b_env.template, timeout=120)
    try:
        await s.files.write("/tmp/kept.txt", "before the pause")
        busy = await s.commands.run("i=0; while :; do i=$((i+1)); done", background=True)
        assert await s.pause() is True
        assert await AsyncSandbox.pause(s.sandbox_id) is False
        assert (await AsyncSandbox.get_info(s.sandbox_id)).state.value == "paused"
        again = await AsyncSandbox.connect(s.sandbox_id)
        assert (await AsyncSandbox.get_info(s.sandbox_id)).state.value == "running"
        assert await again.files.read("/tmp/kept.txt") == "before the pause"
        assert busy.pid in [p.pid for p in await again.commands.list()]
        await again.commands.kill(busy.pid)
    finally:
        await s.kill()
