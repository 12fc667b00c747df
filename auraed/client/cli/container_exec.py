"""``aer container exec``: a command in a running container, with its stdin, stdout and stderr
(and a terminal of its own with -t) relayed over one bidirectional stream."""

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


async def _exec(args: argparse.Namespace, client: AuraeClient) -> int:
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    queue: asyncio.Queue[ExecRequest | None] = asyncio.Queue()
    size = _terminal_size() if args.tty else None
    start = containers_pb.ExecStart(
        container_id=args.name, command=args.args, tty=args.tty, stdin=args.interactive, size=size
    )
    stop_reading: Callable[[], object] = _forward_stdin(loop, queue) if args.interactive else lambda: None
    if not args.interactive and not args.tty:
        queue.put_nowait(None)  # nothing more to send: the process's stdin ends now

    async def requests() -> AsyncIterator[ExecRequest]:
        yield ExecRequest(start=start)
        while (message := await queue.get()) is not None:
            yield message

    def resized() -> None:
        new = _terminal_size()
        if new is not None:
            queue.put_nowait(ExecRequest(resize=new))

    ended_by: list[int] = []

    def terminate(signum: int) -> None:  # a Python exit, so that the terminal is restored
        ended_by.append(signum)
        if task is not None:
            task.cancel()

    handlers: dict[int, tuple[Callable[..., None], tuple[int, ...]]] = {
        signal.SIGTERM: (terminate, (signal.SIGTERM,)),
        signal.SIGHUP: (terminate, (signal.SIGHUP,)),
    }
    if size is not None:
        handlers[signal.SIGWINCH] = (resized, ())
    for signum, (handler, arguments) in handlers.items():
        loop.add_signal_handler(signum, handler, *arguments)
    code: int | None = None
    try:
        async for reply in client.duplex(CONTAINERS, "Exec", requests(), call_timeout(args, open_ended=True)):
            if reply.stdout:
                _write(sys.stdout, reply.stdout)
            if reply.stderr:
                _write(sys.stderr, reply.stderr)
            if reply.exit_code is not None:
                code = reply.exit_code
    except asyncio.CancelledError:
        if not ended_by:
            raise
        return 128 + ended_by[0]
    finally:
        stop_reading()
        queue.put_nowait(None)
        for signum in handlers:
            loop.remove_signal_handler(signum)
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
