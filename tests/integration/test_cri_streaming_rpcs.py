"""Exec, Attach and PortForward through the kubelet's socket, then the URL they answer dialled
with our own SPDY/3.1 and WebSocket clients, against real containers in cell pods.

critest's streaming specs are here as it makes them (exec ``echo hello`` with tty=false and with
tty=true and stdin, attach to a shell with stdin and stdin_once writing ``echo -n hello``,
port-forward to a server in the pod), with what a kubelet relies on besides: exit codes, stdin,
resizes, stdin_once, output without a newline (a shell's prompt) as it is written, attaching
again after auraed was killed, a host-network pod's port, and the errors of bad input.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import urllib.parse
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from auraed.api.runtime import v1 as cri
from auraed.cri.streaming.client import (
    RemoteCommand,
    StreamingClientError,
    open_port_forward,
    open_remote_command,
    run_remote_command,
)
from tests.integration import test_cri_containers as container_tests
from tests.integration.test_cri_containers import EXITED, RUNNING, Node, cri_error, log_records
from tests.support import workers
from tests.support.cri import cri_client, pod_config, run_pod

mirror = container_tests.mirror  # the fixtures of a node with busybox, used by name
node = container_tests.node

TRANSPORTS = ["spdy", "websocket"]
TIMEOUT = 30
PARTIAL_WAIT = 2.0
"""Seconds an attached client waits for output that ends without a newline (critest waits 60 s
for ``echo -n hello``; containerd shows it in about a second)."""
SHELL = ["sh"]
POD_PORT = 8080
GREETING = b"hello from the pod\n"
SERVE_GREETING = ["sh", "-c", f"while true; do echo 'hello from the pod' | nc -l -p {POD_PORT}; done"]


async def exec_url(node: Node, container_id: str, cmd: list[str], **streams: Any) -> str:
    request = cri.ExecRequest(container_id=container_id, cmd=cmd, **streams)
    url: str = (await node.call("Exec", request)).url
    return url


async def attach_url(node: Node, container_id: str, **streams: Any) -> str:
    url: str = (await node.call("Attach", cri.AttachRequest(container_id=container_id, **streams))).url
    return url


async def attach_all(node: Node, container_id: str, transport: str = "spdy") -> RemoteCommand:
    """An attach to the container's stdin, stdout and stderr, open over ``transport``."""
    url = await attach_url(node, container_id, stdin=True, stdout=True, stderr=True)
    return await open_remote_command(
        url,
        transport=transport,  # type: ignore[arg-type]
        stdin=True,
        stdout=True,
        stderr=True,
    )


async def forward_url(node: Node, pod_id: str, ports: list[int] | None = None) -> str:
    request = cri.PortForwardRequest(pod_sandbox_id=pod_id, port=ports or [])
    url: str = (await node.call("PortForward", request)).url
    return url


async def read_until(command: RemoteCommand, wanted: bytes, timeout: float = TIMEOUT) -> bytes:
    """stdout until it holds ``wanted`` (all of it so far)."""
    seen = b""
    try:
        async with asyncio.timeout(timeout):
            while wanted not in seen:
                chunk = await command.read_stdout()
                if not chunk:
                    raise AssertionError(f"stdout ended before {wanted!r}: {seen!r}")
                seen += chunk
    except TimeoutError:
        raise AssertionError(f"no {wanted!r} on stdout in {timeout} s: {seen!r}") from None
    return seen


@contextlib.contextmanager
def host_listener() -> Iterator[int]:
    """A TCP server on the host's loopback that greets each connection: its port."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    server.settimeout(TIMEOUT)

    def serve() -> None:
        with contextlib.suppress(OSError):
            conn, _ = server.accept()
            with conn:
                conn.sendall(b"hello from the host\n")

    loop = asyncio.get_running_loop()
    serving = loop.run_in_executor(None, serve)
    try:
        yield server.getsockname()[1]
    finally:
        server.close()
        serving.cancel()


@pytest.fixture
async def running(node: Node) -> AsyncIterator[tuple[str, str]]:
    """A pod and a running container in it (top), as critest's default container."""
    pod_id = await node.run_pod("streaming")
    container_id = await node.run(pod_id, node.config("streamer", ["top"]))
    await node.wait_state(container_id, RUNNING)
    yield pod_id, container_id


