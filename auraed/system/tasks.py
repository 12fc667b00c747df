"""Blocking work and the calls that wait for it: work that must not be cut short by a caller that
leaves (a client's deadline or hang-up, :func:`run_to_end`), and work a caller must be able to
stop waiting for (:class:`OwnThreads`)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")


async def run_to_end(work: Awaitable[T]) -> T:
    """Await ``work`` to its end even when the caller is cancelled meanwhile, then raise that
    cancellation.

    Cutting a launch or a cgroup change in the middle leaves kernel objects (processes, cgroups,
    namespaces) that nothing records; a thread in ``asyncio.to_thread`` cannot be stopped at all.
    Finishing first lets the caller's own clean-up (its ``except``/``finally``, a lock it holds)
    see the real outcome.
    """
    task = asyncio.ensure_future(work)
    cancelled = False
    while True:
        try:
            result = await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.cancelled():  # the work itself was cancelled, not just its caller
                raise
            cancelled = True
            continue
        if cancelled:
            raise asyncio.CancelledError
        return result


class StuckThreads(Exception):
    """Too many earlier works are still running past their deadline: no new one is started."""


class OwnThreads:
    """Blocking work that may never end (a file a request names, on a hung network filesystem),
    each on a thread of its own, waited for at most a deadline.

    Not on the loop's default pool: a handful of works stuck there would stall every other call
    that needs the pool (asyncio.to_thread) until they end. A thread here that outlives its
    deadline is left to finish on its own (a thread blocked in the kernel cannot be stopped); at
    most ``max_stuck`` of them at once, past which new work is refused (StuckThreads) rather
    than growing threads without bound while the filesystem stays hung.
    """

    def __init__(self, timeout: float, max_stuck: int) -> None:
        self.timeout = timeout
        self._max_stuck = max_stuck
        self._stuck = 0

    @property
    def stuck(self) -> int:
        """Works still running past their deadline."""
        return self._stuck

    async def run(self, work: Callable[[], T], name: str) -> T:
        """``work()`` on a new thread named ``name``, its result or exception; TimeoutError
        when it takes longer than ``timeout`` seconds."""
        if self._stuck >= self._max_stuck:
            raise StuckThreads(f"{self._stuck} earlier works are still running past their deadline")
        loop = asyncio.get_running_loop()
        done: asyncio.Future[T] = loop.create_future()
        abandoned = False  # the caller stopped waiting: the work counts as stuck until it ends

        def settle(ok: bool, value: Any) -> None:  # on the loop, once work() returned or raised
            if abandoned:
                self._stuck -= 1
            elif ok:
                done.set_result(value)
            else:
                done.set_exception(value)

        def body() -> None:
            value: object
            try:
                ok, value = True, work()
            except BaseException as exc:  # handed to the caller, who raises it
                ok, value = False, exc
            with contextlib.suppress(RuntimeError):  # the loop is closed: no one waits any more
                loop.call_soon_threadsafe(settle, ok, value)

        def give_up() -> None:
            nonlocal abandoned
            abandoned = True
            self._stuck += 1
            done.set_exception(TimeoutError(f"{name} took longer than {self.timeout:g}s"))

        # A timer on the future rather than asyncio.wait_for: that costs a task and a shield,
        # ~0.3 ms a call here, which CreateContainer would pay every time.
        timer = loop.call_later(self.timeout, give_up)
        threading.Thread(target=body, name=name, daemon=True).start()
        try:
            return await done
        except asyncio.CancelledError:
            if not abandoned:
                abandoned = True
                self._stuck += 1
            raise
        finally:
            timer.cancel()
