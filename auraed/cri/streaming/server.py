"""The streaming server: an HTTP/1.1 front (h11) that upgrades to SPDY/3.1 or WebSocket.

Routes, as the kubelet's: ``/exec/<token>``, ``/attach/<token>``, ``/portforward/<token>``, GET or
POST. The token is consumed by the first request that presents it. Answers before an upgrade:
404 for an unknown path or token (used, expired, or of another kind), 405 for another method,
400 for a request that is neither upgrade or lacks ``X-Stream-Protocol-Version``, 403 when no
protocol the client offers is served (with ``X-Accepted-Stream-Protocol-Versions``), 503 past
``max_connections``. Each connection serves one request.

SPDY: ``Connection: Upgrade``, ``Upgrade: SPDY/3.1``, and the client's protocols in
``X-Stream-Protocol-Version``; the first the server accepts (in the client's order) is answered in
the 101. WebSocket: the subprotocol picks the same way; exec and attach speak the channel
protocol, port-forward SPDY tunnelled in binary messages.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import urllib.parse
from collections.abc import Awaitable, Callable

import h11

from auraed.cri.streaming import portforward, remotecommand
from auraed.cri.streaming.backend import (
    AttachRequest,
    ExecRequest,
    PortForwardRequest,
    StreamingBackend,
    StreamingRequest,
)
from auraed.cri.streaming.config import StreamingConfig
from auraed.cri.streaming.remotecommand import CommandSpec, StreamOptions
from auraed.cri.streaming.spdy_session import SpdySession
from auraed.cri.streaming.tokens import TokenRegistry
from auraed.cri.streaming.transport import ByteTransport, StreamTransport
from auraed.cri.streaming.websocket import WebSocketConnection, WebSocketTransport

log = logging.getLogger(__name__)

PROTOCOL_HEADER = "x-stream-protocol-version"
ACCEPTED_PROTOCOLS_HEADER = "X-Accepted-Stream-Protocol-Versions"
_KINDS: dict[str, type[StreamingRequest]] = {
    "exec": ExecRequest,
    "attach": AttachRequest,
    "portforward": PortForwardRequest,
}


class HttpRefusal(Exception):
    """Answer the request with ``status`` and ``message`` instead of upgrading it."""

    def __init__(self, status: int, message: str, headers: tuple[tuple[str, str], ...] = ()) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers


class StreamingServer:
    """Serves the URLs ``url_for`` hands out, with ``backend`` behind the streams.

    ``await start()`` listens; ``url_for`` needs it started; ``await close()`` stops listening
    and ends every session (their processes are killed through ``ProcessSession.close``).
    """

    def __init__(self, backend: StreamingBackend, config: StreamingConfig | None = None) -> None:
        self.config = config or StreamingConfig()
        self._backend = backend
        self._tokens = TokenRegistry(self.config.token_ttl, self.config.max_pending_tokens)
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()
        self._closing = False
        self.base_url = ""

    @property
    def active_connections(self) -> int:
        return len(self._connections)

    async def start(self) -> None:
        self._server = await asyncio.start_server(
            self._accept, self.config.bind_address, self.config.port, limit=self.config.max_request_head
        )
        port = self._server.sockets[0].getsockname()[1]
        self.base_url = f"http://{_url_host(self.config.url_host or self.config.bind_address)}:{port}"

    async def close(self) -> None:
        self._closing = True
        if self._server is not None:
            self._server.close()
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    def url_for(self, request: StreamingRequest) -> str:
        """An absolute URL with a one-time token for ``request`` (RESOURCE_EXHAUSTED when full)."""
        if not self.base_url:
            raise RuntimeError("the streaming server is not started")
        kind = next(name for name, kind_type in _KINDS.items() if isinstance(request, kind_type))
        return f"{self.base_url}/{kind}/{self._tokens.insert(request)}"

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            if len(self._connections) > self.config.max_connections:
                raise HttpRefusal(503, "too many streaming connections")
            await self._serve(reader, writer)
        except HttpRefusal as refusal:
            await _refuse(writer, refusal)
        except (OSError, TimeoutError) as exc:
            log.debug("streaming connection ended: %s", exc)
        except Exception:
            log.exception("streaming connection failed")
        finally:
            self._connections.discard(task)
            writer.transport.abort()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(self.config.request_timeout):
                request, head, extra = await _read_request(reader, self.config.max_request_head)
        except TimeoutError:
            raise HttpRefusal(408, "the request head did not arrive in time") from None
        method = request.method.decode("ascii", "replace")
        target = urllib.parse.urlsplit(request.target.decode("ascii", "replace"))
        kind, _, token = target.path.strip("/").partition("/")
        if kind not in _KINDS or not token or "/" in token:
            raise HttpRefusal(404, "404 page not found")
        if method not in ("GET", "POST"):
            raise HttpRefusal(405, "method not allowed", (("Allow", "GET, POST"),))
        headers = [(name.decode("latin-1"), value.decode("latin-1")) for name, value in request.headers]
        if any(
            name.lower() in ("content-length", "transfer-encoding") and value not in ("", "0")
            for name, value in headers
        ):
            raise HttpRefusal(400, "an upgrade request has no body")
        streaming_request = self._tokens.consume(token)
        if not isinstance(streaming_request, _KINDS[kind]):
            raise HttpRefusal(404, "404 page not found")
        upgrade = _header_list(headers, "upgrade")
        if not any(item.lower() == "upgrade" for item in _header_list(headers, "connection")):
            upgrade = []
        if any(item.lower() == "websocket" for item in upgrade):
            await self._serve_websocket(
                streaming_request, head, headers=headers, reader=reader, writer=writer, extra=extra
            )
        elif any(item.lower() == "spdy/3.1" for item in upgrade):
            await self._serve_spdy(streaming_request, headers, reader, writer, extra)
        else:
            raise HttpRefusal(400, "unable to upgrade: missing upgrade headers in request")

    # SPDY

    async def _serve_spdy(
        self,
        request: StreamingRequest,
        headers: list[tuple[str, str]],
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        extra: bytes,
    ) -> None:
        offered = _header_list(headers, PROTOCOL_HEADER)
        if not offered:
            raise HttpRefusal(400, "unable to upgrade: X-Stream-Protocol-Version is required")
        served = (
            (portforward.PROTOCOL,)
            if isinstance(request, PortForwardRequest)
            else remotecommand.SPDY_PROTOCOLS
        )
        protocol = next((item for item in offered if item in served), None)
        if protocol is None:
            raise HttpRefusal(
                403,
                f"unable to upgrade: unable to negotiate protocol: client supports {offered}, "
                f"server accepts {list(served)}",
                tuple((ACCEPTED_PROTOCOLS_HEADER, item) for item in served),
            )
        writer.write(
            b"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: SPDY/3.1\r\n"
            + f"X-Stream-Protocol-Version: {protocol}\r\n\r\n".encode("ascii")
        )
        await writer.drain()
        await self._run_spdy(StreamTransport(reader, writer, extra), request, protocol)

    async def _run_spdy(self, transport: ByteTransport, request: StreamingRequest, protocol: str) -> None:
        spdy = SpdySession(transport, client=False, limits=self.config.spdy)
        reading = asyncio.create_task(spdy.run())
        try:
            if isinstance(request, PortForwardRequest):
                await self._forward_ports(spdy, request)
            else:
                version = remotecommand.protocol_version(protocol)
                options, spec = self._command(request)
                streams = await remotecommand.collect_spdy_streams(
                    spdy, options, version, self.config.stream_creation_timeout
                )
                if streams is not None:

                    def gone() -> Awaitable[None]:
                        return _first(spdy.wait_ended(), self._idle(lambda: spdy.last_activity))

                    await remotecommand.run_remote_command(streams, spec, version, gone)
        finally:
            await spdy.close(self._close_grace())
            reading.cancel()
            await asyncio.gather(reading, return_exceptions=True)

    async def _forward_ports(self, spdy: SpdySession, request: PortForwardRequest) -> None:
        async def dial(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
            return await self._backend.dial(request.pod_sandbox_id, port)

        serving = portforward.serve_port_forward(
            spdy, dial, request.pod_sandbox_id, self.config.stream_creation_timeout
        )
        await _first(serving, self._idle(lambda: spdy.last_activity))

    def _command(self, request: ExecRequest | AttachRequest) -> tuple[StreamOptions, CommandSpec]:
        options = StreamOptions.of(
            stdin=request.stdin, stdout=request.stdout, stderr=request.stderr, tty=request.tty
        )
        if isinstance(request, ExecRequest):
            exec_request = request
            spec = CommandSpec(
                lambda: self._backend.exec(exec_request), "error executing command in container", request.cmd
            )
        else:
            attach_request = request
            spec = CommandSpec(
                lambda: self._backend.attach(attach_request),
                "error attaching to container",
                report_exit_code=False,
            )
        return options, spec

    # WebSocket

    async def _serve_websocket(
        self,
        request: StreamingRequest,
        head: bytes,
        *,
        headers: list[tuple[str, str]],
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        extra: bytes,
    ) -> None:
        offered = _header_list(headers, "sec-websocket-protocol")
        if isinstance(request, PortForwardRequest):
            served: tuple[str, ...] = (portforward.TUNNEL_PROTOCOL,)
        else:
            served = remotecommand.WEBSOCKET_PROTOCOLS
        protocol = next((item for item in offered if item in served), None)
        if protocol is None and (offered or isinstance(request, PortForwardRequest)):
            raise HttpRefusal(
                403,
                f"unable to upgrade: no WebSocket subprotocol of {offered} is served, only {list(served)}",
            )
        connection = await WebSocketConnection.accept(
            head,
            reader,
            writer,
            subprotocol=protocol,
            initial=extra,
            max_message=self.config.websocket_max_message,
        )
        if connection is None:
            return
        if isinstance(request, PortForwardRequest):
            await self._run_spdy(
                WebSocketTransport(connection, self.config.close_grace), request, portforward.PROTOCOL
            )
            return
        options, spec = self._command(request)
        mux = remotecommand.websocket_mux(connection, protocol or "")
        routing = asyncio.create_task(mux.run())
        try:
            await remotecommand.announce_websocket(mux, options)

            def gone() -> Awaitable[None]:
                return _first(connection.wait_closed(), self._idle(lambda: connection.last_activity))

            await remotecommand.run_remote_command(
                remotecommand.websocket_streams(mux, options),
                spec,
                remotecommand.protocol_version(protocol or ""),
                gone,
            )
        finally:
            await connection.close(self._close_grace())
            routing.cancel()
            await asyncio.gather(routing, return_exceptions=True)

    def _close_grace(self) -> float:
        """How long a session's end waits for its client: not at all when the server stops."""
        return 0.0 if self._closing else self.config.close_grace

    async def _idle(self, last_activity: Callable[[], float]) -> None:
        """Returns once nothing went either way for ``idle_timeout`` seconds."""
        loop = asyncio.get_running_loop()
        # Activity is a timestamp the transports keep, not an event: sleep until it could expire.
        while (remaining := last_activity() + self.config.idle_timeout - loop.time()) > 0:  # noqa: ASYNC110
            await asyncio.sleep(remaining)
        log.info("streaming session idle for %.0f s: closing it", self.config.idle_timeout)


