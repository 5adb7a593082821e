"""Pause and resume against a real server (the process provider, isolated), with both clients."""

from __future__ import annotations

from typing import Any

import pytest

import sandman

COUNTER = "i=0; while :; do i=$((i+1)); [ $((i % 20000)) -eq 0 ] && echo $i; done"


async def counts(proc: Any) -> list:
    chunk = await proc.output()
    return [int(line) for line in chunk.data.splitlines() if line.strip().isdigit()]


async def until(check: Any, tries: int = 300) -> None:
    import asyncio

    for _ in range(tries):
        if await check():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the condition never held")


async def test_pause_freezes_and_resume_continues(api: Any) -> None:
    async with await api.create(lease=30) as sb:
        await sb.exec("echo kept > /tmp/kept")
        proc = await sb.start(COUNTER, tag="counter")

        async def printed() -> bool:
            return len(await counts(proc)) > 0

        await until(printed)
        info = await sb.pause()
        assert info.state == "paused" and info.paused_at_ms and info.lease_expires_at_ms is None
        assert sb.info is info and (await api.get(sb.id)).state == "paused"
        assert sb.id in [s.id for s in await api.list(state="paused")]
        # A call on a paused sandbox created without auto_resume fails with `paused`.
        with pytest.raises(sandman.Paused) as e:
            await sb.exec("true")
        assert e.value.code == "paused" and e.value.status == 409
        assert isinstance(e.value, sandman.Conflict)
        assert (await sb.pause()).state == "paused"  # pausing again is fine
        info = await sb.resume()
        assert info.state == "ready" and info.paused_at_ms is None and info.lease_expires_at_ms
        before = len(await counts(proc))

        async def continued() -> bool:
            return len(await counts(proc)) > before + 2

        await until(continued)
        seen = await counts(proc)
        assert seen == [20000 * (k + 1) for k in range(len(seen))], "the counter restarted"
        assert (await sb.exec("cat /tmp/kept")).stdout == "kept\n"
        assert (await proc.status()).state == "running"


async def test_a_call_resumes_a_sandbox_created_with_auto_resume(api: Any) -> None:
    async with await api.create(lease=30, auto_resume=True) as sb:
        assert sb.info.auto_resume
        await api.pause(sb.id)
        assert (await api.get(sb.id)).state == "paused"
        assert (await sb.exec("echo awake")).stdout == "awake\n"
        assert (await api.get(sb.id)).state == "ready"
