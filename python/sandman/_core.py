"""The part of the SDK with no I/O: where the server and token come from, every call as a `Call`
(method, path, query, body, and whether it is safe to send again), the retry policy, and the tar
helpers of `upload`/`download`.

The async client (`sandman/_async/client.py`) sends these calls and parses the answers with
`sandman.models`; the sync client is generated from it. Start there.
"""

from __future__ import annotations

import functools
import io
import logging
import os
import random
import re
import ssl
import tarfile
import uuid
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union
from urllib.parse import quote

import httpx

from . import errors

__version__ = "0.1.0"

log = logging.getLogger("sandman")

DEFAULT_URL = "http://127.0.0.1:7777"
#: Timeout of control calls, in seconds (calls that run commands get their own).
DEFAULT_TIMEOUT = 60.0
#: How long a connect may take.
CONNECT_TIMEOUT = 10.0
#: How many times a call is sent again when that is safe (see `retry_after_error`).
DEFAULT_RETRIES = 5
#: How long after a call's first failure it may still be sent again, in seconds.
DEFAULT_RETRY_DEADLINE = 30.0
#: The most `retries` may be: more would only hide a server that is gone.
MAX_RETRIES = 100
#: Slack added to a call's own timeout (an exec's `timeout`) for the HTTP read timeout.
CALL_TIMEOUT_SLACK = 30.0
#: How long a create may take by default: the server's ready timeout (120 s) plus slack.
CREATE_TIMEOUT = 180.0
#: Connections the client keeps; rollouts run hundreds of calls at once.
DEFAULT_MAX_CONNECTIONS = 1024

Command = Union[str, Sequence[str]]


# ---- where the server and token are -------------------------------------------------------------


def default_state_dir() -> Path:
    """The server's state directory, as the server and the CLI find it: `$SANDMAN_STATE_DIR`,
    else `$XDG_STATE_HOME/sandman` (when absolute), else `~/.local/state/sandman`
    (`/var/lib/sandman` without a home)."""
    sandman = os.environ.get("SANDMAN_STATE_DIR")
    if sandman:
        return Path(sandman)
    xdg = os.environ.get("XDG_STATE_HOME")
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / "sandman"
    home = os.path.expanduser("~")
    if home and home != "~":
        return Path(home) / ".local" / "state" / "sandman"
    return Path("/var/lib/sandman")


def default_token_file() -> Path:
    return default_state_dir() / "token"


SOCKET_FILE = "sandman.sock"


def resolve_retries(retries: Optional[int]) -> int:
    """`retries`, else `$SANDMAN_RETRIES`, else `DEFAULT_RETRIES`: from 0 (never) to 100."""
    if retries is None:
        text = os.environ.get("SANDMAN_RETRIES", "").strip()
        if not text:
            return DEFAULT_RETRIES
        try:
            retries = int(text)
        except ValueError:
            raise errors.InvalidArgument(f"SANDMAN_RETRIES=`{text}` is not a count from 0 to {MAX_RETRIES}") from None
    if not 0 <= retries <= MAX_RETRIES:
        raise errors.InvalidArgument(f"retries={retries} is not a count from 0 to {MAX_RETRIES}")
    return retries


def resolve_retry_deadline(deadline: Optional[float]) -> float:
    """`retry_deadline`, else `$SANDMAN_RETRY_DEADLINE`, else `DEFAULT_RETRY_DEADLINE`: seconds
    from 0 to 3600."""
    if deadline is None:
        text = os.environ.get("SANDMAN_RETRY_DEADLINE", "").strip()
        if not text:
            return DEFAULT_RETRY_DEADLINE
        try:
            deadline = float(text)
        except ValueError:
            raise errors.InvalidArgument(f"SANDMAN_RETRY_DEADLINE=`{text}` is not seconds from 0 to 3600") from None
    if not 0.0 <= deadline <= 3600.0:  # also refuses NaN
        raise errors.InvalidArgument(f"retry_deadline={deadline} is not seconds from 0 to 3600")
    return float(deadline)


def resolve_url(url: Optional[str]) -> str:
    """`url`, else `$SANDMAN_URL`, else the server's Unix socket in its state directory when there
    is one (`unix:<state dir>/sandman.sock`: only the server's user may enter that directory, so
    nobody else can stand in for the server there), else `http://127.0.0.1:7777`; without a
    trailing slash."""
    url = url or os.environ.get("SANDMAN_URL")
    if not url:
        socket = default_state_dir() / SOCKET_FILE
        url = f"unix:{socket}" if socket.is_socket() else DEFAULT_URL
    url = url.strip().rstrip("/")
    if url.startswith("unix:/"):
        return url
    if not url.startswith(("http://", "https://")):
        raise errors.InvalidArgument(f"server URL `{url}` must start with http://, https:// or unix:/")
    return url


