"""What the server answers, as typed, immutable records (no I/O here).

Each record is parsed from the wire's JSON with `from_dict`, which ignores fields it does not know
so that a newer server does not break an older SDK. Times are milliseconds since the Unix epoch,
as on the wire; durations given to the SDK are seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional

__all__ = [
    "Usage",
    "ExitStatus",
    "ExecResult",
    "ExecEvent",
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
    "Event",
    "Health",
]


def _opt_int(value: Any) -> Optional[int]:
    return None if value is None else int(value)


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

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ProcessInfo":
        exit_ = d.get("exit")
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
        )

    @property
    def running(self) -> bool:
        return self.state == "running"


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
    """One event of `Process.follow`: `data` (with `offset`, `data`), `dropped` (with `offset`,
    `bytes`), and a last `exit` (with `exit` and `next_offset`)."""

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
            return cls("data", offset=int(d.get("offset", 0)), data=str(d.get("data", "")))
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
    #: `queued`, `creating`, `ready`, `releasing`, `gone` or `failed`.
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

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "SandboxInfo":
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
class Event:
    """One lifecycle event of a sandbox."""

    seq: int
    time_ms: int
    sandbox: str
    state: str
    job: Optional[str] = None
    reason: Optional[str] = None
    message: Optional[str] = None

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
        )

    @classmethod
    def from_stream(cls, d: Mapping[str, Any]) -> Optional["Event"]:
        """A line of a followed event stream: an event, or None for a keep-alive."""
        if d.get("event", "sandbox") != "sandbox":
            return None
        return cls.from_dict(d)


@dataclass(frozen=True)
class Health:
    """`GET /healthz`."""

    status: str
    version: str
    provider: str

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Health":
        return cls(str(d.get("status", "")), str(d.get("version", "")), str(d.get("provider", "")))
