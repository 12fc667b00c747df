"""A SPDY/3.1 connection over asyncio: streams opened by either side, flow control, ping, goaway.

``SpdySession.run`` reads and dispatches frames until the connection ends; ``accept`` hands out the
streams the peer opens (the caller replies or refuses each), ``open_stream`` opens one and waits
for its reply. A ``SpdyStream`` reads what the peer sent (b"" after its FIN), writes DATA frames,
half-closes (FIN) and resets.

Flow control. Each side announces its receive window in a SETTINGS frame sent first and grants
more with WINDOW_UPDATE as the application reads (per stream, and on stream 0 for the session, as
3.1 adds). Sending respects the peer's windows once the peer has shown it keeps them, by sending
a SETTINGS or WINDOW_UPDATE frame; Go's spdystream, which every kubelet client uses, never sends
either and never grants a window, so waiting for one would hang every transfer past 64 KiB. Such a
peer is paced by TCP alone, in both directions: what it sends and nobody has read yet is bounded
by ``SpdyLimits.max_stream_buffer``, past which the connection is not read until the reader
catches up.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from auraed.cri.streaming.spdy import (
    DEFAULT_INITIAL_WINDOW,
    MAX_WINDOW,
    DataFrame,
    Event,
    Frame,
    FrameDecoder,
    FrameEncoder,
    GoAwayFrame,
    GoAwayStatus,
    Headers,
    HeadersFrame,
    PingFrame,
    RstStatus,
    RstStreamFrame,
    Setting,
    SettingId,
    SettingsFrame,
    SpdyError,
    SpdyLimits,
    SpdyProtocolError,
    StreamError,
    SynReplyFrame,
    SynStreamFrame,
    WindowUpdateFrame,
)
from auraed.cri.streaming.transport import ByteTransport

log = logging.getLogger(__name__)

_READ_SIZE = 64 * 1024
"""Bytes asked of the transport per read; frames span reads as they come."""


class SpdyStreamClosed(SpdyError):
    """The stream was reset (by either side) or its connection ended before it finished."""


class SpdyStream:
    """One stream of a ``SpdySession``."""

    def __init__(self, session: SpdySession, stream_id: int, headers: Headers, *, local: bool) -> None:
        self.session = session
        self.stream_id = stream_id
        self.headers = headers
        self.local = local
        self.send_window = session.peer_initial_window
        self._buffer = bytearray()
        self._readable = asyncio.Event()
        self._drained = asyncio.Event()
        self._drained.set()
        self._replied = asyncio.Event()
        self._reply_received = False
        self._remote_fin = False
        self._local_fin = False
        self._closed_reason: str | None = None
        self._discard = False
        self._unacked = 0

    @property
    def remote_closed(self) -> bool:
        """The peer sent FIN: everything it will send is buffered or read."""
        return self._remote_fin

    @property
    def local_closed(self) -> bool:
        return self._local_fin

    @property
    def reset_reason(self) -> str | None:
        """Why the stream was reset or lost, None while it is not."""
        return self._closed_reason

    @property
    def buffered(self) -> int:
        return len(self._buffer)

    async def reply(self, headers: Headers | None = None) -> None:
        """Accept a stream the peer opened (SYN_REPLY)."""
        self._check_open()
        await self.session.send_frame(SynReplyFrame(self.stream_id, headers or {}))
        self._replied.set()

    async def refuse(self) -> None:
        """Refuse a stream the peer opened (RST_STREAM REFUSED_STREAM)."""
        await self.reset(RstStatus.REFUSED_STREAM)

    def discard_incoming(self) -> None:
        """Drop what the peer sends on this stream from now on (a stream this side only writes)."""
        self._discard = True
        self._buffer.clear()
        self._drained.set()

    async def read(self, max_bytes: int = _READ_SIZE) -> bytes:
        """Up to ``max_bytes`` of what the peer sent; b"" after its FIN; SpdyStreamClosed if reset."""
        while not self._buffer:
            # What the peer finished sending stays readable after a reset (the kubelet resets every
            # stream right after the status it wrote and closed).
            if self._remote_fin:
                return b""
            if self._closed_reason is not None:
                raise SpdyStreamClosed(self._closed_reason)
            self._readable.clear()
            await self._readable.wait()
        data = bytes(self._buffer[:max_bytes])
        del self._buffer[:max_bytes]
        if len(self._buffer) <= self.session.limits.max_stream_buffer:
            self._drained.set()
        await self.session.consumed(self, len(data))
        return data

    async def read_all(self, limit: int) -> bytes:
        """Everything up to the peer's FIN, at most ``limit`` bytes (more is an error)."""
        parts = bytearray()
        while chunk := await self.read():
            parts += chunk
            if len(parts) > limit:
                raise SpdyStreamClosed(f"stream {self.stream_id} sent more than {limit} bytes")
        return bytes(parts)

    async def write(self, data: bytes) -> None:
        """Send ``data`` in DATA frames, within the peer's windows when it keeps them."""
        view = memoryview(data)
        while view:
            size = await self.session.reserve_send(self, len(view))
            chunk, view = bytes(view[:size]), view[size:]
            await self.session.send_frame(DataFrame(self.stream_id, chunk))

    async def close_write(self) -> None:
        """Half-close (FIN): the peer reads the end of the stream. No-op when already closed."""
        if self._local_fin or self._closed_reason is not None:
            return
        self._local_fin = True
        try:
            await self.session.send_frame(DataFrame(self.stream_id, b"", fin=True))
        finally:
            self.session.forget_if_finished(self)

    async def reset(self, status: RstStatus = RstStatus.CANCEL) -> None:
        """End both directions at once (RST_STREAM). No-op once the stream is over."""
        if self._closed_reason is not None or (self._local_fin and self._remote_fin):
            return
        self.mark_reset(f"reset by this side ({status.name})")
        with contextlib.suppress(SpdyError):
            await self.session.send_frame(RstStreamFrame(self.stream_id, status))

    def _check_open(self) -> None:
        if self._closed_reason is not None:
            raise SpdyStreamClosed(self._closed_reason)

    def check_writable(self) -> None:
        self._check_open()
        if self._local_fin:
            raise SpdyStreamClosed(f"stream {self.stream_id} is closed for writing")

    # Called by the session as frames arrive.

    def received(self, data: bytes, fin: bool) -> None:
        if not self._discard and self._closed_reason is None:
            self._buffer += data
            if len(self._buffer) > self.session.limits.max_stream_buffer:
                self._drained.clear()
        if fin:
            self._remote_fin = True
        self._readable.set()

    def mark_reset(self, reason: str) -> None:
        if self._closed_reason is None:
            self._closed_reason = reason
        if not self._remote_fin:
            self._buffer.clear()
        self._readable.set()
        self._drained.set()
        self._replied.set()
        self.session.forget(self)

    def mark_replied(self, fin: bool) -> None:
        self._reply_received = True
        self._replied.set()
        if fin:
            self.received(b"", fin=True)

    async def wait_drained(self) -> None:
        await self._drained.wait()

    async def wait_replied(self) -> None:
        """Until the peer's SYN_REPLY; SpdyStreamClosed if it reset the stream instead."""
        await self._replied.wait()
        if not self._reply_received:
            self._check_open()


