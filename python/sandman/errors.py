"""The exceptions of the SDK: one class per wire error code, all subclasses of `SandmanError`.

Every failed call raises one of these. `code` is the stable wire code, `reason` the machine-readable
reason where the server gives one (for `Gone`, why the sandbox ended: `released`, `lease_expired`,
...), `message` a sentence for people (never parse it), `status` the HTTP status when there was an
answer, and `retry_after` the seconds the server asked to wait before trying again (its
`Retry-After` header: a full admission queue answers 429 with it), when it asked.
"""

from __future__ import annotations

import json
from typing import Dict, Mapping, Optional, Type

__all__ = [
    "SandmanError",
    "InvalidArgument",
    "Unauthorized",
    "Forbidden",
    "NotFound",
    "Gone",
    "Conflict",
    "Paused",
    "TooLarge",
    "Timeout",
    "QuotaExceeded",
    "Unavailable",
    "Internal",
    "TransportError",
    "error_from_response",
]


class SandmanError(Exception):
    """Any failure of a Sandman call."""

    #: The wire code this class stands for.
    code: str = "unknown"

    def __init__(
        self,
        message: str,
        *,
        code: Optional[str] = None,
        reason: Optional[str] = None,
        status: Optional[int] = None,
        retry_after: Optional[float] = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        self.reason = reason
        self.status = status
        #: Seconds the server asked to wait before sending the call again (`Retry-After`).
        self.retry_after = retry_after
        #: How many times the call was sent before this error was raised (see the client's
        #: `retries`).
        self.attempts = 1

    def __str__(self) -> str:
        return self.message

    def __repr__(self) -> str:
        extra = f", reason={self.reason!r}" if self.reason else ""
        return f"{type(self).__name__}({self.message!r}{extra})"


class InvalidArgument(SandmanError):
    """400: the request is malformed or asks for something this server cannot do."""

    code = "invalid_argument"


class Unauthorized(SandmanError):
    """401: missing or wrong token."""

    code = "unauthorized"


class Forbidden(SandmanError):
    """403: the token may not do this."""

    code = "forbidden"


class NotFound(SandmanError):
    """404: no such sandbox, job, process, session or file."""

    code = "not_found"


class Gone(SandmanError):
    """410: the sandbox has ended; `reason` says why (`released`, `lease_expired`, ...)."""

    code = "gone"


class Conflict(SandmanError):
    """409: the target is in the wrong state (a tag in use, a sandbox not ready yet, ...)."""

    code = "conflict"


class Paused(Conflict):
    """409: the sandbox is paused; `resume()` it first, or create it with `auto_resume=True` so
    that calls resume it. A subclass of `Conflict`."""

    code = "paused"


class TooLarge(SandmanError):
    """413: a body over the server's limit."""

    code = "too_large"


class Timeout(SandmanError):
    """408: the server (or, with reason `client_timeout`, this client) gave up waiting."""

    code = "timeout"


class QuotaExceeded(SandmanError):
    """429: a job's quota (`max_sandboxes`) is used up, or the server's admission queue is full
    (then `retry_after` says when to try again; nothing was created, and the same create, with
    its idempotency key, may be sent again)."""

    code = "quota_exceeded"


class Unavailable(SandmanError):
    """503: the server is overloaded, a sandbox failed to come up, or it cannot be reached."""

    code = "unavailable"


class Internal(SandmanError):
    """500: a bug on the server's side."""

    code = "internal"


class TransportError(Unavailable):
    """The server could not be reached, or the connection broke mid-call (no HTTP answer).

    A subclass of `Unavailable`, so one `except Unavailable` covers an overloaded server and an
    unreachable one; the original `httpx` exception is its `__cause__`.
    """


_BY_CODE: Dict[str, Type[SandmanError]] = {
    cls.code: cls
    for cls in (
        InvalidArgument,
        Unauthorized,
        Forbidden,
        NotFound,
        Gone,
        Conflict,
        Paused,
        TooLarge,
        Timeout,
        QuotaExceeded,
        Unavailable,
        Internal,
    )
}

# The wire's one status mapping, for answers whose body is not the error JSON (a proxy in between).
_BY_STATUS: Dict[int, Type[SandmanError]] = {
    400: InvalidArgument,
    401: Unauthorized,
    403: Forbidden,
    404: NotFound,
    408: Timeout,
    409: Conflict,
    410: Gone,
    413: TooLarge,
    429: QuotaExceeded,
    500: Internal,
    502: Unavailable,
    503: Unavailable,
    504: Timeout,
}


def error_class(code: str) -> Type[SandmanError]:
    """The exception class of a wire code (`SandmanError` for a code this SDK does not know)."""
    return _BY_CODE.get(code, SandmanError)


def retry_after_seconds(headers: Optional[Mapping[str, str]]) -> Optional[float]:
    """The `Retry-After` header in seconds, when it is a number (the server never sends a date)."""
    value = None if headers is None else headers.get("retry-after")
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        return None
    return seconds if seconds >= 0 else None


def error_from_response(status: int, body: bytes, headers: Optional[Mapping[str, str]] = None) -> SandmanError:
    """The exception for an error answer: from its `{"error": {...}}` body when it has one."""
    retry_after = retry_after_seconds(headers)
    try:
        detail = json.loads(body.decode("utf-8"))["error"]
        code = str(detail["code"])
        message = str(detail.get("message", code))
        reason = detail.get("reason")
        return error_class(code)(message, code=code, reason=reason, status=status, retry_after=retry_after)
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        pass
    cls = _BY_STATUS.get(status, Internal if status >= 500 else InvalidArgument)
    text = body.decode("utf-8", "replace").strip()[:500] or f"HTTP {status}"
    return cls(f"HTTP {status}: {text}", status=status, retry_after=retry_after)
