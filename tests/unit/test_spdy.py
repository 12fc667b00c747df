"""SPDY/3.1 framing and sessions: round trips, the dictionary, flow control, hostile input."""

from __future__ import annotations

import asyncio
import socket
import struct
import zlib
from collections.abc import AsyncIterator

import pytest

from auraed.cri.streaming.spdy import (
    SPDY3_DICTIONARY,
    DataFrame,
    Event,
    Frame,
    FrameDecoder,
    FrameEncoder,
    GoAwayFrame,
    HeadersFrame,
    PingFrame,
    RstStatus,
    RstStreamFrame,
    Setting,
    SettingId,
    SettingsFrame,
    SpdyLimits,
    SpdyProtocolError,
    StreamError,
    SynReplyFrame,
    SynStreamFrame,
    WindowUpdateFrame,
    encode_header_block,
)
from auraed.cri.streaming.spdy_session import SpdySession, SpdyStreamClosed
from auraed.cri.streaming.transport import StreamTransport

LIMITS = SpdyLimits()


def decode_all(data: bytes, limits: SpdyLimits = LIMITS, *, piecewise: bool = False) -> list[Event]:
    decoder = FrameDecoder(limits)
    events: list[Event] = []
    pieces = [data[i : i + 1] for i in range(len(data))] if piecewise else [data]
    for piece in pieces:
        decoder.feed(piece)
        while (event := decoder.next_event()) is not None:
            events.append(event)
    return events


def control(frame_type: int, flags: int, body: bytes, version: int = 3) -> bytes:
    return struct.pack(">HHI", 0x8000 | version, frame_type, flags << 24 | len(body)) + body


def test_dictionary_is_the_spdy3_one() -> None:
    assert len(SPDY3_DICTIONARY) == 1423
    # The Adler-32 every SPDY/3 zlib stream names as its preset dictionary (FDICT).
    assert zlib.adler32(SPDY3_DICTIONARY) == 0xE3C6A7C2
    assert SPDY3_DICTIONARY.startswith(b"\x00\x00\x00\x07options\x00\x00\x00\x04head")
    assert SPDY3_DICTIONARY.endswith(b"charset=iso-8859-1,utf-,*,enq=0.")


def test_header_blocks_name_the_dictionary_and_compress_against_it() -> None:
    frame = FrameEncoder().encode(SynReplyFrame(1, {"content-type": ("text/plain",)}))
    compressed = frame[12:]
    cmf, flg = compressed[0], compressed[1]
    assert flg & 0x20, "FDICT set"
    assert struct.unpack(">I", compressed[2:6])[0] == 0xE3C6A7C2
    inflater = zlib.decompressobj(zdict=SPDY3_DICTIONARY)
    assert inflater.decompress(compressed) == encode_header_block({"content-type": ("text/plain",)})
    assert cmf & 0x0F == 8


ALL_FRAMES: list[Frame] = [
    SynStreamFrame(1, {"streamtype": ("error",), "port": ("80",)}, priority=3, slot=0),
    SynStreamFrame(3, {"streamtype": ("stdin",)}, fin=True, unidirectional=True, associated_to=1),
    SynReplyFrame(2, {}),
    SynReplyFrame(4, {"set-cookie": ("a", "b")}, fin=True),
    HeadersFrame(5, {"x": ("",)}, fin=True),
    DataFrame(7, b"hello"),
    DataFrame(7, b"", fin=True),
    RstStreamFrame(9, RstStatus.CANCEL),
    SettingsFrame(
        (Setting(SettingId.INITIAL_WINDOW_SIZE, 1 << 20), Setting(SettingId.MAX_CONCURRENT_STREAMS, 8, 1))
    ),
    SettingsFrame((), clear=True),
    PingFrame(3),
    GoAwayFrame(11, 2),
    WindowUpdateFrame(0, 32768),
    WindowUpdateFrame(13, 1),
]


@pytest.mark.parametrize("piecewise", [False, True])
def test_every_frame_round_trips_through_one_compression_context(piecewise: bool) -> None:
    encoder = FrameEncoder()
    wire = b"".join(encoder.encode(frame) for frame in ALL_FRAMES * 3)
    assert decode_all(wire, piecewise=piecewise) == ALL_FRAMES * 3


def test_unknown_control_frames_are_skipped() -> None:
    noop, credential = control(5, 0, b""), control(10, 0, b"\x00" * 12)
    ping = FrameEncoder().encode(PingFrame(1))
    assert decode_all(noop + credential + ping) == [PingFrame(1)]


