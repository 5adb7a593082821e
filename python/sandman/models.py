"""What the server answers, as typed, immutable records (no I/O here).

Each record is parsed from the wire's JSON with `from_dict`, which ignores fields it does not know
so that a newer server does not break an older SDK. Times are milliseconds since the Unix epoch,
as on the wire; durations given to the SDK are seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

__all__ = [
    "Usage",
    "ExitStatus",
    "ExecResult",
    "ExecEvent",
    "DeterminismRun",
    "DeterminismResult",
    "ProcessInfo",
    "OutputChunk",
    "OutputEvent",
    "SessionInfo",
    "SessionResult",
    "FileStat",
    "DirListing",
    "ExtractResult",
    "DaemonInfo",
    "SandboxInfo",
    "JobInfo",
    "JobAction",
    "JobUsage",
    "PoolInfo",
    "PreparedImage",
    "PrepareResult",
    "Event",
    "Asked",
    "Applied",
    "Observed",
    "Mismatch",
    "ConditionsRecord",
    "SignedConditions",
    "Verification",
    "Health",
    "REASONS",
    "PREPARE_PHASES",
]

#: Why a sandbox ended (`SandboxInfo.reason`, `Event.reason`, `Gone.reason`), as the server's wire
#: enum has them. `conditions_mismatch`: an `eval` sandbox whose daemon observed other limits,
#: network, timezone or locale than the provider applied (the message names each difference).
#: `create_interrupted`: the server stopped while creating it; a retry of the create with the same
#: idempotency key makes a new one. `resource_exhausted`: the server or the machine could not hold
#: one more sandbox (the message names the limit); a retry after others are released may succeed.
#: `daemon_untrusted`: what answered at the sandbox's daemon's address did not prove the sandbox's
#: token on a new connection of the server's (its socket was replaced from inside): the sandbox was
#: removed, and nothing was sent there. A newer server may send a reason not listed here; the SDK passes it through as a string.
REASONS = (
    "released",
    "lease_expired",
    "idle_expired",
    "ttl_expired",
    "job_deleted",
    "image_pull_failed",
    "unschedulable",
    "daemon_start_failed",
    "ready_timeout",
    "oom_killed",
    "evicted",
    "node_lost",
    "provider_error",
    "setup_failed",
    "queue_timeout",
    "conditions_mismatch",
    "create_interrupted",
    "resource_exhausted",
    "daemon_untrusted",
)

#: Where the preparation of an image is (`Event.phase` of a `prepare` event): `started`, then
#: `pulling` lines as nodes report, then `ready` or `failed`.
PREPARE_PHASES = ("started", "pulling", "ready", "failed")


def _opt_int(value: Any) -> Optional[int]:
    return None if value is None else int(value)


def _opt_float(value: Any) -> Optional[float]:
    return None if value is None else float(value)


def _opt_str(value: Any) -> Optional[str]:
    return None if value is None else str(value)


@dataclass(frozen=True)
class Usage:
    """Resource usage of a finished process tree (from `wait4`)."""

    cpu_user_ms: int = 0
    cpu_system_ms: int = 0
    #: Peak resident set of the largest process waited for, in KiB.
    max_rss_kib: int = 0

    @classmethod
    def from_dict(cls, d: Optional[Mapping[str, Any]]) -> "Usage":
        d = d or {}
        return cls(int(d.get("cpu_user_ms", 0)), int(d.get("cpu_system_ms", 0)), int(d.get("max_rss_kib", 0)))


@dataclass(frozen=True)
class ExitStatus:
    """How a process ended."""

    #: The exit code, when the process exited by itself.
    exit_code: Optional[int]
    #: The signal that killed it, when one did.
    signal: Optional[int] = None
    #: True when it was killed for exceeding its timeout.
    timed_out: bool = False
    duration_ms: int = 0
    usage: Usage = field(default_factory=Usage)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ExitStatus":
        return cls(
            exit_code=_opt_int(d.get("exit_code")),
            signal=_opt_int(d.get("signal")),
            timed_out=bool(d.get("timed_out", False)),
            duration_ms=int(d.get("duration_ms", 0)),
            usage=Usage.from_dict(d.get("usage")),
        )

    @property
    def ok(self) -> bool:
        """Exited with code 0, in time."""
        return self.exit_code == 0 and not self.timed_out


@dataclass(frozen=True)
class ExecResult:
    """A command run to completion (`Sandbox.exec`)."""

    exit_code: Optional[int]
    stdout: str
    stderr: str
    signal: Optional[int] = None
    timed_out: bool = False
    duration_ms: int = 0
    usage: Usage = field(default_factory=Usage)
    stdout_truncated: bool = False
    stderr_truncated: bool = False

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ExecResult":
        status = ExitStatus.from_dict(d)
        return cls(
            exit_code=status.exit_code,
            stdout=str(d.get("stdout", "")),
            stderr=str(d.get("stderr", "")),
            signal=status.signal,
            timed_out=status.timed_out,
            duration_ms=status.duration_ms,
            usage=status.usage,
            stdout_truncated=bool(d.get("stdout_truncated", False)),
            stderr_truncated=bool(d.get("stderr_truncated", False)),
        )

    @property
    def ok(self) -> bool:
        """Exited with code 0, in time."""
        return self.exit_code == 0 and not self.timed_out


@dataclass(frozen=True)
class DeterminismRun:
    """One run of `Sandman.check_determinism`: the command once, in a fresh sandbox."""

    #: The sandbox it ran in (released since).
    sandbox: str
    #: Which distinct result it gave: an index into `DeterminismResult.results` (0 is the first
    #: run's).
    result: int
    exit_code: Optional[int]
    signal: Optional[int]
    timed_out: bool
    #: Wall time of the command.
    duration_ms: int
    #: User plus system CPU time of the command.
    cpu_ms: int
    #: Peak resident set of its largest process.
    max_rss_kib: int
    stdout_bytes: int
    stderr_bytes: int


@dataclass(frozen=True)
class DeterminismResult:
    """Whether one command gave the same result in fresh sandboxes of one spec
    (`Sandman.check_determinism`). Two runs agree when their exit code, signal, timeout, stdout
    and stderr are all equal; durations and resource use are reported, never compared."""

    #: Every run gave the same result.
    agree: bool
    #: How many distinct results the runs gave (1 when they agree).
    distinct: int
    #: What differs between the distinct results, of `exit` (code, signal or timeout), `stdout`,
    #: `stderr`, in that order; empty when they agree.
    differs_in: List[str]
    #: The runs, in the order they were started.
    runs: List[DeterminismRun]
    #: One `ExecResult` per distinct result: the first run's that gave it.
    results: List[ExecResult]

    @classmethod
    def judge(cls, results: Sequence[Tuple[str, ExecResult]]) -> "DeterminismResult":
        """Groups `(sandbox id, result)` pairs, in run order, by what must be equal to agree."""

        def outcome(r: ExecResult) -> Tuple[Optional[int], Optional[int], bool, str, str]:
            return (r.exit_code, r.signal, r.timed_out, r.stdout, r.stderr)

        seen: List[Tuple[Optional[int], Optional[int], bool, str, str]] = []
        firsts: List[ExecResult] = []
        runs: List[DeterminismRun] = []
        for sandbox, r in results:
            o = outcome(r)
            if o not in seen:
                seen.append(o)
                firsts.append(r)
            runs.append(
                DeterminismRun(
                    sandbox=sandbox,
                    result=seen.index(o),
                    exit_code=r.exit_code,
                    signal=r.signal,
                    timed_out=r.timed_out,
                    duration_ms=r.duration_ms,
                    cpu_ms=r.usage.cpu_user_ms + r.usage.cpu_system_ms,
                    max_rss_kib=r.usage.max_rss_kib,
                    stdout_bytes=len(r.stdout.encode()),
                    stderr_bytes=len(r.stderr.encode()),
                )
            )
        differs_in: List[str] = []
        if seen:
            first = seen[0]
            if any(o[:3] != first[:3] for o in seen):
                differs_in.append("exit")
            if any(o[3] != first[3] for o in seen):
                differs_in.append("stdout")
            if any(o[4] != first[4] for o in seen):
                differs_in.append("stderr")
        return cls(agree=len(seen) <= 1, distinct=len(seen), differs_in=differs_in, runs=runs, results=firsts)


@dataclass(frozen=True)
class ExecEvent:
    """One event of `Sandbox.exec_stream`: `started` (with `pid`), `stdout` or `stderr` (with
    `data`), and a last `exit` (with `exit` and the truncation flags)."""

    type: str
    data: str = ""
    pid: Optional[int] = None
    exit: Optional[ExitStatus] = None
    stdout_truncated: bool = False
    stderr_truncated: bool = False

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Optional["ExecEvent"]:
        kind = d.get("event")
        if kind == "keepalive":
            return None
        if kind == "started":
            return cls("started", pid=_opt_int(d.get("pid")))
        if kind in ("stdout", "stderr"):
            return cls(str(kind), data=str(d.get("data", "")))
        if kind == "exit":
            return cls(
                "exit",
                exit=ExitStatus.from_dict(d),
                stdout_truncated=bool(d.get("stdout_truncated", False)),
                stderr_truncated=bool(d.get("stderr_truncated", False)),
            )
        return None  # an event this SDK does not know yet


@dataclass(frozen=True)
class ProcessInfo:
    """A background process, running or exited (its exit is kept until it is killed)."""

    id: str
    pid: int
    argv: List[str]
    #: `running` or `exited`.
    state: str
    started_at_ms: int
    tag: Optional[str] = None
    exit: Optional[ExitStatus] = None
    stdout_bytes: int = 0
    stderr_bytes: int = 0
    stdin_open: bool = False
    #: The terminal's size, for a process started on one (`Sandbox.pty`, `start(pty=...)`).
    pty: Optional["TerminalSize"] = None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ProcessInfo":
        exit_ = d.get("exit")
        pty = d.get("pty")
        return cls(
            id=str(d["id"]),
            pid=int(d.get("pid", 0)),
            argv=[str(a) for a in d.get("argv", [])],
            state=str(d.get("state", "running")),
            started_at_ms=int(d.get("started_at_ms", 0)),
            tag=d.get("tag"),
            exit=ExitStatus.from_dict(exit_) if exit_ is not None else None,
            stdout_bytes=int(d.get("stdout_bytes", 0)),
            stderr_bytes=int(d.get("stderr_bytes", 0)),
            stdin_open=bool(d.get("stdin_open", False)),
            pty=TerminalSize(rows=int(pty["rows"]), cols=int(pty["cols"])) if pty else None,
        )

    @property
    def running(self) -> bool:
        return self.state == "running"


@dataclass(frozen=True)
class TerminalSize:
    """A pseudo-terminal's size in character cells."""

    rows: int
    cols: int


