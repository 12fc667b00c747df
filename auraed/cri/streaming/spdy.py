"""SPDY/3.1 framing, sans-IO: frames to bytes and bytes to frames, with the header compression.

Written from the SPDY Protocol draft 3 (draft-mbelshe-httpbis-spdy-00) and its 3.1 revision (session
flow control through WINDOW_UPDATE on stream 0); no maintained Python SPDY library exists. The
kubelet's clients and servers speak it through Go's spdystream, so its behaviour is the reference
for what a peer sends: lowercase header names, multiple values joined by NUL, each header block
compressed with a sync flush in one zlib stream per direction, seeded with the SPDY/3 dictionary.

Nothing here does I/O. ``FrameDecoder`` turns received bytes into frames (``next_event``), bounded
by ``SpdyLimits``: a frame longer than allowed, a header block that inflates past its limit, a
broken zlib stream or a frame that does not parse is a ``SpdyProtocolError`` (the session is over);
a well-formed frame whose header block is wrong for its stream is a ``StreamError`` event (that
stream is reset). ``FrameEncoder`` turns frames into bytes. Control frame types this version does
not know (NOOP, CREDENTIAL, anything newer) are skipped, as the draft asks.
"""

from __future__ import annotations

import dataclasses
import enum
import struct
import zlib
from collections.abc import Callable, Mapping

VERSION = 3
FRAME_HEADER_SIZE = 8
MAX_FRAME_LENGTH = (1 << 24) - 1
MAX_STREAM_ID = (1 << 31) - 1
MAX_WINDOW = (1 << 31) - 1
DEFAULT_INITIAL_WINDOW = 64 * 1024
"""The initial stream and session window of SPDY/3.1 (64 KiB), until a SETTINGS frame changes it."""

FLAG_FIN = 0x01
FLAG_UNIDIRECTIONAL = 0x02
FLAG_CLEAR_SETTINGS = 0x01

_CONTROL_BIT = 0x80000000
_ID_MASK = 0x7FFFFFFF
_LENGTH_MASK = 0xFFFFFF


def _length_prefixed(words: tuple[str, ...]) -> bytes:
    return b"".join(struct.pack(">I", len(word)) + word.encode("ascii") for word in words)


# The SPDY/3 header compression dictionary (draft 3, section 2.6.10.1): the header names and values
# a header block is likely to hold, each as a 32-bit length and the word, then a run of status
# lines, dates and content types. Both ends seed their zlib streams with exactly these 1423 bytes.
SPDY3_DICTIONARY = _length_prefixed(
    (
        "options",
        "head",
        "post",
        "put",
        "delete",
        "trace",
        "accept",
        "accept-charset",
        "accept-encoding",
        "accept-language",
        "accept-ranges",
        "age",
        "allow",
        "authorization",
        "cache-control",
        "connection",
        "content-base",
        "content-encoding",
        "content-language",
        "content-length",
        "content-location",
        "content-md5",
        "content-range",
        "content-type",
        "date",
        "etag",
        "expect",
        "expires",
        "from",
        "host",
        "if-match",
        "if-modified-since",
        "if-none-match",
        "if-range",
        "if-unmodified-since",
        "last-modified",
        "location",
        "max-forwards",
        "pragma",
        "proxy-authenticate",
        "proxy-authorization",
        "range",
        "referer",
        "retry-after",
        "server",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "user-agent",
        "vary",
        "via",
        "warning",
        "www-authenticate",
        "method",
        "get",
        "status",
        "200 OK",
        "version",
        "HTTP/1.1",
        "url",
        "public",
        "set-cookie",
        "keep-alive",
        "origin",
    )
) + (
    b"100101201202205206300302303304305306307402405406407408409410411412413414415416417502504505"
    b"203 Non-Authoritative Information204 No Content301 Moved Permanently400 Bad Request"
    b"401 Unauthorized403 Forbidden404 Not Found500 Internal Server Error501 Not Implemented"
    b"503 Service UnavailableJan Feb Mar Apr May Jun Jul Aug Sept Oct Nov Dec 00:00:00 "
    b"Mon, Tue, Wed, Thu, Fri, Sat, Sun, GMTchunked,text/html,image/png,image/jpg,image/gif,"
    b"application/xml,application/xhtml+xml,text/plain,text/javascript,publicprivatemax-age="
    b"gzip,deflate,sdchcharset=utf-8charset=iso-8859-1,utf-,*,enq=0."
)


