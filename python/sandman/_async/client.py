"""The client: `AsyncSandman`, `AsyncSandbox`, `AsyncProcess`, `AsyncSession`, `AsyncJob` and
the NDJSON streams.

One design for both clients: `sandman/_async/client.py` is written by hand, and
`sandman/_sync/client.py` is generated from it by `python/tools/unasync.py` (the `async` and
`await` keywords removed, `Async*` names renamed, `_async` imports pointed at `_sync`); a test
checks that the committed sync copy is what the generator makes. Requests are built and answers
parsed in `sandman._core` and `sandman.models`; what differs between asyncio and threads
(sleeping, the heartbeat's background task or thread) lives in the twin `_rt` modules.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import re
import ssl
import time
import uuid
from pathlib import Path
from typing import (
    Any,
    AsyncIterator,
    Callable,
    Dict,
    Generic,
    List,
    Mapping,
    Optional,
    Sequence,
    Tuple,
    TypeVar,
    Union,
)

import httpx

from .. import _core, errors, snapshots as _snapshots
from .._core import Call, Command
from ..models import (
    DaemonInfo,
    DeterminismResult,
    DirListing,
    Event,
    ExecEvent,
    ExecResult,
    ExitStatus,
    ExtractResult,
    FileStat,
    Health,
    JobAction,
    JobInfo,
    JobUsage,
    OutputChunk,
    OutputEvent,
    PoolInfo,
    PrepareResult,
    ProcessInfo,
    SandboxInfo,
    SessionInfo,
    SessionResult,
    SignedConditions,
    Verification,
)
from ..snapshots import Snapshot
from . import _rt

T = TypeVar("T")
S = TypeVar("S", bound="AsyncStream[Any]")

__all__ = [
    "AsyncSandman",
    "AsyncSandbox",
    "AsyncProcess",
    "AsyncPty",
    "AsyncSession",
    "AsyncJob",
    "AsyncStream",
    "AsyncExecStream",
    "AsyncOutputStream",
]


class AsyncSandman:
    """A client of one Sandman server.

    `url` defaults to `$SANDMAN_URL` (else the server's Unix socket in its state directory,
    `unix:<state dir>/sandman.sock`, when there is one, else `http://127.0.0.1:7777`); `token` to `$SANDMAN_TOKEN`,
    else the token file the server writes (`$SANDMAN_STATE_DIR/token`, else
    `~/.local/state/sandman/token`). `timeout` is the read timeout of control calls in seconds
    (calls that run commands wait as long as their own `timeout`). Calls are sent again, up to
    `retries` times (default `$SANDMAN_RETRIES`, else 5; 0 for never) and no later than
    `retry_deadline` seconds after their first failure (default `$SANDMAN_RETRY_DEADLINE`, else
    30), only where that is safe: when the request never reached the server (connection refused,
    as while a server replica restarts), when the server shed it under load (503 with
    `Retry-After`), and, when the connection broke after the request went out (a replica going
    away), for idempotent calls only (reads, file writes, keepalives, releases, and creates,
    which are keyed with an `idempotency_key`), never for an exec, a process start or a stdin
    write. Resends wait 0.1, 0.2, 0.4 ... s (at most 2 s) with jitter; the error raised at the
    end says how many attempts were made (`attempts`).
    `max_connections` bounds the connections kept to the server (calls past it wait for one);
    `verify` is TLS verification for an `https://` server (a CA bundle path or an SSL context);
    `transport` replaces the HTTP transport (for tests).

    Use it as a context manager, or call `aclose()`, to close its connections.
    """

    def __init__(
        self,
        url: Optional[str] = None,
        token: Optional[str] = None,
        *,
        timeout: Optional[float] = _core.DEFAULT_TIMEOUT,
        retries: Optional[int] = None,
        retry_deadline: Optional[float] = None,
        max_connections: int = _core.DEFAULT_MAX_CONNECTIONS,
        verify: Union[bool, str, ssl.SSLContext] = True,
        transport: Optional[httpx.AsyncBaseTransport] = None,
    ) -> None:
        self.url = _core.resolve_url(url)
        self.retries = _core.resolve_retries(retries)
        self.retry_deadline = _core.resolve_retry_deadline(retry_deadline)
        token = _core.resolve_token(token)
        # Kept for what goes around the pools: a sandbox's ports (`AsyncSandbox.port_client`).
        self._token = token
        self._verify = _core.verify(verify)
        self._base, self._uds = _core.split_url(self.url)
        # Several small connection pools rather than one big one (see `_core.shards`).
        n_shards = 1 if transport is not None else _core.shards(max_connections)
        limits = _core.limits(max_connections, n_shards)
        self._pools = [
            httpx.AsyncClient(
                base_url=self._base,
                headers=_core.headers(token),
                timeout=_core.timeout(timeout),
                limits=limits,
                verify=_core.verify(verify),
                transport=transport or (httpx.AsyncHTTPTransport(uds=self._uds, limits=limits) if self._uds else None),
            )
            for _ in range(n_shards)
        ]
        self._calls = itertools.count()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    async def __aenter__(self) -> "AsyncSandman":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Closes the client's connections."""
        for pool in self._pools:
            await pool.aclose()

    # ---- the server's calls ----

    async def health(self) -> Health:
        """`GET /healthz`: whether the server is up, and which provider it runs."""
        return Health.from_dict(await self._json(_core.health_call()))

    async def create(
        self,
        image: Optional[str] = None,
        *,
        job: Optional[str] = None,
        resources: Optional[Mapping[str, Any]] = None,
        profile: Optional[str] = None,
        network: Optional[str] = None,
        ttl: Optional[int] = None,
        idle_timeout: Optional[int] = None,
        lease: Optional[int] = None,
        pool: Optional[str] = None,
        setup: Optional[Sequence[str]] = None,
        env: Optional[Mapping[str, str]] = None,
        labels: Optional[Mapping[str, str]] = None,
        provider: Optional[str] = None,
        idempotency_key: Optional[str] = None,
        wait: bool = True,
        wait_timeout: Optional[int] = None,
        user: Optional[str] = None,
        auto_resume: bool = False,
    ) -> "AsyncSandbox":
        """Creates a sandbox and answers it once ready (at once with `wait=False`).

        `image` defaults to `host` (the process provider's), or, with `pool`, to the pool's.
        `resources` is `{"cpu": 0.5 | "500m", "memory": "512Mi", "disk": "2G", "pids": 256}`;
        `profile` is `default` or `eval`; `network` `egress` or `none`; `ttl`, `idle_timeout` and
        `lease` are seconds (the lease is renewed by every call, `keepalive()`, or the job's
        heartbeat). `pool` claims a ready sandbox from that warm pool (see `put_pool`; a create
        whose image, resources, profile and network equal a pool's claims from it without naming
        it). `setup` is a list of shell commands run in order before the sandbox is answered
        ready; one that exits non-zero fails the create (`InvalidArgument`, reason
        `setup_failed`). A create past the job's quota, or while the server's admission queue is
        full, raises `QuotaExceeded` (the latter with `retry_after`). The create is keyed with
        `idempotency_key` (a fresh one when not given), so a create sent again after a lost
        answer returns the same sandbox. `user` (a name or `uid[:gid]`) is the user of every
        exec, process and session of the sandbox that names none; on the docker provider the
        image's `USER` is the default without it (see `SandboxInfo.user` and `image_config`).
        With `auto_resume=True` a call on the sandbox while it is paused resumes it first;
        without, such a call raises `Paused`.
        """
        call = _core.create_call(
            image,
            job=job,
            resources=resources,
            profile=profile,
            network=network,
            ttl=ttl,
            idle_timeout=idle_timeout,
            lease=lease,
            pool=pool,
            setup=setup,
            env=env,
            labels=labels,
            provider=provider,
            idempotency_key=idempotency_key,
            wait=wait,
            wait_timeout=wait_timeout,
            user=user,
            auto_resume=auto_resume,
        )
        info = SandboxInfo.from_dict(await self._json(call))
        return AsyncSandbox(self, info.id, info)

    def sandbox(self, sandbox_id: str) -> "AsyncSandbox":
        """A handle on an existing sandbox, without a call."""
        return AsyncSandbox(self, sandbox_id)

    async def get(self, sandbox_id: str) -> SandboxInfo:
        """`GET /v1/sandboxes/{id}`: state, reason, timestamps and expiry, also once it ended."""
        return SandboxInfo.from_dict(await self._json(_core.get_call(sandbox_id)))

    async def list(
        self, *, job: Optional[str] = None, state: Optional[str] = None, label: Optional[str] = None
    ) -> List[SandboxInfo]:
        """`GET /v1/sandboxes`: sandboxes, optionally only of `job`, in `state`, or with the label
        `label` (`"key=value"`). Ended ones are listed for the server's gone retention."""
        body = await self._json(_core.list_call(job, state, label))
        return [SandboxInfo.from_dict(d) for d in _core.as_list(body, "sandboxes")]

    async def release(self, sandbox_id: str) -> Optional[SandboxInfo]:
        """Releases a sandbox; answers its final record, or None when it had already ended."""
        try:
            return SandboxInfo.from_dict(await self._json(_core.release_call(sandbox_id)))
        except errors.Gone:
            return None

    async def keepalive(self, sandbox_id: str) -> SandboxInfo:
        """Renews a sandbox's lease."""
        return SandboxInfo.from_dict(await self._json(_core.keepalive_call(sandbox_id)))

    async def pause(self, sandbox_id: str) -> SandboxInfo:
        """Freezes every process of a ready sandbox (state `paused`): it uses no CPU and keeps
        its memory; its lease and idle timeout stop, its lifetime still counts. Pausing a paused
        sandbox answers it as it is. Refused (`InvalidArgument`) by a provider that cannot
        freeze (kubernetes)."""
        return SandboxInfo.from_dict(await self._json(_core.pause_call(sandbox_id)))

    async def resume(self, sandbox_id: str) -> SandboxInfo:
        """Thaws a paused sandbox (state `ready` again); counts as a call on it."""
        return SandboxInfo.from_dict(await self._json(_core.resume_call(sandbox_id)))

    async def job(
        self,
        name: str,
        *,
        max_sandboxes: Optional[int] = None,
        lease: Optional[int] = None,
        heartbeat: bool = True,
        heartbeat_interval: Optional[float] = None,
        release_on_exit: bool = True,
        create_rate: Optional[float] = None,
        weight: Optional[float] = None,
    ) -> "AsyncJob":
        """Sets the quota of job `name` (`PUT /v1/jobs/{name}`) and answers its `AsyncJob`, whose
        heartbeat renews the lease of all the job's sandboxes in the background, every
        `heartbeat_interval` seconds (default a third of the job's lease, else 10 s), until
        the job is closed.

        `max_sandboxes` caps the job's live sandboxes (a create past it raises `QuotaExceeded`);
        `lease` (seconds) is the default lease of its sandboxes. `create_rate` caps the job's
        creates a second; `weight` is its share of the server's create rate while several jobs
        queue (default 1). Creates past a rate wait in the server's admission queue.
        """
        body = await self._json(
            _core.put_job_call(name, max_sandboxes=max_sandboxes, lease=lease, create_rate=create_rate, weight=weight)
        )
        job = AsyncJob(self, JobInfo.from_dict(body), release_on_exit=release_on_exit)
        if heartbeat:
            job.start_heartbeat(heartbeat_interval)
        return job

    async def get_job(self, name: str) -> JobInfo:
        """`GET /v1/jobs/{name}`: the job's quota and usage."""
        return JobInfo.from_dict(await self._json(_core.get_job_call(name)))

    async def delete_job(self, name: str) -> JobAction:
        """`DELETE /v1/jobs/{name}`: releases every sandbox of the job (`job_deleted`)."""
        return JobAction.from_dict(await self._json(_core.delete_job_call(name)))

    async def heartbeat(self, name: str) -> JobAction:
        """`POST /v1/jobs/{name}/heartbeat`: renews the lease of every sandbox of the job."""
        return JobAction.from_dict(await self._json(_core.heartbeat_call(name)))

    async def job_usage(self, name: str) -> JobUsage:
        """`GET /v1/jobs/{name}/usage`: what the job's ended sandboxes used (sandbox and CPU
        seconds, peak memory, counts by reason), and how many are alive now."""
        return JobUsage.from_dict(await self._json(_core.job_usage_call(name)))

    # ---- snapshots ----

    async def snapshots(self, *, job: Optional[str] = None) -> List[Snapshot]:
        """`GET /v1/snapshots`: the snapshots the server holds (of `job` only), oldest first."""
        return _snapshots.snapshots_of(await self._json(_snapshots.list_call(job)))

    async def get_snapshot(self, snapshot_id: str) -> Snapshot:
        """`GET /v1/snapshots/{id}`."""
        return Snapshot.from_dict(await self._json(_snapshots.get_call(snapshot_id)))

    async def delete_snapshot(self, snapshot_id: str) -> Snapshot:
        """`DELETE /v1/snapshots/{id}`: the sandboxes started from it keep running."""
        return Snapshot.from_dict(await self._json(_snapshots.delete_call(snapshot_id)))

    async def export_snapshot(self, snapshot_id: str, reference: str) -> str:
        """Pushes a snapshot as an image to `reference` (`registry/repository:tag`), so that other
        machines and providers can run it; answers the pushed manifest's digest."""
        body = await self._json(_snapshots.export_call(snapshot_id, reference))
        return str(body["digest"])

    # ---- warm pools ----

    async def put_pool(
        self,
        name: str,
        image: str,
        *,
        min_ready: int,
        max: Optional[int] = None,
        resources: Optional[Mapping[str, Any]] = None,
        profile: Optional[str] = None,
        network: Optional[str] = None,
        env: Optional[Mapping[str, str]] = None,
        setup: Optional[Sequence[str]] = None,
        lease: Optional[int] = None,
        provider: Optional[str] = None,
        autoscale: bool = False,
    ) -> PoolInfo:
        """`PUT /v1/pools/{name}`: creates or changes a warm pool, which keeps `min_ready` sandboxes
        of `image` ready (at most `max` unclaimed, ready or being created; default `min_ready`),
        each having run `setup` (a list of shell commands). A create naming the pool, or asking
        for the same image, resources, profile and network, claims one at once. `lease` (seconds)
        is the longest lease a claim may ask for. With `autoscale` the pool sizes itself from
        demand: it keeps (creates it served, or matched with nothing ready, a second over the last
        30 s) × (how long a refill takes lately) ready, rounded up, between `min_ready` and `max`
        (see `PoolInfo.target`). Changing only the sizes keeps the pool's sandboxes; changing
        anything else replaces the unclaimed ones."""
        call = _core.put_pool_call(
            name,
            image,
            min_ready=min_ready,
            max=max,
            resources=resources,
            profile=profile,
            network=network,
            env=env,
            setup=setup,
            lease=lease,
            provider=provider,
            autoscale=autoscale,
        )
        return PoolInfo.from_dict(await self._json(call))

    async def get_pool(self, name: str) -> PoolInfo:
        """`GET /v1/pools/{name}`: the pool's spec and sizes (ready, creating, claimed, claims)."""
        return PoolInfo.from_dict(await self._json(_core.get_pool_call(name)))

    async def list_pools(self) -> List[PoolInfo]:
        """`GET /v1/pools`: every warm pool with its sizes."""
        body = await self._json(_core.list_pools_call())
        return [PoolInfo.from_dict(d) for d in _core.as_list(body, "pools")]

    async def delete_pool(self, name: str) -> PoolInfo:
        """`DELETE /v1/pools/{name}`: forgets the pool and releases its unclaimed sandboxes (claimed
        ones stay their claimers'); answers the pool as it was. `NotFound` when there is no such
        pool."""
        return PoolInfo.from_dict(await self._json(_core.delete_pool_call(name)))

    # ---- images ----

    async def prepare(
        self,
        images: Sequence[str],
        *,
        job: Optional[str] = None,
        hold_until: Optional[float] = None,
        timeout: Optional[float] = None,
    ) -> PrepareResult:
        """`POST /v1/prepare`: makes `images` ready (pulled on every node that may run sandboxes)
        ahead of the creates that need them; answers once each is ready or has failed, with one
        `PreparedImage` each (`ok`, `message`, `nodes_ready` of `nodes_total`, `duration_ms`). A
        failed image is reported, not raised. Progress is in the events (kind `prepare`), tagged
        with `job`. With `job` and `hold_until` (a fraction of the nodes, 0 < f <= 1), the job's
        creates of these images wait until that fraction of the nodes has the image. `timeout`
        (seconds) bounds the wait on this side (None: the server's request timeout bounds it)."""
        call = _core.prepare_call(images, job=job, hold_until=hold_until, timeout=timeout)
        return PrepareResult.from_dict(await self._json(call))

    # ---- conditions ----

    async def conditions(self, sandbox_id: str) -> SignedConditions:
        """`GET /v1/sandboxes/{id}/conditions`: the signed record of the conditions the sandbox
        runs under (asked, applied by the provider, observed by the daemon, and where the last
        two differ). Store `to_dict()` with a result; check it later with `verify` or, holding
        the server's key, `sandman.verify_conditions`."""
        return SignedConditions.from_dict(await self._json(_core.conditions_call(sandbox_id)))

    async def verify(self, signed: Union[SignedConditions, Mapping[str, Any]]) -> Verification:
        """`POST /v1/verify`: whether the server signed this conditions record (a
        `SignedConditions`, or its dict as stored) and it is intact; `problem` says why not."""
        body = signed.to_dict() if isinstance(signed, SignedConditions) else signed
        return Verification.from_dict(await self._json(_core.verify_call(body)))

    # ---- determinism ----

    async def check_determinism(
        self,
        image: Optional[str],
        command: Command,
        *,
        runs: int = 5,
        parallel: int = 1,
        timeout: Optional[float] = None,
        cwd: Optional[str] = None,
        job: Optional[str] = None,
        resources: Optional[Mapping[str, Any]] = None,
        profile: Optional[str] = None,
        network: Optional[str] = None,
        ttl: Optional[int] = None,
        idle_timeout: Optional[int] = None,
        lease: Optional[int] = None,
        pool: Optional[str] = None,
        setup: Optional[Sequence[str]] = None,
        env: Optional[Mapping[str, str]] = None,
        labels: Optional[Mapping[str, str]] = None,
        provider: Optional[str] = None,
        wait_timeout: Optional[int] = None,
    ) -> DeterminismResult:
        """Runs `command` once in each of `runs` fresh sandboxes of one spec, `parallel` at a
        time, and says whether their results agree (the CLI's `sandman determinism`): a task's
        setup or reward command whose output varies between fresh sandboxes (a clock, randomness,
        the network) would make rewards noisy.

        Each run creates a sandbox (`image` and the create arguments, as `create` takes them),
        runs the command once (`timeout` in seconds, `cwd`) and releases it. Two runs agree when
        exit code, signal, timeout, stdout and stderr are equal. Every sandbox made is released
        before this answers, also when a run fails (the first failure is raised, the other runs
        stop) or the caller is cancelled; its sandboxes carry the label
        `sandman-determinism=<check id>`. `runs` below 2 raises `ValueError`."""
        if runs < 2:
            raise ValueError(f"runs must be at least 2 to compare anything, not {runs}")
        check = uuid.uuid4().hex[:16]
        label = {**(labels or {}), _core.DETERMINISM_LABEL: check}
        create = functools.partial(
            self.create,
            image,
            job=job,
            resources=resources,
            profile=profile,
            network=network,
            ttl=ttl,
            idle_timeout=idle_timeout,
            lease=lease,
            pool=pool,
            setup=setup,
            env=env,
            labels=label,
            provider=provider,
            wait_timeout=wait_timeout,
        )
        one = functools.partial(self._determinism_run, create, command, timeout, cwd)
        try:
            results = await _rt.gather_bounded([one] * runs, min(max(1, parallel), runs))
        finally:
            await self._release_labelled(f"{_core.DETERMINISM_LABEL}={check}")
        return DeterminismResult.judge(results)

    async def _determinism_run(
        self,
        create: Callable[[], Any],
        command: Command,
        timeout: Optional[float],
        cwd: Optional[str],
    ) -> Tuple[str, ExecResult]:
        """One run of `check_determinism`: a fresh sandbox, the command once, the release."""
        sandbox: AsyncSandbox = await _rt.finish(create, AsyncSandbox.release)
        async with sandbox:
            return sandbox.id, await sandbox.exec(command, timeout=timeout, cwd=cwd)

    async def _release_labelled(self, label: str) -> None:
        """Releases every live sandbox labelled `label`: what a run could not release itself (its
        create timed out here while the server went on). A failure is logged, not raised, so the
        error that brought us here stays the one raised."""
        try:
            for info in await self.list(label=label):
                if info.live:
                    await self.release(info.id)
        except errors.SandmanError as e:
            _core.log.warning("could not release the sandboxes labelled %s: %s", label, e)

    # ---- events ----

    async def events(
        self, *, job: Optional[str] = None, after: Optional[int] = None, idempotency_key: Optional[str] = None
    ) -> List[Event]:
        """`GET /v1/events`: the events the server keeps (sandbox lifecycles, and image
        preparations of kind `prepare`), optionally of one job, after one sequence number, or of
        the create keyed `idempotency_key`."""
        body = await self._json(_core.events_call(job, after, False, idempotency_key))
        return [Event.from_dict(d) for d in _core.as_list(body, "events")]

    def follow_events(
        self, *, job: Optional[str] = None, after: Optional[int] = None, idempotency_key: Optional[str] = None
    ) -> "AsyncStream[Event]":
        """The same events as they happen, as a stream (iterate it; close it to stop)."""
        return AsyncStream(self, _core.events_call(job, after, True, idempotency_key), Event.from_stream)

    # ---- transport: the one place calls are sent and answers checked ----

    async def _send(self, call: Call, *, stream: bool = False) -> httpx.Response:
        """Sends `call`, again where that is safe; answers a successful response or raises."""
        attempt = 0
        # When the first attempt failed (`time.monotonic()`): the retry deadline counts from it.
        first_failure: Optional[float] = None
        http = self._pools[_core.shard_of(call, len(self._pools), next(self._calls))]
        while True:
            request = http.build_request(
                call.method,
                call.path,
                params=call.params,
                json=call.json,
                content=call.content,
                headers=call.request_headers(),
                timeout=_core.timeout(call.timeout) if call.has_timeout else httpx.USE_CLIENT_DEFAULT,
            )
            try:
                response = await http.send(request, stream=stream)
            except httpx.TransportError as e:
                first_failure = time.monotonic() if first_failure is None else first_failure
                elapsed = time.monotonic() - first_failure
                delay = _core.retry_after_error(call, e, attempt, self.retries, elapsed, self.retry_deadline)
                if delay is None:
                    raise _core.transport_error(e, self.url, call, attempt + 1) from e
                attempt += 1
                await _rt.sleep(delay)
                continue
            if response.is_success:
                return response
            try:
                body = await response.aread()
            except httpx.TransportError:
                body = b""
            finally:
                await response.aclose()
            first_failure = time.monotonic() if first_failure is None else first_failure
            elapsed = time.monotonic() - first_failure
            delay = _core.retry_after_status(
                call, response.status_code, response.headers, attempt, self.retries, elapsed, self.retry_deadline
            )
            if delay is None:
                err = errors.error_from_response(response.status_code, body, response.headers)
                err.attempts = attempt + 1
                if attempt > 0:
                    err.message = f"{err.message} (after {attempt + 1} attempts)"
                    err.args = (err.message,)
                raise err
            attempt += 1
            await _rt.sleep(delay)

    async def _json(self, call: Call) -> Any:
        response = await self._send(call)
        if not response.content:
            return None
        try:
            return json.loads(response.content)
        except ValueError as e:
            raise errors.Internal(f"{call.method} {call.path}: the answer is not JSON: {e}") from e

    async def _bytes(self, call: Call) -> bytes:
        return (await self._send(call)).content