@dataclass(frozen=True)
class ImageConfig:
    """What an image says about running it (its `Config`), where the provider knows it (docker)."""

    user: Optional[str] = None
    workdir: Optional[str] = None
    env: Dict[str, str] = field(default_factory=dict)
    entrypoint: Optional[List[str]] = None
    cmd: Optional[List[str]] = None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ImageConfig":
        def strings(v: Any) -> Optional[List[str]]:
            return None if v is None else [str(x) for x in v]

        return cls(
            user=d.get("user"),
            workdir=d.get("workdir"),
            env={str(k): str(v) for k, v in (d.get("env") or {}).items()},
            entrypoint=strings(d.get("entrypoint")),
            cmd=strings(d.get("cmd")),
        )


@dataclass(frozen=True)
class OutputChunk:
    """Output of a background process from a byte offset (`Process.output`)."""

    stream: str
    #: Where `data` starts: the requested offset, or later when bytes there were dropped.
    offset: int
    #: The offset to ask for next.
    next_offset: int
    #: Bytes between the requested offset and `offset` that retention dropped.
    dropped: int
    data: str
    #: True when the process has exited and nothing follows `next_offset`.
    eof: bool

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "OutputChunk":
        return cls(
            stream=str(d.get("stream", "stdout")),
            offset=int(d.get("offset", 0)),
            next_offset=int(d.get("next_offset", 0)),
            dropped=int(d.get("dropped", 0)),
            data=str(d.get("data", "")),
            eof=bool(d.get("eof", False)),
        )


