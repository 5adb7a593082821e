"""The asyncio half of the little the two clients cannot share: sleeping, running blocking work
(tarring a directory) off the event loop, and a periodic background task (the job heartbeat).
`sandman/_sync/_rt.py` is its hand-written twin with threads; the two keep the same names."""

from __future__ import annotations

import asyncio
import logging
import weakref
from typing import Any, Awaitable, Callable, Optional, TypeVar

T = TypeVar("T")

log = logging.getLogger("sandman")


async def sleep(seconds: float) -> None:
    await asyncio.sleep(seconds)


async def run_blocking(fn: Callable[..., T], *args: Any) -> T:
    """Runs `fn(*args)` in a worker thread, so the event loop keeps serving."""
    return await asyncio.to_thread(fn, *args)


class Ticker:
    """Calls `method()` (a bound coroutine method) every `interval` seconds from a task, until
    `stop()`, or until the object owning `method` is garbage collected: the task holds it only
    weakly, so a forgotten job stops its heartbeat instead of keeping sandboxes alive forever."""

    def __init__(self, interval: float, method: Callable[[], Awaitable[Any]], name: str) -> None:
        self._interval = interval
        self._method = weakref.WeakMethod(method)
        self._name = name
        self._task: Optional["asyncio.Task[None]"] = None
        self._stopping = asyncio.Event()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name=self._name)

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def _run(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._stopping.wait(), self._interval)
                return
            except asyncio.TimeoutError:
                pass
            method = self._method()
            if method is None:
                return
            try:
                await method()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a missed beat is retried at the next tick
                log.warning("%s failed: %s", self._name, e)
            del method

    async def stop(self) -> None:
        self._stopping.set()
        task, self._task = self._task, None
        if task is not None and not task.done():
            try:
                await asyncio.wait_for(task, self._interval + 5.0)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                task.cancel()
