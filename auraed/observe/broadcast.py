"""A ring buffer of recent events that live subscribers can follow."""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class Broadcast(Generic[T]):
    """Keeps the last ``capacity`` items; each subscriber gets every item published after it joined.

    ``publish`` may be called from any thread (logging handlers run in whatever thread logs). A
    subscriber that falls ``queue_size`` items behind loses the oldest ones rather than
    slowing the publisher down.
    """

    def __init__(self, capacity: int, queue_size: int = 10000) -> None:
        self._recent: collections.deque[T] = collections.deque(maxlen=capacity)
        self._subscribers: set[asyncio.Queue[T]] = set()
        self._queue_size = queue_size
        self._loop: asyncio.AbstractEventLoop | None = None

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def recent(self, tail: int | None = None) -> list[T]:
        """The items kept, or only the last ``tail`` of them (all of them when fewer are kept)."""
        items = list(self._recent)
        if tail is None:
            return items
        return items[-tail:] if tail > 0 else []

    def publish(self, item: T) -> None:
        self._recent.append(item)
        loop = self._loop
        if loop is None or loop.is_closed() or not self._subscribers:
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            self._deliver(item)
        else:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(self._deliver, item)

    def _deliver(self, item: T) -> None:
        for queue in list(self._subscribers):
            if queue.full():
                queue.get_nowait()
            queue.put_nowait(item)

    @contextlib.contextmanager
    def subscribe(self) -> Iterator[asyncio.Queue[T]]:
        queue: asyncio.Queue[T] = asyncio.Queue(self._queue_size)
        self._subscribers.add(queue)
        try:
            yield queue
        finally:
            self._subscribers.discard(queue)