@dataclass(frozen=True)
class OutputEvent:
    """One event of `Process.follow`: `data` (with `offset`, `next_offset`, `data`), `dropped`
    (with `offset`, `bytes`), and a last `exit` (with `exit` and `next_offset`).

    A `data` event's text is the output's bytes from `offset` up to `next_offset`: resume a
    follow at `next_offset`. Its length says nothing of the bytes' (those that are not UTF-8
    arrive as U+FFFD)."""

    type: str
    offset: int = 0
    data: str = ""
    bytes: int = 0
    exit: Optional[ExitStatus] = None
    next_offset: int = 0

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Optional["OutputEvent"]:
        kind = d.get("event")
        if kind == "data":
            return cls(
                "data",
                offset=int(d.get("offset", 0)),
                data=str(d.get("data", "")),
                next_offset=int(d.get("next_offset", 0)),
            )
        if kind == "dropped":
            return cls("dropped", offset=int(d.get("offset", 0)), bytes=int(d.get("bytes", 0)))
        if kind == "exit":
            return cls("exit", exit=ExitStatus.from_dict(d), next_offset=int(d.get("next_offset", 0)))
        return None  # keepalive, or an event this SDK does not know yet


@dataclass(frozen=True)
class SessionInfo:
    """A persistent shell."""

    id: str
    shell: str
    pid: int
    #: False once the shell has died.
    alive: bool

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "SessionInfo":
        return cls(str(d["id"]), str(d.get("shell", "")), int(d.get("pid", 0)), bool(d.get("alive", False)))


