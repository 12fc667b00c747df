"""The streaming server's backend over the CRI's containers and pods (see
auraed.cri.streaming.backend): exec sessions, attaching to a container, connections into a pod.

Exec starts a process in the container (auraed.containers.exec) and splits its output into the
streams the client asked for. Attach joins the container's own streams: its output is followed
in its CRI log from the end (the monitor writes all of it there, so an attach never takes any
from the log; a vm pod's container's log is the host's copy), its input is what the container's
host gives (auraed.containers.attach on the host: the monitor's descriptor for the stdin pipe or
terminal; the guest's Attach stream for a vm pod's container). Output reaches an attached client
record by record, as the container wrote it: the monitor logs what it reads at once, the end of
a line not finished yet as a partial record, so a prompt with no newline shows at once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

from auraed.cri.container_host import AttachInput, ProcessHandle
from auraed.cri.containers import Container, CriContainers
from auraed.cri.errors import CriError
from auraed.cri.model import PodState
from auraed.cri.pods import Pods
from auraed.cri.streaming.backend import AttachRequest, ByteSink, ExecRequest, ProcessSession, TerminalSize
from auraed.observe.logfile import LogWatch, end_position, stream_line_batches

OUTPUT_STREAMS = frozenset({"stdout", "stderr"})
OUTPUT_BACKLOG = 16
"""Chunks of output held for a client that reads slowly; then the source waits."""


class _Output:
    """One output stream of a session as a ByteSource, fed by the session's reader."""

    def __init__(self) -> None:
        self._chunks: asyncio.Queue[bytes] = asyncio.Queue(OUTPUT_BACKLOG)
        self._ended = False

    async def put(self, data: bytes) -> None:
        await self._chunks.put(data)

    def end(self) -> None:
        """No more output: read() returns b"" once what is queued was read."""
        with contextlib.suppress(asyncio.QueueFull):
            self._chunks.put_nowait(b"")
        self._ended = True

    async def read(self, n: int = -1) -> bytes:
        if self._ended and self._chunks.empty():
            return b""
        return await self._chunks.get()


def _outputs(stdout: bool, stderr: bool) -> dict[str, _Output]:
    wanted = {"stdout": stdout, "stderr": stderr}
    return {name: _Output() for name, asked in wanted.items() if asked}


def _ended() -> _Output:
    """A stream asked for that carries nothing (stderr of a terminal): it ends at once, so the
    client's channel is closed rather than left open."""
    output = _Output()
    output.end()
    return output


class _Streams:
    """A session's standard streams as the ProcessSession protocol reads them: the output
    streams asked for, a stderr that ends at once where one was asked of a terminal, stdin."""

    _outputs: dict[str, _Output]
    _no_stderr: _Output | None = None
    _stdin: ByteSink | None = None

    @property
    def stdin(self) -> ByteSink | None:
        return self._stdin

    @property
    def stdout(self) -> _Output | None:
        return self._outputs.get("stdout")

    @property
    def stderr(self) -> _Output | None:
        return self._outputs.get("stderr", self._no_stderr)


class _ExecInput:
    def __init__(self, session: ProcessHandle) -> None:
        self._session = session

    async def write(self, data: bytes) -> None:
        await self._session.write_stdin(data)

    async def close(self) -> None:
        await self._session.close_stdin()


class ExecProcess(_Streams):
    """A ProcessSession over an exec'd process (with a tty its output is all stdout)."""

    def __init__(self, session: ProcessHandle, request: ExecRequest) -> None:
        self._session = session
        self._outputs = _outputs(request.stdout, request.stderr and not request.tty)
        self._stdin: ByteSink | None = _ExecInput(session) if request.stdin else None
        self._reader = asyncio.get_running_loop().create_task(self._read(), name="exec output")

    async def _read(self) -> None:
        try:
            async for stream, data in self._session.output():
                output = self._outputs.get(stream)
                if output is not None:  # what the client did not ask for is read and dropped
                    await output.put(data)
        finally:
            for output in self._outputs.values():
                output.end()

    async def resize(self, size: TerminalSize) -> None:
        self._session.resize(size.height, size.width)

    async def wait(self) -> int:
        return await self._session.wait()

    async def close(self) -> None:
        self._reader.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)
        await self._session.close()


class _AttachInput:
    """The client's stdin into the container's: its end detaches, or with stdin_once closes
    the container's stdin."""

    def __init__(self, process: AttachProcess, container_input: AttachInput) -> None:
        self._process = process
        self._input = container_input

    async def write(self, data: bytes) -> None:
        await self._input.write(data)

    async def close(self) -> None:
        await self._process.input_ended()