@pytest.mark.parametrize(
    ("wire", "problem"),
    [
        (struct.pack(">II", 1, (1 << 20) + 1), "data frame of"),
        (control(6, 0, b"\x00" * (64 * 1024 + 1)), "control frame of"),
        (control(6, 0, b"\x00\x00\x00\x01", version=2), "version 2"),
        (struct.pack(">II", 0, 1) + b"x", "stream 0"),
        (control(6, 0, b"\x00\x00\x01"), "PING of 3"),
        (control(7, 0, b"\x00" * 4), "GOAWAY of 4"),
        (control(9, 0, b"\x00" * 12), "WINDOW_UPDATE of 12"),
        (control(3, 0, struct.pack(">II", 1, 0)), "status 0"),
        (control(3, 0, struct.pack(">II", 0, 1)), "stream 0"),
        (control(4, 0, struct.pack(">I", 1 << 30)), "does not hold"),
        (control(1, 0, struct.pack(">IIBB", 1, 0, 0, 0) + b"not zlib at all"), "does not inflate"),
        (control(2, 0, b"\x00\x00"), "malformed"),
    ],
)
def test_malformed_frames_end_the_connection(wire: bytes, problem: str) -> None:
    with pytest.raises(SpdyProtocolError, match=problem):
        decode_all(wire)


def _raw_syn_stream(block: bytes, stream_id: int = 1) -> bytes:
    deflater = zlib.compressobj(zdict=SPDY3_DICTIONARY)
    compressed = deflater.compress(block) + deflater.flush(zlib.Z_SYNC_FLUSH)
    return control(1, 0, struct.pack(">IIBB", stream_id, 0, 0, 0) + compressed)


def test_a_header_block_inflating_past_the_limit_ends_the_connection() -> None:
    bomb = (
        struct.pack(">I", 1)
        + struct.pack(">I", 1)
        + b"a"
        + struct.pack(">I", 50_000_000)
        + b"\0" * 50_000_000
    )
    wire = _raw_syn_stream(bomb)
    assert len(wire) < 100_000  # a few kilobytes on the wire, 50 MB inflated
    with pytest.raises(SpdyProtocolError, match="inflates past"):
        decode_all(wire)


@pytest.mark.parametrize(
    ("block", "problem"),
    [
        (encode_header_block({"a": ("1",)}).replace(b"a", b"A"), "not lowercase"),
        (struct.pack(">I", 1000), "more than 64"),
        (struct.pack(">I", 2) + struct.pack(">I", 1) + b"a" + struct.pack(">I", 0), "ends inside"),
        (encode_header_block({"a": ("1",)}) + b"junk", "after its last pair"),
        (struct.pack(">I", 2) + (struct.pack(">I", 1) + b"a" + struct.pack(">I", 0)) * 2, "twice"),
        (struct.pack(">I", 1) + struct.pack(">I", 0) + struct.pack(">I", 0), "empty"),
        (struct.pack(">I", 1) + struct.pack(">I", 1) + b"\xff" + struct.pack(">I", 0), "not text"),
    ],
)
def test_a_bad_header_block_resets_only_its_stream(block: bytes, problem: str) -> None:
    encoder = FrameEncoder()
    (error,) = decode_all(_raw_syn_stream(block, stream_id=5))
    assert isinstance(error, StreamError)
    assert (error.stream_id, error.status, error.opens_stream) == (5, RstStatus.PROTOCOL_ERROR, True)
    assert problem in error.reason
    assert encoder.encode(PingFrame(1))  # nothing shared broke


def test_the_limits_refuse_nonsense() -> None:
    with pytest.raises(ValueError, match="max_data_frame"):
        SpdyLimits(max_data_frame=1 << 24)
    with pytest.raises(ValueError, match="initial_window"):
        SpdyLimits(initial_window=0)


# Sessions over a real socket pair.


async def _pair(
    client_limits: SpdyLimits | None = None, server_limits: SpdyLimits | None = None
) -> tuple[SpdySession, SpdySession, list[asyncio.Task[None]]]:
    left, right = socket.socketpair()
    transports = []
    for sock in (left, right):
        reader, writer = await asyncio.open_connection(sock=sock)
        transports.append(StreamTransport(reader, writer))
    client = SpdySession(transports[0], client=True, limits=client_limits)
    server = SpdySession(transports[1], client=False, limits=server_limits)
    return client, server, [asyncio.create_task(client.run()), asyncio.create_task(server.run())]


@pytest.fixture
async def sessions() -> AsyncIterator[tuple[SpdySession, SpdySession]]:
    client, server, tasks = await _pair()
    yield client, server
    for session in (client, server):
        await session.close(grace=1.0)
    await asyncio.gather(*tasks, return_exceptions=True)


