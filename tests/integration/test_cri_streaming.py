"""The CRI streaming server against real processes and TCP servers, over SPDY and WebSocket.

critest's streaming checks are here as it makes them (exec ``echo -n hello`` with and without a
tty, attach to a shell with stdin), with what a kubelet relies on besides: exit codes, resizes
reaching the terminal, large transfers through flow control, tokens used once and expiring, and
a client that vanishes taking its process with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator

import pytest

from auraed.cri.streaming import remotecommand
from auraed.cri.streaming.backend import AttachRequest, ExecRequest, PortForwardRequest
from auraed.cri.streaming.client import (
    ForwardedConnection,
    StreamingClientError,
    open_port_forward,
    open_remote_command,
    run_remote_command,
)
from auraed.cri.streaming.config import StreamingConfig
from auraed.cri.streaming.server import StreamingServer
from auraed.cri.streaming.spdy import SpdyLimits
from tests.support import workers
from tests.support.streaming import ProcessBackend

TRANSPORTS = ["spdy", "websocket"]
TIMEOUT = 30


@pytest.fixture
async def backend() -> AsyncIterator[ProcessBackend]:
    backend = ProcessBackend()
    yield backend
    await backend.close()


@pytest.fixture
async def server(backend: ProcessBackend) -> AsyncIterator[StreamingServer]:
    server = StreamingServer(backend, StreamingConfig(close_grace=2.0))
    await server.start()
    yield server
    await server.close()
    assert server.active_connections == 0


def exec_url(server: StreamingServer, *cmd: str, **flags: bool) -> str:
    return server.url_for(ExecRequest("host", cmd, **flags))


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# critest's checks.


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_exec_echo_gives_exactly_hello(server: StreamingServer, transport: str) -> None:
    url = exec_url(server, "echo", "-n", "hello", stdout=True, stderr=True)
    result = await asyncio.wait_for(run_remote_command(url, transport=transport), TIMEOUT)  # type: ignore[arg-type]
    assert (result.stdout, result.stderr, result.exit_code) == (b"hello", b"", 0)


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_exec_with_tty_and_stdin(server: StreamingServer, transport: str) -> None:
    url = exec_url(server, "echo", "-n", "hello", stdout=True, tty=True, stdin=True, stderr=False)
    command = await open_remote_command(url, transport=transport, stdin=True, tty=True)  # type: ignore[arg-type]
    try:
        result = await asyncio.wait_for(command.collect(), TIMEOUT)
    finally:
        await command.close()
    assert b"hello" in result.stdout
    assert (result.stderr, result.exit_code) == (b"", 0)


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_attach_to_a_shell_with_stdin(
    server: StreamingServer, backend: ProcessBackend, transport: str
) -> None:
    container = await backend.run_container("c1", ("/bin/sh",))
    url = server.url_for(AttachRequest("c1", stdin=True, stdout=True, stderr=True))
    command = await open_remote_command(url, transport=transport, stdin=True)  # type: ignore[arg-type]
    try:
        await command.write_stdin(b"echo -n hello\n")
        assert await asyncio.wait_for(command.read_stdout(), TIMEOUT) == b"hello"
        await command.close_stdin()  # the shell reads EOF and exits: the attach ends
        result = await asyncio.wait_for(command.collect(), TIMEOUT)
    finally:
        await command.close()
    assert (result.stdout, result.stderr, result.exit_code) == (b"", b"", 0)
    assert await container.process.wait() == 0


# Exit codes, versions, terminals.


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_nonzero_exit_code_reaches_the_client(server: StreamingServer, transport: str) -> None:
    url = exec_url(server, "sh", "-c", "echo out; echo err >&2; exit 7")
    result = await asyncio.wait_for(run_remote_command(url, transport=transport), TIMEOUT)  # type: ignore[arg-type]
    assert (result.stdout, result.stderr, result.exit_code) == (b"out\n", b"err\n", 7)
    assert "exit code 7" in result.message


async def test_older_protocols_report_failures_as_text(server: StreamingServer) -> None:
    url = exec_url(server, "sh", "-c", "exit 3")
    command = await open_remote_command(url, protocols=(remotecommand.V3,))
    try:
        result = await asyncio.wait_for(command.collect(), TIMEOUT)
    finally:
        await command.close()
    assert result.exit_code is None
    assert result.message.startswith("command terminated with non-zero exit code")
    url = exec_url(server, "true")
    command = await open_remote_command(url, protocols=(remotecommand.V1,))
    try:
        assert (await asyncio.wait_for(command.collect(), TIMEOUT)).exit_code == 0
    finally:
        await command.close()


async def test_websocket_base64_channels(server: StreamingServer) -> None:
    url = exec_url(server, "sh", "-c", "printf 'a\\0b'; exit 2")
    command = await open_remote_command(url, transport="websocket", protocols=(remotecommand.V4_BASE64,))
    try:
        result = await asyncio.wait_for(command.collect(), TIMEOUT)
    finally:
        await command.close()
    assert (result.stdout, result.exit_code) == (b"a\0b", 2)


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_resize_reaches_the_terminal(server: StreamingServer, transport: str) -> None:
    url = exec_url(server, "/bin/sh", stdin=True, stdout=True, tty=True, stderr=False)
    command = await open_remote_command(url, transport=transport, stdin=True, tty=True)  # type: ignore[arg-type]
    seen = b""
    try:
        await command.resize(101, 42)
        for _ in range(50):
            await command.write_stdin(b"stty size\n")
            seen += await asyncio.wait_for(command.read_stdout(), TIMEOUT)
            if b"42 101" in seen:
                break
            await asyncio.sleep(0.1)
        await command.write_stdin(b"exit 5\n")
        result = await asyncio.wait_for(command.collect(), TIMEOUT)
    finally:
        await command.close()
    assert b"42 101" in seen
    assert result.exit_code == 5


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_megabytes_both_ways(server: StreamingServer, transport: str) -> None:
    data = os.urandom(4 * 1024 * 1024)
    url = exec_url(server, "cat", stdin=True, stdout=True, stderr=True)
    result = await asyncio.wait_for(run_remote_command(url, transport=transport, stdin=data), 120)  # type: ignore[arg-type]
    assert result.exit_code == 0
    assert result.stdout == data


async def test_megabytes_to_a_client_that_grants_no_window(server: StreamingServer) -> None:
    """Go's spdystream never sends WINDOW_UPDATE: the output must flow all the same."""
    url = exec_url(server, "head", "-c", "3000000", "/dev/zero")
    command = await open_remote_command(url, limits=SpdyLimits(send_window_updates=False))
    try:
        result = await asyncio.wait_for(command.collect(), 60)
    finally:
        await command.close()
    assert (len(result.stdout), result.exit_code) == (3_000_000, 0)