@dataclass(frozen=True)
class SessionResult:
    """One command run in a session (`Session.run`)."""

    #: The command's `$?`; None when the session died before it finished.
    exit_code: Optional[int]
    stdout: str
    stderr: str
    timed_out: bool = False
    duration_ms: int = 0
    stdout_truncated: bool = False
    stderr_truncated: bool = False

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "SessionResult":
        return cls(
            exit_code=_opt_int(d.get("exit_code")),
            stdout=str(d.get("stdout", "")),
            stderr=str(d.get("stderr", "")),
            timed_out=bool(d.get("timed_out", False)),
            duration_ms=int(d.get("duration_ms", 0)),
            stdout_truncated=bool(d.get("stdout_truncated", False)),
            stderr_truncated=bool(d.get("stderr_truncated", False)),
        )

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


@dataclass(frozen=True)
class FileStat:
    """Metadata of one path in a sandbox (a symlink is described, not followed)."""

    path: str
    #: `file`, `dir`, `symlink` or `other`.
    kind: str
    size: int
    #: Permission bits, e.g. `0o644`.
    mode: int
    uid: int = 0
    gid: int = 0
    mtime_ms: int = 0
    link_target: Optional[str] = None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "FileStat":
        return cls(
            path=str(d["path"]),
            kind=str(d.get("kind", "other")),
            size=int(d.get("size", 0)),
            mode=int(d.get("mode", 0)),
            uid=int(d.get("uid", 0)),
            gid=int(d.get("gid", 0)),
            mtime_ms=int(d.get("mtime_ms", 0)),
            link_target=d.get("link_target"),
        )


@dataclass(frozen=True)
class DirListing:
    """Entries below a directory, depth-first, with absolute paths."""

    path: str
    entries: List[FileStat]
    #: True when the listing stopped at the daemon's entry limit.
    truncated: bool = False

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "DirListing":
        return cls(
            path=str(d["path"]),
            entries=[FileStat.from_dict(e) for e in d.get("entries", [])],
            truncated=bool(d.get("truncated", False)),
        )


@dataclass(frozen=True)
class ExtractResult:
    """An uploaded tar, extracted (`Sandbox.upload`)."""

    path: str
    entries: int
    #: Bytes of file content written.
    bytes: int

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ExtractResult":
        return cls(str(d["path"]), int(d.get("entries", 0)), int(d.get("bytes", 0)))


@dataclass(frozen=True)
class DaemonInfo:
    """The sandbox's daemon (`Sandbox.daemon_info`)."""

    version: str
    uptime_ms: int
    pid: int
    processes_running: int
    processes: int
    sessions: int
    lease_ms: Optional[int] = None
    lease_remaining_ms: Optional[int] = None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "DaemonInfo":
        return cls(
            version=str(d.get("version", "")),
            uptime_ms=int(d.get("uptime_ms", 0)),
            pid=int(d.get("pid", 0)),
            processes_running=int(d.get("processes_running", 0)),
            processes=int(d.get("processes", 0)),
            sessions=int(d.get("sessions", 0)),
            lease_ms=_opt_int(d.get("lease_ms")),
            lease_remaining_ms=_opt_int(d.get("lease_remaining_ms")),
        )