class AsyncSandbox:
    """One sandbox. Every call renews its lease.

    Use it as a context manager to release it on exit, also when the block raises::

        async with await client.create("host") as sb:
            print((await sb.exec("uname -a")).stdout)
    """

    def __init__(self, client: AsyncSandman, sandbox_id: str, info: Optional[SandboxInfo] = None) -> None:
        self.client = client
        self.id = sandbox_id
        #: The record as last seen (by `create`, `refresh`, `keepalive` or `release`).
        self.info = info
        #: The snapshot this sandbox was forked from, when `fork()` made it.
        self.snapshot_of: Optional[Snapshot] = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.id!r})"

    async def __aenter__(self) -> "AsyncSandbox":
        return self

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            await self.release()
        except errors.NotFound:
            pass  # ended so long ago that the server forgot it
        except errors.SandmanError as e:
            if exc_type is None:
                raise
            # The block's own exception matters more; the lease reclaims the sandbox.
            _core.log.warning("could not release sandbox %s while handling %s: %s", self.id, exc_type.__name__, e)

    # ---- lifecycle ----

    async def refresh(self) -> SandboxInfo:
        """The sandbox's record from the server (also once it ended)."""
        self.info = await self.client.get(self.id)
        return self.info

    async def keepalive(self) -> SandboxInfo:
        """Renews the lease (the daemon's too)."""
        self.info = await self.client.keepalive(self.id)
        return self.info

    async def pause(self) -> SandboxInfo:
        """Freezes every process of the sandbox (see `AsyncSandman.pause`)."""
        self.info = await self.client.pause(self.id)
        return self.info

    async def resume(self) -> SandboxInfo:
        """Thaws the paused sandbox (see `AsyncSandman.resume`)."""
        self.info = await self.client.resume(self.id)
        return self.info

    async def release(self) -> Optional[SandboxInfo]:
        """Releases the sandbox; a no-op (answering None) when it has already ended."""
        info = await self.client.release(self.id)
        if info is not None:
            self.info = info
        return info

    async def daemon_info(self) -> DaemonInfo:
        """The daemon's version, uptime, process counts and lease left."""
        return DaemonInfo.from_dict(await self.client._json(_core.daemon_info_call(self.id)))

    async def conditions(self) -> SignedConditions:
        """The signed record of the conditions the sandbox runs under (see
        `AsyncSandman.conditions`)."""
        return await self.client.conditions(self.id)

    # ---- commands ----

    async def snapshot(self, *, name: Optional[str] = None, paths: Optional[Sequence[str]] = None) -> Snapshot:
        """Records the sandbox's files as they are now (not its processes) as a snapshot, kept until
        deleted or its job is; start sandboxes from it with `create(snapshot.image)`. `paths`
        names the directories to record, which the kubernetes provider needs (it records those
        only); the other providers record the whole file system and refuse it."""
        return Snapshot.from_dict(await self.client._json(_snapshots.take_call(self.id, name, paths)))

    async def fork(
        self,
        count: int = 1,
        *,
        name: Optional[str] = None,
        paths: Optional[Sequence[str]] = None,
        job: Optional[str] = None,
        labels: Optional[Mapping[str, str]] = None,
        resources: Optional[Mapping[str, Any]] = None,
        env: Optional[Mapping[str, str]] = None,
        lease: Optional[int] = None,
        ttl: Optional[int] = None,
        idle_timeout: Optional[int] = None,
        wait: bool = True,
        wait_timeout: Optional[int] = None,
    ) -> "List[AsyncSandbox]":
        """A snapshot of this sandbox and `count` new sandboxes from it, in one call: each starts
        with this one's files (not its processes), and writes its own. The children get this
        sandbox's job, labels, resources, environment (with `env` added), lease and user unless
        given. The snapshot is each child's `snapshot_of` (delete it when done, or let the job's
        end delete it). `paths`: the directories the snapshot records (see `snapshot`)."""
        call = _snapshots.fork_call(
            self.id,
            count,
            name=name,
            paths=paths,
            job=job,
            labels=labels,
            resources=resources,
            env=env,
            lease=lease,
            ttl=ttl,
            idle_timeout=idle_timeout,
            wait=wait,
            wait_timeout=wait_timeout,
        )
        body = await self.client._json(call)
        snapshot = Snapshot.from_dict(body["snapshot"])
        children = [AsyncSandbox(self.client, d["id"], SandboxInfo.from_dict(d)) for d in body.get("sandboxes", [])]
        for child in children:
            child.snapshot_of = snapshot
        return children

    async def exec(
        self,
        cmd: Command,
        *,
        timeout: Optional[float] = None,
        env: Optional[Mapping[str, str]] = None,
        cwd: Optional[str] = None,
        user: Optional[str] = None,
        stdin: Optional[Union[str, bytes]] = None,
        max_output_bytes: Optional[int] = None,
        merge_output: bool = False,
    ) -> ExecResult:
        """Runs a command to completion: a shell string (`/bin/sh -c`) or an argv list.

        `timeout` (seconds) kills the whole process tree and keeps the partial output
        (`timed_out=True`); `stdin` is written to the command and closed; output beyond
        `max_output_bytes` per stream (default 10 MiB) is dropped (`stdout_truncated`).
        `merge_output=True` gives stdout and stderr one pipe, as a terminal shows them: all of
        it is in `stdout`, in the order written, and `stderr` is empty.
        A failing command is not an error: check `exit_code` (or `ok`).
        """
        body = _core.exec_body(
            cmd,
            timeout=timeout,
            env=env,
            cwd=cwd,
            user=user,
            stdin=stdin,
            max_output_bytes=max_output_bytes,
            merge_output=merge_output,
        )
        return ExecResult.from_dict(await self.client._json(_core.exec_call(self.id, body, timeout)))

    def exec_stream(
        self,
        cmd: Command,
        *,
        timeout: Optional[float] = None,
        env: Optional[Mapping[str, str]] = None,
        cwd: Optional[str] = None,
        user: Optional[str] = None,
        stdin: Optional[Union[str, bytes]] = None,
        max_output_bytes: Optional[int] = None,
        merge_output: bool = False,
    ) -> "AsyncExecStream":
        """Runs a command, yielding `ExecEvent`s as output comes: `started`, `stdout`/`stderr`
        chunks, then `exit`. The call is sent when iteration starts; closing the stream early
        (or leaving its `with` block) kills the command's process tree. With `merge_output`
        every chunk is `stdout`, in the order written."""
        body = _core.exec_body(
            cmd,
            timeout=timeout,
            env=env,
            cwd=cwd,
            user=user,
            stdin=stdin,
            max_output_bytes=max_output_bytes,
            merge_output=merge_output,
        )
        return AsyncExecStream(self.client, _core.exec_stream_call(self.id, body))

    async def start(
        self,
        cmd: Command,
        *,
        tag: Optional[str] = None,
        env: Optional[Mapping[str, str]] = None,
        cwd: Optional[str] = None,
        user: Optional[str] = None,
        stdin: bool = False,
        retain_bytes: Optional[int] = None,
        timeout: Optional[float] = None,
        merge_output: bool = False,
        pty: Optional[Tuple[int, int]] = None,
    ) -> "AsyncProcess":
        """Starts a background process. `tag` names it (usable wherever its id is); `stdin=True`
        gives it a pipe for `write_stdin`; `retain_bytes` bounds the output kept per stream
        (default 1 MiB); `timeout` (seconds) kills its tree; `merge_output` gives stdout and
        stderr one pipe (all of it read as `stdout`). `pty=(rows, cols)` runs it on a terminal
        (see `pty()`, which answers a handle made for that)."""
        call = _core.start_call(
            self.id,
            cmd,
            tag=tag,
            env=env,
            cwd=cwd,
            user=user,
            stdin=stdin,
            retain_bytes=retain_bytes,
            timeout=timeout,
            merge_output=merge_output,
            pty=pty,
        )
        info = ProcessInfo.from_dict(await self.client._json(call))
        return AsyncProcess(self, info.id, info)

    async def pty(
        self,
        cmd: Command = ("/bin/sh",),
        *,
        rows: int = 24,
        cols: int = 80,
        tag: Optional[str] = None,
        env: Optional[Mapping[str, str]] = None,
        cwd: Optional[str] = None,
        user: Optional[str] = None,
        retain_bytes: Optional[int] = None,
        timeout: Optional[float] = None,
    ) -> "AsyncPty":
        """Starts `cmd` on a new pseudo-terminal of `rows` x `cols` (1 to 1000 each), as a
        background process: interactive programs (`bash`, `python3 -i`, `less`, `gdb`) see a
        terminal. Write keystrokes with `write` (Enter is `\\r`, Ctrl-C `\\x03`), read what the
        terminal shows with `read`, `read_until` or by iterating, `resize` it, `kill` it. Find it
        again later with `sandbox.pty_of(tag)`. `TERM` is `xterm-256color` unless `env` sets it."""
        call = _core.start_call(
            self.id,
            cmd,
            tag=tag,
            env=env,
            cwd=cwd,
            user=user,
            stdin=False,
            retain_bytes=retain_bytes,
            timeout=timeout,
            pty=(rows, cols),
        )
        info = ProcessInfo.from_dict(await self.client._json(call))
        return AsyncPty(self, info.id, info)

    def pty_of(self, id_or_tag: str, *, offset: int = 0) -> "AsyncPty":
        """A handle on a process already on a terminal, by id or tag, without a call: reattach
        to it. Reading starts at byte `offset` of its output (0: all that is retained)."""
        return AsyncPty(self, id_or_tag, offset=offset)

    def port_url(self, port: int, path: str = "") -> str:
        """The URL of `http://127.0.0.1:{port}/{path}` inside the sandbox, through the server
        (`/v1/sandboxes/{id}/ports/{port}/{path}`): HTTP and WebSockets, on every provider.
        Requests to it need the server's token: send `port_headers()` along (or use
        `port_client`)."""
        return self.client._base.rstrip("/") + _core.port_path(self.id, port, path)

    def port_headers(self) -> Dict[str, str]:
        """The headers a request to `port_url` needs: the server's bearer token."""
        return {"Authorization": f"Bearer {self.client._token}"}

    def port_client(self, port: int, **kwargs: Any) -> httpx.AsyncClient:
        """An `httpx.AsyncClient` whose base URL is `port` inside the sandbox and which sends the
        server's token: `client.get("/index.html")`. Close it when done (it is a context
        manager); extra arguments go to httpx."""
        headers = {**self.port_headers(), **dict(kwargs.pop("headers", None) or {})}
        if self.client._uds and "transport" not in kwargs:
            kwargs["transport"] = httpx.AsyncHTTPTransport(uds=self.client._uds)
        return httpx.AsyncClient(base_url=self.port_url(port), headers=headers, verify=self.client._verify, **kwargs)

    def process(self, id_or_tag: str) -> "AsyncProcess":
        """A handle on a background process by id or tag, without a call."""
        return AsyncProcess(self, id_or_tag)

    async def processes(self) -> List[ProcessInfo]:
        """Every background process the daemon remembers, running or exited."""
        body = await self.client._json(_core.list_processes_call(self.id))
        return [ProcessInfo.from_dict(d) for d in _core.as_list(body, "processes")]

    async def session(
        self,
        *,
        shell: Optional[str] = None,
        env: Optional[Mapping[str, str]] = None,
        cwd: Optional[str] = None,
        user: Optional[str] = None,
    ) -> "AsyncSession":
        """Starts a persistent shell: `cd`, exported variables and functions survive between
        `run`s. A context manager that ends the shell on exit."""
        call = _core.create_session_call(self.id, shell=shell, env=env, cwd=cwd, user=user)
        info = SessionInfo.from_dict(await self.client._json(call))
        return AsyncSession(self, info.id, info)

    async def sessions(self) -> List[SessionInfo]:
        body = await self.client._json(_core.list_sessions_call(self.id))
        return [SessionInfo.from_dict(d) for d in _core.as_list(body, "sessions")]

    # ---- files ----

    async def read_file(self, path: str, *, offset: int = 0, length: Optional[int] = None) -> bytes:
        """The bytes of the file at `path` (absolute), from `offset`, `length` of them (all)."""
        return await self.client._bytes(_core.read_file_call(self.id, path, offset, length))

    async def read_text(self, path: str, *, encoding: str = "utf-8") -> str:
        return (await self.read_file(path)).decode(encoding)

    async def write_file(
        self,
        path: str,
        data: Union[str, bytes],
        *,
        mode: Optional[int] = None,
        user: Optional[str] = None,
        fsync: bool = False,
    ) -> FileStat:
        """Writes `data` (text is UTF-8) to `path` atomically, creating parent directories;
        `mode` defaults to `0o644`. The file and the directories made belong to `user` (a name,
        `uid`, `uid:gid`), by default the sandbox's default user (root when it has none).
        Readers see the old contents or the new, never a part; `fsync=True` also makes the write
        durable (synced to disk) before this returns, at the cost of a disk flush."""
        call = _core.write_file_call(self.id, path, data, mode, user, fsync)
        return FileStat.from_dict(await self.client._json(call))

    async def stat(self, path: str) -> FileStat:
        return FileStat.from_dict(await self.client._json(_core.stat_call(self.id, path)))

    async def list_dir(self, path: str, *, depth: Optional[int] = None) -> DirListing:
        """Entries below `path`, `depth` levels deep (default 1)."""
        return DirListing.from_dict(await self.client._json(_core.list_dir_call(self.id, path, depth)))

    async def mkdir(self, path: str, *, mode: Optional[int] = None, user: Optional[str] = None) -> FileStat:
        """`mkdir -p`; the directories made belong to `user`, as with `write_file`."""
        return FileStat.from_dict(await self.client._json(_core.mkdir_call(self.id, path, mode, user)))

    async def remove(self, path: str, *, recursive: bool = False) -> None:
        """Removes a file, or a directory (a non-empty one needs `recursive=True`)."""
        await self.client._json(_core.remove_call(self.id, path, recursive))

    async def move(self, src: str, dst: str, *, overwrite: bool = False) -> FileStat:
        """Renames `src` to `dst` (an existing `dst` is a `Conflict` unless `overwrite`)."""
        return FileStat.from_dict(await self.client._json(_core.move_call(self.id, src, dst, overwrite)))

    async def upload(
        self, local: Union[str, "os.PathLike[str]"], path: str, *, user: Optional[str] = None, fsync: bool = False
    ) -> ExtractResult:
        """Copies the local directory `local` (its contents; or one file) into the directory
        `path` in the sandbox, created if missing, as one tar; what it creates belongs to
        `user`, as with `write_file`; `fsync=True` makes it durable before this returns."""
        data = await _rt.run_blocking(_core.tar_directory, local)
        return await self.upload_tar(data, path, user=user, fsync=fsync)

    async def download(self, path: str, local: Union[str, "os.PathLike[str]"]) -> Path:
        """Copies the directory `path` in the sandbox (its contents; or one file) into the local
        directory `local`, created if missing. Answers `local` as a `Path`."""
        data = await self.download_tar(path)
        return await _rt.run_blocking(_core.extract_tar, data, local)

    async def upload_tar(
        self, data: bytes, path: str, *, user: Optional[str] = None, fsync: bool = False
    ) -> ExtractResult:
        """Extracts a tar (gzip detected) into the directory `path`; what it creates belongs to
        `user`, as with `write_file` (the tar's own owners are not kept). `fsync=True` makes
        what it wrote durable (one sync of the file system) before this returns."""
        call = _core.upload_tar_call(self.id, path, data, user, fsync)
        return ExtractResult.from_dict(await self.client._json(call))

    async def download_tar(self, path: str) -> bytes:
        """The directory `path` as a tar of its contents (a file: a tar of that file)."""
        return await self.client._bytes(_core.download_tar_call(self.id, path))


