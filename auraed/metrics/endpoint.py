"""The metrics endpoint: Prometheus's text format over plain HTTP/1.1, on the event loop.

Not prometheus_client's own server, which answers from threads: the collectors read the domain's
records (containers by state, say), which only the event loop changes, so they are read there.
Each connection serves one request (``Connection: close``): GET or HEAD of ``/metrics`` (``/``
too); 404 for another path, 405 for another method, 408 for a head not sent within
``HEAD_TIMEOUT``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import h11
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

log = logging.getLogger(__name__)

HEAD_TIMEOUT = 10.0  # seconds a client has to send its request's head
MAX_HEAD_BYTES = 16 * 1024
PATHS = (b"/metrics", b"/")


class MetricsEndpoint:
    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        self._registry = registry
        self._host, self._port = host, port
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()

    async def start(self) -> int:
        """Listen; the port bound (``port`` 0 picks one)."""
        self._server = await asyncio.start_server(self._accept, self._host.strip("[]"), self._port)
        return int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            await self._serve(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the scraper went away
        finally:
            self._connections.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connection = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
        try:
            request = await asyncio.wait_for(_read_head(reader, connection), HEAD_TIMEOUT)
        except TimeoutError:
            await _refuse(writer, "408 Request Timeout")
            return
        except h11.RemoteProtocolError:
            await _refuse(writer, "400 Bad Request")
            return
        if request is None:
            return
        path = request.target.split(b"?", 1)[0]
        if request.method not in (b"GET", b"HEAD"):
            await _answer(writer, connection, 405, b"only GET\n", headers=(("Allow", "GET, HEAD"),))
        elif path not in PATHS:
            await _answer(writer, connection, 404, b"the metrics are at /metrics\n")
        else:
            body = generate_latest(self._registry)
            head_only = request.method == b"HEAD"
            await _answer(
                writer,
                connection,
                200,
                b"" if head_only else body,
                content_type=CONTENT_TYPE_LATEST,
                length=len(body),
            )


async def _read_head(reader: asyncio.StreamReader, connection: h11.Connection) -> h11.Request | None:
    while True:
        event = connection.next_event()
        if isinstance(event, h11.Request):
            return event
        if event is h11.NEED_DATA:
            data = await reader.read(4096)
            connection.receive_data(data)
            if not data and connection.their_state is h11.IDLE:
                return None  # connected and went without a word (a port probe)
            continue
        if isinstance(event, h11.ConnectionClosed):
            return None


async def _refuse(writer: asyncio.StreamWriter, status: str) -> None:
    """An answer before any request was read, which h11 has no state to send from."""
    writer.write(f"HTTP/1.1 {status}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".encode())
    await writer.drain()


async def _answer(
    writer: asyncio.StreamWriter,
    connection: h11.Connection,
    status: int,
    body: bytes,
    *,
    headers: tuple[tuple[str, str], ...] = (),
    content_type: str = "text/plain; charset=utf-8",
    length: int | None = None,
) -> None:
    response = h11.Response(
        status_code=status,
        headers=[
            ("Content-Type", content_type),
            ("Content-Length", str(len(body) if length is None else length)),
            ("Connection", "close"),
            *headers,
        ],
    )
    data = connection.send(response) or b""
    if body:
        data += connection.send(h11.Data(data=body)) or b""
    data += connection.send(h11.EndOfMessage()) or b""
    writer.write(data)
    await writer.drain()