@dataclass(frozen=True)
class SandboxInfo:
    """A sandbox as the server reports it."""

    id: str
    image: str
    provider: str
    #: `queued`, `creating`, `ready`, `paused`, `releasing`, `gone` or `failed`.
    state: str
    profile: str
    network: str
    created_at_ms: int
    lease_s: int
    #: Why it ended (`released`, `lease_expired`, ...), once it has.
    reason: Optional[str] = None
    message: Optional[str] = None
    job: Optional[str] = None
    labels: Dict[str, str] = field(default_factory=dict)
    resources: Dict[str, Any] = field(default_factory=dict)
    ready_at_ms: Optional[int] = None
    ended_at_ms: Optional[int] = None
    lease_expires_at_ms: Optional[int] = None
    idle_expires_at_ms: Optional[int] = None
    ttl_expires_at_ms: Optional[int] = None
    #: How the provider isolates it: `user_namespace` (the process provider), `container`
    #: (docker), `pod` (kubernetes) or `none`; `None` from a server that does not say.
    isolation: Optional[str] = None
    #: The user its commands run as unless a call names one (the create's `user`, else the
    #: image's `USER` on docker); None for the daemon's own (root).
    user: Optional[str] = None
    #: The image's configuration where the provider knows it (docker), else None.
    image_config: Optional[ImageConfig] = None
    #: While `paused`: since when (milliseconds since the Unix epoch).
    paused_at_ms: Optional[int] = None
    #: Calls on it while paused resume it (the create's `auto_resume`).
    auto_resume: bool = False

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "SandboxInfo":
        image_config = d.get("image_config")
        return cls(
            id=str(d["id"]),
            image=str(d.get("image", "")),
            provider=str(d.get("provider", "")),
            state=str(d.get("state", "")),
            profile=str(d.get("profile", "default")),
            network=str(d.get("network", "egress")),
            created_at_ms=int(d.get("created_at_ms", 0)),
            lease_s=int(d.get("lease_s", 0)),
            reason=d.get("reason"),
            message=d.get("message"),
            job=d.get("job"),
            labels=dict(d.get("labels") or {}),
            resources=dict(d.get("resources") or {}),
            ready_at_ms=_opt_int(d.get("ready_at_ms")),
            ended_at_ms=_opt_int(d.get("ended_at_ms")),
            lease_expires_at_ms=_opt_int(d.get("lease_expires_at_ms")),
            idle_expires_at_ms=_opt_int(d.get("idle_expires_at_ms")),
            ttl_expires_at_ms=_opt_int(d.get("ttl_expires_at_ms")),
            isolation=d.get("isolation"),
            user=d.get("user"),
            image_config=ImageConfig.from_dict(image_config) if image_config else None,
            paused_at_ms=_opt_int(d.get("paused_at_ms")),
            auto_resume=bool(d.get("auto_resume", False)),
        )

    @property
    def live(self) -> bool:
        """Not yet ended (`gone` or `failed`)."""
        return self.state not in ("gone", "failed")


@dataclass(frozen=True)
class JobInfo:
    """A job's quota, defaults and usage."""

    name: str
    max_sandboxes: Optional[int]
    lease_s: Optional[int]
    #: Sandboxes of the job not yet ended.
    live: int
    #: Sandboxes of the job created since the server started.
    created: int
    last_heartbeat_ms: Optional[int] = None
    #: The whole spec as the server holds it.
    spec: Dict[str, Any] = field(default_factory=dict)
    #: Most creates a second the job is admitted (None: only the server's global rate).
    create_rate: Optional[float] = None
    #: The job's share of the create rate while jobs queue (None: 1).
    weight: Optional[float] = None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "JobInfo":
        spec = dict(d.get("spec") or {})
        return cls(
            name=str(d["name"]),
            max_sandboxes=_opt_int(spec.get("max_sandboxes")),
            lease_s=_opt_int(spec.get("lease_s")),
            live=int(d.get("live", 0)),
            created=int(d.get("created", 0)),
            last_heartbeat_ms=_opt_int(d.get("last_heartbeat_ms")),
            spec=spec,
            create_rate=_opt_float(spec.get("create_rate")),
            weight=_opt_float(spec.get("weight")),
        )


@dataclass(frozen=True)
class JobAction:
    """What a heartbeat renewed, or a job delete released."""

    job: str
    sandboxes: int

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "JobAction":
        return cls(str(d["job"]), int(d.get("sandboxes", 0)))


@dataclass(frozen=True)
class JobUsage:
    """`GET /v1/jobs/{job}/usage`: the sums of the accounting records of a job's ended sandboxes."""

    job: str
    #: Sandboxes of the job that have ended (and so are in the sums).
    sandboxes: int
    #: Sandboxes of the job alive now (not yet in the sums).
    live: int
    #: Ended sandboxes by reason (`released`, `lease_expired`, ...).
    by_reason: Dict[str, int] = field(default_factory=dict)
    sandbox_seconds: float = 0.0
    #: CPU (user + system) of the finished commands, where the daemon reported it.
    cpu_seconds: float = 0.0
    #: How many records carried CPU and memory figures.
    with_usage: int = 0
    #: Largest peak resident set of any finished command, in KiB.
    peak_memory_kib: Optional[int] = None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "JobUsage":
        return cls(
            job=str(d.get("job", "")),
            sandboxes=int(d.get("sandboxes", 0)),
            live=int(d.get("live", 0)),
            by_reason={str(k): int(v) for k, v in (d.get("by_reason") or {}).items()},
            sandbox_seconds=float(d.get("sandbox_seconds", 0.0)),
            cpu_seconds=float(d.get("cpu_seconds", 0.0)),
            with_usage=int(d.get("with_usage", 0)),
            peak_memory_kib=_opt_int(d.get("peak_memory_kib")),
        )


