"""Warm pools and setup commands: against the real server with both clients (the `api` fixture),
and the request each call sends (a fake server)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, List

import httpx
import pytest
from conftest import unique

import sandman
from sandman import PoolInfo


async def _until_ready(api: Any, name: str, n: int) -> PoolInfo:
    """The pool once `n` of its sandboxes are ready (its refills run in the background)."""
    deadline = time.monotonic() + 60
    while True:
        pool = await api.get_pool(name)
        if pool.ready >= n or time.monotonic() > deadline:
            return pool
        await asyncio.sleep(0.05)


async def test_a_pool_keeps_sandboxes_ready_with_its_setup_and_a_create_claims_one(api: Any) -> None:
    name = unique("pool")
    pool = await api.put_pool(
        name, "host", min_ready=1, max=2, setup=["echo warmed > /tmp/warm"], env={"POOL": "yes"}, lease=120
    )
    try:
        assert (pool.name, pool.image, pool.min_ready, pool.max, pool.setup) == (
            name, "host", 1, 2, ["echo warmed > /tmp/warm"],
        )
        # A plain pool keeps `min_ready`, and has no demand figures.
        assert (pool.target, pool.autoscale, pool.claim_rate, pool.refill_seconds) == (1, False, None, None)
        assert pool.spec["env"] == {"POOL": "yes"} and pool.spec["lease_s"] == 120
        assert name in [p.name for p in await api.list_pools()]
        ready = await _until_ready(api, name, 1)
        assert ready.ready >= 1 and ready.last_error is None, ready
        # Claimed by name, with no image: the pool's, its setup already run, its env kept.
        async with await api.create(pool=name, lease=60, setup=["echo mine >> /tmp/warm"]) as sb:
            assert sb.info.image == "host" and sb.info.state == "ready"
            assert sb.info.labels.get("sandman.dev/pool") == name
            assert (await sb.exec("cat /tmp/warm; echo $POOL")).stdout == "warmed\nmine\nyes\n"
            after = await api.get_pool(name)
            assert (after.claims, after.claimed) == (1, 1)
    finally:
        gone = await api.delete_pool(name)
    assert gone.name == name
    with pytest.raises(sandman.NotFound):
        await api.get_pool(name)
    assert name not in [p.name for p in await api.list_pools()]


async def test_setup_runs_before_ready_and_a_failing_one_fails_the_create(api: Any) -> None:
    setup = ["mkdir -p /tmp/w", "echo one > /tmp/w/f", "echo two >> /tmp/w/f"]
    async with await api.create(lease=30, setup=setup) as sb:
        assert (await sb.read_text("/tmp/w/f")) == "one\ntwo\n"
    label = unique("setup")
    with pytest.raises(sandman.InvalidArgument) as e:
        await api.create(lease=30, labels={"t": label}, setup=["true", "echo broken >&2; exit 3"])
    assert e.value.reason == "setup_failed" and "exit 3" in e.value.message, repr(e.value)
    [failed] = await api.list(label=f"t={label}")
    assert (failed.state, failed.reason) == ("failed", "setup_failed")


async def test_what_the_server_refuses_of_a_pool(api: Any) -> None:
    with pytest.raises(sandman.InvalidArgument, match="max"):
        await api.put_pool(unique("small"), "host", min_ready=3, max=2)
    with pytest.raises(sandman.InvalidArgument, match="pool name"):
        await api.put_pool("no/slash", "host", min_ready=0)
    with pytest.raises(sandman.NotFound):
        await api.delete_pool(unique("never"))
    with pytest.raises(sandman.InvalidArgument, match="list"):
        await api.put_pool(unique("str"), "host", min_ready=0, setup="echo one string")


async def test_pool_calls_send_the_whole_spec_and_parse_the_sizes(mock_api: Any) -> None:
    seen: List[httpx.Request] = []
    report = {
        "name": "py", "ready": 2, "creating": 1, "claimed": 3, "claims": 9, "last_error": "pull failed",
        "spec": {"image": "python:3.12", "min_ready": 2, "max": 4, "setup": ["pip install x"], "lease_s": 60,
                 "resources": {"cpu": 1}, "profile": "eval", "network": "none", "env": {"A": "1"}},
    }

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.url.path == "/v1/pools":
            return httpx.Response(200, json={"pools": [report]})
        return httpx.Response(200, json=report)

    async with mock_api(handler) as c:
        pool = await c.put_pool(
            "py", "python:3.12", min_ready=2, max=4, resources={"cpu": 1}, profile="eval", network="none",
            env={"A": "1"}, setup=["pip install x"], lease=60, provider="docker",
        )
        bare = await c.put_pool("py", "python:3.12", min_ready=0)
        assert [p.name for p in await c.list_pools()] == ["py"]
        assert await c.get_pool("py") == pool
        assert await c.delete_pool("py") == pool
    assert [(r.method, r.url.path) for r in seen] == [
        ("PUT", "/v1/pools/py"), ("PUT", "/v1/pools/py"), ("GET", "/v1/pools"), ("GET", "/v1/pools/py"),
        ("DELETE", "/v1/pools/py"),
    ]
    assert json.loads(seen[0].content) == {
        "image": "python:3.12", "min_ready": 2, "max": 4, "resources": {"cpu": 1}, "profile": "eval",
        "network": "none", "env": {"A": "1"}, "setup": ["pip install x"], "lease_s": 60, "provider": "docker",
    }
    assert json.loads(seen[1].content) == {"image": "python:3.12", "min_ready": 0}
    assert (pool.ready, pool.creating, pool.claimed, pool.claims, pool.last_error) == (2, 1, 3, 9, "pull failed")
    assert (pool.image, pool.min_ready, pool.max, pool.setup, pool.spec["profile"]) == (
        "python:3.12", 2, 4, ["pip install x"], "eval",
    )
    assert bare == pool  # the fake answers the same report


async def test_autoscale_is_sent_only_when_set_and_the_demand_figures_parse(mock_api: Any) -> None:
    bodies: List[Any] = []
    scaled = {
        "name": "auto", "ready": 3, "creating": 2, "claimed": 0, "claims": 40, "target": 5, "claim_rate": 1.5,
        "refill_seconds": 3.2, "spec": {"image": "host", "min_ready": 1, "max": 8, "autoscale": True},
    }
    plain = {"name": "plain", "ready": 1, "creating": 0, "claimed": 0, "claims": 0, "target": 1,
             "spec": {"image": "host", "min_ready": 1}}

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        bodies.append(body)
        return httpx.Response(200, json=scaled if body.get("autoscale") else plain)

    async with mock_api(handler) as c:
        auto = await c.put_pool("auto", "host", min_ready=1, max=8, autoscale=True)
        fixed = await c.put_pool("plain", "host", min_ready=1)
        unset = await c.put_pool("plain", "host", min_ready=1, autoscale=False)
    assert bodies == [
        {"image": "host", "min_ready": 1, "max": 8, "autoscale": True},
        {"image": "host", "min_ready": 1},
        {"image": "host", "min_ready": 1},
    ]
    assert (auto.autoscale, auto.target, auto.claim_rate, auto.refill_seconds) == (True, 5, 1.5, 3.2)
    assert (fixed.autoscale, fixed.target, fixed.claim_rate, fixed.refill_seconds) == (False, 1, None, None)
    assert unset == fixed


async def test_a_create_from_a_pool_sends_no_image_unless_given(mock_api: Any) -> None:
    bodies: List[Any] = []

    def handler(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        return httpx.Response(200, json={"id": "sb-1", "image": "python:3.12", "state": "ready", "lease_s": 9})

    async with mock_api(handler) as c:
        await c.create(pool="py", setup=["echo hi"])
        await c.create()
        await c.create("python:3.12", pool="py")
    assert {k: v for k, v in bodies[0].items() if k != "idempotency_key"} == {"pool": "py", "setup": ["echo hi"]}
    assert bodies[1]["image"] == "host" and "pool" not in bodies[1] and "setup" not in bodies[1]
    assert (bodies[2]["image"], bodies[2]["pool"]) == ("python:3.12", "py")
