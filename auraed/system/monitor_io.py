"""What a monitor's modules share (auraed.system.monitor, monitor_child, monitor_protocol and
cri_log): whole writes to a descriptor, errors described in a line, the monitor's own lines on its
stderr. Builtins only, as everything on the monitor's path (see auraed.system.monitor)."""

# contextlib.suppress would pull contextlib (+collections, functools) into the lean monitor path.
# ruff: noqa: SIM105

from __future__ import annotations

import os


def describe(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.errno:
        return os.strerror(exc.errno)
    return f"{type(exc).__name__}: {exc}"


def errno_of(exc: BaseException) -> int:
    return exc.errno if isinstance(exc, OSError) and exc.errno else 0


def log_error(message: str) -> None:
    try:
        os.write(2, f"auraed-monitor[{os.getpid()}]: {message}\n".encode(errors="replace"))
    except OSError:
        pass


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]