class AsyncProcess:
    """A background process in a sandbox (`AsyncSandbox.start`), addressed by id or tag."""

    def __init__(self, sandbox: AsyncSandbox, process_id: str, info: Optional[ProcessInfo] = None) -> None:
        self.sandbox = sandbox
        self.id = process_id
        #: The status as last seen.
        self.info = info

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.sandbox.id!r}, {self.id!r})"

    async def status(self) -> ProcessInfo:
        """The process's status, with its exit once it has exited."""
        self.info = ProcessInfo.from_dict(await self.sandbox.client._json(_core.process_call(self.sandbox.id, self.id)))
        return self.info

    async def output(self, *, stream: str = "stdout", offset: int = 0, max_bytes: Optional[int] = None) -> OutputChunk:
        """Output of `stream` (`stdout` or `stderr`) from byte `offset`; read on from
        `next_offset`. Bytes older than the retention are `dropped`."""
        call = _core.output_call(
            self.sandbox.id, self.id, stream=stream, offset=offset, max_bytes=max_bytes, follow=False
        )
        return OutputChunk.from_dict(await self.sandbox.client._json(call))

    def follow(self, *, stream: str = "stdout", offset: int = 0) -> "AsyncOutputStream":
        """Output of `stream` as it comes, as `OutputEvent`s (`data`, `dropped`), ending with
        `exit` when the process exits. Each `data` event's bytes end at its `next_offset`, and
        the stream's `offset` is where those read so far end: follow again from there after a
        broken connection."""
        call = _core.output_call(self.sandbox.id, self.id, stream=stream, offset=offset, max_bytes=None, follow=True)
        return AsyncOutputStream(self.sandbox.client, call, offset)

    async def wait(self, timeout: Optional[float] = None) -> ProcessInfo:
        """Waits for the process to exit, at most `timeout` seconds (None: as long as it takes);
        answers its status, still `running` if the timeout passed first."""
        while True:
            step = _core.WAIT_STEP if timeout is None else timeout
            call = _core.wait_call(self.sandbox.id, self.id, step)
            self.info = ProcessInfo.from_dict(await self.sandbox.client._json(call))
            if timeout is not None or not self.info.running:
                return self.info

    async def write_stdin(self, data: Union[str, bytes], *, close: bool = False) -> ProcessInfo:
        """Writes to the process's stdin (it was started with `stdin=True`); `close` closes it."""
        call = _core.stdin_call(self.sandbox.id, self.id, data, close)
        self.info = ProcessInfo.from_dict(await self.sandbox.client._json(call))
        return self.info

    async def close_stdin(self) -> ProcessInfo:
        return await self.write_stdin("", close=True)

    async def resize(self, rows: int, cols: int) -> ProcessInfo:
        """Sets the size of the process's terminal (it was started on one); the terminal sends
        SIGWINCH to its foreground job."""
        call = _core.resize_call(self.sandbox.id, self.id, rows, cols)
        self.info = ProcessInfo.from_dict(await self.sandbox.client._json(call))
        return self.info

    async def signal(self, signal: Union[str, int] = "TERM") -> ProcessInfo:
        """Sends `signal` (a name like `TERM`, or a number) to the process group."""
        call = _core.signal_call(self.sandbox.id, self.id, signal)
        self.info = ProcessInfo.from_dict(await self.sandbox.client._json(call))
        return self.info

    async def kill(self) -> None:
        """Kills the process tree and forgets the process (its id and tag are free again)."""
        try:
            await self.sandbox.client._json(_core.kill_call(self.sandbox.id, self.id))
        except errors.NotFound:
            pass