async def _first(*awaitables: Awaitable[None]) -> None:
    """Wait for the first of ``awaitables`` to finish; cancel the others."""
    tasks = [asyncio.ensure_future(awaitable) for awaitable in awaitables]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    for task in done:
        if not task.cancelled() and task.exception() is not None:
            raise task.exception()  # type: ignore[misc]


async def _read_request(reader: asyncio.StreamReader, limit: int) -> tuple[h11.Request, bytes, bytes]:
    """The request parsed by h11, its head's bytes, and the bytes the client sent after it."""
    buffer = b""
    while (end := buffer.find(b"\r\n\r\n")) < 0:
        if len(buffer) > limit:
            raise HttpRefusal(431, "request head too large")
        data = await reader.read(limit)
        if not data:
            raise ConnectionResetError("the client closed the connection before its request")
        buffer += data
    head, extra = buffer[: end + 4], buffer[end + 4 :]
    if len(head) > limit:
        raise HttpRefusal(431, "request head too large")
    connection = h11.Connection(h11.SERVER, max_incomplete_event_size=limit)
    connection.receive_data(head)
    try:
        event = connection.next_event()
    except h11.RemoteProtocolError as exc:
        raise HttpRefusal(400, f"malformed request: {exc}") from None
    if not isinstance(event, h11.Request):
        raise HttpRefusal(400, "malformed request")
    return event, head, extra


