"""The kubelet's remotecommand protocol (exec, attach), over SPDY streams or WebSocket channels.

Versions, as the kubelet serves them: ``channel.k8s.io`` (v1) and ``v2.channel.k8s.io`` carry
stdin, stdout, stderr and an error stream with a plain-text message on failure only;
``v3.channel.k8s.io`` adds the resize stream (JSON ``{"Width":..,"Height":..}`` objects, one after
another); ``v4.channel.k8s.io`` writes a metav1.Status JSON on the error stream, with the exit code
of a command that failed; ``v5.channel.k8s.io`` (WebSocket only, as the API server serves it) adds
the close signal that ends the client's stdin. Over SPDY each is a stream the client opens with a
``streamType`` header; over WebSocket each is a numbered channel (0 stdin, 1 stdout, 2 stderr,
3 error, 4 resize).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

from auraed.cri.streaming.backend import ByteSink, ByteSource, ProcessSession, TerminalSize
from auraed.cri.streaming.channels import ChannelClosed, ChannelMux
from auraed.cri.streaming.spdy import SpdyError, header_value
from auraed.cri.streaming.spdy_session import SpdySession, SpdyStream
from auraed.cri.streaming.websocket import WebSocketClosed, WebSocketConnection
from auraed.errors import AuraeError

log = logging.getLogger(__name__)

V1, V2, V3, V4, V5 = (
    "channel.k8s.io",
    "v2.channel.k8s.io",
    "v3.channel.k8s.io",
    "v4.channel.k8s.io",
    "v5.channel.k8s.io",
)
SPDY_PROTOCOLS = (V4, V3, V2, V1)
"""What the kubelet (and containerd, CRI-O) accept over SPDY, in the order the kubelet prefers."""
V4_BASE64 = "v4.base64.channel.k8s.io"
V1_BASE64 = "base64.channel.k8s.io"
WEBSOCKET_PROTOCOLS = (V5, V4, V4_BASE64, V1, V1_BASE64)
"""WebSocket subprotocols for exec and attach: the kubelet's four, and v5 as the API server has it
(client-go's WebSocket executor offers only v5)."""

STREAM_TYPE_HEADER = "streamtype"
CHANNEL_STDIN, CHANNEL_STDOUT, CHANNEL_STDERR, CHANNEL_ERROR, CHANNEL_RESIZE = range(5)

_COPY_SIZE = 32 * 1024
_MAX_RESIZE_MESSAGE = 4096
"""Longest resize message accepted (bytes): ``{"Width":65535,"Height":65535}`` is 30."""
_MAX_TERMINAL_SIDE = 65535
"""A terminal side is a uint16 in the kubelet's TerminalSize."""


def protocol_version(protocol: str) -> int:
    """1 to 5 for a remotecommand protocol name (WebSocket ones included); "" is v1."""
    return {V5: 5, V4: 4, V4_BASE64: 4, V3: 3, V2: 2}.get(protocol, 1)


@dataclasses.dataclass(frozen=True)
class StreamOptions:
    """Which streams a request carries. With a tty, stderr is merged into stdout (the kubelet's rule)."""

    stdin: bool
    stdout: bool
    stderr: bool
    tty: bool

    @classmethod
    def of(cls, *, stdin: bool, stdout: bool, stderr: bool, tty: bool) -> StreamOptions:
        return cls(stdin, stdout, stderr and not tty, tty)


class InputChannel(Protocol):
    async def read(self) -> bytes: ...

    def discard_incoming(self) -> None: ...


class OutputChannel(Protocol):
    async def write(self, data: bytes) -> None: ...

    async def close_write(self) -> None: ...


@dataclasses.dataclass(frozen=True)
class RemoteStreams:
    """A session's streams to the client, whatever carries them."""

    error: OutputChannel
    stdin: InputChannel | None = None
    stdout: OutputChannel | None = None
    stderr: OutputChannel | None = None
    resize: InputChannel | None = None


# The error stream: what the kubelet writes there, byte for byte.


def _go_json(value: object) -> bytes:
    """JSON as Go's encoding/json writes it: compact, UTF-8, with <, > and & escaped."""
    text = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    for char, escape in (
        ("<", "\\u003c"),
        (">", "\\u003e"),
        ("&", "\\u0026"),
        ("\u2028", "\\u2028"),
        ("\u2029", "\\u2029"),
    ):
        text = text.replace(char, escape)
    return text.encode("utf-8")


def success_status() -> dict[str, object]:
    return {"metadata": {}, "status": "Success"}


def exit_code_status(code: int, cmd: tuple[str, ...]) -> dict[str, object]:
    """A command that exited non-zero, with containerd's wording and the code where clients read it."""
    return {
        "metadata": {},
        "status": "Failure",
        "message": f"command terminated with non-zero exit code: error executing command [{' '.join(cmd)}], "
        f"exit code {code}",
        "reason": "NonZeroExitCode",
        "details": {"causes": [{"reason": "ExitCode", "message": str(code)}]},
    }


def internal_error_status(message: str) -> dict[str, object]:
    """apierrors.NewInternalError: what the kubelet writes when the runtime fails a session."""
    return {
        "metadata": {},
        "status": "Failure",
        "message": f"Internal error occurred: {message}",
        "reason": "InternalError",
        "details": {"causes": [{"message": message}]},
        "code": 500,
    }


def encode_status(status: dict[str, object], version: int) -> bytes:
    """v4 and later: the JSON; before: the message of a failure in plain text, nothing on success."""
    if version >= 4:
        return _go_json(status)
    if status.get("status") == "Success":
        return b""
    return str(status.get("message", "")).encode("utf-8")


# Terminal resizes.


class ResizeDecoder:
    """JSON objects one after another, as Go's json.Encoder writes them, into terminal sizes."""

    def __init__(self) -> None:
        self._pending = ""
        self._decoder = json.JSONDecoder()

    def feed(self, data: bytes) -> list[TerminalSize]:
        """Sizes completed by ``data``; ValueError for a message that is not one."""
        self._pending += data.decode("utf-8")
        sizes = []
        while True:
            self._pending = self._pending.lstrip()
            if not self._pending:
                break
            try:
                value, end = self._decoder.raw_decode(self._pending)
            except json.JSONDecodeError:
                if len(self._pending) > _MAX_RESIZE_MESSAGE:
                    raise ValueError("resize message too long") from None
                break  # incomplete: wait for the rest
            self._pending = self._pending[end:]
            sizes.append(_terminal_size(value))
        return sizes


def _terminal_size(value: object) -> TerminalSize:
    if not isinstance(value, dict):
        raise ValueError(f"resize message {value!r} is not an object")
    # Go's decoder matches field names case-insensitively.
    fields = {str(key).lower(): item for key, item in value.items()}
    width, height = fields.get("width", 0), fields.get("height", 0)
    for side in (width, height):
        if not isinstance(side, int) or isinstance(side, bool) or not 0 <= side <= _MAX_TERMINAL_SIDE:
            raise ValueError(f"resize message {value!r} has a side that is not 0 to {_MAX_TERMINAL_SIDE}")
    return TerminalSize(width, height)


# Running a session.


@dataclasses.dataclass(frozen=True)
class CommandSpec:
    """What a session runs, for the error stream's words."""

    start: Callable[[], Awaitable[ProcessSession]]
    failure: str
    """Prefix of a backend error: "error executing command in container" or "error attaching to container"."""
    cmd: tuple[str, ...] = ()
    report_exit_code: bool = True
    """Exec reports a non-zero exit code; attach reports success (as the kubelet does)."""


async def run_remote_command(
    streams: RemoteStreams, spec: CommandSpec, version: int, client_gone: Callable[[], Awaitable[None]]
) -> None:
    """Start the session, pipe its streams, write its status on the error stream, close it.

    ``client_gone()`` completes when the client's connection ends (or idles out): the session is
    then closed (an exec'd process killed) without a status.
    """
    try:
        session = await spec.start()
    except Exception as exc:
        if not isinstance(exc, AuraeError | OSError):
            log.exception("the streaming backend failed to start a session")
        message = exc.message if isinstance(exc, AuraeError) else str(exc)
        await _finish(streams, encode_status(internal_error_status(f"{spec.failure}: {message}"), version))
        return
    try:
        code = await _until_client_gone(_pipe(session, streams), client_gone())
    except (SpdyError, ChannelClosed, WebSocketClosed, ConnectionError) as exc:
        log.info("streaming client went away: %s", exc)
        code = None
    except Exception as exc:  # the session failed (its end unknown): the client is told so
        if not isinstance(exc, AuraeError | OSError):
            log.exception("a streaming session failed")
        message = exc.message if isinstance(exc, AuraeError) else str(exc)
        await _finish(streams, encode_status(internal_error_status(f"{spec.failure}: {message}"), version))
        return
    finally:
        await session.close()
    if code is None:
        return
    failed = code != 0 and spec.report_exit_code
    status = exit_code_status(code, spec.cmd) if failed else success_status()
    await _finish(streams, encode_status(status, version))


async def _until_client_gone(work: Awaitable[int], client_gone: Awaitable[None]) -> int | None:
    """``work``'s result, or None when the client goes first (``work`` is then cancelled)."""
    work_task = asyncio.ensure_future(work)
    gone_task = asyncio.ensure_future(client_gone)
    try:
        await asyncio.wait({work_task, gone_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (work_task, gone_task):
            if not task.done():
                task.cancel()
        await asyncio.gather(work_task, gone_task, return_exceptions=True)
    if not work_task.done() or work_task.cancelled():
        return None
    return work_task.result()


async def _pipe(session: ProcessSession, streams: RemoteStreams) -> int:
    inputs = [
        asyncio.create_task(_copy_stdin(streams.stdin, session.stdin)),
        asyncio.create_task(_apply_resizes(streams.resize, session)),
    ]
    try:
        async with asyncio.TaskGroup() as group:
            exit_code = group.create_task(session.wait())
            group.create_task(_copy_output(session.stdout, streams.stdout))
            group.create_task(_copy_output(session.stderr, streams.stderr))
    except BaseExceptionGroup as failures:
        raise failures.exceptions[0] from None
    finally:
        for task in inputs:
            task.cancel()
        await asyncio.gather(*inputs, return_exceptions=True)
    return exit_code.result()


async def _copy_output(source: ByteSource | None, channel: OutputChannel | None) -> None:
    """The process's output to the client; read to its end even when the client did not ask for it."""
    if source is None:
        return
    while data := await source.read(_COPY_SIZE):
        if channel is not None:
            await channel.write(data)
    if channel is not None:
        await channel.close_write()


async def _copy_stdin(channel: InputChannel | None, sink: ByteSink | None) -> None:
    if channel is None:
        return
    if sink is None:
        channel.discard_incoming()
        return
    try:
        while data := await channel.read():
            await sink.write(data)
    except (SpdyError, ChannelClosed):
        pass  # the client reset stdin or left: the process gets EOF
    except OSError:
        # The process closed its stdin. What the client still sends is dropped, so that a full
        # buffer does not stop the connection (and with it the output) from being read.
        channel.discard_incoming()
    finally:
        with contextlib.suppress(OSError):
            await sink.close()


async def _apply_resizes(channel: InputChannel | None, session: ProcessSession) -> None:
    if channel is None:
        return
    decoder = ResizeDecoder()
    try:
        while data := await channel.read():
            for size in decoder.feed(data):
                await session.resize(size)
    except (ValueError, UnicodeDecodeError) as exc:
        log.info("streaming client sent a bad resize message: %s", exc)
        channel.discard_incoming()
    except (SpdyError, ChannelClosed, OSError):
        pass


async def _finish(streams: RemoteStreams, status: bytes) -> None:
    with contextlib.suppress(SpdyError, ChannelClosed, WebSocketClosed, ConnectionError):
        if status:
            await streams.error.write(status)
        await streams.error.close_write()


# SPDY: the client opens one stream per channel.


async def collect_spdy_streams(
    spdy: SpdySession, options: StreamOptions, version: int, timeout: float
) -> RemoteStreams | None:
    """Accept the streams ``options`` calls for; None if they do not all come within ``timeout`` s.

    Every stream is answered, as the kubelet does; one of a type not asked for, or a second of a
    type, is left unused (what comes on it dropped) rather than refused.
    """
    wanted = {"error"}
    wanted |= {name for name, on in (("stdin", options.stdin), ("stdout", options.stdout)) if on}
    if options.stderr:
        wanted.add("stderr")
    if options.tty and version >= 3:
        wanted.add("resize")
    found: dict[str, SpdyStream] = {}
    try:
        async with asyncio.timeout(timeout):
            while not wanted <= found.keys():
                stream = await spdy.accept()
                if stream is None:
                    return None
                await stream.reply()
                kind = header_value(stream.headers, STREAM_TYPE_HEADER) or ""
                if kind not in wanted or kind in found:
                    stream.discard_incoming()
                    continue
                found[kind] = stream
    except TimeoutError:
        log.info("streaming client did not open its streams within %.0f s", timeout)
        return None
    found["error"].discard_incoming()
    for output in ("stdout", "stderr"):
        if output in found:
            found[output].discard_incoming()
    return RemoteStreams(
        error=found["error"],
        stdin=found.get("stdin"),
        stdout=found.get("stdout"),
        stderr=found.get("stderr"),
        resize=found.get("resize"),
    )


# WebSocket: numbered channels.


def websocket_streams(mux: ChannelMux, options: StreamOptions) -> RemoteStreams:
    return RemoteStreams(
        error=mux.output(CHANNEL_ERROR),
        stdin=mux.input(CHANNEL_STDIN) if options.stdin else None,
        stdout=mux.output(CHANNEL_STDOUT) if options.stdout else None,
        stderr=mux.output(CHANNEL_STDERR) if options.stderr else None,
        resize=mux.input(CHANNEL_RESIZE) if options.tty else None,
    )


async def announce_websocket(mux: ChannelMux, options: StreamOptions) -> None:
    """An empty message on the lowest channel written: the kubelet's sign that the session is up."""
    if options.stdout:
        await mux.send(CHANNEL_STDOUT, b"")
    elif options.stderr:
        await mux.send(CHANNEL_STDERR, b"")
    else:
        await mux.send(CHANNEL_ERROR, b"")


def websocket_mux(connection: WebSocketConnection, protocol: str) -> ChannelMux:
    return ChannelMux(connection, base64_encoded="base64" in protocol, close_signal=protocol == V5)