class SpdySession:
    """One SPDY/3.1 connection. ``client`` picks the stream and ping id parity (odd for clients).

    ``peer_flow_control``: True to always respect the peer's windows, False never, None (the
    default) from the first SETTINGS or WINDOW_UPDATE the peer sends (see the module docstring).
    """

    def __init__(
        self,
        transport: ByteTransport,
        *,
        client: bool,
        limits: SpdyLimits | None = None,
        peer_flow_control: bool | None = None,
    ) -> None:
        self.limits = limits or SpdyLimits()
        self.client = client
        self.peer_initial_window = DEFAULT_INITIAL_WINDOW
        self.last_activity = asyncio.get_running_loop().time()
        self._transport = transport
        self._encoder = FrameEncoder()
        self._decoder = FrameDecoder(self.limits)
        self._write_lock = asyncio.Lock()
        self._streams: dict[int, SpdyStream] = {}
        self._next_stream_id = 1 if client else 2
        self._last_peer_stream_id = 0
        self._next_ping_id = 1 if client else 2
        self._pings: dict[int, asyncio.Future[None]] = {}
        self._incoming: asyncio.Queue[SpdyStream | None] = asyncio.Queue()
        self._respect_windows = peer_flow_control is True
        self._detect_flow_control = peer_flow_control is None
        self._session_send_window = DEFAULT_INITIAL_WINDOW
        self._session_unacked = 0
        self._window_changed = asyncio.Event()
        self._goaway_sent = False
        self._goaway_received = False
        self._ended = asyncio.Event()
        self.end_reason: str | None = None

    @property
    def respects_windows(self) -> bool:
        return self._respect_windows

    @property
    def open_streams(self) -> int:
        return len(self._streams)

    @property
    def ended(self) -> bool:
        return self._ended.is_set()

    async def wait_ended(self) -> None:
        await self._ended.wait()

    async def run(self) -> None:
        """Send the opening SETTINGS, then read and dispatch frames until the connection ends."""
        reason = "the peer closed the connection"
        try:
            if self.limits.send_window_updates:
                window = Setting(SettingId.INITIAL_WINDOW_SIZE, self.limits.initial_window)
                await self.send_frame(SettingsFrame((window,)))
            while data := await self._transport.read(_READ_SIZE):
                self.last_activity = asyncio.get_running_loop().time()
                self._decoder.feed(data)
                while (event := self._decoder.next_event()) is not None:
                    await self._dispatch(event)
        except SpdyProtocolError as exc:
            reason = f"protocol error: {exc}"
            log.info("SPDY peer broke the protocol: %s", exc)
            with contextlib.suppress(SpdyError):
                await self.goaway(GoAwayStatus.PROTOCOL_ERROR)
        except (OSError, SpdyError) as exc:
            reason = f"connection lost: {exc}"
        finally:
            self._end(reason)

    async def accept(self) -> SpdyStream | None:
        """The next stream the peer opened, None once the connection has ended."""
        stream = await self._incoming.get()
        if stream is None:
            self._incoming.put_nowait(None)
        return stream

    async def open_stream(self, headers: Headers, timeout: float) -> SpdyStream:
        """Open a stream and wait up to ``timeout`` seconds for the peer's SYN_REPLY."""
        if self._ended.is_set() or self._goaway_received:
            raise SpdyStreamClosed(self.end_reason or "the peer sent GOAWAY")
        stream_id = self._next_stream_id
        self._next_stream_id += 2
        stream = SpdyStream(self, stream_id, headers, local=True)
        self._streams[stream_id] = stream
        await self.send_frame(SynStreamFrame(stream_id, headers))
        try:
            await asyncio.wait_for(stream.wait_replied(), timeout)
        except TimeoutError:
            await stream.reset()
            raise SpdyStreamClosed(f"no reply to stream {stream_id} within {timeout} s") from None
        return stream

    async def ping(self, timeout: float) -> None:
        """Send a PING and wait up to ``timeout`` seconds for its echo."""
        ping_id = self._next_ping_id
        self._next_ping_id += 2
        answer: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pings[ping_id] = answer
        try:
            await self.send_frame(PingFrame(ping_id))
            await asyncio.wait_for(answer, timeout)
        finally:
            self._pings.pop(ping_id, None)

    async def goaway(self, status: GoAwayStatus = GoAwayStatus.OK) -> None:
        """Tell the peer no more streams will be accepted (once)."""
        if self._goaway_sent:
            return
        self._goaway_sent = True
        await self.send_frame(GoAwayFrame(self._last_peer_stream_id, status))

    async def close(self, grace: float) -> None:
        """Reset what is still open, GOAWAY, half-close, and wait up to ``grace`` s for the peer to go.

        Closing outright could make the kernel reset the connection when the peer's next frame
        arrives, discarding what it had not read yet; so the peer is left to close first.
        """
        for stream in list(self._streams.values()):
            await stream.reset()
        with contextlib.suppress(SpdyError, OSError):
            await self.goaway()
            await self._transport.close_write()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._ended.wait(), grace)
        self._transport.abort()

    async def send_frame(self, frame: Frame) -> None:
        async with self._write_lock:
            if self._ended.is_set():
                raise SpdyStreamClosed(self.end_reason or "the connection ended")
            # Encoding and writing under one lock: header blocks reach the wire in the order their
            # compressor saw them.
            data = self._encoder.encode(frame)
            try:
                await self._transport.write(data)
            except OSError as exc:
                self._transport.abort()
                raise SpdyStreamClosed(f"connection lost: {exc}") from exc
        self.last_activity = asyncio.get_running_loop().time()

    async def reserve_send(self, stream: SpdyStream, wanted: int) -> int:
        """How much of ``wanted`` bytes ``stream`` may send now, waiting for window if need be."""
        size = min(wanted, self.limits.max_outgoing_frame)
        while True:
            stream.check_writable()
            if self._ended.is_set():
                raise SpdyStreamClosed(self.end_reason or "the connection ended")
            if not self._respect_windows:
                break
            available = min(stream.send_window, self._session_send_window)
            if available > 0:
                size = min(size, available)
                break
            await self._window_changed.wait()
        stream.send_window -= size
        self._session_send_window -= size
        return size

    async def consumed(self, stream: SpdyStream, size: int) -> None:
        """The application read ``size`` bytes of ``stream``: grant the window back in halves."""
        if not self.limits.send_window_updates or size == 0:
            return
        stream._unacked += size
        self._session_unacked += size
        grants: list[Frame] = []
        if not stream.remote_closed and stream._unacked >= self.limits.initial_window // 2:
            grants.append(WindowUpdateFrame(stream.stream_id, stream._unacked))
            stream._unacked = 0
        if self._session_unacked >= DEFAULT_INITIAL_WINDOW // 2:
            grants.append(WindowUpdateFrame(0, self._session_unacked))
            self._session_unacked = 0
        with contextlib.suppress(SpdyError):
            for grant in grants:
                await self.send_frame(grant)

    def forget(self, stream: SpdyStream) -> None:
        self._streams.pop(stream.stream_id, None)
        self._pulse_windows()

    def forget_if_finished(self, stream: SpdyStream) -> None:
        if stream.local_closed and stream.remote_closed:
            self.forget(stream)

    def _pulse_windows(self) -> None:
        """Wake every writer waiting for window (they check again what changed)."""
        self._window_changed.set()
        self._window_changed = asyncio.Event()

    def _end(self, reason: str) -> None:
        if self._ended.is_set():
            return
        self.end_reason = reason
        self._ended.set()
        for stream in list(self._streams.values()):
            if not stream.remote_closed:
                stream.mark_reset(reason)
        for answer in self._pings.values():
            if not answer.done():
                answer.set_exception(SpdyStreamClosed(reason))
        self._incoming.put_nowait(None)
        self._pulse_windows()

    # Frames from the peer.

    async def _dispatch(self, event: Event) -> None:
        match event:
            case DataFrame():
                await self._on_data(event)
            case SynStreamFrame():
                await self._on_syn_stream(event)
            case StreamError():
                if event.opens_stream:
                    self._claim_peer_stream_id(event.stream_id)
                log.info("SPDY stream %d refused: %s", event.stream_id, event.reason)
                await self.send_frame(RstStreamFrame(event.stream_id, event.status))
            case SynReplyFrame():
                await self._on_syn_reply(event)
            case HeadersFrame():
                stream = self._streams.get(event.stream_id)
                if stream is not None and event.fin:
                    stream.received(b"", fin=True)
                    self.forget_if_finished(stream)
            case RstStreamFrame():
                stream = self._streams.get(event.stream_id)
                if stream is not None:
                    stream.mark_reset(f"reset by the peer ({_rst_name(event.status)})")
            case SettingsFrame():
                self._on_settings(event)
            case PingFrame():
                await self._on_ping(event)
            case GoAwayFrame():
                self._goaway_received = True
            case WindowUpdateFrame():
                await self._on_window_update(event)

    async def _on_data(self, frame: DataFrame) -> None:
        stream = self._streams.get(frame.stream_id)
        if stream is None:
            if not self._is_past_stream(frame.stream_id):
                await self.send_frame(RstStreamFrame(frame.stream_id, RstStatus.INVALID_STREAM))
            return  # data still in flight for a stream already over: dropped
        if stream.remote_closed:
            await stream.reset(RstStatus.STREAM_ALREADY_CLOSED)
            return
        stream.received(frame.data, frame.fin)
        self.forget_if_finished(stream)
        await stream.wait_drained()

    async def _on_syn_stream(self, frame: SynStreamFrame) -> None:
        self._claim_peer_stream_id(frame.stream_id)
        if self._goaway_sent:
            return  # after GOAWAY new streams are ignored, as the draft says
        if len(self._streams) >= self.limits.max_streams or frame.associated_to:
            await self.send_frame(RstStreamFrame(frame.stream_id, RstStatus.REFUSED_STREAM))
            return
        stream = SpdyStream(self, frame.stream_id, frame.headers, local=False)
        self._streams[frame.stream_id] = stream
        if frame.fin:
            stream.received(b"", fin=True)
        if frame.unidirectional:
            stream._local_fin = True
        await self._incoming.put(stream)

    def _claim_peer_stream_id(self, stream_id: int) -> None:
        peer_parity = 0 if self.client else 1
        if stream_id % 2 != peer_parity or stream_id <= self._last_peer_stream_id:
            raise SpdyProtocolError(f"stream id {stream_id} is not the peer's next one")
        self._last_peer_stream_id = stream_id

    async def _on_syn_reply(self, frame: SynReplyFrame) -> None:
        stream = self._streams.get(frame.stream_id)
        if stream is None:
            if not self._is_past_stream(frame.stream_id):
                await self.send_frame(RstStreamFrame(frame.stream_id, RstStatus.INVALID_STREAM))
            return
        if not stream.local or stream._replied.is_set():
            await stream.reset(RstStatus.STREAM_IN_USE)
            return
        stream.mark_replied(frame.fin)
        self.forget_if_finished(stream)

    def _is_past_stream(self, stream_id: int) -> bool:
        """A stream id that was in use on this connection and is over now."""
        peer_parity = 0 if self.client else 1
        if stream_id % 2 == peer_parity:
            return stream_id <= self._last_peer_stream_id
        return stream_id < self._next_stream_id

    def _on_settings(self, frame: SettingsFrame) -> None:
        self._peer_keeps_windows()
        for setting in frame.settings:
            if setting.id != SettingId.INITIAL_WINDOW_SIZE:
                continue
            if not 0 < setting.value <= MAX_WINDOW:
                raise SpdyProtocolError(f"initial window {setting.value} out of range")
            delta = setting.value - self.peer_initial_window
            self.peer_initial_window = setting.value
            for stream in self._streams.values():
                stream.send_window += delta
        self._pulse_windows()

    async def _on_ping(self, frame: PingFrame) -> None:
        ours = frame.ping_id % 2 == (1 if self.client else 0)
        if not ours:
            await self.send_frame(frame)
            return
        answer = self._pings.get(frame.ping_id)
        if answer is not None and not answer.done():
            answer.set_result(None)

    async def _on_window_update(self, frame: WindowUpdateFrame) -> None:
        self._peer_keeps_windows()
        if frame.delta == 0:
            return
        if frame.stream_id == 0:
            self._session_send_window += frame.delta
            if self._session_send_window > MAX_WINDOW:
                raise SpdyProtocolError("session window grown past 2^31-1")
        else:
            stream = self._streams.get(frame.stream_id)
            if stream is None:
                return
            stream.send_window += frame.delta
            if stream.send_window > MAX_WINDOW:
                await stream.reset(RstStatus.FLOW_CONTROL_ERROR)
        self._pulse_windows()

    def _peer_keeps_windows(self) -> None:
        if self._detect_flow_control:
            self._respect_windows = True


def _rst_name(status: int) -> str:
    try:
        return RstStatus(status).name
    except ValueError:
        return f"status {status}"
