"""The client (`sandman/_async` is written by hand; `sandman/_sync` is generated from it)."""

from .client import (
    AsyncExecStream,
    AsyncJob,
    AsyncOutputStream,
    AsyncProcess,
    AsyncSandbox,
    AsyncSandman,
    AsyncSession,
    AsyncStream,
)

__all__ = [
    "AsyncSandman",
    "AsyncSandbox",
    "AsyncProcess",
    "AsyncSession",
    "AsyncJob",
    "AsyncStream",
    "AsyncExecStream",
    "AsyncOutputStream",
]
