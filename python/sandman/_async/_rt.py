"""The asyncio half of the little the two clients cannot share: sleeping, running blocking work
(tarring a directory) off the event loop, running calls side by side, finishing a call whose
caller was cancelled, and a periodic background task (the job heartbeat).
`sandman/_sync/_rt.py` is its hand-written twin with threads; the two keep the same names."""

from __future__ import annotations

import asyncio
import logging
import weakref
from typing import Any, Awaitable, Callable, List, Optional, Sequence, TypeVar

T = TypeVar("T")

log = logging.getLogger("sandman")


async def sleep(seconds: float) -> None:
    await asyncio.sleep(seconds)


async def run_blocking(fn: Callable[..., T], *args: Any) -> T:
    """Runs `fn(*args)` in a worker thread, so the event loop keeps serving."""
    return await asyncio.to_thread(fn, *args)


async def gather_bounded(thunks: Sequence[Callable[[], Awaitable[T]]], parallel: int) -> List[T]:
    """Runs every `thunk()` as a task, at most `parallel` at once, and answers their results in
    order. At the first failure the others are cancelled, and all are awaited (so each finishes
    its own cleanup) before that failure is raised; a cancelled caller cancels them the same way."""
    gate = asyncio.Semaphore(max(1, parallel))

    async def one(thunk: Callable[[], Awaitable[T]]) -> T:
        async with gate:
            return await thunk()

    tasks = [asyncio.ensure_future(one(t)) for t in thunks]
    if not tasks:
        return []
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    for t in tasks:
        error = None if t.cancelled() else t.exception()
        if error is not None:
            raise error
    return [t.result() for t in tasks]


async def finish(fn: Callable[[], Awaitable[T]], undo: Callable[[T], Awaitable[Any]]) -> T:
    """Answers `await fn()`. Cancelled meanwhile, it still lets `fn()` run to its end and then
    calls `undo` on what it made before letting the cancellation through: a sandbox being created
    when its creator is cancelled is released, not left to its lease. (Cancelled again while
    finishing, it gives up.)"""
    task = asyncio.ensure_future(fn())
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        try:
            made = await asyncio.shield(task)
        except Exception:
            raise asyncio.CancelledError() from None
        try:
            await undo(made)
        except Exception as e:
            log.warning("could not undo %r after a cancellation: %s", made, e)
        raise


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
