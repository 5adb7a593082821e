"""Preparing images (`prepare`) and its progress events: against the real server with both clients,
and a multi-node answer and its `pulling` events from a fake server."""

from __future__ import annotations

import json
from typing import Any, List

import httpx
import pytest
from conftest import unique

import sandman


async def test_prepare_reports_each_image_and_its_progress_is_in_the_events(api: Any) -> None:
    job = unique("prep")
    absent = "127.0.0.1:9/absent:1"  # no registry there: refused on loopback, nothing leaves
    result = await api.prepare(["host", absent], job=job)
    assert [i.image for i in result.images] == ["host", absent]
    host, missing = result.images
    assert (host.ok, host.nodes_ready, host.nodes_total, host.message) == (True, 1, 1, None)
    assert host.duration_ms >= 0
    # The image that cannot be had fails, reported (with the registry's reason) rather than raised.
    assert not missing.ok and missing.message and "Connection refused" in missing.message
    assert not result.ok and result.failed == [missing]
    events = [e for e in await api.events(job=job) if e.kind == "prepare"]
    phases = {(e.image, e.phase) for e in events}
    assert phases == {
        ("host", "started"), ("host", "pulling"), ("host", "ready"),
        (absent, "started"), (absent, "pulling"), (absent, "failed"),
    }
    assert all(e.job == job and e.sandbox == "" and e.state == "" for e in events)
    failed = [e for e in events if e.phase == "failed"]
    assert failed[0].message and "registry 127.0.0.1:9" in failed[0].message


async def test_prepare_with_a_hold_needs_a_job_and_a_fraction(api: Any) -> None:
    with pytest.raises(sandman.InvalidArgument, match="job"):
        await api.prepare(["host"], hold_until=0.5)
    with pytest.raises(sandman.InvalidArgument, match="fraction"):
        await api.prepare(["host"], job=unique("hold"), hold_until=1.5)
    held = await api.prepare(["host"], job=unique("hold"), hold_until=1.0)
    assert held.ok
    with pytest.raises(sandman.InvalidArgument, match="list"):
        await api.prepare("host")


async def test_prepare_sends_its_request_and_parses_nodes_and_pulling_events(mock_api: Any) -> None:
    seen: List[httpx.Request] = []
    events = [
        {"seq": 1, "time_ms": 10, "kind": "prepare", "image": "py:3", "job": "j", "phase": "started"},
        {"seq": 2, "time_ms": 11, "kind": "prepare", "image": "py:3", "job": "j", "phase": "pulling",
         "node": "node-a", "message": "py:3 is ready", "nodes_ready": 1, "nodes_total": 3},
        {"seq": 3, "time_ms": 12, "kind": "prepare", "image": "py:3", "job": "j", "phase": "ready",
         "nodes_ready": 3, "nodes_total": 3},
        {"seq": 4, "time_ms": 13, "sandbox": "sb-1", "state": "queued", "job": "j", "queue_position": 4,
         "estimated_wait_ms": 250, "idempotency_key": "k"},
    ]

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.url.path == "/v1/events":
            if request.url.params.get("follow") == "true":
                lines = [json.dumps(dict(e, event="sandbox")) for e in events] + ['{"event":"keepalive"}']
                return httpx.Response(200, content="\n".join(lines).encode() + b"\n")
            return httpx.Response(200, json={"events": events})
        return httpx.Response(200, json={"images": [
            {"image": "py:3", "ok": True, "nodes_ready": 3, "nodes_total": 3, "duration_ms": 4200},
            {"image": "gone:1", "ok": False, "nodes_ready": 0, "nodes_total": 0, "duration_ms": 7,
             "message": "pull access denied"},
        ]})

    async with mock_api(handler) as c:
        result = await c.prepare(["py:3", "gone:1"], job="j", hold_until=0.5)
        listed = await c.events(job="j", after=0, idempotency_key="k")
        followed = [e async for e in c.follow_events(job="j")]
    assert (seen[0].method, seen[0].url.path) == ("POST", "/v1/prepare")
    assert json.loads(seen[0].content) == {"images": ["py:3", "gone:1"], "job": "j", "hold_until": 0.5}
    assert dict(seen[1].url.params) == {"job": "j", "after": "0", "idempotency_key": "k"}
    ok, bad = result.images
    assert (ok.image, ok.ok, ok.nodes_ready, ok.nodes_total, ok.duration_ms, ok.message) == (
        "py:3", True, 3, 3, 4200, None,
    )
    assert (bad.ok, bad.message) == (False, "pull access denied") and result.failed == [bad]
    assert listed == followed  # the keep-alive line is skipped
    started, pulling, ready, queued = listed
    assert (started.kind, started.image, started.phase) == ("prepare", "py:3", "started")
    assert (pulling.phase, pulling.node, pulling.nodes_ready, pulling.nodes_total) == ("pulling", "node-a", 1, 3)
    assert (ready.phase, ready.nodes_ready) == ("ready", 3)
    assert {e.phase for e in listed[:3]} <= set(sandman.PREPARE_PHASES)
    assert (queued.kind, queued.sandbox, queued.state, queued.phase) == ("sandbox", "sb-1", "queued", None)
    assert (queued.queue_position, queued.estimated_wait_ms, queued.idempotency_key) == (4, 250, "k")