class AsyncPty(AsyncProcess):
    """A process on a pseudo-terminal (`AsyncSandbox.pty`): keystrokes in, what the terminal
    shows out (one stream, escape sequences included). It keeps `offset`, the byte of the output
    that `read`, `read_until` and iteration have reached, so each reads on from the last."""

    def __init__(
        self, sandbox: AsyncSandbox, process_id: str, info: Optional[ProcessInfo] = None, *, offset: int = 0
    ) -> None:
        super().__init__(sandbox, process_id, info)
        #: The byte offset of the output read so far.
        self.offset = offset

    async def write(self, data: Union[str, bytes]) -> ProcessInfo:
        """Types `data` into the terminal: text, or bytes sent as they are. Enter is `\\r`,
        Ctrl-C `\\x03` (SIGINT to the foreground job), Ctrl-D `\\x04`."""
        return await self.write_stdin(data if isinstance(data, bytes) else data.encode("utf-8"))

    async def send_eof(self) -> ProcessInfo:
        """Ctrl-D: end-of-file for a program reading a line."""
        return await self.write_stdin(b"", close=True)

    async def read(self, *, max_bytes: Optional[int] = None) -> str:
        """What the terminal showed since the last read (possibly nothing), without waiting."""
        chunk = await self.output(offset=self.offset, max_bytes=max_bytes)
        self.offset = chunk.next_offset
        return chunk.data

    async def read_until(self, text: str, *, timeout: Optional[float] = 30.0) -> str:
        """Waits until the terminal shows `text` after the last read, and answers everything up
        to and including it (the rest is read next). Raises `Timeout` (reason `client_timeout`)
        when it has not come within `timeout` seconds, and `Conflict` when the process exits
        before it comes."""
        _, upto = await self.expect([re.escape(text)], timeout=timeout)
        return upto

    async def expect(
        self, patterns: Sequence[Union[str, "re.Pattern[str]"]], *, timeout: Optional[float] = 30.0
    ) -> Tuple[int, str]:
        """Waits until the terminal shows a match of one of `patterns` (regular expressions, as
        pexpect's `expect`) after the last read; answers the index of the pattern whose match
        starts first (the lowest index on a tie) and everything up to the end of its match (the rest is read next).
        Raises `Timeout` (reason `client_timeout`) after `timeout` seconds, and `Conflict` when
        the process exits first."""
        compiled = [p if isinstance(p, re.Pattern) else re.compile(p) for p in patterns]
        deadline = None if timeout is None else time.monotonic() + timeout
        seen = ""
        offsets = _core.TextOffsets(self.offset)
        while True:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise errors.Timeout(
                    f"no match of {[p.pattern for p in compiled]} in {timeout} s; the terminal showed {seen[-500:]!r}",
                    reason="client_timeout",
                )
            call = _core.output_call(
                self.sandbox.id, self.id, stream="stdout", offset=offsets.end, max_bytes=None, follow=True
            )
            if remaining is not None:
                # A silent terminal sends nothing: wake up in time to give up at the deadline.
                call = call.with_timeout(min(remaining, _core.READ_UNTIL_STEP))
            try:
                async with AsyncOutputStream(self.sandbox.client, call) as events:
                    async for ev in events:
                        if ev.type == "data":
                            seen += ev.data
                            offsets.add(ev.offset, ev.next_offset, ev.data)
                            found = _core.first_match(compiled, seen)
                            if found is not None:
                                index, end = found
                                self.offset = offsets.at(end)
                                return index, seen[:end]
                        elif ev.type == "exit":
                            raise errors.Conflict(
                                f"the process exited before {[p.pattern for p in compiled]} showed; the terminal "
                                f"showed {seen[-500:]!r}"
                            )
                        if deadline is not None and time.monotonic() >= deadline:
                            break
            except errors.Timeout as e:
                if e.reason != "client_timeout":
                    raise

    async def __aiter__(self) -> AsyncIterator[str]:
        """What the terminal shows, as it comes, from the last read until the process exits."""
        async with self.follow(offset=self.offset) as events:
            async for ev in events:
                if ev.type == "data":
                    self.offset = ev.next_offset
                    yield ev.data
                elif ev.type == "exit":
                    self.offset = ev.next_offset


