"""Background delivery of hint events: never blocks the agent, never raises into it.

:meth:`HintSender.submit` puts an event in a bounded queue and returns at once; one daemon
worker thread (started on the first submit) hands events to the sink in submission order.
A full queue drops the oldest (default) or the newest event; failures (connection refused,
timeout, HTTP 4xx/5xx, an exception from an in-process callable) are logged at debug level
and counted, never raised. ``flush`` and ``close`` wait with a timeout, for tests and clean
shutdown; ``aflush`` and ``aclose`` do the same from async code without blocking its loop.

One sender serves any number of sessions (share it across the trackers of a process). The
worker is a daemon thread: events still queued when the process exits are lost unless
``close`` ran first.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from typing import Any, Literal

import anyio.to_thread
import attrs

from talaria.errors import ConfigError
from talaria.session.hints import HintCounters, HintEvent, HintStats
from talaria.session.sinks import (
    DEFAULT_TIMEOUT_S,
    CallableSink,
    HintCallable,
    HintSink,
    HttpSink,
    running_loop_or_none,
)

__all__ = ["HintSender"]

log = logging.getLogger(__name__)

_Item = tuple[HintEvent, HintCounters | None]


def _check_max_queue(instance: object, attribute: attrs.Attribute[Any], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1_000_000:
        raise ConfigError(f"max_queue must be an integer in [1, 1000000], got {value!r}")


def _check_drop(instance: object, attribute: attrs.Attribute[Any], value: str) -> None:
    if value not in ("oldest", "newest"):
        raise ConfigError(f'drop must be "oldest" or "newest", got {value!r}')


@attrs.define(eq=False)
class HintSender:
    """Delivers :class:`HintEvent` s to ``sink`` from a background thread.

    ``max_queue``: events waiting at most; ``drop``: which event a full queue loses. Counts
    (:meth:`stats`) cover every event submitted: each ends up sent, dropped or failed, and is
    also counted on the per-submit ``counters`` given with it (a tracker's own).
    """

    sink: HintSink
    max_queue: int = attrs.field(default=1024, validator=_check_max_queue)
    drop: Literal["oldest", "newest"] = attrs.field(default="oldest", validator=_check_drop)
    _queue: collections.deque[_Item] = attrs.field(init=False, factory=collections.deque)
    _cond: threading.Condition = attrs.field(init=False, factory=threading.Condition)
    _thread: threading.Thread | None = attrs.field(init=False, default=None)
    _busy: bool = attrs.field(init=False, default=False)
    _closing: bool = attrs.field(init=False, default=False)
    _deadline: float = attrs.field(init=False, default=0.0)
    _counters: HintCounters = attrs.field(init=False, factory=HintCounters)

    # ------------------------------------------------------------------ construction
    @classmethod
    def http(
        cls,
        base_url: str,
        *,
        api_key: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        max_queue: int = 1024,
        drop: Literal["oldest", "newest"] = "oldest",
    ) -> HintSender:
        """A sender posting to a Talaria server (:class:`~talaria.session.sinks.HttpSink`)."""
        sink = HttpSink(base_url, api_key=api_key, timeout_s=timeout_s)
        return cls(sink, max_queue=max_queue, drop=drop)

    @classmethod
    def in_process(
        cls,
        fn: HintCallable,
        *,
        loop: asyncio.AbstractEventLoop | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        max_queue: int = 1024,
        drop: Literal["oldest", "newest"] = "oldest",
    ) -> HintSender:
        """A sender calling ``fn(session_id, event, **fields)`` (sync or async;
        :class:`~talaria.session.sinks.CallableSink`). Async results run on ``loop``; when
        ``loop`` is None and this is called inside a running asyncio loop, on that loop."""
        target = loop if loop is not None else running_loop_or_none()
        return cls(CallableSink(fn, loop=target, timeout_s=timeout_s), max_queue, drop)

    # ------------------------------------------------------------------ agent side
    def submit(self, event: HintEvent, counters: HintCounters | None = None) -> bool:
        """Queue ``event``; True if queued. Never blocks (beyond a short lock) and never
        raises: a full queue or a closed sender drops an event (counted)."""
        try:
            with self._cond:
                if self._closing:
                    self._count(counters, dropped=1)
                    return False
                if len(self._queue) >= self.max_queue:
                    if self.drop == "newest":
                        self._count(counters, dropped=1)
                        return False
                    _, old_counters = self._queue.popleft()
                    self._count(old_counters, dropped=1)
                self._queue.append((event, counters))
                self._start_worker()
                self._cond.notify_all()
                return True
        except Exception:  # e.g. no thread can be started: the agent must not notice
            log.debug("talaria hint not queued", exc_info=True)
            return False

    def stats(self) -> HintStats:
        """Events sent, dropped and failed so far (all sessions)."""
        return self._counters.snapshot()

    @property
    def pending(self) -> int:
        """Events queued or being delivered now."""
        with self._cond:
            return len(self._queue) + int(self._busy)

    # ------------------------------------------------------------------ waiting
    def flush(self, timeout_s: float = 1.0) -> bool:
        """Wait until every event submitted so far is sent, failed or dropped; False if
        ``timeout_s`` seconds passed first. Do not call it on the thread of the loop an
        in-process async sink delivers to (use :meth:`aflush` there)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._queue or self._busy:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)
            return True

    def close(self, timeout_s: float = 1.0) -> bool:
        """Stop accepting events, deliver what is queued for up to ``timeout_s`` seconds, drop
        (and count) the rest, close the sink. Idempotent. True if the worker finished in time
        (a delivery already under way may outlast the deadline by the sink's timeout)."""
        with self._cond:
            if not self._closing:
                self._closing = True
                self._deadline = time.monotonic() + timeout_s
            thread = self._thread
            self._cond.notify_all()
        if thread is None:
            self._close_sink()
            return True
        thread.join(max(0.0, self._deadline - time.monotonic()) + 0.05)
        return not thread.is_alive()

    async def aflush(self, timeout_s: float = 1.0) -> bool:
        """:meth:`flush` from async code, waiting on a worker thread (the loop keeps running)."""
        return await anyio.to_thread.run_sync(self.flush, timeout_s)

    async def aclose(self, timeout_s: float = 1.0) -> bool:
        """:meth:`close` from async code, waiting on a worker thread."""
        return await anyio.to_thread.run_sync(self.close, timeout_s)

    def __enter__(self) -> HintSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ worker
    def _count(self, counters: HintCounters | None, **n: int) -> None:
        self._counters.add(**n)
        if counters is not None:
            counters.add(**n)

    def _start_worker(self) -> None:
        """Called with the lock held."""
        if self._thread is None:
            thread = threading.Thread(target=self._work, name="talaria-hints", daemon=True)
            thread.start()
            self._thread = thread

    def _next(self) -> _Item | None:
        """The next item to deliver (marks the worker busy), or None when it should exit."""
        with self._cond:
            self._busy = False
            self._cond.notify_all()
            while not self._queue and not self._closing:
                self._cond.wait()
            if self._closing and (not self._queue or time.monotonic() >= self._deadline):
                while self._queue:
                    _, counters = self._queue.popleft()
                    self._count(counters, dropped=1)
                self._cond.notify_all()
                return None
            self._busy = True
            return self._queue.popleft()

    def _work(self) -> None:
        try:
            while (item := self._next()) is not None:
                event, counters = item
                try:
                    self.sink.deliver(event)
                except (Exception, asyncio.CancelledError) as e:
                    log.debug(
                        "talaria hint %s for %s failed: %r", event.kind.value, event.session_id, e
                    )
                    self._count(counters, failed=1)
                else:
                    self._count(counters, sent=1)
        finally:
            self._close_sink()

    def _close_sink(self) -> None:
        try:
            self.sink.close()
        except Exception:
            log.debug("talaria hint sink did not close cleanly", exc_info=True)
