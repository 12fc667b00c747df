"""A small asyncio QMP client (QEMU Machine Protocol over a unix socket).

The protocol: QEMU greets with ``{"QMP": {...}}``; the client must send ``qmp_capabilities``
before anything else; every command is a JSON object ``{"execute": ..., "arguments": ...,
"id": ...}`` answered by ``{"return": ...}`` or ``{"error": {"class", "desc"}}`` carrying the same
id; asynchronous events (``{"event": "SHUTDOWN", "data": {...}, "timestamp": {...}}``) may arrive
at any time in between. Messages are one JSON document per line.

QEMU serves one QMP client at a time on a socket, so one client per VM is kept connected for
the VMM's life: it issues commands and records events (SHUTDOWN tells a guest power-off from a
host-side kill).
"""

from __future__ import annotations

import array
import asyncio
import collections
import contextlib
import itertools
import json
import logging
import os
import socket
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

READ_LIMIT = 16 * 1024 * 1024  # query results (query-qmp-schema) can be large
MAX_EVENTS = 256


class QmpError(Exception):
    """A QMP command failed, or the connection did."""

    def __init__(self, message: str, error_class: str = "") -> None:
        super().__init__(message)
        self.error_class = error_class


class QmpClient:
    def __init__(self, path: Path | str) -> None:
        self.path = str(path)
        self.greeting: dict[str, Any] = {}
        self.events: collections.deque[dict[str, Any]] = collections.deque(maxlen=MAX_EVENTS)
        # The last SHUTDOWN event: {"guest": bool, "reason": "guest-shutdown" | "host-qmp-quit" | ...}.
        self.shutdown_event: dict[str, Any] | None = None
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._pending: dict[str, asyncio.Future[Any]] = {}
        self._ids = itertools.count(1)
        self._task: asyncio.Task[None] | None = None
        self._event_waiters: list[tuple[str, asyncio.Future[dict[str, Any]]]] = []
        self._closed = asyncio.Event()
        self._connect_lock = asyncio.Lock()

    @property
    def connected(self) -> bool:
        return self._task is not None and not self._closed.is_set()

    async def connect(self, timeout: float = 5.0) -> None:
        """Connect, read the greeting and negotiate capabilities (idempotent while connected)."""
        async with self._connect_lock:
            if self.connected:
                return
            self._closed = asyncio.Event()
            try:
                async with asyncio.timeout(timeout):
                    self._reader, self._writer = await asyncio.open_unix_connection(
                        self.path, limit=READ_LIMIT
                    )
                    greeting = json.loads(await self._reader.readline() or b"null")
            except (OSError, ValueError, TimeoutError) as exc:
                await self._drop()
                raise QmpError(f"cannot connect to QMP at {self.path}: {exc or type(exc).__name__}") from None
            if not isinstance(greeting, dict) or "QMP" not in greeting:
                await self._drop()
                raise QmpError(f"unexpected QMP greeting from {self.path}: {str(greeting)[:200]}")
            self.greeting = greeting["QMP"]
            self._task = asyncio.get_running_loop().create_task(self._read_loop())
        await self.execute("qmp_capabilities", timeout=timeout)

    async def execute(
        self, command: str, arguments: dict[str, Any] | None = None, timeout: float = 10.0
    ) -> Any:
        if self._writer is None or not self.connected:
            raise QmpError(f"QMP at {self.path} is not connected")
        ident = f"auraed-{next(self._ids)}"
        message: dict[str, Any] = {"execute": command, "id": ident}
        if arguments:
            message["arguments"] = arguments
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[ident] = future
        try:
            self._writer.write(json.dumps(message).encode() + b"\n")
            await self._writer.drain()
            async with asyncio.timeout(timeout):
                return await future
        except TimeoutError:
            raise QmpError(f"QMP {command} got no answer within {timeout:g} s") from None
        except OSError as exc:
            raise QmpError(f"QMP {command}: {exc}") from None
        finally:
            self._pending.pop(ident, None)

    async def send_fd(self, name: str, fd: int, timeout: float = 10.0) -> None:
        """Hand QEMU a copy of ``fd`` under ``name`` (QMP ``getfd``: the descriptor travels as
        SCM_RIGHTS with the command), for commands that take ``fd:NAME`` (``migrate``)."""
        if self._writer is None or not self.connected:
            raise QmpError(f"QMP at {self.path} is not connected")
        await self._writer.drain()  # nothing of ours may sit before the command in the stream
        transport = self._writer.get_extra_info("socket")
        ident = f"auraed-{next(self._ids)}"
        message = json.dumps({"execute": "getfd", "arguments": {"fdname": name}, "id": ident}).encode()
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[ident] = future
        # A second socket object on a copy of the connection's descriptor: asyncio's own wrapper
        # does not send ancillary data. The line is short: one sendmsg writes it whole.
        with socket.socket(fileno=os.dup(transport.fileno())) as sock:
            try:
                sock.sendmsg(
                    [message + b"\n"],
                    [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]).tobytes())],
                )
            except OSError as exc:
                self._pending.pop(ident, None)
                raise QmpError(f"QMP getfd: {exc}") from None
        try:
            async with asyncio.timeout(timeout):
                await future
        except TimeoutError:
            raise QmpError(f"QMP getfd got no answer within {timeout:g} s") from None
        finally:
            self._pending.pop(ident, None)

    async def wait_event(self, name: str, timeout: float) -> dict[str, Any]:
        """The next event called ``name`` (not one already received)."""
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        entry = (name, future)
        self._event_waiters.append(entry)
        try:
            async with asyncio.timeout(timeout):
                return await future
        finally:
            with contextlib.suppress(ValueError):
                self._event_waiters.remove(entry)

    async def wait_closed(self) -> None:
        await self._closed.wait()

    async def _read_loop(self) -> None:
        assert self._reader is not None
        reason = "connection closed"
        try:
            while True:
                line = await self._reader.readline()
                if not line:
                    break
                try:
                    message = json.loads(line)
                except ValueError:
                    log.warning("QMP %s: unreadable message %r", self.path, line[:200])
                    continue
                if isinstance(message, dict):
                    self._dispatch(message)
        except (OSError, asyncio.LimitOverrunError, ValueError) as exc:
            reason = f"connection failed: {exc}"
        finally:
            for future in self._pending.values():
                if not future.done():
                    future.set_exception(QmpError(f"QMP at {self.path}: {reason}"))
            for _, waiter in self._event_waiters:
                if not waiter.done():
                    waiter.set_exception(QmpError(f"QMP at {self.path}: {reason}"))
            self._closed.set()

    def _dispatch(self, message: dict[str, Any]) -> None:
        if "event" in message:
            self.events.append(message)
            if message["event"] == "SHUTDOWN":
                self.shutdown_event = dict(message.get("data") or {})
            for name, waiter in list(self._event_waiters):
                if name == message["event"] and not waiter.done():
                    waiter.set_result(message)
            return
        future = self._pending.get(str(message.get("id")))
        if future is None or future.done():
            return
        if "error" in message:
            error = message["error"] or {}
            future.set_exception(QmpError(f"QMP: {error.get('desc', 'failed')}", str(error.get("class", ""))))
        else:
            future.set_result(message.get("return"))

    async def _drop(self) -> None:
        # Taken before awaiting: a second caller must not wait on the same close future, which
        # a cancellation of the first caller cancels (it would raise CancelledError there).
        writer, self._reader, self._writer = self._writer, None, None
        if writer is not None:
            writer.close()
            with contextlib.suppress(OSError, ConnectionError):
                await writer.wait_closed()

    async def close(self) -> None:
        task, self._task = self._task, None
        await self._drop()
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._closed.set()