class AsyncSession:
    """A persistent shell in a sandbox (`AsyncSandbox.session`). Runs are one at a time."""

    def __init__(self, sandbox: AsyncSandbox, session_id: str, info: Optional[SessionInfo] = None) -> None:
        self.sandbox = sandbox
        self.id = session_id
        self.info = info

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.sandbox.id!r}, {self.id!r})"

    async def __aenter__(self) -> "AsyncSession":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def run(
        self,
        command: str,
        *,
        timeout: Optional[float] = None,
        max_output_bytes: Optional[int] = None,
        merge_output: bool = False,
    ) -> SessionResult:
        """Runs `command` in the shell. After `timeout` seconds the command is interrupted (SIGINT,
        then SIGKILL to what it started a second later); the shell stays, with its cwd and
        environment, and the result has `timed_out=True`. `merge_output` sends the command's
        stderr to its stdout (one pipe, order kept; `stderr` is empty)."""
        call = _core.session_run_call(self.sandbox.id, self.id, command, timeout, max_output_bytes, merge_output)
        return SessionResult.from_dict(await self.sandbox.client._json(call))

    async def interrupt(self) -> None:
        """Sends SIGINT to the running command; the shell carries on."""
        await self.sandbox.client._json(_core.session_interrupt_call(self.sandbox.id, self.id))

    async def close(self) -> None:
        """Ends the shell (a no-op when it is already gone, or its sandbox is)."""
        try:
            await self.sandbox.client._json(_core.session_delete_call(self.sandbox.id, self.id))
        except (errors.NotFound, errors.Gone):
            pass


