"""The threaded half of the little the two clients cannot share: sleeping, running blocking work,
running calls side by side (in threads), finishing a call, and a periodic background thread (the
job heartbeat). `sandman/_async/_rt.py` is its asyncio twin;
the two keep the same names, so the generated sync client calls these where the async one awaits
those."""

from __future__ import annotations

import logging
import threading
import time
import weakref
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import Any, Callable, List, Optional, Sequence, TypeVar

T = TypeVar("T")

log = logging.getLogger("sandman")


def sleep(seconds: float) -> None:
    time.sleep(seconds)


def run_blocking(fn: Callable[..., T], *args: Any) -> T:
    """Runs `fn(*args)` here: a sync caller blocks anyway."""
    return fn(*args)


def gather_bounded(thunks: Sequence[Callable[[], T]], parallel: int) -> List[T]:
    """Runs every `thunk()` in a pool of `parallel` threads and answers their results in order.
    At the first failure the ones not started yet are dropped and the running ones are waited for
    (each finishes its own cleanup) before that failure is raised; so too on KeyboardInterrupt."""
    with ThreadPoolExecutor(max_workers=max(1, parallel), thread_name_prefix="sandman") as pool:
        futures = [pool.submit(t) for t in thunks]
        try:
            wait(futures, return_when=FIRST_EXCEPTION)
        finally:
            for f in futures:
                f.cancel()
    for f in futures:
        error = None if f.cancelled() else f.exception()
        if error is not None:
            raise error
    return [f.result() for f in futures]


def finish(fn: Callable[[], T], undo: Callable[[T], Any]) -> T:
    """Answers `fn()`. (The asyncio twin also undoes what `fn` made when its caller is cancelled
    meanwhile; a thread is not cancelled halfway through a call.)"""
    return fn()


class Ticker:
    """Calls `method()` (a bound method) every `interval` seconds from a daemon thread, until
    `stop()`, or until the object owning `method` is garbage collected: the thread holds it only
    weakly, so a forgotten job stops its heartbeat instead of keeping sandboxes alive forever."""

    def __init__(self, interval: float, method: Callable[[], Any], name: str) -> None:
        self._interval = interval
        self._method = weakref.WeakMethod(method)
        self._name = name
        self._thread: Optional[threading.Thread] = None
        self._stopping = threading.Event()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        while not self._stopping.wait(self._interval):
            method = self._method()
            if method is None:
                return
            try:
                method()
            except Exception as e:  # a missed beat is retried at the next tick
                log.warning("%s failed: %s", self._name, e)
            del method

    def stop(self) -> None:
        self._stopping.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(self._interval + 5.0)
