"""What aer's interactive streams share (``container exec``, ``vm console --shell``): this
terminal's size, stdin relayed as it comes, the local terminal in raw mode for the call, and the
signals aer gets meanwhile."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import termios
import threading
import tty
from collections.abc import Callable, Iterator

STDIN_CHUNK = 1 << 16


def terminal_size() -> tuple[int, int] | None:
    """(rows, columns) of the terminal on stdin or stdout; None without one."""
    for stream in (sys.stdin, sys.stdout):
        try:
            columns, rows = os.get_terminal_size(stream.fileno())
        except (OSError, ValueError, AttributeError):
            continue
        return rows, columns
    return None


def forward_stdin(loop: asyncio.AbstractEventLoop, deliver: Callable[[bytes], None]) -> Callable[[], object]:
    """``deliver`` what comes on stdin, then b"" for its end; returns how to stop."""
    if sys.stdin is None:  # closed (`aer ... <&-`): an input that has ended
        deliver(b"")
        return lambda: None
    fd = sys.stdin.fileno()

    def read() -> bytes:
        try:
            return os.read(fd, STDIN_CHUNK)
        except OSError:  # e.g. EIO once a terminal hangs up: the end of input
            return b""

    def readable() -> None:
        data = read()
        if not data:
            loop.remove_reader(fd)
        deliver(data)

    try:
        loop.add_reader(fd, readable)
        return lambda: loop.remove_reader(fd)
    except OSError:  # a regular file or /dev/null: epoll cannot watch it, a thread reads it instead
        pass

    def pump() -> None:
        while True:
            data = read()
            try:
                loop.call_soon_threadsafe(deliver, data)
            except RuntimeError:  # the loop is closed: the call is over
                return
            if not data:
                return

    threading.Thread(target=pump, name="aer-stdin", daemon=True).start()
    return lambda: None


@contextlib.contextmanager
def raw_terminal(wanted: bool) -> Iterator[None]:
    """Stdin's terminal in raw mode (every key, ^C included, goes to the remote terminal) while
    the block runs, its modes as they were afterwards; nothing unless ``wanted`` and a terminal."""
    fd = sys.stdin.fileno() if sys.stdin is not None else -1
    saved = termios.tcgetattr(fd) if wanted and fd >= 0 and os.isatty(fd) else None
    try:
        if saved is not None:
            tty.setraw(fd)
        yield
    finally:
        if saved is not None:
            termios.tcsetattr(fd, termios.TCSADRAIN, saved)


class CallSignals:
    """What aer does with the signals it gets during an interactive call. With ``forward``
    (no terminal), SIGINT, SIGTERM and SIGHUP are handed to it by name (for the remote process);
    the same signal again ends aer. Without, SIGTERM and SIGHUP end aer (a Python exit, so that
    the terminal is restored) and ^C is a key. ``ended_by`` says which signal ended it."""

    def __init__(self, forward: Callable[[str], None] | None) -> None:
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()
        self._send = forward
        self._forwarded: set[int] = set()
        self.ended_by: list[int] = []
        on_signal = self._terminate if forward is None else self._forward
        self._handlers: dict[int, tuple[Callable[..., None], tuple[int, ...]]] = {
            signum: (on_signal, (signum,)) for signum in (signal.SIGTERM, signal.SIGHUP)
        }
        if forward is not None:
            self._handlers[signal.SIGINT] = (self._forward, (signal.SIGINT,))

    def on_resize(self, resized: Callable[[], None]) -> None:
        self._handlers[signal.SIGWINCH] = (resized, ())

    def __enter__(self) -> CallSignals:
        for signum, (handler, arguments) in self._handlers.items():
            self._loop.add_signal_handler(signum, handler, *arguments)
        return self

    def __exit__(self, *_: object) -> None:
        for signum in self._handlers:
            self._loop.remove_signal_handler(signum)

    def _terminate(self, signum: int) -> None:
        self.ended_by.append(signum)
        if self._task is not None:
            self._task.cancel()

    def _forward(self, signum: int) -> None:
        if signum in self._forwarded or self._send is None:
            self._terminate(signum)
            return
        self._forwarded.add(signum)
        self._send(signal.Signals(signum).name)