class AsyncJob:
    """A job: its quota, and a heartbeat renewing the lease of all its sandboxes at once.

    The heartbeat runs in the background until `close()`. As a context manager, leaving the
    block closes the job and, with `release_on_exit` (the default), releases every sandbox of the
    job (`DELETE /v1/jobs/{name}`).
    """

    def __init__(self, client: AsyncSandman, info: JobInfo, *, release_on_exit: bool = True) -> None:
        self.client = client
        self.name = info.name
        #: The job as last seen.
        self.info = info
        self.release_on_exit = release_on_exit
        #: The error of the last heartbeat, or None when it succeeded.
        self.heartbeat_error: Optional[BaseException] = None
        #: How many heartbeats succeeded.
        self.heartbeats = 0
        self._ticker: Optional[_rt.Ticker] = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"

    async def __aenter__(self) -> "AsyncJob":
        return self

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        await self.close()
        if self.release_on_exit:
            try:
                await self.delete()
            except errors.NotFound:
                pass
            except errors.SandmanError as e:
                if exc_type is None:
                    raise
                _core.log.warning("could not release job %s while handling %s: %s", self.name, exc_type.__name__, e)

    def start_heartbeat(self, interval: Optional[float] = None) -> None:
        """Starts the background heartbeat (`client.job` does, unless `heartbeat=False`)."""
        if self._ticker is not None:
            return
        if interval is None:
            interval = self.info.lease_s / 3.0 if self.info.lease_s else 10.0
        self._ticker = _rt.Ticker(max(0.05, interval), self._beat, f"sandman heartbeat of job {self.name}")
        self._ticker.start()

    @property
    def heartbeat_running(self) -> bool:
        return self._ticker is not None and self._ticker.running

    async def _beat(self) -> None:
        try:
            await self.heartbeat()
            self.heartbeat_error = None
        except Exception as e:
            self.heartbeat_error = e
            raise

    async def close(self) -> None:
        """Stops the heartbeat. The job's sandboxes stay until released or their lease lapses."""
        ticker, self._ticker = self._ticker, None
        if ticker is not None:
            await ticker.stop()

    async def create(self, image: Optional[str] = None, **kwargs: Any) -> AsyncSandbox:
        """`AsyncSandman.create` with `job=` this job."""
        return await self.client.create(image, job=self.name, **kwargs)

    async def heartbeat(self) -> JobAction:
        """Renews the lease of every sandbox of the job, now."""
        action = await self.client.heartbeat(self.name)
        self.heartbeats += 1
        return action

    async def refresh(self) -> JobInfo:
        """The job's quota and usage (live and created counts, last heartbeat)."""
        self.info = await self.client.get_job(self.name)
        return self.info

    async def usage(self) -> JobUsage:
        """What the job's ended sandboxes used (`AsyncSandman.job_usage`)."""
        return await self.client.job_usage(self.name)

    async def sandboxes(self, *, state: Optional[str] = None) -> List[SandboxInfo]:
        return await self.client.list(job=self.name, state=state)

    async def delete(self) -> JobAction:
        """Releases every sandbox of the job (`job_deleted`) and forgets the job."""
        return await self.client.delete_job(self.name)