class ControlType(enum.IntEnum):
    SYN_STREAM = 1
    SYN_REPLY = 2
    RST_STREAM = 3
    SETTINGS = 4
    PING = 6
    GOAWAY = 7
    HEADERS = 8
    WINDOW_UPDATE = 9


class RstStatus(enum.IntEnum):
    PROTOCOL_ERROR = 1
    INVALID_STREAM = 2
    REFUSED_STREAM = 3
    UNSUPPORTED_VERSION = 4
    CANCEL = 5
    INTERNAL_ERROR = 6
    FLOW_CONTROL_ERROR = 7
    STREAM_IN_USE = 8
    STREAM_ALREADY_CLOSED = 9
    INVALID_CREDENTIALS = 10
    FRAME_TOO_LARGE = 11


class GoAwayStatus(enum.IntEnum):
    OK = 0
    PROTOCOL_ERROR = 1
    INTERNAL_ERROR = 2


class SettingId(enum.IntEnum):
    UPLOAD_BANDWIDTH = 1
    DOWNLOAD_BANDWIDTH = 2
    ROUND_TRIP_TIME = 3
    MAX_CONCURRENT_STREAMS = 4
    CURRENT_CWND = 5
    DOWNLOAD_RETRANS_RATE = 6
    INITIAL_WINDOW_SIZE = 7
    CLIENT_CERTIFICATE_VECTOR_SIZE = 8


Headers = Mapping[str, tuple[str, ...]]
"""A header block: lowercase names, each with its values (a name appears once; values keep order)."""


def header_value(headers: Headers, name: str) -> str | None:
    """The first value of ``name`` (lowercase), or None when the block does not carry it."""
    values = headers.get(name)
    return values[0] if values else None