def split_url(url: str) -> Tuple[str, Optional[str]]:
    """The base URL requests go to, and the Unix socket they go through (for a `unix:` URL: any
    host will do, the socket is the server)."""
    if url.startswith("unix:"):
        return "http://sandman", url[len("unix:") :]
    return url, None


def resolve_token(token: Optional[str]) -> str:
    """`token`, else `$SANDMAN_TOKEN`, else the token file the server writes into its state
    directory (see `default_state_dir`)."""
    if token:
        return token
    token = os.environ.get("SANDMAN_TOKEN")
    if token:
        return token
    path = default_token_file()
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        text = ""
    except OSError as e:
        raise errors.Unauthorized(f"cannot read the token file `{path}`: {e}") from e
    if not text:
        raise errors.Unauthorized(
            f"no token: set SANDMAN_TOKEN, pass token=, or point SANDMAN_STATE_DIR at the server's "
            f"state directory (looked for `{path}`)"
        )
    return text


@functools.lru_cache(maxsize=None)
def _default_ssl_context() -> ssl.SSLContext:
    return ssl.create_default_context()


def verify(value: Union[bool, str, ssl.SSLContext]) -> Union[bool, str, ssl.SSLContext]:
    """TLS verification for httpx: `True` becomes one SSL context shared by every pool of every
    client (httpx would load the CA bundle again for each, ~50 ms apiece)."""
    return _default_ssl_context() if value is True else value


def headers(token: str) -> Dict[str, str]:
    return {"Authorization": f"Bearer {token}", "User-Agent": f"sandman-sdk-python/{__version__}"}


#: Connections per pool shard. httpcore's pool does work quadratic in its connections on every
#: request (httpcore 1.0: `_assign_requests_to_connections` counts all connections for each idle
#: one), which made a client with 200 busy connections spend ~7 ms of CPU per call; spreading
#: them over shards of this size keeps every pool small.
CONNECTIONS_PER_SHARD = 32
MAX_SHARDS = 32