@dataclass(frozen=True)
class PoolInfo:
    """A warm pool: its spec and its sizes (`GET /v1/pools/{name}`)."""

    name: str
    image: str
    #: Sandboxes kept ready, unclaimed.
    min_ready: int
    #: Most unclaimed sandboxes (ready or being created) at once; None: `min_ready`.
    max: Optional[int]
    #: Ready and unclaimed now.
    ready: int
    #: Being created (or queued for admission) to refill the pool.
    creating: int
    #: Claimed from the pool and still alive.
    claimed: int
    #: Claims served since the server started.
    claims: int
    #: How many it keeps ready now: `min_ready`, or with `autoscale` what demand asks for.
    target: int = 0
    #: Whether the pool sizes itself from demand (`put_pool(..., autoscale=True)`).
    autoscale: bool = False
    #: With `autoscale`: creates served (or matched with nothing ready) a second, over the last 30 s.
    claim_rate: Optional[float] = None
    #: With `autoscale`: how long a refill took lately (a moving average), in seconds.
    refill_seconds: Optional[float] = None
    #: The last failure to refill the pool, while refills are failing.
    last_error: Optional[str] = None
    #: Shell commands run in each sandbox before it joins the pool.
    setup: List[str] = field(default_factory=list)
    #: The whole spec as the server holds it (resources, profile, network, env, lease_s, ...).
    spec: Dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "PoolInfo":
        spec = dict(d.get("spec") or {})
        return cls(
            name=str(d["name"]),
            image=str(spec.get("image", "")),
            min_ready=int(spec.get("min_ready", 0)),
            max=_opt_int(spec.get("max")),
            ready=int(d.get("ready", 0)),
            creating=int(d.get("creating", 0)),
            claimed=int(d.get("claimed", 0)),
            claims=int(d.get("claims", 0)),
            target=int(d.get("target", 0)),
            autoscale=bool(spec.get("autoscale", False)),
            claim_rate=_opt_float(d.get("claim_rate")),
            refill_seconds=_opt_float(d.get("refill_seconds")),
            last_error=_opt_str(d.get("last_error")),
            setup=[str(c) for c in spec.get("setup") or []],
            spec=spec,
        )


@dataclass(frozen=True)
class PreparedImage:
    """How the preparation of one image ended."""

    image: str
    ok: bool
    #: Nodes that have the image, of those that may run sandboxes (1 of 1 for one host).
    nodes_ready: int
    nodes_total: int
    duration_ms: int
    #: Why it failed.
    message: Optional[str] = None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "PreparedImage":
        return cls(
            image=str(d.get("image", "")),
            ok=bool(d.get("ok", False)),
            nodes_ready=int(d.get("nodes_ready", 0)),
            nodes_total=int(d.get("nodes_total", 0)),
            duration_ms=int(d.get("duration_ms", 0)),
            message=_opt_str(d.get("message")),
        )


@dataclass(frozen=True)
class PrepareResult:
    """`POST /v1/prepare`: one `PreparedImage` per image asked for, in the order asked."""

    images: List[PreparedImage]

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "PrepareResult":
        return cls([PreparedImage.from_dict(i) for i in d.get("images", [])])

    @property
    def ok(self) -> bool:
        """Every image is ready."""
        return all(i.ok for i in self.images)

    @property
    def failed(self) -> List[PreparedImage]:
        return [i for i in self.images if not i.ok]