class AsyncStream(Generic[T]):
    """An NDJSON stream of the server, parsed line by line as it arrives.

    Iterate it; the call is sent on the first item. Close it (or use it as a context manager)
    to drop the connection before the end.
    """

    _what = "event"

    def __init__(self, client: AsyncSandman, call: Call, parse: Callable[[Dict[str, Any]], Optional[T]]) -> None:
        self._client = client
        self._call = call
        self._parse = parse
        self._response: Optional[httpx.Response] = None
        self._lines: Optional[AsyncIterator[str]] = None
        self._done = False

    def __aiter__(self: S) -> S:
        return self

    async def __anext__(self) -> T:
        if self._done:
            raise StopAsyncIteration
        if self._lines is None:
            self._response = await self._client._send(self._call, stream=True)
            self._lines = self._response.aiter_lines()
        while True:
            try:
                line = await self._lines.__anext__()
            except StopAsyncIteration:
                await self.aclose()
                self._ended()
                raise
            except httpx.TransportError as e:
                await self.aclose()
                raise _core.transport_error(e, self._client.url) from e
            if not line.strip():
                continue
            try:
                data = json.loads(line)
            except ValueError as e:
                await self.aclose()
                raise _core.bad_line(line, e) from e
            item = self._parse(data)
            if item is not None:
                self._seen(item)
                return item

    def _seen(self, item: T) -> None:
        pass

    def _ended(self) -> None:
        pass

    async def aclose(self) -> None:
        self._done = True
        response, self._response = self._response, None
        if response is not None:
            await response.aclose()

    async def __aenter__(self: S) -> S:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()


