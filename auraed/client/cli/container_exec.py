"""``aer container exec``: a command in a running container, with its stdin, stdout and stderr
(and a terminal of its own with -t) relayed over one bidirectional stream. Without a terminal,
SIGINT, SIGTERM and SIGHUP are passed on to the process (a second one ends aer); on a terminal,
^C is a key the terminal's process gets, and SIGTERM or SIGHUP end aer."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import termios
import threading
import tty
from collections.abc import AsyncIterator, Callable
from typing import IO

from auraed.api.aurae.containers import v0 as containers_pb
from auraed.client.cli.calls import CONTAINERS, CliError, call_timeout, session
from auraed.client.client import AuraeClient

STDIN_CHUNK = 1 << 16

ExecRequest = containers_pb.ContainerServiceExecRequest


def _terminal_size() -> containers_pb.TerminalSize | None:
    for stream in (sys.stdin, sys.stdout):
        try:
            columns, rows = os.get_terminal_size(stream.fileno())
        except (OSError, ValueError, AttributeError):
            continue
        return containers_pb.TerminalSize(rows=rows, columns=columns)
    return None


def _forward_stdin(
    loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[ExecRequest | None]
) -> Callable[[], object]:
    """Send what comes on stdin, then the end of it; returns how to stop."""
    if sys.stdin is None:  # closed (`aer ... <&-`): an input that has ended
        queue.put_nowait(ExecRequest(close_stdin=True))
        return lambda: None
    fd = sys.stdin.fileno()

    def deliver(data: bytes) -> None:
        queue.put_nowait(ExecRequest(stdin=data) if data else ExecRequest(close_stdin=True))

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
            except RuntimeError:  # the loop is closed: exec is over
                return
            if not data:
                return

    threading.Thread(target=pump, name="aer-stdin", daemon=True).start()
    return lambda: None


def _write(stream: IO[str], data: bytes) -> None:
    stream.buffer.write(data)  # type: ignore[attr-defined]
    stream.flush()


class _Signals:
    """What aer does with the signals it gets during an exec (the module's doc says what)."""

    def __init__(self, queue: asyncio.Queue[ExecRequest | None], terminal: bool) -> None:
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()
        self._queue = queue
        self._forwarded: set[int] = set()
        self.ended_by: list[int] = []
        on_signal = self._terminate if terminal else self._forward
        self._handlers: dict[int, tuple[Callable[..., None], tuple[int, ...]]] = {
            signum: (on_signal, (signum,)) for signum in (signal.SIGTERM, signal.SIGHUP)
        }
        if not terminal:
            self._handlers[signal.SIGINT] = (self._forward, (signal.SIGINT,))

    def on_resize(self, resized: Callable[[], None]) -> None:
        self._handlers[signal.SIGWINCH] = (resized, ())

    def __enter__(self) -> _Signals:
        for signum, (handler, arguments) in self._handlers.items():
            self._loop.add_signal_handler(signum, handler, *arguments)
        return self

    def __exit__(self, *_: object) -> None:
        for signum in self._handlers:
            self._loop.remove_signal_handler(signum)

    def _terminate(self, signum: int) -> None:  # a Python exit, so that the terminal is restored
        self.ended_by.append(signum)
        if self._task is not None:
            self._task.cancel()

    def _forward(self, signum: int) -> None:
        """To the process, which may handle it and end with its own exit code; the same signal
        again ends aer (and the process with the call)."""
        if signum in self._forwarded:
            self._terminate(signum)
            return
        self._forwarded.add(signum)
        self._queue.put_nowait(ExecRequest(signal=signal.Signals(signum).name))


async def _exec(args: argparse.Namespace, client: AuraeClient) -> int:
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[ExecRequest | None] = asyncio.Queue()
    size = _terminal_size() if args.tty else None
    start = containers_pb.ExecStart(
        container_id=args.name, command=args.args, tty=args.tty, stdin=args.interactive, size=size
    )
    stop_reading: Callable[[], object] = _forward_stdin(loop, queue) if args.interactive else lambda: None
    if not args.interactive and not args.tty:
        # The process's stdin ends now; the stream stays open for the signals aer passes on.
        queue.put_nowait(ExecRequest(close_stdin=True))

    async def requests() -> AsyncIterator[ExecRequest]:
        yield ExecRequest(start=start)
        while (message := await queue.get()) is not None:
            yield message

    def resized() -> None:
        new = _terminal_size()
        if new is not None:
            queue.put_nowait(ExecRequest(resize=new))

    code: int | None = None
    signals = _Signals(queue, terminal=args.tty)
    if size is not None:
        signals.on_resize(resized)
    try:
        with signals:
            async for reply in client.duplex(
                CONTAINERS, "Exec", requests(), call_timeout(args, open_ended=True)
            ):
                if reply.stdout:
                    _write(sys.stdout, reply.stdout)
                if reply.stderr:
                    _write(sys.stderr, reply.stderr)
                if reply.exit_code is not None:
                    code = reply.exit_code
    except asyncio.CancelledError:
        if not signals.ended_by:
            raise
        return 128 + signals.ended_by[0]
    finally:
        stop_reading()
        queue.put_nowait(None)
    if code is None:
        raise CliError("exec ended without an exit code")
    return code


def cmd_container_exec(args: argparse.Namespace) -> int:
    if not args.args:
        raise CliError("container exec: give the command after --")
    fd = sys.stdin.fileno() if sys.stdin is not None else -1
    saved = termios.tcgetattr(fd) if args.tty and args.interactive and os.isatty(fd) else None
    try:
        if saved is not None:
            tty.setraw(fd)  # keys, ^C included, go to the container's terminal
        return session(args, lambda client: _exec(args, client))
    finally:
        if saved is not None:
            termios.tcsetattr(fd, termios.TCSADRAIN, saved)