@dataclass(frozen=True)
class Event:
    """One event of the server: a sandbox's lifecycle (`kind` `sandbox`: `sandbox` and `state`
    are set), the preparation of an image (`kind` `prepare`: `image` and `phase` are set, and
    for a `pulling` line `node`, `nodes_ready` and `nodes_total`), or a SandboxFusion API call
    the service failed (`kind` `fusion`: `message` says why, `sandbox` names its sandbox when it
    had one)."""

    seq: int
    time_ms: int
    #: The sandbox; empty for a `prepare` event.
    sandbox: str
    #: The sandbox's new state; empty for a `prepare` event.
    state: str
    job: Optional[str] = None
    reason: Optional[str] = None
    message: Optional[str] = None
    #: `sandbox`, `prepare` or `fusion`.
    kind: str = "sandbox"
    #: For a `queued` sandbox: about how many creates will be admitted before it.
    queue_position: Optional[int] = None
    #: For a `queued` sandbox: about how long until it is admitted.
    estimated_wait_ms: Optional[int] = None
    #: On the progress of a `creating` sandbox: the idempotency key of its create.
    idempotency_key: Optional[str] = None
    #: For a `prepare` event: the image.
    image: Optional[str] = None
    #: For a `prepare` event: `started`, `pulling`, `ready` or `failed` (see `PREPARE_PHASES`).
    phase: Optional[str] = None
    #: For a `pulling` line: the node it is about.
    node: Optional[str] = None
    #: For a `prepare` event: nodes that have the image so far, of `nodes_total`.
    nodes_ready: Optional[int] = None
    nodes_total: Optional[int] = None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Event":
        return cls(
            seq=int(d.get("seq", 0)),
            time_ms=int(d.get("time_ms", 0)),
            sandbox=str(d.get("sandbox", "")),
            state=str(d.get("state", "")),
            job=d.get("job"),
            reason=d.get("reason"),
            message=d.get("message"),
            kind=str(d.get("kind", "sandbox")),
            queue_position=_opt_int(d.get("queue_position")),
            estimated_wait_ms=_opt_int(d.get("estimated_wait_ms")),
            idempotency_key=_opt_str(d.get("idempotency_key")),
            image=_opt_str(d.get("image")),
            phase=_opt_str(d.get("phase")),
            node=_opt_str(d.get("node")),
            nodes_ready=_opt_int(d.get("nodes_ready")),
            nodes_total=_opt_int(d.get("nodes_total")),
        )

    @classmethod
    def from_stream(cls, d: Mapping[str, Any]) -> Optional["Event"]:
        """A line of a followed event stream: an event, or None for a keep-alive."""
        if d.get("event", "sandbox") != "sandbox":
            return None
        return cls.from_dict(d)


# ---- conditions ----


@dataclass(frozen=True)
class Asked:
    """What a create asked for, as the conditions record keeps it."""

    image: str
    resources: Dict[str, Any]
    profile: str
    network: str

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Asked":
        return cls(
            image=str(d.get("image", "")),
            resources=dict(d.get("resources") or {}),
            profile=str(d.get("profile", "default")),
            network=str(d.get("network", "egress")),
        )


@dataclass(frozen=True)
class Applied:
    """What the provider applied to a sandbox, as the provider reports it (None: nothing applied,
    or it cannot tell)."""

    #: The image as it runs, pinned to its digest where the provider resolves one.
    image: Optional[str] = None
    #: CPU limit in cores.
    cpu: Optional[float] = None
    #: Memory limit in bytes.
    memory: Optional[int] = None
    #: Swap allowed beyond memory, in bytes (0: none).
    swap: Optional[int] = None
    #: Largest number of processes.
    pids: Optional[int] = None
    #: `none` (loopback only), `policy` (denied by a network policy) or `egress`.
    network: Optional[str] = None
    timezone: Optional[str] = None
    locale: Optional[str] = None
    #: Provider specifics (Docker's host config, the pod's QoS class, ...).
    details: Dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Applied":
        return cls(
            image=_opt_str(d.get("image")),
            cpu=_opt_float(d.get("cpu")),
            memory=_opt_int(d.get("memory")),
            swap=_opt_int(d.get("swap")),
            pids=_opt_int(d.get("pids")),
            network=_opt_str(d.get("network")),
            timezone=_opt_str(d.get("timezone")),
            locale=_opt_str(d.get("locale")),
            details=dict(d.get("details") or {}),
        )