class AttachProcess(_Streams):
    """A ProcessSession attached to a running container's streams."""

    def __init__(
        self,
        container: Container,
        exited: Callable[[Container], Awaitable[object]],
        request: AttachRequest,
        container_input: AttachInput | None,
        *,
        watch: LogWatch | None,
        log_end: tuple[int, int],
    ) -> None:
        host = container.host
        self._container = container
        self._exited = exited
        self._host = host
        self._input = container_input
        self._outputs = _outputs(request.stdout, request.stderr and not host.tty)
        self._no_stderr = _ended() if request.stderr and host.tty else None
        # Without an input to write to (the container's stdin closed by an earlier stdin_once
        # attach), what the client types is dropped, as containerd does.
        self._stdin: ByteSink | None = (
            _AttachInput(self, container_input) if request.stdin and container_input is not None else None
        )
        self._detached = asyncio.Event()
        self._closed = False
        self._follower = asyncio.get_running_loop().create_task(
            self._follow(watch, log_end), name="attach output"
        )

    async def _follow(self, watch: LogWatch | None, log_end: tuple[int, int]) -> None:
        host = self._host
        newline = b"\r\n" if host.tty else b"\n"
        lines = stream_line_batches(
            host.log_path,
            frozenset(self._outputs),
            0,
            True,
            lambda: not host.alive,
            watch=watch,
            start=log_end,
            parts=True,
        )
        try:
            async for batch in lines:
                for part in batch:
                    ending = b"" if part.partial else newline
                    await self._outputs[part.stream].put(part.content.encode() + ending)
        finally:
            await lines.aclose()
            for output in self._outputs.values():
                output.end()

    async def resize(self, size: TerminalSize) -> None:
        if self._input is not None:
            self._input.resize(size.height, size.width)

    async def input_ended(self) -> None:
        """The client's stdin ended: it detaches, and with stdin_once (not on a terminal, as
        containerd) the container's stdin is closed; the session then lasts until it exits."""
        container_input = self._input
        if container_input is None or not container_input.closes_stdin:
            self._detach()
            return
        await container_input.end()

    def _detach(self) -> None:
        """The session ends here; the container runs on."""
        self._detached.set()
        self._follower.cancel()

    async def wait(self) -> int:
        """Until the container exits (its last lines sent) or the client detaches: 0 then."""
        exited = asyncio.ensure_future(self._exited(self._container))
        detached = asyncio.ensure_future(self._detached.wait())
        try:
            await asyncio.wait({exited, detached}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in (exited, detached):
                waiter.cancel()
            await asyncio.gather(exited, detached, return_exceptions=True)
        if not self._detached.is_set():
            await asyncio.gather(self._follower, return_exceptions=True)  # the lines before the end
        code = self._host.exit_code
        return code if code is not None and not self._detached.is_set() else 0

    def _close_input(self) -> None:
        if self._input is not None:
            self._input.close()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._follower.cancel()
        await asyncio.gather(self._follower, return_exceptions=True)
        self._close_input()


class CriSessions:
    """The StreamingBackend of the CRI: validated requests become sessions here."""

    def __init__(self, containers: CriContainers, pods: Pods, watch: LogWatch | None) -> None:
        self._containers = containers
        self._pods = pods
        self._watch = watch

    async def exec(self, request: ExecRequest) -> ProcessSession:
        session = await self._containers.exec(
            request.container_id, list(request.cmd), tty=request.tty, stdin=request.stdin
        )
        return ExecProcess(session, request)

    def exec_target(self, container_id: str) -> str:
        """The full id of the running container an exec names (by id or a prefix of it)."""
        return self._containers.running(container_id, "exec").record.id

    def attachable(self, request: AttachRequest) -> Container:
        """The container to attach to; FAILED_PRECONDITION when it cannot give what is asked."""
        container = self._containers.running(request.container_id, "attach")
        host = container.host
        if request.tty and not host.tty:
            raise CriError.precondition(f"container {host.id[:13]} was created without a terminal")
        return container

    async def attach(self, request: AttachRequest) -> ProcessSession:
        container = self.attachable(request)
        host = container.host
        # Where the output starts, before any input can reach the container: what it answers
        # to the client's first line is after this.
        log_end = await asyncio.to_thread(end_position, host.log_path, OUTPUT_STREAMS)
        # A terminal's size is set through its input too.
        container_input = (
            await self._containers.attach_input(container) if request.stdin or host.tty else None
        )
        return AttachProcess(
            container,
            self._containers.wait,
            request,
            container_input,
            watch=self._watch,
            log_end=log_end,
        )

    async def dial(self, pod_sandbox_id: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        pod = self._pods.get(pod_sandbox_id)
        if pod.state != PodState.READY:
            raise CriError.precondition(f"pod sandbox {pod.id[:13]} is not ready")
        return await self._pods.controller(pod).dial(pod, port)
