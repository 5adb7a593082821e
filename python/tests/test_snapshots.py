"""Snapshots and forks: against the real server with both clients (the `api` fixture), on an image
taken from the local Docker engine (`docker-daemon:`, the test image of scripts/test-images), and
the request a fork sends (a fake server)."""

from __future__ import annotations

import json
from typing import Any, List

import httpx
import pytest
from conftest import unique

import sandman
from sandman import Snapshot

IMAGE = "docker-daemon:sandman-test/busybox:latest"


async def test_a_snapshot_and_a_fork_carry_the_files_and_each_child_writes_its_own(api: Any) -> None:
    job = unique("snapjob")
    src = await api.create(IMAGE, job=job, labels={"role": "source"})
    try:
        await src.write_file("/srv/prepared.txt", b"prepared\n")
        snap = await src.snapshot(name="prepared")
        assert isinstance(snap, Snapshot)
        assert (snap.source, snap.job, snap.name, snap.image) == (src.id, job, "prepared", f"snapshot:{snap.id}")
        assert sandman.snapshot_image(snap.id) == snap.image
        assert [s.id for s in await api.snapshots(job=job)] == [snap.id]
        assert (await api.get_snapshot(snap.id)).id == snap.id

        retry = await api.create(snap.image, job=job)
        assert await retry.read_file("/srv/prepared.txt") == b"prepared\n"

        kids = await src.fork(2, env={"KID": "yes"})
        assert len(kids) == 2
        for kid in kids:
            assert kid.snapshot_of is not None and kid.snapshot_of.source == src.id
            assert kid.info is not None and kid.info.job == job and kid.info.labels.get("role") == "source"
            assert await kid.read_file("/srv/prepared.txt") == b"prepared\n"
            await kid.write_file("/srv/own.txt", kid.id.encode())
        for kid in kids:
            assert await kid.read_file("/srv/own.txt") == kid.id.encode()
        with pytest.raises(sandman.NotFound):
            await src.read_file("/srv/own.txt")

        await api.delete_snapshot(snap.id)
        with pytest.raises(sandman.NotFound):
            await api.get_snapshot(snap.id)
    finally:
        await api.delete_job(job)
    assert await api.snapshots(job=job) == []


async def test_a_fork_sends_its_count_and_only_the_fields_given(mock_api: Any) -> None:
    seen: List[httpx.Request] = []
    snapshot = {"id": "snap-1", "source": "sb-1", "provider": "process", "image": "snapshot:snap-1",
                "base_image": "python:3.12", "created_at_ms": 1}
    sandbox = {"id": "sb-2", "image": "snapshot:snap-1", "provider": "process", "state": "ready",
               "profile": "default", "network": "egress", "resources": {}, "created_at_ms": 1, "lease_s": 60}

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"snapshot": snapshot, "sandboxes": [sandbox]})

    async with mock_api(handler) as api:
        kids = await api.sandbox("sb-1").fork(1, job="other", lease=60)
    assert seen[0].url.path == "/v1/sandboxes/sb-1/fork"
    assert json.loads(seen[0].content) == {"count": 1, "wait": True, "job": "other", "lease_s": 60}
    assert [k.id for k in kids] == ["sb-2"] and kids[0].snapshot_of is not None


async def test_a_snapshot_and_a_fork_send_the_directories_named_and_read_where_it_was_pushed(mock_api: Any) -> None:
    seen: List[httpx.Request] = []
    snapshot = {"id": "snap-1", "source": "sb-1", "provider": "kubernetes", "image": "snapshot:snap-1",
                "base_image": "python:3.12", "created_at_ms": 1, "paths": ["/workspace"],
                "pushed": "registry.internal/snaps:snap-1@sha256:ab"}

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.url.path.endswith("/fork"):
            return httpx.Response(200, json={"snapshot": snapshot, "sandboxes": []})
        return httpx.Response(200, json=snapshot)

    async with mock_api(handler) as api:
        snap = await api.sandbox("sb-1").snapshot(paths=["/workspace"])
        await api.sandbox("sb-1").fork(2, paths=["/workspace", "/root"])
    assert json.loads(seen[0].content) == {"paths": ["/workspace"]}
    assert (snap.paths, snap.pushed) == (["/workspace"], "registry.internal/snaps:snap-1@sha256:ab")
    assert json.loads(seen[1].content) == {"count": 2, "wait": True, "paths": ["/workspace", "/root"]}
