"""The kubelet's port-forward protocol (``portforward.k8s.io``) over a SPDY session.

For each connection it forwards, the client opens an ``error`` and a ``data`` stream, both with
the headers ``port`` and ``requestID``. Once a pair is complete the server dials the port in the
pod and copies bytes both ways over the data stream; a failure is written as text on the error
stream, which the server then closes. The same session runs over TCP or tunnelled in a WebSocket
(``SPDY/3.1+portforward.k8s.io``, what client-go's WebSocket port-forward dialer speaks).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Awaitable, Callable

from auraed.cri.streaming.spdy import SpdyError, header_value
from auraed.cri.streaming.spdy_session import SpdySession, SpdyStream
from auraed.errors import AuraeError

log = logging.getLogger(__name__)

PROTOCOL = "portforward.k8s.io"
TUNNEL_PREFIX = "SPDY/3.1+"
TUNNEL_PROTOCOL = TUNNEL_PREFIX + PROTOCOL
PORT_HEADER = "port"
REQUEST_ID_HEADER = "requestid"
STREAM_TYPE_HEADER = "streamtype"
_COPY_SIZE = 32 * 1024

Dial = Callable[[int], Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]]


@dataclasses.dataclass
class _Pair:
    request_id: str
    port: int
    error: SpdyStream | None = None
    data: SpdyStream | None = None
    timer: asyncio.TimerHandle | None = None


def _port(stream: SpdyStream) -> int | None:
    text = header_value(stream.headers, PORT_HEADER) or ""
    if not text.isdigit() or not 0 < int(text) <= 65535:
        return None
    return int(text)


def _request_id(stream: SpdyStream, kind: str) -> str:
    request_id = header_value(stream.headers, REQUEST_ID_HEADER)
    if request_id:
        return request_id
    # Clients older than the header number pairs by stream id: error n, data n+2 (the kubelet's rule).
    return str(stream.stream_id if kind == "error" else stream.stream_id - 2)


async def serve_port_forward(spdy: SpdySession, dial: Dial, describe: str, pair_timeout: float) -> None:
    """Serve stream pairs until the session ends; every forwarded connection ends with it."""
    pairs: dict[str, _Pair] = {}
    async with asyncio.TaskGroup() as group:
        while (stream := await spdy.accept()) is not None:
            kind = header_value(stream.headers, STREAM_TYPE_HEADER)
            port = _port(stream)
            if kind not in ("error", "data") or port is None:
                log.info("port-forward stream %d refused: bad streamType or port header", stream.stream_id)
                await stream.reset()
                continue
            request_id = _request_id(stream, kind)
            pair = pairs.get(request_id)
            if pair is None:
                pair = pairs[request_id] = _Pair(request_id, port)
                pair.timer = asyncio.get_running_loop().call_later(
                    pair_timeout, _schedule_expiry, group, pairs, pair
                )
            if getattr(pair, kind) is not None:
                await stream.reset()
                continue
            await stream.reply()
            setattr(pair, kind, stream)
            if pair.error is not None and pair.data is not None:
                del pairs[request_id]
                if pair.timer is not None:
                    pair.timer.cancel()
                group.create_task(_forward(pair.error, pair.data, pair.port, dial, describe))
        for pair in pairs.values():
            if pair.timer is not None:
                pair.timer.cancel()


def _schedule_expiry(group: asyncio.TaskGroup, pairs: dict[str, _Pair], pair: _Pair) -> None:
    group.create_task(_expire(pairs, pair))


async def _expire(pairs: dict[str, _Pair], pair: _Pair) -> None:
    if pairs.get(pair.request_id) is not pair:
        return
    del pairs[pair.request_id]
    message = f"timed out waiting for the streams of request {pair.request_id}"
    for stream in (pair.error, pair.data):
        if stream is None:
            continue
        with contextlib.suppress(SpdyError):
            if stream is pair.error:
                await stream.write(message.encode())
                await stream.close_write()
            else:
                await stream.reset()


async def _forward(error: SpdyStream, data: SpdyStream, port: int, dial: Dial, describe: str) -> None:
    error.discard_incoming()
    try:
        reader, writer = await dial(port)
    except (AuraeError, OSError) as exc:
        reason = exc.message if isinstance(exc, AuraeError) else str(exc)
        with contextlib.suppress(SpdyError):
            await error.write(f"error forwarding port {port} to pod {describe}: {reason}".encode())
            await error.close_write()
            await data.close_write()
        return
    try:
        async with asyncio.TaskGroup() as group:
            group.create_task(_to_pod(data, writer))
            group.create_task(_from_pod(reader, data))
    except BaseExceptionGroup as failures:
        log.info("port-forward to %d ended: %s", port, failures.exceptions[0])
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        await data.reset()
        with contextlib.suppress(SpdyError):
            await error.close_write()


async def _to_pod(data: SpdyStream, writer: asyncio.StreamWriter) -> None:
    # A reset by the client raises here and ends the other direction with it.
    while chunk := await data.read(_COPY_SIZE):
        writer.write(chunk)
        await writer.drain()
    if writer.can_write_eof():
        writer.write_eof()


async def _from_pod(reader: asyncio.StreamReader, data: SpdyStream) -> None:
    while chunk := await reader.read(_COPY_SIZE):
        await data.write(chunk)
    await data.close_write()
