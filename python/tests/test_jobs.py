"""Jobs: quotas, the background heartbeat, and reclaiming after it stops; both clients."""

from __future__ import annotations

import asyncio
import gc
import time
from typing import Any, List

import pytest
from conftest import unique

import sandman
from sandman import Sandman


async def _states(api: Any, job: str) -> List[tuple]:
    return sorted((s.id, s.state, s.reason) for s in await api.list(job=job))


async def test_quota_usage_and_delete(api: Any) -> None:
    name = unique("quota")
    job = await api.job(name, max_sandboxes=2, lease=30, heartbeat=False)
    assert (job.info.name, job.info.max_sandboxes, job.info.lease_s) == (name, 2, 30)
    assert not job.heartbeat_running
    a = await job.create()
    b = await job.create("host")
    assert a.info.job == name and a.info.lease_s == 30  # the job's lease is the default
    with pytest.raises(sandman.QuotaExceeded) as e:
        await job.create()
    assert e.value.code == "quota_exceeded" and e.value.status == 429 and name in str(e.value)
    info = await job.refresh()
    assert (info.live, info.created) == (2, 2) and info.last_heartbeat_ms is None
    beat = await job.heartbeat()
    assert (beat.job, beat.sandboxes) == (name, 2)
    assert (await api.get_job(name)).last_heartbeat_ms
    assert sorted(s.id for s in await job.sandboxes()) == sorted([a.id, b.id])
    done = await job.delete()
    assert done.sandboxes == 2
    for sb in (a, b):
        with pytest.raises(sandman.Gone) as g:
            await sb.exec("true")
        assert g.value.reason == "job_deleted"
    # The quota is forgotten (the server may still answer the name while ended sandboxes name it).
    try:
        assert (await api.get_job(name)).max_sandboxes is None
    except sandman.NotFound:
        pass


async def test_admission_settings_are_applied_or_refused_never_dropped(api: Any) -> None:
    # This server has no admission control yet and refuses them; one that has it keeps them.
    for field, value in (("create_rate", 5.0), ("weight", 2.0)):
        name = unique(field)
        try:
            job = await api.job(name, heartbeat=False, **{field: value})
        except sandman.InvalidArgument as e:
            assert field in str(e) or "admission" in str(e)
        else:
            assert job.info.spec.get(field) == value
            await job.delete()


async def test_heartbeat_keeps_sandboxes_alive_past_their_lease_until_closed(api: Any) -> None:
    name = unique("beat")
    job = await api.job(name, lease=1, heartbeat_interval=0.2)
    try:
        assert job.heartbeat_running
        sbs = [await job.create() for _ in range(3)]
        assert all(sb.info.lease_s == 1 for sb in sbs)
        await asyncio.sleep(3.5)  # more than three leases with no call on the sandboxes
        assert [s[1] for s in await _states(api, name)] == ["ready"] * 3
        assert job.heartbeats >= 5 and job.heartbeat_error is None
        assert (await api.get_job(name)).last_heartbeat_ms
    finally:
        await job.close()
    assert not job.heartbeat_running
    beats = job.heartbeats
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if all(s[1] == "gone" for s in await _states(api, name)):
            break
        await asyncio.sleep(0.1)
    assert [s[1:] for s in await _states(api, name)] == [("gone", "lease_expired")] * 3
    assert job.heartbeats == beats  # it really stopped
    with pytest.raises(sandman.Gone) as e:
        await sbs[0].exec("true")
    assert e.value.reason == "lease_expired"
    await job.delete()


async def test_job_as_context_manager_stops_its_heartbeat_and_releases_its_sandboxes(api: Any) -> None:
    name = unique("ctx")
    async with await api.job(name, lease=30) as job:
        sb = await job.create()
        assert job.heartbeat_running
    assert not job.heartbeat_running
    assert (await api.get(sb.id)).reason == "job_deleted"


async def test_job_left_open_keeps_its_sandboxes_when_asked(api: Any) -> None:
    name = unique("keep")
    async with await api.job(name, lease=30, release_on_exit=False) as job:
        sb = await job.create()
    assert (await api.get(sb.id)).state == "ready"
    assert (await api.delete_job(name)).sandboxes == 1


def test_a_forgotten_sync_job_stops_its_heartbeat_thread(client: Sandman) -> None:
    job = client.job(unique("gc"), lease=30, heartbeat_interval=0.05)
    ticker = job._ticker
    assert ticker is not None and ticker.running
    name = job.name
    del job
    gc.collect()
    deadline = time.monotonic() + 5
    while ticker.running and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not ticker.running
    client.delete_job(name)
