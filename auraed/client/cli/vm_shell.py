"""``aer vm console NAME --shell``: the guest's debug shell (VmService.DebugShell; the host's
vm_debug_console) on this terminal, in raw mode as ``aer container exec -it``: every key, ^C
included, goes to the guest's shell. ``exit`` (or ^D) ends it and aer with the shell's status;
SIGTERM and SIGHUP end aer (the terminal restored). Without a terminal, stdin is sent as typed
and its end as ^D, so ``echo 'uname -a' | aer vm console g1 --shell`` runs one command."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import AsyncIterator

from auraed.api.aurae.vms import v0 as vms_pb
from auraed.client.cli.calls import VMS, CliError, call_timeout, session
from auraed.client.cli.terminal import CallSignals, forward_stdin, raw_terminal, terminal_size
from auraed.client.client import AuraeClient

EOF_KEY = b"\x04"  # ^D: the end of input for a shell on a terminal

Request = vms_pb.VmServiceDebugShellRequest


def _size() -> vms_pb.TerminalSize | None:
    size = terminal_size()
    return None if size is None else vms_pb.TerminalSize(rows=size[0], columns=size[1])


async def _shell(args: argparse.Namespace, client: AuraeClient) -> int:
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[Request | None] = asyncio.Queue()

    async def requests() -> AsyncIterator[Request]:
        yield Request(name=args.name, size=_size())
        while (message := await queue.get()) is not None:
            yield message

    def resized() -> None:
        size = _size()
        if size is not None:
            queue.put_nowait(Request(size=size))

    signals = CallSignals(None)  # SIGTERM and SIGHUP end aer; ^C is a key for the guest's shell
    signals.on_resize(resized)
    stop_reading = forward_stdin(loop, lambda data: queue.put_nowait(Request(input=data or EOF_KEY)))
    code: int | None = None
    try:
        with signals:
            async for reply in client.duplex(
                VMS, "DebugShell", requests(), call_timeout(args, open_ended=True)
            ):
                if reply.output:
                    sys.stdout.buffer.write(reply.output)
                    sys.stdout.flush()
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
        raise CliError(f"the debug shell of VM {args.name} ended without an exit status")
    return code


def cmd_vm_shell(args: argparse.Namespace) -> int:
    with raw_terminal(True):
        return session(args, lambda client: _shell(args, client))
