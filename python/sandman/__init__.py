"""Sandman's Python SDK: sandboxes for agentic RL, from sync code or asyncio.

    from sandman import Sandman

    with Sandman() as client, client.create("host") as sb:
        print(sb.exec("echo hello").stdout)

`Sandman` and `AsyncSandman` are one design (the sync client is generated from the async one);
see docs/python.md for every call.
"""

from ._async.client import (
    AsyncExecStream,
    AsyncJob,
    AsyncOutputStream,
    AsyncProcess,
    AsyncSandbox,
    AsyncSandman,
    AsyncSession,
    AsyncStream,
)
from ._core import __version__
from ._sync.client import ExecStream, Job, OutputStream, Process, Sandbox, Sandman, Session, Stream
from .errors import (
    Conflict,
    Forbidden,
    Gone,
    Internal,
    InvalidArgument,
    NotFound,
    QuotaExceeded,
    SandmanError,
    Timeout,
    TooLarge,
    TransportError,
    Unauthorized,
    Unavailable,
)
from .models import (
    DaemonInfo,
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
    OutputChunk,
    OutputEvent,
    ProcessInfo,
    SandboxInfo,
    SessionInfo,
    SessionResult,
    Usage,
)

__all__ = [
    "__version__",
    # clients
    "Sandman",
    "Sandbox",
    "Process",
    "Session",
    "Job",
    "Stream",
    "ExecStream",
    "OutputStream",
    "AsyncSandman",
    "AsyncSandbox",
    "AsyncProcess",
    "AsyncSession",
    "AsyncJob",
    "AsyncStream",
    "AsyncExecStream",
    "AsyncOutputStream",
    # errors
    "SandmanError",
    "InvalidArgument",
    "Unauthorized",
    "Forbidden",
    "NotFound",
    "Gone",
    "Conflict",
    "TooLarge",
    "Timeout",
    "QuotaExceeded",
    "Unavailable",
    "Internal",
    "TransportError",
    # records
    "DaemonInfo",
    "DirListing",
    "Event",
    "ExecEvent",
    "ExecResult",
    "ExitStatus",
    "ExtractResult",
    "FileStat",
    "Health",
    "JobAction",
    "JobInfo",
    "OutputChunk",
    "OutputEvent",
    "ProcessInfo",
    "SandboxInfo",
    "SessionInfo",
    "SessionResult",
    "Usage",
]
