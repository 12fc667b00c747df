"""``aer container exec``: a command in a running container, with its stdin, stdout and stderr
(and a terminal of its own with -t) relayed over one bidirectional stream. Without a terminal,
SIGINT, SIGTERM and SIGHUP are passed on to the process (a second one ends aer); on a terminal,
^C is a key the terminal's process gets, and SIGTERM or SIGHUP end aer."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import AsyncIterator, Callable
from typing import IO

from auraed.api.aurae.containers import v0 as containers_pb
from auraed.client.cli.calls import CONTAINERS, CliError, call_timeout, session
from auraed.client.cli.terminal import CallSignals, forward_stdin, raw_terminal, terminal_size
from auraed.client.client import AuraeClient

ExecRequest = containers_pb.ContainerServiceExecRequest


def _size() -> containers_pb.TerminalSize | None:
    size = terminal_size()
    return None if size is None else containers_pb.TerminalSize(rows=size[0], columns=size[1])


def _write(stream: IO[str], data: bytes) -> None:
    stream.buffer.write(data)  # type: ignore[attr-defined]
    stream.flush()


async def _exec(args: argparse.Namespace, client: AuraeClient) -> int:
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[ExecRequest | None] = asyncio.Queue()
    size = _size() if args.tty else None
    start = containers_pb.ExecStart(
        container_id=args.name, command=args.args, tty=args.tty, stdin=args.interactive, size=size
    )

    def deliver(data: bytes) -> None:
        queue.put_nowait(ExecRequest(stdin=data) if data else ExecRequest(close_stdin=True))

    # Without -i the process's stdin is /dev/null from the start (ExecStart.stdin false): nothing
    # follows the start but signals. A close_stdin right after it was a second write racing a
    # server that refuses the start (a container not found), and grpc's aio client then reports
    # its own "INTERNAL: Internal error from Core" instead of the server's status (grpc#36066).
    stop_reading: Callable[[], object] = forward_stdin(loop, deliver) if args.interactive else lambda: None

    async def requests() -> AsyncIterator[ExecRequest]:
        yield ExecRequest(start=start)
        while (message := await queue.get()) is not None:
            yield message

    def resized() -> None:
        new = _size()
        if new is not None:
            queue.put_nowait(ExecRequest(resize=new))

    code: int | None = None

    def forward(name: str) -> None:
        queue.put_nowait(ExecRequest(signal=name))

    signals = CallSignals(None if args.tty else forward)
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
    with raw_terminal(args.tty and args.interactive):  # keys, ^C included, go to the container's terminal
        return session(args, lambda client: _exec(args, client))