# -- exec --------------------------------------------------------------------------------------


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_exec_without_a_terminal(node: Node, running: tuple[str, str], transport: str) -> None:
    _, container_id = running
    url = await exec_url(node, container_id, ["echo", "hello"], stdout=True, stderr=True)
    parts = urllib.parse.urlsplit(url)
    assert parts.scheme == "http" and parts.hostname == "127.0.0.1" and parts.port
    result = await run_remote_command(url, transport=transport)  # type: ignore[arg-type]
    assert (result.exit_code, result.stdout, result.stderr) == (0, b"hello\n", b"")
    # The token was used: the URL serves once.
    with pytest.raises(StreamingClientError) as refused:
        await run_remote_command(url, transport=transport)  # type: ignore[arg-type]
    assert refused.value.status == 404


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_exec_with_a_terminal_and_stdin(node: Node, running: tuple[str, str], transport: str) -> None:
    _, container_id = running
    url = await exec_url(node, container_id, ["echo", "hello"], stdout=True, stdin=True, tty=True)
    command = await open_remote_command(
        url,
        transport=transport,  # type: ignore[arg-type]
        stdin=True,
        stdout=True,
        stderr=False,
        tty=True,
    )
    try:
        await read_until(command, b"hello\r\n")
        # The command has ended by now and the server is closing: closing its stdin is no error.
        await asyncio.sleep(1.0)
        await command.close_stdin()
        result = await command.collect()
    finally:
        await command.close()
    assert result.exit_code == 0


async def test_exec_exit_code_stderr_and_stdin(node: Node, running: tuple[str, str]) -> None:
    _, container_id = running
    cmd = ["sh", "-c", "cat; echo oops >&2; exit 3"]
    url = await exec_url(node, container_id, cmd, stdin=True, stdout=True, stderr=True)
    result = await run_remote_command(url, stdin=b"from the client\n")
    assert (result.exit_code, result.stdout, result.stderr) == (3, b"from the client\n", b"oops\n")


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_exec_terminal_resize(node: Node, running: tuple[str, str], transport: str) -> None:
    _, container_id = running
    cmd = ["sh", "-c", "read line; stty size"]
    url = await exec_url(node, container_id, cmd, stdin=True, stdout=True, tty=True)
    command = await open_remote_command(
        url,
        transport=transport,  # type: ignore[arg-type]
        stdin=True,
        stdout=True,
        stderr=False,
        tty=True,
    )
    try:
        await command.resize(width=132, height=43)
        await asyncio.sleep(0.2)  # the resize stream and stdin are separate: let it land first
        await command.write_stdin(b"go\r")
        await read_until(command, b"43 132")
        result = await command.collect()
    finally:
        await command.close()
    assert result.exit_code == 0


async def test_a_client_that_vanishes_takes_its_exec_with_it(node: Node, running: tuple[str, str]) -> None:
    _, container_id = running
    url = await exec_url(node, container_id, ["sleep", "1000"], stdout=True)
    command = await open_remote_command(url, stdout=True, stderr=False)

    async def sleeping() -> bool:
        return (await node.exec_sync(container_id, ["pidof", "sleep"])).exit_code == 0

    await wait_until_async(sleeping)
    await command.close()

    async def gone() -> bool:
        return not await sleeping()

    await wait_until_async(gone)


async def wait_until_async(check: Any, timeout: float = TIMEOUT) -> None:
    await container_tests.eventually(check, timeout)


# -- attach ------------------------------------------------------------------------------------


