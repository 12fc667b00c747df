"""The host's side of the debug console (vm_debug_console): one session relayed to a VM's debug port.

QEMU listens on ``debug.sock`` in the run dir of a VM booted cold while the setting was on, and
in that of each clone of a template made while it was on (qemu.py); the guest's PID 1 runs a
shell there (init/debugshell.py). A session connects to the socket, sends frames (bootargs'
debug_frame: input, terminal sizes), and yields what the guest sends back: output bytes, then the
shell's exit status. One session a VM at a time (QEMU's socket serves one connection; a second
would wait, silently, behind the first). Closing the connection hangs up the guest's shell. Each
session is logged with who opened it, never its bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
import time
from collections.abc import AsyncIterator
from pathlib import Path

from auraed.bootargs import (
    DEBUG_EXIT,
    DEBUG_INPUT,
    DEBUG_OPEN,
    DEBUG_OUTPUT,
    DEBUG_SIZE,
    DebugFrames,
    debug_frame,
)
from auraed.vms import backend as common
from auraed.vms.errors import VmError
from auraed.vms.model import State
from auraed.vms.vms import Vms

log = logging.getLogger(__name__)

SETTING = "vm_debug_console"
READ_SIZE = 64 * 1024
CONNECT_TIMEOUT = 5.0


class Output:
    """What a session yields: terminal output, or (last) the shell's exit status."""

    __slots__ = ("data", "exit_code")

    def __init__(self, data: bytes = b"", exit_code: int | None = None) -> None:
        self.data = data
        self.exit_code = exit_code


class DebugConsoles:
    """The debug sessions of a daemon's VMs; ``enabled`` is the daemon's vm_debug_console."""

    def __init__(self, vms: Vms, enabled: bool) -> None:
        self._vms = vms
        self.enabled = enabled
        self._open: set[str] = set()

    def socket_of(self, name: str) -> Path:
        """The VM's debug socket once checked usable; FAILED_PRECONDITION saying why not."""
        if not self.enabled:
            raise VmError.precondition(
                f"the debug console is off: {SETTING} = true in the daemon's configuration turns it "
                "on (for VMs started after)"
            )
        record = self._vms.get(name)
        if record.state != State.RUNNING:
            raise VmError.precondition(f"VM {name} is {record.state}: a debug shell needs it running")
        path = Path(record.run_dir) / common.DEBUG_SOCKET
        if not path.exists():
            raise VmError.precondition(
                f"VM {name} has no debug port: it was started before {SETTING} was on, or runs on "
                "cloud-hypervisor (restart it with the setting on)"
            )
        if name in self._open:
            raise VmError.precondition(f"VM {name} has a debug shell session open already")
        return path

    async def session(
        self,
        name: str,
        who: str,
        size: tuple[int, int] | None,
        requests: AsyncIterator[tuple[bytes, tuple[int, int] | None]],
    ) -> AsyncIterator[Output]:
        """Relay ``requests`` (input bytes, a new size or None) to the VM's shell; its output back."""
        path = self.socket_of(name)
        self._open.add(name)
        started = time.monotonic()
        relay: _Relay | None = None
        try:
            try:
                async with asyncio.timeout(CONNECT_TIMEOUT):
                    reader, writer = await asyncio.open_unix_connection(path)
            except (OSError, TimeoutError) as exc:
                raise VmError.precondition(f"VM {name}: its debug port does not answer: {exc}") from None
            relay = _Relay(name, reader, writer)
            log.info("debug shell on VM %s opened for %s", name, who)
            async for item in relay.run(size, requests):
                yield item
        except BaseException as exc:
            if relay is not None and not isinstance(exc, VmError):
                relay.reason = f"{type(exc).__name__} {exc}".strip()
            raise
        finally:
            self._open.discard(name)
            if relay is not None:
                await relay.close()
                log.info(
                    "debug shell on VM %s closed for %s after %.1f s: %s (%d bytes in, %d out)",
                    name, who, time.monotonic() - started, relay.reason, relay.sent, relay.received,
                )  # fmt: skip


class _Relay:
    """One connection to a debug socket: input frames out, the guest's frames back."""

    def __init__(self, name: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.name = name
        self.reader = reader
        self.writer = writer
        self.sent = self.received = 0
        self.reason = "the caller ended it"
        self.queue: asyncio.Queue[Output | None] = asyncio.Queue(maxsize=16)

    async def run(
        self, size: tuple[int, int] | None, requests: AsyncIterator[tuple[bytes, tuple[int, int] | None]]
    ) -> AsyncIterator[Output]:
        self.writer.write(debug_frame(DEBUG_OPEN, b""))
        if size is not None:
            self.writer.write(debug_frame(DEBUG_SIZE, _size(size)))
        tasks = [asyncio.ensure_future(self._pump(requests)), asyncio.ensure_future(self._from_guest())]
        try:
            while (item := await self.queue.get()) is not None:
                if item.exit_code is not None:
                    self.reason = f"the shell exited with {item.exit_code}"
                self.received += len(item.data)
                yield item
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    async def _pump(self, requests: AsyncIterator[tuple[bytes, tuple[int, int] | None]]) -> None:
        try:
            async for data, new_size in requests:
                if new_size is not None:
                    self.writer.write(debug_frame(DEBUG_SIZE, _size(new_size)))
                if data:
                    self.writer.write(debug_frame(DEBUG_INPUT, data))
                    self.sent += len(data)
                await self.writer.drain()
        except Exception as exc:  # the caller's stream or the socket failed
            log.info("debug shell on VM %s: input ended: %s", self.name, exc)
        await self.queue.put(None)  # the caller half-closed: the session ends

    async def _from_guest(self) -> None:
        frames = DebugFrames()
        while data := await self.reader.read(READ_SIZE):
            for kind, payload in frames.feed(data):
                if kind == DEBUG_OUTPUT:
                    await self.queue.put(Output(payload))
                elif kind == DEBUG_EXIT and len(payload) == 4:
                    await self.queue.put(Output(exit_code=struct.unpack(">i", payload)[0]))
                    await self.queue.put(None)
                    return
        self.reason = "the VM's end of the port closed"
        await self.queue.put(None)

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(Exception):
            await self.writer.wait_closed()


def _size(size: tuple[int, int]) -> bytes:
    rows, columns = size
    return struct.pack(">HH", min(rows, 0xFFFF), min(columns, 0xFFFF))