class AsyncExecStream(AsyncStream[ExecEvent]):
    """The events of `AsyncSandbox.exec_stream`. After the last one, `exit` is the command's
    exit status. A stream that ends without `exit` raises `Unavailable`."""

    _what = "exec"

    def __init__(self, client: AsyncSandman, call: Call) -> None:
        super().__init__(client, call, ExecEvent.from_dict)
        self.exit: Optional[ExitStatus] = None

    def _seen(self, item: ExecEvent) -> None:
        if item.type == "exit":
            self.exit = item.exit

    def _ended(self) -> None:
        if self.exit is None:
            raise _core.stream_ended_early("exec")


class AsyncOutputStream(AsyncStream[OutputEvent]):
    """The events of `AsyncProcess.follow`. After the last one, `exit` is the exit status.
    `offset` is the byte offset where the events read so far end: a follow that broke resumes
    there (`process.follow(offset=stream.offset)`) with nothing repeated or lost."""

    _what = "output"

    def __init__(self, client: AsyncSandman, call: Call, offset: int = 0) -> None:
        super().__init__(client, call, OutputEvent.from_dict)
        self.exit: Optional[ExitStatus] = None
        #: Where the output read so far ends, in bytes.
        self.offset = offset

    def _seen(self, item: OutputEvent) -> None:
        if item.type == "data":
            self.offset = item.next_offset
        elif item.type == "dropped":
            self.offset = item.offset + item.bytes
        elif item.type == "exit":
            self.exit = item.exit
            self.offset = item.next_offset

    def _ended(self) -> None:
        if self.exit is None:
            raise _core.stream_ended_early("output")

