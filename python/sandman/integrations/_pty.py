"""Terminals for the integrations: start a background process on a pseudo-terminal, resize it.
TODO(harness): the SDK's own calls for these once it has them (`start(..., pty=)`, `resize`)."""

from __future__ import annotations

from typing import Dict, List, Optional

from .. import AsyncProcess, AsyncSandbox, ProcessInfo, _core


async def start_on_terminal(
    sb: AsyncSandbox,
    argv: List[str],
    *,
    rows: int,
    cols: int,
    tag: Optional[str] = None,
    env: Optional[Dict[str, str]] = None,
    cwd: Optional[str] = None,
    user: Optional[str] = None,
) -> AsyncProcess:
    """Starts `argv` in the background on a terminal of `rows` x `cols`."""
    call = _core.start_call(
        sb.id, argv, tag=tag, env=env, cwd=cwd, user=user, stdin=False, retain_bytes=None, timeout=None
    )
    call.json["pty"] = {"rows": rows, "cols": cols}
    info = ProcessInfo.from_dict(await sb.client._json(call))
    return AsyncProcess(sb, info.id, info)


async def resize(process: AsyncProcess, rows: int, cols: int) -> None:
    """Sets a new size of the process's terminal (its foreground job gets SIGWINCH)."""
    path = _core.process_path(process.sandbox.id, process.id, "/resize")
    await process.sandbox.client._json(_core.Call("POST", path, json={"rows": rows, "cols": cols}))