async def _accept_and_reply(server: SpdySession) -> None:
    stream = await server.accept()
    assert stream is not None
    await stream.reply()


async def test_streams_carry_bytes_both_ways_and_half_close(
    sessions: tuple[SpdySession, SpdySession],
) -> None:
    client, server = sessions
    opening = asyncio.create_task(client.open_stream({"streamtype": ("stdin",)}, timeout=5))
    incoming = await server.accept()
    assert incoming is not None and incoming.headers == {"streamtype": ("stdin",)}
    await incoming.reply()
    outgoing = await opening
    await outgoing.write(b"ping")
    await outgoing.close_write()
    assert await incoming.read_all(1024) == b"ping"
    await incoming.write(b"pong")
    await incoming.close_write()
    assert await outgoing.read_all(1024) == b"pong"
    await asyncio.sleep(0.05)
    assert client.open_streams == server.open_streams == 0


async def test_a_reset_reaches_the_other_side(sessions: tuple[SpdySession, SpdySession]) -> None:
    client, server = sessions
    replying = asyncio.create_task(_accept_and_reply(server))
    stream = await client.open_stream({"a": ("b",)}, timeout=5)
    await replying
    (incoming,) = list(server._streams.values())
    await incoming.reset()
    with pytest.raises(SpdyStreamClosed, match="CANCEL"):
        await stream.read()


async def test_ping_is_echoed(sessions: tuple[SpdySession, SpdySession]) -> None:
    client, server = sessions
    await client.ping(timeout=5)
    await server.ping(timeout=5)


async def test_a_sender_waits_for_the_window_of_a_peer_that_keeps_one(
    sessions: tuple[SpdySession, SpdySession],
) -> None:
    client, server = sessions
    replying = asyncio.create_task(_accept_and_reply(server))
    stream = await client.open_stream({"streamtype": ("stdin",)}, timeout=5)
    await replying
    (incoming,) = list(server._streams.values())
    writing = asyncio.create_task(stream.write(b"x" * 200_000))
    await asyncio.sleep(0.2)
    assert client.respects_windows
    assert not writing.done()
    assert incoming.buffered == 64 * 1024, "exactly the initial window, then the sender waits"
    received = bytearray()
    while len(received) < 200_000:
        received += await incoming.read()
    await writing
    assert received == b"x" * 200_000


async def test_a_peer_without_flow_control_is_paced_by_tcp() -> None:
    """Go's spdystream announces no window and grants none: writing to it must not wait for one."""
    quiet = SpdyLimits(send_window_updates=False)
    client, server, tasks = await _pair(client_limits=quiet)
    opening = asyncio.create_task(client.open_stream({"streamtype": ("stdout",)}, timeout=5))
    incoming = await server.accept()
    assert incoming is not None
    await incoming.reply()
    stream = await opening
    assert not server.respects_windows
    payload = bytes(range(256)) * 8192  # 2 MiB, 32 times the initial window
    writing = asyncio.create_task(incoming.write(payload))
    received = bytearray()
    while len(received) < len(payload):
        received += await stream.read()
    await writing
    assert received == payload
    for session in (client, server):
        await session.close(grace=1.0)
    await asyncio.gather(*tasks, return_exceptions=True)


async def test_streams_past_the_limit_are_refused() -> None:
    client, server, tasks = await _pair(server_limits=SpdyLimits(max_streams=2))
    try:
        opened = []
        for _ in range(2):
            replying = asyncio.create_task(_accept_and_reply(server))
            opened.append(await client.open_stream({"n": ("1",)}, timeout=5))
            await replying
        with pytest.raises(SpdyStreamClosed, match="REFUSED_STREAM"):
            await client.open_stream({"n": ("3",)}, timeout=5)
    finally:
        for session in (client, server):
            await session.close(grace=1.0)
        await asyncio.gather(*tasks, return_exceptions=True)


async def test_a_peer_reusing_a_stream_id_is_sent_away() -> None:
    left, right = socket.socketpair()
    reader, writer = await asyncio.open_connection(sock=right)
    server = SpdySession(StreamTransport(reader, writer), client=False)
    running = asyncio.create_task(server.run())
    peer_reader, peer_writer = await asyncio.open_connection(sock=left)
    encoder = FrameEncoder()
    peer_writer.write(encoder.encode(SynStreamFrame(5, {})) + encoder.encode(SynStreamFrame(3, {})))
    await asyncio.wait_for(running, 5)
    assert server.end_reason is not None and "not the peer's next one" in server.end_reason
    received = decode_all(await peer_reader.read(65536))
    assert GoAwayFrame(5, 1) in received
    peer_writer.close()