async def shell(node: Node, pod_id: str, name: str, **fields: Any) -> str:
    container_id = await node.run(pod_id, node.config(name, SHELL, stdin=True, **fields))
    await node.wait_state(container_id, RUNNING)
    return container_id


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_attach_to_a_shell(node: Node, transport: str) -> None:
    """critest's attach: write ``echo hello``, read ``hello`` and nothing else; then, as the
    container has no stdin_once, the client's end of stdin detaches and the shell runs on."""
    pod_id = await node.run_pod("attach")
    container_id = await shell(node, pod_id, "shell")
    for _ in range(2):  # a second attach finds the same shell
        command = await attach_all(node, container_id, transport)
        try:
            await command.write_stdin(b"echo hello\n")
            assert await read_until(command, b"hello\n") == b"hello\n"
            await command.close_stdin()
            result = await command.collect()
        finally:
            await command.close()
        assert (result.exit_code, result.stdout, result.stderr) == (0, b"", b"")
        assert (await node.status(container_id)).state == RUNNING


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_attach_relays_output_that_ends_without_a_newline(node: Node, transport: str) -> None:
    """critest's attach spec as it runs: a shell with stdin and stdin_once, ``echo -n hello``
    written, and exactly ``hello`` on stdout while stdin is still open (it waited for a newline
    that never came: critest timed out). The kubelet's log holds it as a P record, which the F
    record of what the shell writes next completes."""
    pod_id = await node.run_pod("attach-partial", log_directory=True)
    container_id = await shell(node, pod_id, "partial", stdin_once=True, log=True)
    command = await attach_all(node, container_id, transport)
    try:
        await command.write_stdin(b"echo -n hello\n")
        assert await read_until(command, b"hello", PARTIAL_WAIT) == b"hello"
        await command.write_stdin(b"echo ' world'\n")
        assert await read_until(command, b" world\n") == b" world\n"
        await command.close_stdin()  # stdin_once: the shell reads EOF and ends, and the attach
        result = await command.collect()
    finally:
        await command.close()
    assert (result.exit_code, result.stdout, result.stderr) == (0, b"", b"")
    records = log_records(node.log_root / "attach-partial" / "partial.log")
    assert [(stream, tag, content) for _, stream, tag, content in records] == [
        ("stdout", "P", "hello"),
        ("stdout", "F", " world"),
    ]


async def test_a_shell_prompt_shows_at_once(node: Node) -> None:
    """A shell on a terminal writes its prompt with no newline: an attached client sees it as
    soon as it is written, not with the line typed after it."""
    pod_id = await node.run_pod("attach-prompt")
    container_id = await shell(node, pod_id, "prompt", tty=True)
    url = await attach_url(node, container_id, stdin=True, stdout=True, tty=True)
    command = await open_remote_command(url, stdin=True, stdout=True, stderr=False, tty=True)
    try:
        await command.write_stdin(b"echo hi\r")
        # The terminal's echo of the line, the command's output, then the next prompt (busybox
        # sh's as root: "/ # ", then its query of the cursor's position), with no newline.
        seen = await read_until(command, b"echo hi\r\nhi\r\n", PARTIAL_WAIT)
        prompt = seen.split(b"echo hi\r\nhi\r\n", 1)[1]
        if b"# " not in prompt:
            prompt += await read_until(command, b"# ", PARTIAL_WAIT)
        assert prompt.startswith(b"/ # ") and b"\n" not in prompt, prompt
        await command.close_stdin()  # no stdin_once: a detach
        result = await command.collect()
    finally:
        await command.close()
    assert result.exit_code == 0
    assert (await node.status(container_id)).state == RUNNING


async def test_attach_with_stdin_once_ends_the_containers_input(node: Node) -> None:
    pod_id = await node.run_pod("attach-once")
    container_id = await shell(node, pod_id, "once", stdin_once=True)
    url = await attach_url(node, container_id, stdin=True, stdout=True, stderr=True)
    result = await run_remote_command(url, stdin=b"echo bye; echo err >&2\n")
    assert (result.exit_code, result.stdout, result.stderr) == (0, b"bye\n", b"err\n")
    # The shell read EOF: it ended, as a container with stdin_once does after its first attach.
    status = await node.wait_state(container_id, EXITED)
    assert (status.exit_code, status.reason) == (0, "Completed")


