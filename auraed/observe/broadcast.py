"""A ring buffer of recent events that live subscribers can follow."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
from collections.abc import Iterator
from typing import Generic, TypeVar

T = TypeVar("T")

# How far a subscriber may fall behind before it loses the oldest items it has not read.
DEFAULT_QUEUE_SIZE = 10000

Entry = tuple[int, T]  # an item and its number: the how-manieth published it was


class Subscription(Generic[T]):
    """The items kept when it began (``recent``), then, from ``get``, each item published after
    them: none twice, none missed, whichever thread publishes meanwhile."""

    def __init__(self, recent: list[T], newest: int, queue: asyncio.Queue[Entry[T]]) -> None:
        self.recent = recent
        self._newest = newest  # the number of the last item published before it began
        self._queue = queue

    async def get(self) -> T:
        while True:
            number, item = await self._queue.get()
            # An item published by another thread just before it began is in ``recent``, but
            # its delivery may reach the queue after: it was already given.
            if number > self._newest:
                return item


class Broadcast(Generic[T]):
    """Keeps the last ``capacity`` items; each subscriber gets every item published after it joined.

    ``publish`` may be called from any thread (logging handlers run in whatever thread logs). A
    subscriber that falls ``queue_size`` items behind loses the oldest ones rather than
    slowing the publisher down.
    """

    def __init__(self, capacity: int, queue_size: int = DEFAULT_QUEUE_SIZE) -> None:
        self._recent: collections.deque[Entry[T]] = collections.deque(maxlen=capacity)
        self._published = 0
        # Numbers are given and items kept under it, so that the ring is in their order and a
        # snapshot's newest number covers exactly what it holds.
        self._lock = threading.Lock()
        self._subscribers: set[asyncio.Queue[Entry[T]]] = set()
        self._queue_size = queue_size
        self._loop: asyncio.AbstractEventLoop | None = None

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def recent(self, tail: int | None = None) -> list[T]:
        """The items kept, or only the last ``tail`` of them (all of them when fewer are kept)."""
        return self._snapshot(tail)[0]

    def _snapshot(self, tail: int | None) -> tuple[list[T], int]:
        with self._lock:
            entries, newest = list(self._recent), self._published
        if tail is not None:
            entries = entries[-tail:] if tail > 0 else []
        return [item for _, item in entries], newest

    def publish(self, item: T) -> None:
        with self._lock:
            self._published += 1
            entry = (self._published, item)
            self._recent.append(entry)
        loop = self._loop
        if loop is None or loop.is_closed() or not self._subscribers:
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            self._deliver(entry)
        else:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(self._deliver, entry)

    def _deliver(self, entry: Entry[T]) -> None:
        for queue in list(self._subscribers):
            if queue.full():
                queue.get_nowait()
            queue.put_nowait(entry)

    @contextlib.contextmanager
    def subscribe(self, tail: int | None = None) -> Iterator[Subscription[T]]:
        """Follow from now on, after the last ``tail`` items kept (all when None); on the loop."""
        queue: asyncio.Queue[Entry[T]] = asyncio.Queue(self._queue_size)
        self._subscribers.add(queue)
        try:
            yield Subscription(*self._snapshot(tail), queue)
        finally:
            self._subscribers.discard(queue)