@dataclass(frozen=True)
class Observed:
    """What the sandbox's daemon observes from inside: the machine, its cgroup limits, the limits
    it sets on commands, the network interfaces, timezone and locale."""

    daemon_version: str
    kernel: str
    cpu_model: str
    cpus_available: int
    network_interfaces: List[str]
    hostname: str
    #: The daemon is PID 1 of its pid namespace.
    pid1: bool
    #: cgroup cpu quota in cores.
    cgroup_cpu_limit: Optional[float] = None
    #: cgroup memory limit in bytes.
    cgroup_memory_limit: Optional[int] = None
    #: cgroup swap limit in bytes beyond memory.
    cgroup_swap_limit: Optional[int] = None
    cgroup_pids_limit: Optional[int] = None
    rlimit_as: Optional[int] = None
    rlimit_fsize: Optional[int] = None
    rlimit_nofile: Optional[int] = None
    timezone: Optional[str] = None
    locale: Optional[str] = None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Observed":
        return cls(
            daemon_version=str(d.get("daemon_version", "")),
            kernel=str(d.get("kernel", "")),
            cpu_model=str(d.get("cpu_model", "")),
            cpus_available=int(d.get("cpus_available", 0)),
            network_interfaces=[str(i) for i in d.get("network_interfaces") or []],
            hostname=str(d.get("hostname", "")),
            pid1=bool(d.get("pid1", False)),
            cgroup_cpu_limit=_opt_float(d.get("cgroup_cpu_limit")),
            cgroup_memory_limit=_opt_int(d.get("cgroup_memory_limit")),
            cgroup_swap_limit=_opt_int(d.get("cgroup_swap_limit")),
            cgroup_pids_limit=_opt_int(d.get("cgroup_pids_limit")),
            rlimit_as=_opt_int(d.get("rlimit_as")),
            rlimit_fsize=_opt_int(d.get("rlimit_fsize")),
            rlimit_nofile=_opt_int(d.get("rlimit_nofile")),
            timezone=_opt_str(d.get("timezone")),
            locale=_opt_str(d.get("locale")),
        )


@dataclass(frozen=True)
class Mismatch:
    """One place where what the provider applied and what the daemon observes differ."""

    #: `cpu`, `memory`, `swap`, `pids`, `network`, `timezone` or `locale`.
    field: str
    applied: str
    observed: str

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Mismatch":
        return cls(str(d.get("field", "")), str(d.get("applied", "")), str(d.get("observed", "")))


@dataclass(frozen=True)
class ConditionsRecord:
    """The conditions a sandbox runs under: asked, applied, observed, and where the last two
    differ."""

    sandbox: str
    provider: str
    server_version: str
    #: When the record was taken.
    recorded_ms: int
    asked: Asked
    applied: Applied
    observed: Observed
    mismatches: List[Mismatch] = field(default_factory=list)
    job: Optional[str] = None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ConditionsRecord":
        return cls(
            sandbox=str(d.get("sandbox", "")),
            provider=str(d.get("provider", "")),
            server_version=str(d.get("server_version", "")),
            recorded_ms=int(d.get("recorded_ms", 0)),
            asked=Asked.from_dict(d.get("asked") or {}),
            applied=Applied.from_dict(d.get("applied") or {}),
            observed=Observed.from_dict(d.get("observed") or {}),
            mismatches=[Mismatch.from_dict(m) for m in d.get("mismatches") or []],
            job=_opt_str(d.get("job")),
        )


@dataclass(frozen=True)
class SignedConditions:
    """`GET /v1/sandboxes/{id}/conditions`: the record and the server's HMAC-SHA256 over its
    canonical JSON. `raw` is the answer exactly as parsed: what `verify_conditions` and
    `client.verify` check (the typed fields drop what this SDK does not know, so they cannot)."""

    record: ConditionsRecord
    #: `hmac-sha256:<hex>`.
    signature: str
    #: The first 16 hex digits of the SHA-256 of the signing key: which server signed it.
    key_id: str
    raw: Dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "SignedConditions":
        return cls(
            record=ConditionsRecord.from_dict(d.get("record") or {}),
            signature=str(d.get("signature", "")),
            key_id=str(d.get("key_id", "")),
            raw=dict(d),
        )

    def to_dict(self) -> Dict[str, Any]:
        """The record as the server answered it (to store next to results, or to verify later)."""
        return dict(self.raw)

    @property
    def matches(self) -> bool:
        """What the daemon observed agrees with what the provider applied."""
        return not self.record.mismatches


@dataclass(frozen=True)
class Verification:
    """`POST /v1/verify`: whether a signed conditions record is intact and signed by this server."""

    valid: bool
    #: Why not, when it is not.
    problem: Optional[str] = None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Verification":
        return cls(bool(d.get("valid", False)), _opt_str(d.get("problem")))


@dataclass(frozen=True)
class Health:
    """`GET /healthz`."""

    status: str
    version: str
    provider: str
    #: How the provider isolates sandboxes (see `SandboxInfo.isolation`).
    isolation: Optional[str] = None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Health":
        return cls(
            str(d.get("status", "")), str(d.get("version", "")), str(d.get("provider", "")), d.get("isolation")
        )