async def test_attach_to_a_terminal(node: Node) -> None:
    pod_id = await node.run_pod("attach-tty")
    container_id = await shell(node, pod_id, "tty", tty=True)
    url = await attach_url(node, container_id, stdin=True, stdout=True, tty=True)
    command = await open_remote_command(url, stdin=True, stdout=True, stderr=False, tty=True)
    try:
        await command.resize(width=120, height=41)
        await asyncio.sleep(0.2)
        await command.write_stdin(b"stty size\r")
        await read_until(command, b"41 120\r\n")
        await command.close_stdin()  # no stdin_once: a detach
        result = await command.collect()
    finally:
        await command.close()
    assert result.exit_code == 0
    assert (await node.status(container_id)).state == RUNNING


async def test_attach_again_after_kill_9(node: Node) -> None:
    """The monitor holds the shell's stdin while auraed is away; a new auraed borrows it again."""
    pod_id = await node.run_pod("attach-restart")
    container_id = await shell(node, pod_id, "survivor")
    node.daemon.kill9()
    node.daemon.start()
    await node.client.close()
    node.client = cri_client(node.daemon)
    url = await attach_url(node, container_id, stdin=True, stdout=True)
    command = await open_remote_command(url, stdin=True, stdout=True, stderr=False)
    try:
        await command.write_stdin(b"echo still here\n")
        await read_until(command, b"still here\n")
    finally:
        await command.close()


async def test_a_container_that_does_not_read_never_holds_the_daemon(node: Node) -> None:
    """1 MiB written to the stdin of a shell that sleeps first: the pipe fills, the daemon
    answers other calls meanwhile, and once the shell reads, all of it arrives (stdin_once: the
    end of the client's stdin is the container's EOF)."""
    pod_id = await node.run_pod("slow-reader")
    cmd = ["sh", "-c", "sleep 4; wc -c"]
    container_id = await node.run(pod_id, node.config("slow", cmd, stdin=True, stdin_once=True))
    await node.wait_state(container_id, RUNNING)
    url = await attach_url(node, container_id, stdin=True, stdout=True)
    command = await open_remote_command(url, stdin=True, stdout=True, stderr=False)
    try:

        async def feed() -> None:
            await command.write_stdin(b"x" * (1 << 20))
            await command.close_stdin()

        feeding = asyncio.create_task(feed())
        for _ in range(3):
            started = asyncio.get_running_loop().time()
            await node.call("Version", cri.VersionRequest(), timeout=5)
            assert asyncio.get_running_loop().time() - started < 2.0
            await asyncio.sleep(0.3)
        assert (await read_until(command, b"\n")).strip() == b"1048576"
        await feeding
        result = await command.collect()
    finally:
        await command.close()
    assert result.exit_code == 0
    await node.wait_state(container_id, EXITED)


async def test_attach_for_output_only_and_to_a_terminal_without_one(node: Node) -> None:
    """kubectl attach without -i (output only, any container); a client asking a terminal's
    container for stderr gets it closed at once (a terminal has one output); stdin for a
    container without stdin is dropped, as containerd does."""
    pod_id = await node.run_pod("watch")
    looper = await node.run(pod_id, node.config("looper", container_tests.LOOP_LOG))
    await node.wait_state(looper, RUNNING)
    command = await attach_all(node, looper)
    try:
        await command.write_stdin(b"ignored\n")
        await read_until(command, b"hello World\nhello World\n")
    finally:
        await command.close()
    tty = await shell(node, pod_id, "tty", tty=True)
    command = await attach_all(node, tty)
    try:
        async with asyncio.timeout(TIMEOUT):
            assert await command.read_stderr() == b""
        await command.write_stdin(b"echo from tty\r")
        await read_until(command, b"from tty\r\n")
    finally:
        await command.close()


