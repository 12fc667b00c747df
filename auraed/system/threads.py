"""Work on a short-lived thread of its own: for per-thread kernel state (a network namespace,
v1 cgroup membership) that must neither stick to the caller's thread nor to a pool thread that
is reused afterwards.

Only the builtin ``_thread``: the monitor imports this on its lean path.
"""

from __future__ import annotations

import _thread

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any, TypeVar

    T = TypeVar("T")


def in_new_thread(work: Callable[[], T]) -> T:
    """``work()`` run on a new thread and waited for; what it raises is raised here. Per-thread
    state it changes dies with the thread."""
    done = _thread.allocate_lock()
    done.acquire()
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(work())
        except BaseException as exc:
            outcome.append(exc)
        finally:
            done.release()

    _thread.start_new_thread(run, ())
    done.acquire()
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    result: T = outcome[0]
    return result