def shards(max_connections: int) -> int:
    """How many connection pools a client of `max_connections` connections keeps."""
    return max(1, min(MAX_SHARDS, max_connections // CONNECTIONS_PER_SHARD))


def limits(max_connections: int, n_shards: int) -> httpx.Limits:
    """The limits of one of `n_shards` pools sharing `max_connections`."""
    per = max(1, -(-max_connections // n_shards))
    return httpx.Limits(max_connections=per, max_keepalive_connections=per)


def shard_of(call: "Call", n_shards: int, counter: int) -> int:
    """The pool a call goes through: by its sandbox (so its calls reuse that pool's
    connections), else by `counter` (round robin)."""
    if n_shards == 1:
        return 0
    if call.key:
        return zlib.crc32(call.key.encode("utf-8")) % n_shards
    return counter % n_shards


def timeout(seconds: Optional[float]) -> httpx.Timeout:
    """An HTTP timeout: `seconds` between bytes read (None: none), a bounded connect, and no
    limit on waiting for a pooled connection (concurrency is the caller's to bound)."""
    return httpx.Timeout(seconds, connect=CONNECT_TIMEOUT, pool=None)


# ---- calls -------------------------------------------------------------------------------------


@dataclass
class Call:
    """One HTTP call, built here and sent by the client's one `_send`."""

    method: str
    path: str
    params: Optional[Dict[str, str]] = None
    json: Any = None
    content: Optional[bytes] = None
    content_type: Optional[str] = None
    accept: str = "application/json"
    #: Safe to send again even when the first attempt may have reached the server.
    idempotent: bool = False
    #: The read timeout when this call sets its own (`has_timeout`); None means no limit.
    timeout: Optional[float] = None
    has_timeout: bool = False
    #: Which connection pool to use (see `shard_of`): the sandbox's id, or empty.
    key: str = ""

    def __post_init__(self) -> None:
        if not self.key and self.path.startswith("/v1/sandboxes/"):
            self.key = self.path.split("/", 4)[3]

    def with_timeout(self, seconds: Optional[float]) -> "Call":
        self.timeout = seconds
        self.has_timeout = True
        return self

    def request_headers(self) -> Dict[str, str]:
        h = {"Accept": self.accept}
        if self.content_type:
            h["Content-Type"] = self.content_type
        return h


def seg(s: str) -> str:
    """One path segment, escaped."""
    return quote(s, safe="")


def sandbox_path(sandbox_id: str, rest: str = "") -> str:
    return f"/v1/sandboxes/{seg(sandbox_id)}{rest}"


def job_path(name: str, rest: str = "") -> str:
    return f"/v1/jobs/{seg(name)}{rest}"


def ms(seconds: Optional[float]) -> Optional[int]:
    return None if seconds is None else max(0, int(round(seconds * 1000)))


def long_call_timeout(seconds: Optional[float]) -> Optional[float]:
    """The read timeout of a call that itself waits up to `seconds` (None: as long as it takes)."""
    return None if seconds is None else seconds + CALL_TIMEOUT_SLACK


def _drop_none(d: Dict[str, Any]) -> Dict[str, Any]:
    return {k: v for k, v in d.items() if v is not None and v != {}}


def command_fields(cmd: Command) -> Dict[str, Any]:
    """A shell string becomes `command` (run by the sandbox's `/bin/sh -c`); a list is `argv`."""
    if isinstance(cmd, str):
        return {"command": cmd}
    argv = [str(a) for a in cmd]
    if not argv:
        raise errors.InvalidArgument("argv is empty: pass a shell string or a non-empty list")
    return {"argv": argv}


def octal(mode: Optional[int]) -> Optional[str]:
    return None if mode is None else format(mode, "o")


def text_bytes(data: Union[str, bytes]) -> bytes:
    return data.encode("utf-8") if isinstance(data, str) else bytes(data)


# -- the server's calls --


def health_call() -> Call:
    return Call("GET", "/healthz", idempotent=True)


def create_call(
    image: Optional[str],
    *,
    job: Optional[str],
    resources: Optional[Mapping[str, Any]],
    profile: Optional[str],
    network: Optional[str],
    ttl: Optional[int],
    idle_timeout: Optional[int],
    lease: Optional[int],
    pool: Optional[str],
    setup: Optional[Sequence[str]],
    env: Optional[Mapping[str, str]],
    labels: Optional[Mapping[str, str]],
    provider: Optional[str],
    idempotency_key: Optional[str],
    wait: bool,
    wait_timeout: Optional[int],
    user: Optional[str] = None,
    auto_resume: bool = False,
) -> Call:
    """`POST /v1/sandboxes`, always keyed: a resend after a lost answer returns the same sandbox.

    With no `image`, `host` is asked for, unless `pool` names a pool: then the image is left out
    and the pool's is used."""
    if image is None and pool is None:
        image = "host"
    body = _drop_none(
        {
            "image": image,
            "provider": provider,
            "resources": dict(resources) if resources else None,
            "env": dict(env) if env else None,
            "labels": dict(labels) if labels else None,
            "job": job,
            "profile": profile,
            "network": network,
            "ttl_s": ttl,
            "idle_timeout_s": idle_timeout,
            "lease_s": lease,
            "pool": pool,
            "setup": setup_list(setup),
            "idempotency_key": idempotency_key or new_idempotency_key(),
            "wait_timeout_s": wait_timeout,
            "user": user,
        }
    )
    if auto_resume:
        body["auto_resume"] = True
    if not wait:
        body["wait"] = False
    read = CREATE_TIMEOUT if wait_timeout is None else wait_timeout + CALL_TIMEOUT_SLACK
    call = Call("POST", "/v1/sandboxes", json=body, idempotent=True, key=body["idempotency_key"])
    return call.with_timeout(read)


def setup_list(setup: Optional[Sequence[str]]) -> Optional[List[str]]:
    """Setup commands as the wire wants them: a list of shell strings (left out when empty). A
    lone string is refused rather than sent one character per command."""
    if setup is None:
        return None
    if isinstance(setup, str):
        raise errors.InvalidArgument("`setup` is a list of shell commands: pass [\"...\"], not a string")
    commands = [str(c) for c in setup]
    return commands or None


#: The label `check_determinism` puts on its sandboxes, valued with the check's id, so that what a
#: run could not release itself is found and released at the end.
DETERMINISM_LABEL = "sandman-determinism"


def new_idempotency_key() -> str:
    return f"py-{uuid.uuid4().hex}"


def list_call(job: Optional[str], state: Optional[str], label: Optional[str]) -> Call:
    return Call("GET", "/v1/sandboxes", params=_drop_none({"job": job, "state": state, "label": label}), idempotent=True)


def get_call(sandbox_id: str) -> Call:
    return Call("GET", sandbox_path(sandbox_id), idempotent=True)


def release_call(sandbox_id: str) -> Call:
    # A resend of a release that went through answers `gone` (released), which `release` accepts.
    return Call("DELETE", sandbox_path(sandbox_id), idempotent=True)


def keepalive_call(sandbox_id: str) -> Call:
    return Call("POST", sandbox_path(sandbox_id, "/keepalive"), idempotent=True)


def pause_call(sandbox_id: str) -> Call:
    # Pausing a paused sandbox answers it as it is: safe to send again.
    return Call("POST", sandbox_path(sandbox_id, "/pause"), idempotent=True)


def resume_call(sandbox_id: str) -> Call:
    return Call("POST", sandbox_path(sandbox_id, "/resume"), idempotent=True)


def put_job_call(
    name: str,
    *,
    max_sandboxes: Optional[int],
    lease: Optional[int],
    create_rate: Optional[float],
    weight: Optional[float],
) -> Call:
    body = _drop_none({"max_sandboxes": max_sandboxes, "lease_s": lease, "create_rate": create_rate, "weight": weight})
    return Call("PUT", job_path(name), json=body, idempotent=True)


def get_job_call(name: str) -> Call:
    return Call("GET", job_path(name), idempotent=True)


def delete_job_call(name: str) -> Call:
    return Call("DELETE", job_path(name), idempotent=True)


def heartbeat_call(name: str) -> Call:
    return Call("POST", job_path(name, "/heartbeat"), idempotent=True)


def job_usage_call(name: str) -> Call:
    return Call("GET", job_path(name, "/usage"), idempotent=True)


def pool_path(name: str) -> str:
    return f"/v1/pools/{seg(name)}"


def put_pool_call(
    name: str,
    image: str,
    *,
    min_ready: int,
    max: Optional[int],
    resources: Optional[Mapping[str, Any]],
    profile: Optional[str],
    network: Optional[str],
    env: Optional[Mapping[str, str]],
    setup: Optional[Sequence[str]],
    lease: Optional[int],
    provider: Optional[str],
    autoscale: bool = False,
) -> Call:
    """`PUT /v1/pools/{name}`: the whole spec, so sending it again sets the same pool.
    `autoscale` is sent only when set, as the server writes it (absent means false)."""
    body = _drop_none(
        {
            "image": image,
            "provider": provider,
            "resources": dict(resources) if resources else None,
            "profile": profile,
            "network": network,
            "env": dict(env) if env else None,
            "min_ready": min_ready,
            "max": max,
            "setup": setup_list(setup),
            "lease_s": lease,
            "autoscale": True if autoscale else None,
        }
    )
    return Call("PUT", pool_path(name), json=body, idempotent=True)


def get_pool_call(name: str) -> Call:
    return Call("GET", pool_path(name), idempotent=True)


def list_pools_call() -> Call:
    return Call("GET", "/v1/pools", idempotent=True)


def delete_pool_call(name: str) -> Call:
    # A resend of a delete that went through answers `not_found`, which `delete_pool` reports.
    return Call("DELETE", pool_path(name), idempotent=True)


def prepare_call(
    images: Sequence[str], *, job: Optional[str], hold_until: Optional[float], timeout: Optional[float]
) -> Call:
    """`POST /v1/prepare`. It answers once every image is ready or has failed, which may take as
    long as the slowest pull: the read timeout is `timeout` (None: no limit on the client's side;
    the server bounds control calls with its own `--request-timeout-s`). Preparing again does no
    harm, so it is resent where that is safe."""
    if isinstance(images, str):
        raise errors.InvalidArgument("`images` is a list of image names: pass [\"...\"], not a string")
    body = _drop_none({"images": [str(i) for i in images], "job": job, "hold_until": hold_until})
    return Call("POST", "/v1/prepare", json=body, idempotent=True).with_timeout(timeout)


def conditions_call(sandbox_id: str) -> Call:
    return Call("GET", sandbox_path(sandbox_id, "/conditions"), idempotent=True)


def verify_call(signed: Mapping[str, Any]) -> Call:
    # The record is sent back exactly as it was answered: the server checks its signature.
    return Call("POST", "/v1/verify", json=dict(signed), idempotent=True)


def events_call(
    job: Optional[str], after: Optional[int], follow: bool, idempotency_key: Optional[str] = None
) -> Call:
    params = _drop_none(
        {"job": job, "after": None if after is None else str(after), "idempotency_key": idempotency_key}
    )
    if follow:
        params["follow"] = "true"
        return Call("GET", "/v1/events", params=params, accept="application/x-ndjson", idempotent=True)
    return Call("GET", "/v1/events", params=params, idempotent=True)


# -- the daemon's calls, proxied under /v1/sandboxes/{id}/ --


def daemon_info_call(sandbox_id: str) -> Call:
    return Call("GET", sandbox_path(sandbox_id, "/info"), idempotent=True)


def exec_body(
    cmd: Command,
    *,
    timeout: Optional[float],
    env: Optional[Mapping[str, str]],
    cwd: Optional[str],
    user: Optional[str],
    stdin: Optional[Union[str, bytes]],
    max_output_bytes: Optional[int],
    merge_output: bool = False,
) -> Dict[str, Any]:
    body = command_fields(cmd)
    if isinstance(stdin, bytes):
        stdin = stdin.decode("utf-8")
    body.update(
        _drop_none(
            {
                "env": dict(env) if env else None,
                "cwd": cwd,
                "user": user,
                "stdin": stdin,
                "timeout_ms": ms(timeout),
                "max_output_bytes": max_output_bytes,
            }
        )
    )
    if merge_output:
        body["merge_output"] = True
    return body


def exec_call(sandbox_id: str, body: Dict[str, Any], timeout: Optional[float]) -> Call:
    # Never resent: the command may have run.
    return Call("POST", sandbox_path(sandbox_id, "/exec"), json=body).with_timeout(long_call_timeout(timeout))


def exec_stream_call(sandbox_id: str, body: Dict[str, Any]) -> Call:
    # Keep-alive lines arrive every 15 s, so the client's read timeout still finds a dead peer.
    return Call("POST", sandbox_path(sandbox_id, "/exec/stream"), json=body, accept="application/x-ndjson")


def start_call(
    sandbox_id: str,
    cmd: Command,
    *,
    tag: Optional[str],
    env: Optional[Mapping[str, str]],
    cwd: Optional[str],
    user: Optional[str],
    stdin: bool,
    retain_bytes: Optional[int],
    timeout: Optional[float],
    merge_output: bool = False,
    pty: Optional[Tuple[int, int]] = None,
) -> Call:
    body = command_fields(cmd)
    body.update(
        _drop_none(
            {
                "env": dict(env) if env else None,
                "cwd": cwd,
                "user": user,
                "tag": tag,
                "retain_bytes": retain_bytes,
                "timeout_ms": ms(timeout),
            }
        )
    )
    if stdin:
        body["stdin"] = True
    if merge_output:
        body["merge_output"] = True
    if pty is not None:
        rows, cols = pty
        body["pty"] = {"rows": int(rows), "cols": int(cols)}
    return Call("POST", sandbox_path(sandbox_id, "/processes"), json=body)


def list_processes_call(sandbox_id: str) -> Call:
    return Call("GET", sandbox_path(sandbox_id, "/processes"), idempotent=True)


def process_path(sandbox_id: str, process: str, rest: str = "") -> str:
    return sandbox_path(sandbox_id, f"/processes/{seg(process)}{rest}")


def process_call(sandbox_id: str, process: str) -> Call:
    return Call("GET", process_path(sandbox_id, process), idempotent=True)


def output_call(
    sandbox_id: str, process: str, *, stream: str, offset: int, max_bytes: Optional[int], follow: bool
) -> Call:
    params = _drop_none({"stream": stream, "offset": str(offset), "max_bytes": _opt_str(max_bytes)})
    if follow:
        params["follow"] = "true"
        return Call(
            "GET",
            process_path(sandbox_id, process, "/output"),
            params=params,
            accept="application/x-ndjson",
            idempotent=True,
        )
    return Call("GET", process_path(sandbox_id, process, "/output"), params=params, idempotent=True)


def _opt_str(v: Optional[int]) -> Optional[str]:
    return None if v is None else str(v)


def stdin_call(sandbox_id: str, process: str, data: Union[str, bytes], close: bool) -> Call:
    """Text goes as JSON; bytes go raw (`application/octet-stream`), so any byte gets through."""
    if isinstance(data, bytes):
        params = {"close": "true"} if close else None
        return Call(
            "POST",
            process_path(sandbox_id, process, "/stdin"),
            params=params,
            content=data,
            content_type="application/octet-stream",
        )
    body: Dict[str, Any] = {"data": data}
    if close:
        body["close"] = True
    return Call("POST", process_path(sandbox_id, process, "/stdin"), json=body)


def resize_call(sandbox_id: str, process: str, rows: int, cols: int) -> Call:
    return Call(
        "POST", process_path(sandbox_id, process, "/resize"), json={"rows": int(rows), "cols": int(cols)}, idempotent=True
    )


def port_path(sandbox_id: str, port: int, path: str = "") -> str:
    """`/v1/sandboxes/{id}/ports/{port}/{path}`: `127.0.0.1:{port}` inside the sandbox."""
    if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535:
        raise ValueError(f"port must be an integer from 1 to 65535, not {port!r}")
    return sandbox_path(sandbox_id, f"/ports/{port}/{path.lstrip('/')}")


def signal_call(sandbox_id: str, process: str, signal: Union[str, int]) -> Call:
    return Call("POST", process_path(sandbox_id, process, "/signal"), json={"signal": signal})


def wait_call(sandbox_id: str, process: str, timeout: float) -> Call:
    return Call(
        "POST", process_path(sandbox_id, process, "/wait"), json={"timeout_ms": ms(timeout)}, idempotent=True
    ).with_timeout(long_call_timeout(timeout))


def first_match(patterns: Sequence["re.Pattern[str]"], text: str) -> Optional[Tuple[int, int]]:
    """As pexpect: the pattern whose match starts first in `text` (the lowest index on a tie),
    and where that match ends; None when none matches."""
    best: Optional[Tuple[int, int, int]] = None
    for i, p in enumerate(patterns):
        m = p.search(text)
        if m is not None and (best is None or m.start() < best[0]):
            best = (m.start(), i, m.end())
    return None if best is None else (best[1], best[2])


class TextOffsets:
    """Where the characters of text read from a followed output lie in its bytes: each `data`
    event says where its text starts and ends (`offset`, `next_offset`). Inside an event a
    character's bytes are its UTF-8 length, and the bytes the event's U+FFFDs stood for are
    shared out among them evenly: exact for UTF-8 output and for invalid bytes that each became
    one U+FFFD; otherwise a position inside that event may be a byte or two off, never outside
    the event."""

    def __init__(self, start: int) -> None:
        #: (index of the event's first character, offset, next_offset, text), in order.
        self._spans: List[Tuple[int, int, int, str]] = []
        self._chars = 0
        self._end = start

    def add(self, offset: int, next_offset: int, text: str) -> None:
        self._spans.append((self._chars, offset, next_offset, text))
        self._chars += len(text)
        self._end = next_offset

    @property
    def end(self) -> int:
        """The byte offset after everything added: where a follow goes on."""
        return self._end

    def at(self, index: int) -> int:
        """The byte offset of character `index` of the text added (its length: `end`)."""
        for first, offset, next_offset, text in self._spans:
            if index < first + len(text):
                if index <= first:
                    return offset
                prefix = text[: index - first]
                at = len(prefix.encode("utf-8"))
                replaced = text.count("\ufffd")
                if replaced:
                    # Each U+FFFD is three bytes of text for the one to three it replaced.
                    missing = len(text.encode("utf-8")) - (next_offset - offset)
                    at -= prefix.count("\ufffd") * missing // replaced
                return offset + min(max(at, 0), next_offset - offset)
        return self._end


#: `Pty.read_until` follows a silent terminal for at most this long at a time, to keep its timeout.
READ_UNTIL_STEP = 5.0

#: One `/wait` call waits at most this long; `Process.wait()` with no timeout loops on it.
WAIT_STEP = 30.0


def kill_call(sandbox_id: str, process: str) -> Call:
    return Call("DELETE", process_path(sandbox_id, process), idempotent=True)


def create_session_call(
    sandbox_id: str,
    *,
    shell: Optional[str],
    env: Optional[Mapping[str, str]],
    cwd: Optional[str],
    user: Optional[str],
) -> Call:
    body = _drop_none({"shell": shell, "env": dict(env) if env else None, "cwd": cwd, "user": user})
    return Call("POST", sandbox_path(sandbox_id, "/sessions"), json=body)


def list_sessions_call(sandbox_id: str) -> Call:
    return Call("GET", sandbox_path(sandbox_id, "/sessions"), idempotent=True)


def session_path(sandbox_id: str, session: str, rest: str = "") -> str:
    return sandbox_path(sandbox_id, f"/sessions/{seg(session)}{rest}")


def session_run_call(
    sandbox_id: str,
    session: str,
    command: str,
    timeout: Optional[float],
    max_output_bytes: Optional[int],
    merge_output: bool = False,
) -> Call:
    body = _drop_none({"command": command, "timeout_ms": ms(timeout), "max_output_bytes": max_output_bytes})
    if merge_output:
        body["merge_output"] = True
    return Call("POST", session_path(sandbox_id, session, "/run"), json=body).with_timeout(long_call_timeout(timeout))


def session_interrupt_call(sandbox_id: str, session: str) -> Call:
    return Call("POST", session_path(sandbox_id, session, "/interrupt"))


def session_delete_call(sandbox_id: str, session: str) -> Call:
    return Call("DELETE", session_path(sandbox_id, session), idempotent=True)


def read_file_call(sandbox_id: str, path: str, offset: int, length: Optional[int]) -> Call:
    params = _drop_none({"path": path, "offset": str(offset) if offset else None, "length": _opt_str(length)})
    return Call(
        "GET", sandbox_path(sandbox_id, "/files"), params=params, accept="application/octet-stream", idempotent=True
    )


def write_file_call(
    sandbox_id: str,
    path: str,
    data: Union[str, bytes],
    mode: Optional[int],
    user: Optional[str] = None,
    fsync: bool = False,
) -> Call:
    # An atomic write of the whole body: sending it again writes the same file.
    return Call(
        "PUT",
        sandbox_path(sandbox_id, "/files"),
        params=_drop_none({"path": path, "mode": octal(mode), "user": user, "fsync": "true" if fsync else None}),
        content=text_bytes(data),
        content_type="application/octet-stream",
        idempotent=True,
    )


def stat_call(sandbox_id: str, path: str) -> Call:
    return Call("GET", sandbox_path(sandbox_id, "/stat"), params={"path": path}, idempotent=True)


def list_dir_call(sandbox_id: str, path: str, depth: Optional[int]) -> Call:
    return Call(
        "GET", sandbox_path(sandbox_id, "/dir"), params=_drop_none({"path": path, "depth": _opt_str(depth)}), idempotent=True
    )


def mkdir_call(sandbox_id: str, path: str, mode: Optional[int], user: Optional[str] = None) -> Call:
    params = _drop_none({"path": path, "mode": octal(mode), "user": user})
    return Call("POST", sandbox_path(sandbox_id, "/dir"), params=params, idempotent=True)


def remove_call(sandbox_id: str, path: str, recursive: bool) -> Call:
    params = {"path": path}
    if recursive:
        params["recursive"] = "true"
    return Call("DELETE", sandbox_path(sandbox_id, "/files"), params=params)


def move_call(sandbox_id: str, src: str, dst: str, overwrite: bool) -> Call:
    body: Dict[str, Any] = {"from": src, "to": dst}
    if overwrite:
        body["overwrite"] = True
    return Call("POST", sandbox_path(sandbox_id, "/move"), json=body)


def upload_tar_call(
    sandbox_id: str, path: str, data: bytes, user: Optional[str] = None, fsync: bool = False
) -> Call:
    return Call(
        "PUT",
        sandbox_path(sandbox_id, "/archive"),
        params=_drop_none({"path": path, "user": user, "fsync": "true" if fsync else None}),
        content=data,
        content_type="application/x-tar",
        idempotent=True,
    )


def download_tar_call(sandbox_id: str, path: str) -> Call:
    return Call(
        "GET", sandbox_path(sandbox_id, "/archive"), params={"path": path}, accept="application/x-tar", idempotent=True
    )


# ---- answers -----------------------------------------------------------------------------------


def as_list(body: Any, key: str) -> List[Any]:
    """A list answer: `{"<key>": [...]}`, or a bare list (as `GET /v1/sessions` answers)."""
    if isinstance(body, list):
        return body
    return list(body.get(key, []))


# ---- retries -----------------------------------------------------------------------------------
#
# A failure is one of three kinds, and the kind decides whether the call is sent again:
# - not sent (the connection could not be made: refused, a connect timeout): any call;
# - shed (503 with `Retry-After`, the server's load shedding at its edge, before anything ran):
#   any call, after the wait it asked for (at most 5 s);
# - maybe sent (the connection broke once the request was out): idempotent calls only.
# Resends wait 0.1, 0.2, 0.4 ... s (at most 2 s) times a random factor from 0.5 to 1.5; none
# starts past `retries` resends or `retry_deadline` seconds after the first failure. The Rust
# client (crates/client/src/retry.rs) follows the same rules.

# Errors raised before any byte of the request could reach the server: always safe to resend.
_NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)
# Errors after which the server may have acted on the request: resent only for idempotent calls.
_MAYBE_SENT = (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError, httpx.ReadTimeout, httpx.WriteTimeout)


def backoff(attempt: int) -> float:
    """Seconds to wait before resend number `attempt` (0-based): 0.1, 0.2, 0.4 ... with jitter."""
    return min(2.0, 0.1 * 2.0 ** min(attempt, 16)) * (0.5 + random.random())


def _within(delay: float, elapsed: float, deadline: float) -> Optional[float]:
    return delay if elapsed + delay <= deadline else None


def retry_after_error(
    call: Call, exc: Exception, attempt: int, retries: int, elapsed: float = 0.0, deadline: float = DEFAULT_RETRY_DEADLINE
) -> Optional[float]:
    """How long to wait before sending `call` again after `exc` ended attempt number `attempt`
    (0-based), `elapsed` seconds after the first failure; None not to."""
    if attempt >= retries:
        return None
    if isinstance(exc, _NOT_SENT) or (call.idempotent and isinstance(exc, _MAYBE_SENT)):
        return _within(backoff(attempt), elapsed, deadline)
    return None


#: A replica's 503 header: the call went out to the leader, which went away before answering.
UNANSWERED_HEADER = "x-sandman-unanswered"


def retry_after_status(
    call: Call,
    status: int,
    hdrs: Mapping[str, str],
    attempt: int,
    retries: int,
    elapsed: float = 0.0,
    deadline: float = DEFAULT_RETRY_DEADLINE,
) -> Optional[float]:
    """How long to wait before sending `call` again after an error answer, or None not to.

    Only the server's load shedding is retried (503 with `Retry-After`): the request was refused
    at the edge before anything ran, so even an exec is safe to resend. A 503 with
    `X-Sandman-Unanswered` (a replica lost the leader with the call under way) is retried only
    for an idempotent call.
    """
    if attempt >= retries or status != 503:
        return None
    value = hdrs.get("retry-after")
    if value is None:
        # A replica that passed the call on to the leader, which went away with it under way:
        # as after a broken connection, only an idempotent call goes again.
        if call.idempotent and hdrs.get(UNANSWERED_HEADER) is not None:
            return _within(backoff(attempt), elapsed, deadline)
        return None
    try:
        delay = min(5.0, max(0.1, float(value))) * (0.5 + random.random())
    except ValueError:
        delay = backoff(attempt)
    return _within(delay, elapsed, deadline)


def _attempts(n: int) -> str:
    return "1 attempt" if n == 1 else f"{n} attempts"


def transport_error(exc: Exception, url: str, call: Optional[Call] = None, attempts: int = 1) -> errors.SandmanError:
    """The SDK's exception for an `httpx` transport failure of `call`, sent `attempts` times."""
    detail = f"{exc or type(exc).__name__}"
    if isinstance(exc, httpx.TimeoutException) and not isinstance(exc, (httpx.ConnectTimeout, httpx.PoolTimeout)):
        err: errors.SandmanError = errors.Timeout(
            f"no answer from {url} in time ({type(exc).__name__}; {_attempts(attempts)})", reason="client_timeout"
        )
    elif isinstance(exc, _NOT_SENT):
        err = errors.TransportError(
            f"cannot reach the Sandman server at {url} ({_attempts(attempts)}): {detail}; start one with "
            f"`sandman serve` or point SANDMAN_URL at it",
            reason="connect_failed",
        )
    elif call is not None and not call.idempotent and isinstance(exc, _MAYBE_SENT):
        err = errors.TransportError(
            f"the connection to {url} failed ({_attempts(attempts)}): {detail}; {call.method} {call.path} was not "
            f"sent again: it is not idempotent, and the server may have run it",
            reason="connection_lost",
        )
    else:
        err = errors.TransportError(
            f"the connection to {url} failed ({_attempts(attempts)}): {detail}", reason="connection_lost"
        )
    err.attempts = attempts
    return err


def bad_line(line: str, e: Exception) -> errors.SandmanError:
    return errors.Internal(f"the server sent a stream line that is not JSON ({e}): {line[:200]!r}")


def stream_ended_early(what: str) -> errors.SandmanError:
    return errors.Unavailable(
        f"the {what} stream ended before its exit event: the connection or the sandbox went away",
        reason="stream_ended",
    )


# ---- tar (upload / download) -------------------------------------------------------------------


def tar_directory(local: Union[str, "os.PathLike[str]"]) -> bytes:
    """A gzip'd tar of the contents of the directory `local` (or of one file), names relative to it."""
    src = Path(local)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=1) as tar:
        if src.is_dir():
            for child in sorted(src.iterdir()):
                tar.add(str(child), arcname=child.name)
        elif src.exists():
            tar.add(str(src), arcname=src.name)
        else:
            raise errors.InvalidArgument(f"`{src}` does not exist")
    return buf.getvalue()


def extract_tar(data: bytes, local: Union[str, "os.PathLike[str]"]) -> Path:
    """Extracts a tar into the directory `local` (created), refusing entries that would land
    outside it (absolute, `..`, or through a link)."""
    dest = Path(local)
    dest.mkdir(parents=True, exist_ok=True)
    root = dest.resolve()
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as tar:
        members = tar.getmembers()
        for m in members:
            _check_member(root, m)
        # Python 3.12+ (and 3.9-3.11 since their 2023 security releases) filter extraction too;
        # every member was checked above either way.
        extra: Dict[str, Any] = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(str(dest), members=members, **extra)
    return dest


def _check_member(root: Path, m: tarfile.TarInfo) -> None:
    target = (root / m.name).resolve()
    if m.name.startswith("/") or not _inside(root, target):
        raise errors.InvalidArgument(f"archive entry `{m.name}` would land outside `{root}`")
    if m.issym() or m.islnk():
        link = (target.parent / m.linkname).resolve() if m.issym() else (root / m.linkname).resolve()
        if m.linkname.startswith("/") or not _inside(root, link):
            raise errors.InvalidArgument(f"archive link `{m.name}` -> `{m.linkname}` points outside `{root}`")


def _inside(root: Path, p: Path) -> bool:
    return p == root or root in p.parents


def split_env(env: Optional[Mapping[str, str]]) -> Tuple[str, ...]:
    """For reprs: the names of an env mapping (never the values, which may be secrets)."""
    return tuple(sorted(env)) if env else ()