async def test_a_backend_error_is_reported_on_the_error_stream(server: StreamingServer) -> None:
    url = server.url_for(ExecRequest("no-such-container", ("true",)))
    result = await asyncio.wait_for(run_remote_command(url), TIMEOUT)
    assert result.exit_code is None
    expected = "error executing command in container: container 'no-such-container' not found"
    assert result.message == f"Internal error occurred: {expected}"


# A client that vanishes.


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_vanished_client_leaves_no_process_behind(
    server: StreamingServer, backend: ProcessBackend, transport: str
) -> None:
    url = exec_url(server, "sleep", "1000", stdin=True)
    command = await open_remote_command(url, transport=transport, stdin=True)  # type: ignore[arg-type]
    for _ in range(100):
        if backend.sessions:
            break
        await asyncio.sleep(0.05)
    (session,) = backend.sessions
    pid = session.process.pid
    assert pid_alive(pid)
    # Cut the TCP connection without any goodbye.
    if transport == "spdy":
        command._spdy._transport.abort()  # type: ignore[attr-defined]
    else:
        command._connection.abort()  # type: ignore[attr-defined]
    for _ in range(100):
        if server.active_connections == 0 and session.process.returncode is not None:
            break
        await asyncio.sleep(0.05)
    assert session.process.returncode is not None
    assert not pid_alive(pid)
    assert server.active_connections == 0
    await command.close()


async def test_closing_the_server_ends_its_sessions(backend: ProcessBackend) -> None:
    server = StreamingServer(backend)
    await server.start()
    command = await open_remote_command(exec_url(server, "sleep", "1000"))
    for _ in range(100):
        if backend.sessions:
            break
        await asyncio.sleep(0.05)
    await asyncio.wait_for(server.close(), TIMEOUT)
    assert backend.sessions[0].process.returncode is not None
    await command.close()