@dataclasses.dataclass(frozen=True)
class SpdyLimits:
    """What one SPDY connection accepts from its peer, and how it paces what it receives."""

    max_data_frame: int = 1 << 20
    """Longest DATA payload accepted (bytes). Go's clients write at most 32 KiB a frame."""
    max_control_frame: int = 64 * 1024
    """Longest control frame payload accepted (bytes), a compressed header block included."""
    max_header_block: int = 64 * 1024
    """Largest header block once inflated (bytes); a longer one ends the connection."""
    max_header_count: int = 64
    """Most names in one header block."""
    max_streams: int = 256
    """Most streams open at once; a SYN_STREAM beyond it is refused (RST_STREAM REFUSED_STREAM)."""
    initial_window: int = DEFAULT_INITIAL_WINDOW
    """Receive window of each stream (bytes), announced in the SETTINGS frame sent first."""
    max_stream_buffer: int = 1 << 20
    """Bytes received on one stream and not yet read after which reading the connection pauses.

    Go's spdystream ignores windows altogether: for such a peer this is what bounds memory, by
    leaving its data in the kernel's socket buffers (TCP pushes back) until the reader catches up.
    """
    max_outgoing_frame: int = 32 * 1024
    """Longest DATA payload sent (bytes)."""
    send_window_updates: bool = True
    """Announce windows (SETTINGS) and grant more as data is read (WINDOW_UPDATE). Off only to
    imitate a peer without flow control, as Go's spdystream is."""

    def __post_init__(self) -> None:
        for name in ("max_data_frame", "max_control_frame", "max_outgoing_frame"):
            value = getattr(self, name)
            if not 0 < value <= MAX_FRAME_LENGTH:
                raise ValueError(f"{name}: must be 1 to {MAX_FRAME_LENGTH}")
        if not 0 < self.initial_window <= MAX_WINDOW:
            raise ValueError(f"initial_window: must be 1 to {MAX_WINDOW}")
        for name in ("max_header_block", "max_header_count", "max_streams", "max_stream_buffer"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be positive")


class SpdyError(Exception):
    """A SPDY connection or stream failed."""


class SpdyProtocolError(SpdyError):
    """The peer broke the protocol in a way that ends the whole connection (GOAWAY PROTOCOL_ERROR)."""


@dataclasses.dataclass(frozen=True)
class DataFrame:
    stream_id: int
    data: bytes
    fin: bool = False


@dataclasses.dataclass(frozen=True)
class SynStreamFrame:
    stream_id: int
    headers: Headers
    fin: bool = False
    unidirectional: bool = False
    associated_to: int = 0
    priority: int = 0
    slot: int = 0


@dataclasses.dataclass(frozen=True)
class SynReplyFrame:
    stream_id: int
    headers: Headers
    fin: bool = False


@dataclasses.dataclass(frozen=True)
class RstStreamFrame:
    stream_id: int
    status: int


@dataclasses.dataclass(frozen=True)
class Setting:
    id: int
    value: int
    flags: int = 0


@dataclasses.dataclass(frozen=True)
class SettingsFrame:
    settings: tuple[Setting, ...]
    clear: bool = False


@dataclasses.dataclass(frozen=True)
class PingFrame:
    ping_id: int


@dataclasses.dataclass(frozen=True)
class GoAwayFrame:
    last_good_stream_id: int
    status: int = GoAwayStatus.OK


@dataclasses.dataclass(frozen=True)
class HeadersFrame:
    stream_id: int
    headers: Headers
    fin: bool = False


@dataclasses.dataclass(frozen=True)
class WindowUpdateFrame:
    stream_id: int
    delta: int


@dataclasses.dataclass(frozen=True)
class StreamError:
    """A frame that parsed but is wrong for its stream (a bad header block): reset that stream.

    ``opens_stream`` is set for a SYN_STREAM, whose stream id the peer has now used up.
    """

    stream_id: int
    status: RstStatus
    reason: str
    opens_stream: bool = False


Frame = (
    DataFrame
    | SynStreamFrame
    | SynReplyFrame
    | RstStreamFrame
    | SettingsFrame
    | PingFrame
    | GoAwayFrame
    | HeadersFrame
    | WindowUpdateFrame
)
Event = Frame | StreamError


class _HeaderBlockError(Exception):
    pass


def encode_header_block(headers: Headers) -> bytes:
    """A header block, uncompressed: the pair count, then each name and its NUL-joined values."""
    parts = [struct.pack(">I", len(headers))]
    for name, values in headers.items():
        raw_name = name.encode("utf-8")
        if not raw_name or name != name.lower():
            raise ValueError(f"header name {name!r}: must be non-empty and lowercase")
        raw_value = b"\0".join(value.encode("utf-8") for value in values)
        parts += (struct.pack(">I", len(raw_name)), raw_name, struct.pack(">I", len(raw_value)), raw_value)
    return b"".join(parts)


def decode_header_block(raw: bytes, max_count: int) -> Headers:
    """The header block in ``raw`` (inflated); raises _HeaderBlockError naming what is wrong."""
    if len(raw) < 4:
        raise _HeaderBlockError("header block shorter than its pair count")
    (count,) = struct.unpack_from(">I", raw)
    if count > max_count:
        raise _HeaderBlockError(f"header block has {count} names, more than {max_count}")
    position = 4
    headers: dict[str, tuple[str, ...]] = {}
    for _ in range(count):
        raw_name, position = _length_prefixed_field(raw, position)
        raw_value, position = _length_prefixed_field(raw, position)
        try:
            name = raw_name.decode("ascii")
            values = tuple(raw_value.decode("utf-8").split("\0"))
        except UnicodeDecodeError as exc:
            raise _HeaderBlockError("header name or value is not text") from exc
        if not name or name != name.lower():
            raise _HeaderBlockError(f"header name {name!r} is empty or not lowercase")
        if name in headers:
            raise _HeaderBlockError(f"header {name!r} appears twice")
        headers[name] = values
    if position != len(raw):
        raise _HeaderBlockError("header block has bytes after its last pair")
    return headers


def _length_prefixed_field(raw: bytes, position: int) -> tuple[bytes, int]:
    if position + 4 > len(raw):
        raise _HeaderBlockError("header block ends inside a length")
    (length,) = struct.unpack_from(">I", raw, position)
    start = position + 4
    if start + length > len(raw):
        raise _HeaderBlockError("header block ends inside a name or value")
    return raw[start : start + length], start + length


class HeaderCompressor:
    """The sending side's zlib stream: one per connection, every header block sync-flushed."""

    def __init__(self) -> None:
        self._zlib = zlib.compressobj(
            zlib.Z_DEFAULT_COMPRESSION, zlib.DEFLATED, zlib.MAX_WBITS, zdict=SPDY3_DICTIONARY
        )

    def compress(self, headers: Headers) -> bytes:
        block = encode_header_block(headers)
        return self._zlib.compress(block) + self._zlib.flush(zlib.Z_SYNC_FLUSH)


class HeaderDecompressor:
    """The receiving side's zlib stream: every header block of the connection goes through it."""

    def __init__(self, max_block: int) -> None:
        self._zlib = zlib.decompressobj(zlib.MAX_WBITS, zdict=SPDY3_DICTIONARY)
        self._max_block = max_block

    def decompress(self, compressed: bytes) -> bytes:
        try:
            raw = self._zlib.decompress(compressed, self._max_block + 1)
        except zlib.error as exc:
            raise SpdyProtocolError(f"header block does not inflate: {exc}") from exc
        if len(raw) > self._max_block or self._zlib.unconsumed_tail:
            raise SpdyProtocolError(f"header block inflates past {self._max_block} bytes")
        if self._zlib.eof:
            raise SpdyProtocolError("the peer ended its header compression stream")
        return raw


class FrameDecoder:
    """Bytes in (``feed``), frames out (``next_event``), one header decompressor for the connection."""

    def __init__(self, limits: SpdyLimits) -> None:
        self._limits = limits
        self._buffer = bytearray()
        self._headers = HeaderDecompressor(limits.max_header_block)

    def feed(self, data: bytes) -> None:
        self._buffer += data

    def next_event(self) -> Event | None:
        """The next complete frame or stream error, None until more bytes are fed."""
        while len(self._buffer) >= FRAME_HEADER_SIZE:
            first, second = struct.unpack_from(">II", self._buffer)
            flags, length = second >> 24, second & _LENGTH_MASK
            control = bool(first & _CONTROL_BIT)
            limit = self._limits.max_control_frame if control else self._limits.max_data_frame
            if length > limit:
                kind = "control" if control else "data"
                raise SpdyProtocolError(f"{kind} frame of {length} bytes, more than {limit}")
            end = FRAME_HEADER_SIZE + length
            if len(self._buffer) < end:
                return None
            payload = bytes(self._buffer[FRAME_HEADER_SIZE:end])
            del self._buffer[:end]
            if not control:
                stream_id = first & _ID_MASK
                if stream_id == 0:
                    raise SpdyProtocolError("data frame on stream 0")
                return DataFrame(stream_id, payload, bool(flags & FLAG_FIN))
            version = (first >> 16) & 0x7FFF
            if version != VERSION:
                raise SpdyProtocolError(f"control frame of SPDY version {version}, not {VERSION}")
            event = self._control(first & 0xFFFF, flags, payload)
            if event is not None:
                return event
        return None

    def _control(self, frame_type: int, flags: int, payload: bytes) -> Event | None:
        match frame_type:
            case ControlType.SYN_STREAM:
                return self._syn_stream(flags, payload)
            case ControlType.SYN_REPLY:
                stream_id = self._stream_id(payload, "SYN_REPLY", minimum=4)
                return self._with_headers(
                    stream_id, payload[4:], lambda h: SynReplyFrame(stream_id, h, bool(flags & FLAG_FIN))
                )
            case ControlType.HEADERS:
                stream_id = self._stream_id(payload, "HEADERS", minimum=4)
                return self._with_headers(
                    stream_id, payload[4:], lambda h: HeadersFrame(stream_id, h, bool(flags & FLAG_FIN))
                )
            case ControlType.RST_STREAM:
                stream_id = self._stream_id(payload, "RST_STREAM", exactly=8)
                (status,) = struct.unpack_from(">I", payload, 4)
                if status == 0:
                    raise SpdyProtocolError("RST_STREAM with status 0")
                return RstStreamFrame(stream_id, status)
            case ControlType.SETTINGS:
                return _settings(flags, payload)
            case ControlType.PING:
                if len(payload) != 4:
                    raise SpdyProtocolError(f"PING of {len(payload)} bytes, not 4")
                return PingFrame(struct.unpack(">I", payload)[0])
            case ControlType.GOAWAY:
                if len(payload) != 8:
                    raise SpdyProtocolError(f"GOAWAY of {len(payload)} bytes, not 8")
                last, status = struct.unpack(">II", payload)
                return GoAwayFrame(last & _ID_MASK, status)
            case ControlType.WINDOW_UPDATE:
                if len(payload) != 8:
                    raise SpdyProtocolError(f"WINDOW_UPDATE of {len(payload)} bytes, not 8")
                stream_id, delta = struct.unpack(">II", payload)
                return WindowUpdateFrame(stream_id & _ID_MASK, delta & _ID_MASK)
        return None

    def _syn_stream(self, flags: int, payload: bytes) -> Event:
        stream_id = self._stream_id(payload, "SYN_STREAM", minimum=10)
        (associated,) = struct.unpack_from(">I", payload, 4)
        priority, slot = payload[8] >> 5, payload[9]
        return self._with_headers(
            stream_id,
            payload[10:],
            lambda headers: SynStreamFrame(
                stream_id,
                headers,
                fin=bool(flags & FLAG_FIN),
                unidirectional=bool(flags & FLAG_UNIDIRECTIONAL),
                associated_to=associated & _ID_MASK,
                priority=priority,
                slot=slot,
            ),
            opens_stream=True,
        )

    @staticmethod
    def _stream_id(payload: bytes, name: str, *, minimum: int = 0, exactly: int = 0) -> int:
        if (exactly and len(payload) != exactly) or len(payload) < max(minimum, 4):
            raise SpdyProtocolError(f"{name} of {len(payload)} bytes is malformed")
        stream_id: int = struct.unpack_from(">I", payload)[0] & _ID_MASK
        if stream_id == 0:
            raise SpdyProtocolError(f"{name} on stream 0")
        return stream_id

    def _with_headers(
        self,
        stream_id: int,
        compressed: bytes,
        build: Callable[[Headers], Frame],
        *,
        opens_stream: bool = False,
    ) -> Event:
        # Inflate even a block that will be refused: the zlib stream spans the whole connection.
        raw = self._headers.decompress(compressed)
        try:
            headers = decode_header_block(raw, self._limits.max_header_count)
        except _HeaderBlockError as exc:
            return StreamError(stream_id, RstStatus.PROTOCOL_ERROR, str(exc), opens_stream)
        return build(headers)


def _settings(flags: int, payload: bytes) -> SettingsFrame:
    if len(payload) < 4:
        raise SpdyProtocolError("SETTINGS shorter than its entry count")
    (count,) = struct.unpack_from(">I", payload)
    if len(payload) != 4 + 8 * count:
        raise SpdyProtocolError(f"SETTINGS of {len(payload)} bytes does not hold {count} entries")
    settings = []
    for index in range(count):
        flags_and_id, value = struct.unpack_from(">II", payload, 4 + 8 * index)
        settings.append(Setting(flags_and_id & _LENGTH_MASK, value, flags_and_id >> 24))
    return SettingsFrame(tuple(settings), bool(flags & FLAG_CLEAR_SETTINGS))


class FrameEncoder:
    """Frames to bytes, with the one header compressor of the connection's sending side."""

    def __init__(self) -> None:
        self._headers = HeaderCompressor()

    def encode(self, frame: Frame) -> bytes:
        match frame:
            case DataFrame(stream_id, data, fin):
                _check_stream_id(stream_id)
                if len(data) > MAX_FRAME_LENGTH:
                    raise ValueError(f"data frame of {len(data)} bytes, more than {MAX_FRAME_LENGTH}")
                return struct.pack(">II", stream_id, (FLAG_FIN if fin else 0) << 24 | len(data)) + data
            case SynStreamFrame():
                _check_stream_id(frame.stream_id)
                flags = (FLAG_FIN if frame.fin else 0) | (FLAG_UNIDIRECTIONAL if frame.unidirectional else 0)
                head = struct.pack(
                    ">IIBB", frame.stream_id, frame.associated_to, (frame.priority & 7) << 5, frame.slot
                )
                return _control(ControlType.SYN_STREAM, flags, head + self._headers.compress(frame.headers))
            case SynReplyFrame(stream_id, headers, fin):
                _check_stream_id(stream_id)
                body = struct.pack(">I", stream_id) + self._headers.compress(headers)
                return _control(ControlType.SYN_REPLY, FLAG_FIN if fin else 0, body)
            case HeadersFrame(stream_id, headers, fin):
                _check_stream_id(stream_id)
                body = struct.pack(">I", stream_id) + self._headers.compress(headers)
                return _control(ControlType.HEADERS, FLAG_FIN if fin else 0, body)
            case RstStreamFrame(stream_id, status):
                _check_stream_id(stream_id)
                return _control(ControlType.RST_STREAM, 0, struct.pack(">II", stream_id, status))
            case SettingsFrame(settings, clear):
                body = struct.pack(">I", len(settings)) + b"".join(
                    struct.pack(">II", (s.flags << 24) | s.id, s.value) for s in settings
                )
                return _control(ControlType.SETTINGS, FLAG_CLEAR_SETTINGS if clear else 0, body)
            case PingFrame(ping_id):
                return _control(ControlType.PING, 0, struct.pack(">I", ping_id))
            case GoAwayFrame(last_good_stream_id, status):
                return _control(ControlType.GOAWAY, 0, struct.pack(">II", last_good_stream_id, status))
            case WindowUpdateFrame(stream_id, delta):
                if not 0 < delta <= MAX_WINDOW:
                    raise ValueError(f"window delta {delta}: must be 1 to {MAX_WINDOW}")
                return _control(ControlType.WINDOW_UPDATE, 0, struct.pack(">II", stream_id, delta))
        raise TypeError(f"not a SPDY frame: {frame!r}")


def _check_stream_id(stream_id: int) -> None:
    if not 0 < stream_id <= MAX_STREAM_ID:
        raise ValueError(f"stream id {stream_id}: must be 1 to {MAX_STREAM_ID}")


def _control(frame_type: ControlType, flags: int, body: bytes) -> bytes:
    if len(body) > MAX_FRAME_LENGTH:
        raise ValueError(f"control frame of {len(body)} bytes, more than {MAX_FRAME_LENGTH}")
    return struct.pack(">HHI", 0x8000 | VERSION, frame_type, flags << 24 | len(body)) + body
