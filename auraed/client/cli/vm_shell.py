"""``aer vm console NAME --shell``: the guest's debug shell (VmService.DebugShell; the host's
vm_debug_console) on this terminal, in raw mode as ``aer container exec -it``: every key, ^C
included, goes to the guest's shell. ``exit`` (or ^D) ends it and aer with the shell's status;
SIGTERM and SIGHUP end aer (the terminal restored). Without a terminal, stdin is sent as typed
and its end as ^D, so ``echo 'uname -a' | aer vm console g1 --shell`` runs one command."""

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

from auraed.api.aurae.vms import v0 as vms_pb
from auraed.client.cli.calls import VMS, CliError, call_timeout, session
from auraed.client.client import AuraeClient

STDIN_CHUNK = 1 << 16
EOF_KEY = b"\x04"  # ^D: the end of input for a shell on a terminal

Request = vms_pb.VmServiceDebugShellRequest


def _terminal_size() -> vms_pb.TerminalSize | None:
    for stream in (sys.stdin, sys.stdout):
        try:
            columns, rows = os.get_terminal_size(stream.fileno())
        except (OSError, ValueError, AttributeError):
            continue
        return vms_pb.TerminalSize(rows=rows, columns=columns)
    return None


def _read_stdin(
    loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[Request | None]
) -> Callable[[], object]:
    """Send what comes on stdin, its end as ^D; returns how to stop."""
    if sys.stdin is None:
        queue.put_nowait(Request(input=EOF_KEY))
        return lambda: None
    fd = sys.stdin.fileno()

    def deliver(data: bytes) -> None:
        queue.put_nowait(Request(input=data or EOF_KEY))

    def read() -> bytes:
        try:
            return os.read(fd, STDIN_CHUNK)
        except OSError:
            return b""

    def readable() -> None:
        data = read()
        if not data:
            loop.remove_reader(fd)
        deliver(data)

    try:
        loop.add_reader(fd, readable)
        return lambda: loop.remove_reader(fd)
    except OSError:  # a regular file: epoll cannot watch it
        pass

    def pump() -> None:
        while True:
            data = read()
            try:
                loop.call_soon_threadsafe(deliver, data)
            except RuntimeError:
                return
            if not data:
                return

    threading.Thread(target=pump, name="aer-stdin", daemon=True).start()
    return lambda: None


async def _shell(args: argparse.Namespace, client: AuraeClient) -> int:
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    queue: asyncio.Queue[Request | None] = asyncio.Queue()
    ended_by: list[int] = []

    async def requests() -> AsyncIterator[Request]:
        yield Request(name=args.name, size=_terminal_size())
        while (message := await queue.get()) is not None:
            yield message

    def resized() -> None:
        size = _terminal_size()
        if size is not None:
            queue.put_nowait(Request(size=size))

    def terminate(signum: int) -> None:
        ended_by.append(signum)
        if task is not None:
            task.cancel()

    handlers: dict[int, tuple[Callable[..., None], tuple[int, ...]]] = {
        signal.SIGTERM: (terminate, (signal.SIGTERM,)),
        signal.SIGHUP: (terminate, (signal.SIGHUP,)),
        signal.SIGWINCH: (resized, ()),
    }
    for signum, (handler, arguments) in handlers.items():
        loop.add_signal_handler(signum, handler, *arguments)
    stop_reading = _read_stdin(loop, queue)
    code: int | None = None
    try:
        async for reply in client.duplex(VMS, "DebugShell", requests(), call_timeout(args, open_ended=True)):
            if reply.output:
                sys.stdout.buffer.write(reply.output)
                sys.stdout.flush()
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
        raise CliError(f"the debug shell of VM {args.name} ended without an exit status")
    return code


def cmd_vm_shell(args: argparse.Namespace) -> int:
    fd = sys.stdin.fileno() if sys.stdin is not None else -1
    saved = termios.tcgetattr(fd) if fd >= 0 and os.isatty(fd) else None
    try:
        if saved is not None:
            tty.setraw(fd)
        return session(args, lambda client: _shell(args, client))
    finally:
        if saved is not None:
            termios.tcsetattr(fd, termios.TCSADRAIN, saved)