# Port-forward.


@pytest.fixture
async def echo_port() -> AsyncIterator[int]:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        writer.close()

    echo_server = await asyncio.start_server(echo, "127.0.0.1", 0)
    yield echo_server.sockets[0].getsockname()[1]
    echo_server.close()
    await echo_server.wait_closed()


async def read_all(connection: ForwardedConnection) -> bytes:
    received = bytearray()
    while chunk := await connection.read():
        received += chunk
    return bytes(received)


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_port_forward_carries_megabytes_both_ways(
    server: StreamingServer, backend: ProcessBackend, echo_port: int, transport: str
) -> None:
    forward = await open_port_forward(server.url_for(PortForwardRequest("pod")), transport=transport)  # type: ignore[arg-type]
    try:
        for _ in range(2):  # two connections over one forward, as curl twice would make
            connection = await forward.connect(echo_port)
            data = os.urandom(3 * 1024 * 1024)
            reading = asyncio.create_task(read_all(connection))
            await connection.write(data)
            await connection.close_write()
            assert await asyncio.wait_for(reading, 120) == data
            assert await asyncio.wait_for(connection.error(), TIMEOUT) == ""
    finally:
        await forward.close()
    assert backend.dialed == [echo_port, echo_port]


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_port_forward_to_a_closed_port_reports_it(server: StreamingServer, transport: str) -> None:
    closed_port = workers.free_port()  # this worker's own: no other worker listens on it meanwhile
    forward = await open_port_forward(server.url_for(PortForwardRequest("pod")), transport=transport)  # type: ignore[arg-type]
    try:
        connection = await forward.connect(closed_port)
        message = await asyncio.wait_for(connection.error(), TIMEOUT)
        assert message.startswith(f"error forwarding port {closed_port} to pod pod: ")
        assert await connection.read() == b""
    finally:
        await forward.close()


# Tokens and refusals.


async def test_a_token_serves_one_request(server: StreamingServer) -> None:
    url = exec_url(server, "true")
    assert (await asyncio.wait_for(run_remote_command(url), TIMEOUT)).exit_code == 0
    with pytest.raises(StreamingClientError) as refused:
        await run_remote_command(url)
    assert refused.value.status == 404


async def test_an_expired_token_is_refused(backend: ProcessBackend) -> None:
    server = StreamingServer(backend, StreamingConfig(token_ttl=0.2))
    await server.start()
    try:
        url = exec_url(server, "true")
        await asyncio.sleep(0.4)
        with pytest.raises(StreamingClientError) as refused:
            await run_remote_command(url, transport="websocket")
        assert refused.value.status == 404
    finally:
        await server.close()


async def test_tokens_of_another_kind_or_made_up_are_refused(server: StreamingServer) -> None:
    url = server.url_for(PortForwardRequest("pod"))
    for wrong in (url.replace("/portforward/", "/exec/"), server.base_url + "/exec/madeup"):
        with pytest.raises(StreamingClientError) as refused:
            await run_remote_command(wrong)
        assert refused.value.status == 404
    # The token was spent on the wrong path, as the kubelet spends it.
    with pytest.raises(StreamingClientError):
        await open_port_forward(url)


async def http_exchange(server: StreamingServer, request: bytes) -> bytes:
    host, port = server.base_url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(request)
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(65536), TIMEOUT)
    writer.close()
    return answer


@pytest.mark.parametrize(
    ("request_head", "status"),
    [
        (
            "POST /exec/{token} HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: SPDY/3.1\r\n\r\n",
            b"400",
        ),
        (
            "POST /exec/{token} HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: SPDY/3.1\r\n"
            "X-Stream-Protocol-Version: v9.channel.k8s.io\r\n\r\n",
            b"403",
        ),
        (
            "POST /exec/{token} HTTP/1.1\r\nHost: x\r\nX-Stream-Protocol-Version: v4.channel.k8s.io\r\n\r\n",
            b"400",
        ),
        ("PUT /exec/{token} HTTP/1.1\r\nHost: x\r\n\r\n", b"405"),
        ("GET /nothing/{token} HTTP/1.1\r\nHost: x\r\n\r\n", b"404"),
        (
            "GET /exec/{token} HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
            "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
            "Sec-WebSocket-Protocol: chat\r\n\r\n",
            b"403",
        ),
        ("GARBAGE\r\n\r\n", b"400"),
    ],
)
async def test_bad_requests_are_answered_plainly(
    server: StreamingServer, request_head: str, status: bytes
) -> None:
    token = exec_url(server, "true").rsplit("/", 1)[1]
    answer = await http_exchange(server, request_head.format(token=token).encode())
    assert answer.startswith(b"HTTP/1.1 " + status), answer
    if status == b"403" and b"X-Stream" in request_head.encode():
        assert b"X-Accepted-Stream-Protocol-Versions: v4.channel.k8s.io" in answer


