"""Work that must not be cut short by a caller that leaves (a client's deadline or hang-up)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

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