# -- port-forward --------------------------------------------------------------------------------


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_port_forward_into_the_pod(node: Node, transport: str) -> None:
    pod_id = await node.run_pod("forward")
    server = await node.run(pod_id, node.config("server", SERVE_GREETING))
    await node.wait_state(server, RUNNING)
    url = await forward_url(node, pod_id, [POD_PORT])
    forward = await open_port_forward(url, transport=transport)  # type: ignore[arg-type]
    try:
        received = b""
        async with asyncio.timeout(TIMEOUT):
            while GREETING not in received:  # nc may not listen yet: each try is a new connection
                connection = await forward.connect(POD_PORT)
                received = await connection.read()
                if not received:
                    assert "connection refused" in await connection.error()
                    await asyncio.sleep(0.2)
                await connection.close()
    finally:
        await forward.close()
    assert received.startswith(GREETING)


async def test_port_forward_to_a_host_network_pod_and_to_nothing(node: Node) -> None:
    config = pod_config(
        "host-forward",
        namespace="critest",
        linux=cri.LinuxPodSandboxConfig(
            security_context=cri.LinuxSandboxSecurityContext(
                namespace_options=cri.NamespaceOption(network=cri.NamespaceMode.NODE)
            )
        ),
    )
    pod_id = await run_pod(node.client, config)
    with host_listener() as port:
        forward = await open_port_forward(await forward_url(node, pod_id))
        try:
            connection = await forward.connect(port)
            assert await connection.read() == b"hello from the host\n"
            # A port nothing listens on: the error stream says so, the session goes on.
            closed = workers.free_port()  # this worker's own: no other worker listens on it
            refused = await forward.connect(closed)
            assert await refused.read() == b""
            assert str(closed) in await refused.error()
        finally:
            await forward.close()


# -- bad input -----------------------------------------------------------------------------------


async def test_streaming_requests_are_validated(node: Node, running: tuple[str, str]) -> None:
    pod_id, container_id = running
    created = await node.create(pod_id, node.config("not-started", ["top"]))
    cases: list[tuple[str, Any, str, str]] = [
        (
            "Exec",
            cri.ExecRequest(container_id="", cmd=["ls"], stdout=True),
            "INVALID_ARGUMENT",
            "container_id",
        ),
        ("Exec", cri.ExecRequest(container_id="nope" * 4, cmd=["ls"], stdout=True), "NOT_FOUND", ""),
        ("Exec", cri.ExecRequest(container_id=container_id, cmd=[], stdout=True), "INVALID_ARGUMENT", "cmd"),
        ("Exec", cri.ExecRequest(container_id=container_id, cmd=["ls"]), "INVALID_ARGUMENT", "stdin"),
        (
            "Exec",
            cri.ExecRequest(container_id=container_id, cmd=["ls"], tty=True, stdout=True, stderr=True),
            "INVALID_ARGUMENT",
            "stderr",
        ),
        ("Exec", cri.ExecRequest(container_id=created, cmd=["ls"], stdout=True), "FAILED_PRECONDITION", ""),
        (
            "Attach",
            cri.AttachRequest(container_id=container_id, tty=True, stdout=True),
            "FAILED_PRECONDITION",
            "",
        ),
        ("PortForward", cri.PortForwardRequest(pod_sandbox_id="nope" * 4), "NOT_FOUND", ""),
        ("PortForward", cri.PortForwardRequest(pod_sandbox_id=pod_id, port=[0]), "INVALID_ARGUMENT", "port"),
        (
            "PortForward",
            cri.PortForwardRequest(pod_sandbox_id=pod_id, port=[70000]),
            "INVALID_ARGUMENT",
            "port",
        ),
    ]
    for method, request, code, field in cases:
        error = await cri_error(node.call(method, request))
        assert error.code == code, (method, request, error)
        if field:
            assert error.message.startswith(f"{field}: "), error.message
    await node.stop_pod(pod_id)
    error = await cri_error(node.call("PortForward", cri.PortForwardRequest(pod_sandbox_id=pod_id)))
    assert error.code == "FAILED_PRECONDITION"
