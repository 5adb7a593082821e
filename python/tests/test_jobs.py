"""Jobs: quotas, the background heartbeat, and reclaiming after it stops; both clients."""

from __future__ import annotations

import asyncio
import gc
import json
import time
from typing import Any, List

import httpx
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


async def test_admission_settings_are_kept_and_bad_ones_refused(api: Any) -> None:
    name = unique("admit")
    job = await api.job(name, heartbeat=False, create_rate=5.0, weight=2.0, max_sandboxes=4)
    assert (job.info.create_rate, job.info.weight, job.info.max_sandboxes) == (5.0, 2.0, 4)
    assert (await api.get_job(name)).spec == {"create_rate": 5.0, "weight": 2.0, "max_sandboxes": 4}
    await job.delete()
    for field in ("create_rate", "weight"):
        with pytest.raises(sandman.InvalidArgument, match=field):
            await api.job(unique(field), heartbeat=False, **{field: 0.0})


async def test_job_usage_sums_its_ended_sandboxes(api: Any) -> None:
    name = unique("usage")
    job = await api.job(name, lease=30, heartbeat=False)
    a = await job.create()
    b = await job.create()
    r = await a.exec("i=0; while [ $i -lt 100000 ]; do i=$((i+1)); done")
    assert r.ok and r.usage.cpu_user_ms + r.usage.cpu_system_ms > 0
    await a.release()
    usage = await job.usage()
    assert (usage.job, usage.sandboxes, usage.live, usage.by_reason) == (name, 1, 1, {"released": 1})
    assert usage.sandbox_seconds > 0 and usage.with_usage == 1 and usage.cpu_seconds > 0
    assert usage.peak_memory_kib and usage.peak_memory_kib > 0
    await job.delete()
    after = await api.job_usage(name)
    assert (after.sandboxes, after.live, after.by_reason) == (2, 0, {"released": 1, "job_deleted": 1})
    assert (await api.get(b.id)).reason == "job_deleted"
    with pytest.raises(sandman.NotFound):
        await api.job_usage(unique("nobody"))


async def test_a_full_admission_queue_is_quota_exceeded_with_retry_after_and_not_resent(mock_api: Any) -> None:
    sent: List[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(f"{request.method} {request.url.path}")
        error = {"code": "quota_exceeded", "message": "the admission queue is full: 10 creates are waiting, its "
                 "bound (`--max-queue`); retry in 7 s"}
        return httpx.Response(429, headers={"Retry-After": "7"}, json={"error": error})

    async with mock_api(handler) as c:
        with pytest.raises(sandman.QuotaExceeded) as e:
            await c.create("host", job="j", wait=False)
    assert sent == ["POST /v1/sandboxes"]
    assert (e.value.code, e.value.status, e.value.retry_after) == ("quota_exceeded", 429, 7.0)
    assert "--max-queue" in e.value.message


async def test_job_calls_send_their_quota_and_parse_the_usage(mock_api: Any) -> None:
    seen: List[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.url.path.endswith("/usage"):
            return httpx.Response(200, json={
                "job": "j", "sandboxes": 5, "live": 2, "by_reason": {"released": 4, "oom_killed": 1},
                "sandbox_seconds": 12.5, "cpu_seconds": 3.25, "with_usage": 4, "peak_memory_kib": 2048,
            })
        spec = json.loads(request.content) if request.content else {}
        return httpx.Response(200, json={"name": "j", "spec": spec, "live": 0, "created": 0})

    async with mock_api(handler) as c:
        job = await c.job("j", max_sandboxes=8, create_rate=2.5, weight=3.0, lease=20, heartbeat=False)
        usage = await job.usage()
        assert usage == await c.job_usage("j")
    assert json.loads(seen[0].content) == {"max_sandboxes": 8, "create_rate": 2.5, "weight": 3.0, "lease_s": 20}
    assert [(r.method, r.url.path) for r in seen[1:]] == [("GET", "/v1/jobs/j/usage")] * 2
    assert (job.info.create_rate, job.info.weight, job.info.lease_s) == (2.5, 3.0, 20)
    assert (usage.sandboxes, usage.live, usage.by_reason) == (5, 2, {"released": 4, "oom_killed": 1})
    assert (usage.sandbox_seconds, usage.cpu_seconds, usage.with_usage, usage.peak_memory_kib) == (12.5, 3.25, 4, 2048)


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