def _header_list(headers: list[tuple[str, str]], name: str) -> list[str]:
    """Every comma-separated value of header ``name``, in order, blanks dropped."""
    return [
        item.strip()
        for header, value in headers
        if header.lower() == name
        for item in value.split(",")
        if item.strip()
    ]


async def _refuse(writer: asyncio.StreamWriter, refusal: HttpRefusal) -> None:
    body = (refusal.message + "\n").encode("utf-8")
    connection = h11.Connection(h11.SERVER)
    # h11 answers only what it has parsed: hand it a minimal request first.
    connection.receive_data(b"GET / HTTP/1.1\r\nHost: streaming\r\n\r\n")
    connection.next_event()
    headers = [
        ("Content-Type", "text/plain; charset=utf-8"),
        ("Content-Length", str(len(body))),
        ("Connection", "close"),
        *refusal.headers,
    ]
    data = connection.send(h11.Response(status_code=refusal.status, headers=headers))
    data = (
        (data or b"")
        + (connection.send(h11.Data(data=body)) or b"")
        + (connection.send(h11.EndOfMessage()) or b"")
    )
    with contextlib.suppress(OSError):
        writer.write(data)
        await writer.drain()


def _url_host(host: str) -> str:
    """``host`` as a URL's authority: IPv6 bracketed, a wildcard replaced by loopback."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host
    if address.is_unspecified:
        address = ipaddress.ip_address("::1" if address.version == 6 else "127.0.0.1")
    return f"[{address}]" if address.version == 6 else str(address)