async def test_a_slow_request_head_is_cut(backend: ProcessBackend) -> None:
    server = StreamingServer(backend, StreamingConfig(request_timeout=0.3))
    await server.start()
    try:
        answer = await http_exchange(server, b"POST /exec/x HTTP/1.1\r\n")
        assert answer.startswith(b"HTTP/1.1 408")
    finally:
        await server.close()


async def test_urls_are_absolute_with_a_host(backend: ProcessBackend) -> None:
    for bind, host in (("127.0.0.1", "127.0.0.1"), ("::1", "[::1]"), ("0.0.0.0", "127.0.0.1")):
        server = StreamingServer(backend, StreamingConfig(bind_address=bind))
        await server.start()
        try:
            url = server.url_for(ExecRequest("host", ("true",)))
            assert url.startswith(f"http://{host}:")
            assert url.split("/")[3] == "exec"
            if bind != "0.0.0.0":
                assert (await asyncio.wait_for(run_remote_command(url), TIMEOUT)).exit_code == 0
        finally:
            await server.close()


async def test_the_server_refuses_more_pending_tokens_than_allowed(backend: ProcessBackend) -> None:
    from auraed.errors import AuraeError, ErrorKind

    server = StreamingServer(backend, StreamingConfig(max_pending_tokens=2))
    await server.start()
    try:
        server.url_for(ExecRequest("host", ("true",)))
        server.url_for(ExecRequest("host", ("true",)))
        with pytest.raises(AuraeError) as full:
            server.url_for(ExecRequest("host", ("true",)))
        assert full.value.kind is ErrorKind.RESOURCE_EXHAUSTED
    finally:
        with contextlib.suppress(Exception):
            await server.close()


async def test_an_idle_session_is_closed_and_its_process_killed(backend: ProcessBackend) -> None:
    server = StreamingServer(backend, StreamingConfig(idle_timeout=0.5, close_grace=0.5))
    await server.start()
    try:
        command = await open_remote_command(exec_url(server, "sleep", "1000"))
        for _ in range(100):
            if backend.sessions and backend.sessions[0].process.returncode is not None:
                break
            await asyncio.sleep(0.05)
        assert backend.sessions[0].process.returncode is not None
        await command.close()
    finally:
        await server.close()


async def test_streams_not_opened_in_time_end_the_session(backend: ProcessBackend) -> None:
    server = StreamingServer(backend, StreamingConfig(stream_creation_timeout=0.3, close_grace=0.5))
    await server.start()
    try:
        url = exec_url(server, "true", stdin=True)
        # The request wants stdin, the client opens only the error stream: nothing runs.
        with pytest.raises(StreamingClientError):
            await asyncio.wait_for(run_remote_command(url, transport="spdy"), TIMEOUT)
        assert backend.sessions == []
    finally:
        await server.close()


async def test_an_incomplete_port_forward_pair_is_told_so(backend: ProcessBackend, echo_port: int) -> None:
    server = StreamingServer(backend, StreamingConfig(stream_creation_timeout=0.3))
    await server.start()
    forward = await open_port_forward(server.url_for(PortForwardRequest("pod")))
    try:
        headers = {"streamtype": ("error",), "port": (str(echo_port),), "requestid": ("9",)}
        error = await forward._spdy.open_stream(headers, TIMEOUT)
        message = await asyncio.wait_for(error.read_all(4096), TIMEOUT)
        assert message == b"timed out waiting for the streams of request 9"
        assert backend.dialed == []
    finally:
        await forward.close()
        await server.close()
